"""Write each rank's program as a standalone Python file (``hapc synth ... --emit-code DIR``).

``rank{r}.py`` holds one ``nn.Module`` class, ``Rank{r}``: its ``__init__`` declares the rank's
parameter and buffer shards with their local shapes (and which slice of which model tensor each
holds), its ``forward`` is the ``.code`` of the rank's ``torch.fx.GraphModule`` -- the very graph
:func:`hapc.compile` runs -- with the runtime's functions spelled ``C.all_gather(...)`` for
``hapc.collectives``, ``F.<op>`` for ``torch.nn.functional`` and ``hapc.ops.<name>`` for hapc's
custom ops, and without fx's early ``x = None`` frees. The file is generated from the in-memory
plan only; nothing is read back from disk to build it.

    from rank1 import Rank1
    module = Rank1(group=None, device="cpu")
    module.load_state_dict(shards)          # e.g. CompiledModule.program.state_dict()
    loss = module(x, y)
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import collectives as _collectives
from .. import ops as _ops
from ..plan import Plan
from ..theory.graph import PARAM
from ..theory.triples import Theory
from .program import RankProgram

_STANDARD = {"inf", "nan", "NoneType", "torch", "device", "fx_pytree", "pytree"}


def _spell(name: str, obj: Any) -> tuple[str | None, str | None]:
    """How generated code should call global ``obj`` (fx named it ``name``), plus an import if needed."""
    fn_name = getattr(obj, "__name__", None)
    if fn_name in _collectives.__all__ and getattr(_collectives, fn_name) is obj:
        return f"C.{fn_name}", None
    if fn_name and getattr(_ops, fn_name, None) is obj:
        return f"hapc.ops.{fn_name}", None
    module = getattr(obj, "__module__", None)
    if module and fn_name:
        return None, f"from {module} import {fn_name} as {name}"
    return None, None


def rank_source(theory: Theory, plan: Plan, rank: int) -> str:
    """The Python source of rank ``rank``'s program (see module docstring)."""
    rp = RankProgram(theory, plan, rank)
    graph = rp.build_graph()
    code = graph.python_code(root_module="self")
    body = code.src.strip("\n")
    imports = ["import torch", "import torch.nn.functional as F", "", "import hapc.collectives as C", "import hapc.ops"]
    for name, obj in code.globals.items():
        if name in _STANDARD:
            continue
        spelled, imp = _spell(name, obj)
        if spelled is not None:
            body = re.sub(rf"\b{re.escape(name)}\b", spelled, body)
        elif imp is not None:
            imports.append(imp)
    # the functional spellings people write (fx prints the C bindings they resolve to)
    body = re.sub(r"torch\._C\._nn\.(\w+)", lambda m: f"F.{m[1]}" if hasattr(F, m[1]) else m[0], body)
    body = body.replace("torch.nn.functional.", "F.").replace("torch.functional.einsum", "torch.einsum")
    # fx's ``;  x = y = None`` (free as early as possible) is noise to a reader; Python frees at return
    body = re.sub(r";  (\w+ = )+None$", "", body, flags=re.M)
    body = _inline_attributes(body)
    body = "\n".join(_keyword_spacing(line) for line in body.splitlines())
    dtypes = [theory.graph[ref].meta.dtype for ref, _ in rp.state.values() if theory.graph[ref].kind == PARAM]
    default = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    ratio = plan.device_ratios[rank]
    lines = [
        f'"""hapc program for rank {rank} of {len(plan.device_ratios)} (sharding ratio {ratio:.4f}).',
        "",
        f"Generated from a plan for cluster {plan.cluster_name!r} (graph {plan.graph_fingerprint[:12]}, predicted",
        f"step time {plan.time * 1e3:.3f} ms). Each attribute holds the commented slice of the single-device",
        "model's tensor; collectives are given every rank's shard sizes.",
        *(
            [
                "",
                f"The optional arguments ({', '.join(rp.batch_values)}) are sums over the whole batch",
                "that the program would otherwise all-reduce; hapc.compile's module computes them",
                "from the inputs when every rank is given the whole batch.",
            ]
            if rp.batch_values
            else []
        ),
        '"""',
        "",
        *imports,
        "",
        "",
        f"class Rank{rank}(torch.nn.Module):",
        f"    def __init__(self, group=None, device='cpu', dtype={default}):",
        "        super().__init__()",
        "        self.group = group  # the torch.distributed process group of the plan's ranks",
        "        self.device = torch.device(device)",
        *(["        self.rng = hapc.ops.RandomStream()  # seed, step and mode of dropout"] if rp.uses_stream else []),
        "",
        "        def param(*shape):",
        "            return torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))",
        "",
    ]
    for attr, (ref, lay) in rp.state.items():
        node = theory.graph[ref]
        shape = list(node.shape)
        where = node.target
        if lay.is_sharded:
            lo, hi = rp.span(ref, lay.dim)
            shape[lay.dim] = hi - lo
            where += "[" + ", ".join(f"{lo}:{hi}" if d == lay.dim else ":" for d in range(len(shape))) + "]"
        dims = ", ".join(str(d) for d in shape)
        if node.kind == PARAM and node.meta.dtype == default:
            lines.append(f"        self.{attr} = param({dims})  # {where}")
        elif node.kind == PARAM:
            empty = f"torch.empty(({dims}{',' if len(shape) == 1 else ''}), dtype={node.meta.dtype}, device=device)"
            lines.append(f"        self.{attr} = torch.nn.Parameter({empty})  # {where}")
        else:
            empty = f"torch.empty(({dims}{',' if len(shape) == 1 else ''}), dtype={node.meta.dtype}, device=device)"
            lines.append(f"        self.register_buffer({attr!r}, {empty})  # {where}")
    lines += ["", textwrap.indent(body, "    ").rstrip(), ""]
    return "\n".join(line.rstrip() for line in lines)


