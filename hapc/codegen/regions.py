"""``torch.utils.checkpoint`` regions in the per-rank program (issue 13 item 9).

The capture marks every op a model ran inside ``torch.utils.checkpoint.checkpoint(fn, ...)`` with that
call's region (:func:`hapc.theory.trace.checkpoint_regions`); :class:`~hapc.codegen.program.RankProgram`
marks the program's nodes with the region of the reference op they compute (collectives of a region's
values included). :func:`checkpoint_regions` then moves each run of consecutive nodes of one region
into a submodule ``region{k}`` and calls it through :func:`checkpointed`, i.e. through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its activations are not kept, they
are recomputed in backward, as the user asked on one device.

Two things make the recomputation exact:

* **randomness** -- hapc's dropout masks are a function of the module's ``RandomStream`` step, which
  the module advances after every forward; :func:`checkpointed` runs the recomputation at the step of
  the forward it repeats, so the masks are the forward's;
* **no communication is recomputed**: a region whose program (under this plan) contains a collective
  is not checkpointed -- its activations are kept, and :func:`checkpoint_regions` warns once naming
  how many. Recomputing a collective in backward would interleave it with the gradient buckets'
  all-reduces in an order that need not match across ranks (seen: a GPT-2 whose regions hold
  tensor-parallel collectives hung). Under data parallelism (the usual plan for checkpointed
  blocks) a region is local compute and is recomputed.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

#: the key under which program nodes carry their region
REGION = "hapc_region"
#: the key under which program nodes carry the ``torch.autocast`` contexts the model ran them under
AUTOCAST = "hapc_autocast"


def checkpointed(region: torch.nn.Module, rng: Any, *args: Any) -> tuple:
    """``region(*args)`` whose activations are recomputed in backward (``torch.utils.checkpoint``,
    non-reentrant), with hapc's random stream at this forward's step (and a pipeline's micro-batch)
    during the recomputation."""
    at = (rng.step, rng.micro) if rng is not None else None

    def run(*xs: Any) -> tuple:
        if rng is None or (rng.step, rng.micro) == at:
            return region(*xs)
        now = rng.step, rng.micro
        rng.step, rng.micro = at  # type: ignore[misc]
        try:
            return region(*xs)
        finally:
            rng.step, rng.micro = now

    return checkpoint(run, *args, use_reentrant=False)


def _breaks(n: fx.Node) -> bool:
    """Nodes that stay outside every region: an async collective's start and its wait."""
    name = getattr(n.target, "__name__", str(n.target))
    return name == "wait" or name.endswith("_start")


def _runs(graph: fx.Graph, mark: str) -> list[list[fx.Node]]:
    """The runs of consecutive computing nodes with one (not ``None``) value of ``meta[mark]``."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    key = None
    for n in graph.nodes:
        if n.op == "get_attr":  # a parameter read between a region's ops does not end it (moved before it)
            continue
        k = n.meta.get(mark) if n.op in ("call_function", "call_method", "call_module") and not _breaks(n) else None
        if k is not None and k == key:
            current.append(n)
            continue
        if current:
            runs.append(current)
        current, key = ([n], k) if k is not None else ([], None)
    if current:
        runs.append(current)
    return runs


def _communicates(n: fx.Node) -> bool:
    target = n.target if n.op == "call_function" else None
    return getattr(target, "__module__", "").startswith("hapc.collectives")


def outline(gm: fx.GraphModule, run: list[fx.Node], name: str, target: Any, lead: tuple) -> bool:
    """Move ``run`` into a submodule ``name`` of ``gm`` called as ``target(module, *lead, *inputs)``
    (returning a tuple of the run's values read outside it); ``False`` where nobody reads them."""
    g = gm.graph
    inside = set(run)
    inputs: list[fx.Node] = []
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    if not outputs:
        return False
    pos = {n: i for i, n in enumerate(g.nodes)}
    for a in inputs:  # parameter reads interleaved with the run: before it (they read nothing)
        if a.op == "get_attr" and pos[a] > pos[run[0]]:
            run[0].prepend(a)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in run:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name=name[0].upper() + name[1:]))
    with g.inserting_before(run[0]):
        module = g.get_attr(name)
        call = g.call_function(target, (module, *lead, *inputs), name=f"{name}_out")
        for i, o in enumerate(outputs):
            o.replace_all_uses_with(g.call_function(operator.getitem, (call, i), name=f"{o.name}_r"))
    for n in reversed(run):
        g.erase_node(n)
    return True


def checkpoint_regions(gm: fx.GraphModule) -> int:
    """Move each run of consecutive nodes of one region into a submodule called through
    :func:`checkpointed`; returns how many regions were made. A run whose values nobody outside reads
    (dead code) is left as it is; one that communicates is left as it is with a warning."""
    made = skipped = 0
    g = gm.graph
    rng = getattr(gm, "rng", None)
    for run in _runs(g, REGION):
        if any(_communicates(n) for n in run):
            skipped += 1
            continue
        if rng is not None:
            with g.inserting_before(run[0]), warnings.catch_warnings():
                # fx asks get_attr targets to be modules or tensors; rng is neither
                warnings.simplefilter("ignore", UserWarning)
                stream = g.get_attr("rng")
        else:
            stream = None
        if outline(gm, run, f"region{made}", checkpointed, (stream,)):
            made += 1
        elif stream is not None:
            g.erase_node(stream)
    if skipped:
        warnings.warn(
            f"{skipped} torch.utils.checkpoint region(s) communicate under this plan and are not recomputed: "
            "their activations are kept (memory as without checkpointing there). A plan that keeps those "
            "blocks data-parallel recomputes them (e.g. hapc.compile(..., baseline='dp-ev'))",
            stacklevel=2,
        )
    if made:
        g.lint()
        gm.recompile()
    return made


def autocasted(region: torch.nn.Module, states: tuple, *args: Any) -> tuple:
    """``region(*args)`` under the ``torch.autocast`` contexts the model entered around these ops, outermost
    first: ``states`` holds ``(device_type, dtype, enabled, cache_enabled)`` each, as captured
    (:func:`hapc.theory.trace.autocast_regions`). ``enabled=False`` contexts (a model keeping rotary
    embeddings in float32 under the caller's autocast) are re-entered too, so the region computes in the
    dtypes it does on one device whatever autocast the training loop runs under."""
    with contextlib.ExitStack() as stack:
        for device, dtype, enabled, cache in states:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
        return region(*args)


def autocast_regions(gm: fx.GraphModule) -> int:
    """Move each run of consecutive nodes the model ran under one stack of ``torch.autocast`` contexts
    (``meta[AUTOCAST]``) into a submodule ``autocast{k}`` called through :func:`autocasted`, in ``gm``
    and in its checkpoint regions' submodules (whose nodes keep their marks); returns how many."""
    made = 0
    for mod in [gm, *(m for m in gm.children() if isinstance(m, fx.GraphModule))]:
        count = 0
        for run in _runs(mod.graph, AUTOCAST):
            if outline(mod, run, f"autocast{count}", autocasted, (run[0].meta[AUTOCAST],)):
                count += 1
        if count:
            mod.graph.lint()
            mod.recompile()
        made += count
    return made
