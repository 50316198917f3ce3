"""The cold start of tracing and synthesis (issue 15): what a fresh process imports, not how long it
takes (timings are benchmarks/synth_time.py's cold-start table, never asserted here).

Tracing runs torch's Python meta kernels, many wrapped by ``torch._disable_dynamo``, which imports
``torch._dynamo`` (and part of ``torch._inductor``) on a function's first call; ``hapc.trace``
pre-empts that for its meta evaluation (``_meta_kernels_without_dynamo``) and imports
``torch.utils.flop_counter`` (which imports triton) only for a user's leaf module. The meta kernels'
sympy (via ``torch.fx.experimental.symbolic_shapes``) is stood in for, and repeated meta evaluations
come from a memo (``hapc.theory.plain_meta``): the same graphs, every memo hit equal to the real
evaluation. The ``hapc`` process itself ends without the interpreter's teardown (``cli._exit_now``).
Each check runs in a fresh interpreter, as a ``hapc`` command does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> dict:
    """The JSON the last line of ``code``'s output holds, run in a fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


HEAVY = ("torch._dynamo", "torch._inductor", "triton")


def test_trace_derive_and_synthesis_import_no_dynamo_inductor_or_triton():
    # a ViT: conv, cat, layer_norm, gelu, softmax -- Python meta kernels behind torch._disable_dynamo
    out = _fresh(
        f"""
        import json, sys
        import torch
        import hapc
        from hapc import models
        from hapc.api import synthesize_theory
        from hapc.cluster import Cluster

        before = {{m: m in sys.modules for m in {HEAVY!r}}}
        model, inputs = models.vit("tiny", layers=2, batch=8, device="meta")
        graph = hapc.trace(model, inputs)
        plan = synthesize_theory(hapc.derive(graph), Cluster.load("hap-testbed"))
        after = {{m: m in sys.modules for m in {HEAVY!r}}}
        print(json.dumps({{"before": before, "after": after, "nodes": len(graph), "time": plan.time}}))
        """
    )
    assert out["nodes"] > 20 and out["time"] > 0
    assert not any(out["before"].values())
    assert out["after"] == {m: False for m in HEAVY}, out["after"]


def test_the_preemption_ends_with_the_trace():
    """After tracing, torch's wrappers behave as before: the first call of one outside hapc builds
    ``torch._dynamo.disable(fn)`` (importing dynamo) and caches it, as torch alone does."""
    out = _fresh(
        """
        import json, sys
        import torch
        import hapc
        from hapc import models
        trace_mod = sys.modules["hapc.theory.trace"]

        model, inputs = models.vit("tiny", layers=1, batch=4, device="meta")
        hapc.trace(model, inputs)
        wrapped = trace_mod._dynamo_wrapped()
        left = [getattr(fn, "__name__", "?") for fn in wrapped if getattr(fn, "__dynamo_disable", None) is fn]
        dynamo_after_trace = "torch._dynamo" in sys.modules
        a = torch.empty(2, 3, device="meta")
        torch.cat([a, a])  # a Python meta kernel behind torch._disable_dynamo, outside hapc
        cached = [fn for fn in wrapped if getattr(fn, "__dynamo_disable", None) is not None]
        print(json.dumps({"found": len(wrapped), "left": left, "dynamo_after_trace": dynamo_after_trace,
                          "dynamo_after_cat": "torch._dynamo" in sys.modules,
                          "real_cache": all(c.__dynamo_disable is not c for c in cached), "cached": len(cached)}))
        """
    )
    assert out["found"] > 20  # the wrappers were found (else the pre-emption silently does nothing)
    assert out["left"] == []
    assert not out["dynamo_after_trace"]
    assert out["dynamo_after_cat"] and out["cached"] >= 1 and out["real_cache"]