def _keyword_spacing(line: str) -> str:
    """``f(x, dim = 1)`` -> ``f(x, dim=1)`` (fx spaces keyword arguments like assignments)."""
    if line.lstrip().startswith("def "):  # default values of optional arguments
        return re.sub(r"(\w+) = ", r"\1=", line)
    head, sep, rest = line.partition(" = ")
    return head + sep + re.sub(r"(\w+) = ", r"\1=", rest) if sep else line


def _inline_attributes(body: str) -> str:
    """``w = self.w`` then ``f(x, w)`` becomes ``f(x, self.w)`` (fx names every attribute read)."""
    alias: dict[str, str] = {}
    out = []
    for line in body.splitlines():
        m = re.fullmatch(r"\s*(\w+) = self\.(\w+)", line)
        if m:
            alias[m[1]] = f"self.{m[2]}"
            continue
        if alias:  # outside string literals only
            parts = re.split(r"('[^']*')", line)
            line = "".join(
                p if i % 2 else re.sub(r"(?<![\w.])(\w+)\b", lambda t: alias.get(t[1], t[1]), p)
                for i, p in enumerate(parts)
            )
        out.append(line)
    return "\n".join(out)


def emit_code(plan: Plan, theory: Theory, directory: str | Path) -> list[Path]:
    """Write ``rank{r}.py`` for every rank and ``plan.json`` into ``directory``; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(len(plan.device_ratios)):
        path = out / f"rank{rank}.py"
        path.write_text(rank_source(theory, plan, rank))
        paths.append(path)
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan.to_json(), indent=1))
    paths.append(plan_path)
    return paths


def load_rank_module(path: str | Path, rank: int) -> type[torch.nn.Module]:
    """The ``Rank{rank}`` class of an emitted file (for tests and inspection)."""
    namespace: dict[str, Any] = {"__name__": f"hapc_rank{rank}"}
    source = Path(path).read_text()
    exec(compile(source, str(path), "exec"), namespace)
    return namespace[f"Rank{rank}"]