def test_a_trace_after_dynamo_was_imported_leaves_torch_alone():
    out = _fresh(
        """
        import json, sys
        import torch, torch._dynamo
        import hapc
        from hapc import models
        trace_mod = sys.modules["hapc.theory.trace"]
        model, inputs = models.vit("tiny", layers=1, batch=4, device="meta")
        graph = hapc.trace(model, inputs)
        placed = [fn for fn in trace_mod._dynamo_wrapped() if getattr(fn, "__dynamo_disable", None) is fn]
        print(json.dumps({"nodes": len(graph), "placed": len(placed)}))
        """
    )
    assert out["nodes"] > 10 and out["placed"] == 0


def test_a_user_leaf_module_still_counts_its_flops():
    """``torch.utils.flop_counter`` is imported lazily, where a user's leaf module needs it."""
    out = _fresh(
        """
        import json, sys
        import torch, torch.nn as nn
        import hapc

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 32)
            def forward(self, x):
                return self.fc(x).relu()

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Block()
            def forward(self, x):
                return self.block(x).sum()

        before = "torch.utils.flop_counter" in sys.modules
        graph = hapc.trace(M(), (torch.randn(4, 16),), leaf_modules=[Block])
        leaf = [n for n in graph.nodes if n.op == "Block" or "Block" in str(n.op)]
        print(json.dumps({"before": before, "after": "torch.utils.flop_counter" in sys.modules,
                          "flops": [n.flops for n in leaf]}))
        """
    )
    assert not out["before"] and out["after"]
    assert out["flops"] == [2 * 4 * 16 * 32], out  # the matmul, counted by FlopCounterMode


def test_cli_main_called_by_a_program_leaves_its_garbage_collector_alone():
    """``hapc``'s own process runs without cyclic collections (cli._without_gc_pauses); a program
    that calls ``hapc.cli.main([...])`` keeps its collector as it was."""
    out = _fresh(
        """
        import contextlib, gc, io, json
        from hapc.cli import main
        frozen = gc.get_freeze_count()
        with contextlib.redirect_stdout(io.StringIO()):
            rc = main(["synth", "mlp", "--cluster", "local-cpu:2", "--kind", "spmd"])
        print(json.dumps({"rc": rc, "enabled": gc.isenabled(), "frozen_added": gc.get_freeze_count() - frozen}))
        """
    )
    assert out == {"rc": 0, "enabled": True, "frozen_added": 0}


# -- hapc.theory.plain_meta: no sympy while tracing, and a memo of the layers' meta evaluations -------

ZOO = ("mlp", "transformer", "bert", "bert-moe", "moe", "gpt", "cnn", "cnn-pool", "vit", "wide-resnet")

#: in-place calls on activations (never memoised) and one shape in two layouts, in identical blocks
_IN_PLACE = """
import torch, torch.nn as nn, torch.nn.functional as F

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = (self.fc(x) * 2).add_(1)
        y = F.relu(y, inplace=True)
        z = y.t().contiguous().t().mul_(0.5)
        a, b = z.chunk(2, dim=1)
        sq = z.t() @ z  # the same shape with other strides: exp keeps its operand's layout
        return torch.cat([b, a], 1).unsqueeze_(0).squeeze(0) + (torch.exp(sq.t()) + torch.exp(sq)).sum()

class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()
"""

#: the memo turned off: every meta evaluation runs
_NO_MEMO = (
    "from hapc.theory import plain_meta; plain_meta.MetaMemo.call = lambda self, fn, args, kwargs, method=None: "
    "getattr(args[0], method)(*args[1:], **kwargs) if method else fn(*args, **kwargs)"
)

_GRAPHS = f"""
    import json, sys
    import torch
    PRELUDE
    import hapc
    from hapc import models
    from hapc.errors import TraceError
    exec({_IN_PLACE!r})

    def summary(model, inputs):
        graph = hapc.trace(model, inputs)
        return [graph.fingerprint(), [(n.flops, n.mem_bytes, n.requires_grad) for n in graph.nodes]]

    out = {{name: summary(*models.load(name)) for name in {ZOO!r}}}
    out["in-place"] = summary(InPlace(), (torch.randn(4, 8),))
    out["imported"] = [m for m in ("sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules]

    class Bad(torch.nn.Module):  # a meta kernel's torch._check fails: the same error either way
        def forward(self, x, y):
            return torch.cat([x, y], dim=1).sum()
    try:
        hapc.trace(Bad(), (torch.randn(2, 3), torch.randn(4, 3)), capture="fx")
    except TraceError as exc:
        out["error"] = str(exc)
    print(json.dumps(out))
"""


def test_tracing_imports_no_sympy_and_gives_the_same_graphs_as_with_it_and_without_the_memo():
    """The zoo traced in a fresh process (stand-ins, memo) and in one that imported sympy's users first
    (torch's own modules) and evaluates every node: the same nodes, shapes, flops, memory traffic, and
    the same error for a bad shape."""
    fresh = _fresh(_GRAPHS.replace("PRELUDE", "pass"))
    real = _fresh(_GRAPHS.replace("PRELUDE", "import torch.fx.experimental.symbolic_shapes; " + _NO_MEMO))
    assert fresh["imported"] == []
    assert real["imported"] == ["sympy", "torch.fx.experimental.symbolic_shapes"]
    assert "cat" in fresh["error"] or "Sizes of tensors" in fresh["error"], fresh["error"]
    for key in (*ZOO, "in-place", "error"):
        assert fresh[key] == real[key], key


def test_the_stand_ins_leave_with_the_trace_and_answer_as_torch_does():
    out = _fresh(
        """
        import json, sys
        import torch
        import hapc
        from hapc import models
        from hapc.theory import plain_meta

        shapes = plain_meta._STANDINS[plain_meta.SHAPES]
        names = [*plain_meta._BOOL_IDENTITIES, *plain_meta._INT_IDENTITIES, "sym_and", "sym_or", "sym_eq",
                 "is_nested_int", "has_guarding_hint", "guarding_hint_or_throw"]
        stand_in = {n: getattr(shapes, n) for n in names}
        Basic = plain_meta._STANDINS["sympy"].Basic
        before = {"object": isinstance(object(), Basic), "int": isinstance(1, Basic)}

        hapc.trace(*models.load("vit"))
        left = [m for m in ("sympy", plain_meta.SHAPES) if m in sys.modules]
        parent = hasattr(sys.modules["torch.fx.experimental"], "symbolic_shapes")

        import sympy
        import torch.fx.experimental.symbolic_shapes as real
        values = [True, False, 0, 1, 3, -2, 1.5, None, "x", [1, 2], (1, 2), [1, 3], [[1], [2]], [], (True,)]
        def answer(fn, *args):
            try:
                return repr(fn(*args))
            except Exception as exc:
                return type(exc).__name__
        differ = []
        for n in names:
            for a in values:
                if answer(stand_in[n], a) != answer(getattr(real, n), a):
                    differ.append((n, repr(a)))
                if n in ("sym_and", "sym_or", "sym_eq"):
                    for b in values:
                        if answer(stand_in[n], a, b) != answer(getattr(real, n), a, b):
                            differ.append((n, repr(a), repr(b)))
        class Derived(Basic):
            pass
        print(json.dumps({
            "left": left, "parent": parent, "differ": differ, "before": before,
            "real": [getattr(m, "__file__", None) is not None for m in (sympy, real)],
            "after": isinstance(sympy.Integer(2), Basic) and not isinstance(2, Basic),
            "subclass": issubclass(sympy.Symbol, Basic) and issubclass(Derived, sympy.Basic),
            "alias": shapes.guard_or_false is real.guard_or_false,
        }))
        """
    )
    assert out["left"] == [] and not out["parent"]  # a later import gets the real modules
    assert out["real"] == [True, True]
    assert out["differ"] == []
    assert out["before"] == {"object": False, "int": False}
    assert out["after"] and out["subclass"]
    assert out["alias"]  # the stand-in became the real module once that was imported


_MODEL_WITH_EXIT_HOOKS = """
import atexit
import models


class Noisy:
    def __del__(self):
        print("torn down")


KEEP = Noisy()  # freed only by the interpreter's teardown


def build(note="atexit.txt"):
    atexit.register(lambda: open(note, "w").write("ran"))
    return models.load("mlp")
"""


def test_the_hapc_process_skips_the_interpreter_teardown_but_runs_atexit_and_flushes(tmp_path):
    """``hapc synth`` ends with ``os._exit`` after the atexit handlers and a flush (cli._exit_now):
    the plan file, the whole printout and a model's atexit handler are there; module teardown is not."""
    (tmp_path / "hooked.py").write_text(_MODEL_WITH_EXIT_HOOKS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "hapc", "synth", "hooked:build", "--cluster", "local-cpu:2", "--kind", "spmd"]
    proc = subprocess.run(
        [*argv, "--json", "plan.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan written to plan.json" in proc.stdout  # the last line printed: stdout was flushed
    assert json.loads((tmp_path / "plan.json").read_text())
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "torn down" not in proc.stdout
    # an error after the heavy imports (the model's factory is called) keeps its status and message
    bad = subprocess.run(
        [*argv, "--arg", "nosuch=1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2 and "unknown --arg nosuch" in bad.stderr, bad.stderr[-2000:]


def test_every_memo_hit_is_what_the_meta_kernel_gives():
    """Each result the memo gives is compared with the real evaluation of the same call: shape,
    strides, offset, dtype, requires_grad, leaf or not, view or not; the transformer models hit it."""
    out = _fresh(
        f"""
        import json
        import torch
        import hapc
        from hapc import models
        from hapc.theory import plain_meta
        exec({_IN_PLACE!r})

        def describe(v):
            if isinstance(v, torch.Tensor):
                return [type(v).__name__, list(v.shape), list(v.stride()), v.storage_offset(), str(v.dtype),
                        v.requires_grad, v.is_leaf, v._is_view(), v.device.type]
            if isinstance(v, (tuple, list)):
                return [type(v).__name__, [describe(e) for e in v]]
            return repr(v)

        call, hits, differ = plain_meta.MetaMemo.call, {{}}, []
        def checked(self, fn, args, kwargs, method=None):
            before = self.hits
            out = call(self, fn, args, kwargs, method)
            if self.hits > before:
                real = getattr(args[0], method)(*args[1:], **kwargs) if method else fn(*args, **kwargs)
                hits[NAME] = hits.get(NAME, 0) + 1
                if describe(out) != describe(real):
                    differ.append([NAME, method or getattr(fn, "__name__", repr(fn)), describe(out), describe(real)])
            return out
        plain_meta.MetaMemo.call = checked

        for NAME in {ZOO!r}:
            hapc.trace(*models.load(NAME))
        NAME = "in-place"
        hapc.trace(InPlace(), (torch.randn(4, 8),))
        print(json.dumps({{"hits": hits, "differ": differ[:5]}}))
        """
    )
    assert out["differ"] == []
    assert out["hits"].get("vit", 0) > 20 and out["hits"].get("gpt", 0) > 20, out["hits"]


def test_sympy_imported_while_tracing_is_the_real_one():
    """A model's own code never sees the stand-ins (only torch's kernels run with them): its forward
    imports a sympy submodule and star-imports sympy, and gets the real package."""
    out = _fresh(
        """
        import json, sys
        import torch, torch.nn as nn
        import hapc

        seen = {}

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                standin = [m for m in ("sympy", "torch.fx.experimental.symbolic_shapes")
                           if getattr(sys.modules.get(m), "_hapc_standin", False)]
                import sympy.core.numbers as numbers
                ns = {}
                exec("from sympy import *", ns)
                seen.update(numbers=numbers.__name__, integer="Integer" in ns, symbol="Symbol" in ns, standin=standin)
                return torch.cat([self.fc(x), x], 1).sum()

        graph = hapc.trace(M(), (torch.randn(2, 4),), capture="fx")
        import sympy
        print(json.dumps({"seen": seen, "nodes": len(graph), "real": getattr(sympy, "__file__", None) is not None}))
        """
    )
    assert out["seen"] == {"numbers": "sympy.core.numbers", "integer": True, "symbol": True, "standin": []}
    assert out["nodes"] > 3 and out["real"]
