"""The ``hapc`` command line.

    hapc rules [--json]                      every op the theory knows and how it may shard
    hapc theory MODEL [--json] [--verify]    the Hoare-triple theory of a model
    hapc synth MODEL --cluster C [--kind auto|spmd|pipeline|segmented] [--show-program] [--json PLAN]
               [--baseline dp-ev|dp-cp|ep|tp|fsdp] [--emit-code DIR]
    torchrun --nproc-per-node N -m hapc.cli profile --out cluster.toml   (or: hapc profile --local N)
    hapc demo [--model M] [--cluster C]      the README's main job: synthesize, train, compare

MODEL is a zoo alias (``gpt``, ``gpt-1.3b``, ``bert``, ``mlp``, ``cnn``, ``moe``...) or
``package.module:function`` returning ``(model, example_inputs)`` (the current directory is
importable, as under ``python -m``); ``--arg key=value`` passes keyword arguments to the factory.
"""

from __future__ import annotations

# Only light imports at module level: argument parsing (and so --help and every usage error) must
# not wait for torch. The commands import what they need.
import argparse
import ast
import contextlib
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import HapcError

#: hapc.synth.baselines.BASELINES, spelled out so that parsing needs no torch (a test keeps them equal)
BASELINES = ("dp-ev", "dp-cp", "ep", "tp", "fsdp")
#: hapc.planner.KINDS, likewise
KINDS = ("spmd", "pipeline", "segmented")
#: models.ZOO's aliases, likewise: an unknown model is refused before torch is imported
ZOO_ALIASES = (
    "bert", "bert-base", "bert-moe", "bert-moe-base", "bert-moe5", "cnn", "cnn-pool", "gpt", "gpt-1.3b", "gpt-13b",
    "gpt-2.7b", "gpt-39b", "gpt-6.7b", "gpt-small", "mlp", "moe", "transformer", "vgg19", "vit", "vit-24", "vit-hap",
    "wide-resnet", "wide-resnet-1b", "wide-resnet-2b", "wide-resnet-4b", "wide-resnet-6.8b",
)  # fmt: skip


def check_model_spec(spec: str) -> None:
    """Refuse a MODEL that is neither a zoo alias nor ``package.module:function`` -- a usage error,
    answered before torch and the zoo are imported (as ``models.factory`` would answer it)."""
    if spec not in ZOO_ALIASES and ":" not in spec:
        raise HapcError(
            f"unknown model {spec!r}: use a zoo alias ({', '.join(sorted(ZOO_ALIASES))}) or 'package.module:function'"
        )


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def _without_gc_pauses(ns: argparse.Namespace) -> None:
    """In a ``hapc`` process (not a caller's ``main([...])``), before the heavy imports of a command
    that traces: no cyclic garbage collection for the rest of this short-lived process, and no
    teardown of the interpreter at its end (:func:`_exit_now`). Full collections would rescan torch's
    and hapc's modules and the model each time (0.2-0.5 s of a cold ``hapc synth`` on ViT-24);
    trace, derive and synthesis pause the collector anyway (``hapc._util.without_gc``), and
    reference counting still frees everything acyclic."""
    if getattr(ns, "entry", False):
        import gc

        gc.disable()
        ns.exit_now = True


def _exit_now(rc: int) -> None:
    """End the ``hapc`` process now with status ``rc``: run the ``atexit`` handlers (logging's,
    ``weakref.finalize``'s, a model's own), flush stdout and stderr, then ``os._exit``. What it skips
    is the interpreter's teardown -- its last cyclic collection and the freeing of every module and
    object, 0.4-0.7 s after a ViT-24 synthesis, for a process that is ending anyway (freezing the heap
    instead left extension objects unfreed, and nanobind, triton's bindings, printed hundreds of
    "leaked instance" lines). Where a thread other than daemons is still running it returns, and
    the interpreter ends as usual."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be written anyway
            pass
    os._exit(rc)


def _table(title: str) -> Any:
    from rich.table import Table

    return Table(title=title)


def load_model(spec: str, args: Sequence[str] = ()) -> tuple[Any, Any]:
    """``(model, example_inputs)`` from a zoo alias or ``package.module:function``."""
    import inspect

    from . import models

    kwargs = {}
    for a in args:
        key, sep, value = a.partition("=")
        if not sep or not key.isidentifier():
            raise HapcError(f"--arg expects key=value with a Python name as key, got {a!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    try:
        factory = models.factory(spec)
    except KeyError as exc:
        raise HapcError(str(exc.args[0])) from None
    except AttributeError as exc:
        raise HapcError(str(exc)) from None
    except ImportError as exc:
        raise HapcError(f"model {spec!r}: {exc} (the current directory and sys.path are searched)") from None
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: let the call check its arguments
        sig = None
    if sig is not None:
        params = sig.parameters.values()
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            unknown = [k for k in kwargs if k not in named]
            if unknown:
                raise HapcError(
                    f"model {spec!r}: unknown --arg {', '.join(unknown)}; it accepts {', '.join(named) or 'none'}"
                )
        try:
            sig.bind(**kwargs)
        except TypeError as exc:
            raise HapcError(f"model {spec!r}: {exc} (pass it with --arg KEY=VALUE)") from None
    out = factory(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise HapcError(f"model {spec!r} must return (model, example_inputs), got {type(out).__name__}")
    return out


# -- hapc rules ---------------------------------------------------------------------------------


def cmd_rules(ns: argparse.Namespace) -> int:
    from .theory import default_registry

    rows = default_registry.table()
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = _table(f"hapc rules: {len(rows)} ops")
    for col in ("op", "kind", "how it may shard", "linear in"):
        table.add_column(col, overflow="fold")
    for r in rows:
        how = (
            r["shards"]
            if not r["annotation"] or r["shards"] == r["annotation"]
            else f"{r['annotation']}  ({r['shards']})"
        )
        table.add_row(r["op"], r["kind"], how, r["linear"] or "")
    _console().print(table)
    return 0


# -- hapc theory ------------------------------------------------------------------------------


def cmd_theory(ns: argparse.Namespace) -> int:
    check_model_spec(ns.model)  # before the heavy imports
    _without_gc_pauses(ns)
    import torch

    from . import derive, trace
    from .theory.verify import verify

    console = _console()
    model, inputs = load_model(ns.model, ns.arg)
    t0 = time.perf_counter()
    graph = trace(model, inputs)
    t1 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theory = derive(graph, strict=ns.strict, optimise=not ns.raw)
    t2 = time.perf_counter()
    info = {
        "model": ns.model,
        "graph": graph.summary(),
        "raw_triples": theory.raw_counts,
        "triples": theory.counts(),
        "unsupported_ops": theory.unsupported,
        "seconds": {"trace": round(t1 - t0, 4), "derive": round(t2 - t1, 4)},
    }
    failures = None
    if ns.verify:
        if any(p.device.type == "meta" for p in model.parameters()):
            raise HapcError("--verify needs a model with real weights (this one is on the meta device)")
        names = [n.name for n in graph.inputs]
        given = dict(zip(_input_names(model), inputs if isinstance(inputs, (tuple, list)) else [inputs]))
        failures = verify(theory, {k: v for k, v in given.items() if k in names}, [[0.5, 0.3, 0.2], [0.7, 0.3]])
        info["verify"] = {"failures": [str(f) for f in failures]}
    if ns.json:
        info["theory"] = [theory.fmt_triple(t) for t in theory.triples]
        print(json.dumps(info, indent=1, default=str))
        return 1 if failures else 0
    g = info["graph"]
    console.print(
        f"[bold]{ns.model}[/]: {g['nodes']} nodes ({g.get('input', 0)} inputs, {g.get('param', 0)} parameters, "
        f"{g.get('op', 0)} ops), {g['parameters']:,} parameter values, {g['forward_flops']:.3g} forward flops"
    )
    console.print(f"traced in {t1 - t0:.2f}s, theory derived in {t2 - t1:.2f}s")
    table = _table("Hoare triples")
    table.add_column("")
    for k in ("source", "compute", "comm", "loss", "total"):
        table.add_column(k, justify="right")
    raw = theory.raw_counts
    table.add_row("derived", *(str(raw.get(k, 0)) for k in ("source", "compute", "comm", "loss", "total")))
    c = theory.counts()
    if not ns.raw:
        table.add_row(
            "after HAP §4.5", *(str(c.get(k, 0)) for k in ("source", "compute", "comm", "loss")), str(c["triples"])
        )
    console.print(table)
    console.print(f"{c['properties']} distinct properties")
    for w in caught:
        console.print(f"[yellow]warning:[/] {w.message}")
    shown = theory.triples if ns.show == "all" else theory.triples[: ns.show]
    if shown:
        console.print(f"\n[bold]triples[/] (first {len(shown)} of {len(theory.triples)}; --show all for every one):")
        for t in shown:
            console.print("  " + theory.fmt_triple(t), markup=False)
    if failures is not None:
        if failures:
            console.print(f"[red]verify: {len(failures)} unsound triple instances[/]")
            for f in failures[:20]:
                console.print("  " + str(f), markup=False)
            return 1
        console.print("[green]verify: every triple holds, forward and backward, on 3 and 2 uneven devices[/]")
    del torch
    return 0


def _input_names(model: Any) -> list[str]:
    import inspect

    return [p for p in inspect.signature(model.forward).parameters]


# -- hapc synth --------------------------------------------------------------------------------


def _choose(ns: argparse.Namespace, model: Any, inputs: Any, cluster: Any, kind: str, progress: Any, shown: Any) -> Any:
    """:func:`hapc.planner.choose_plan` as ``hapc synth`` asks it; ``shown``: a rich status line
    naming each entry as it is priced (None: nothing shown)."""
    from .planner import KINDS, choose_plan

    return choose_plan(
        model,
        cluster,
        inputs,
        kinds=(kind,) if kind in ("spmd", "segmented") else KINDS,
        num_micro=ns.micro,
        synth_options={
            "segments": ns.segments,
            "rounds": ns.rounds,
            "solver": ns.solver,
            "baseline": ns.baseline,
            "memory": not ns.no_memory,
            "time_limit": ns.time_limit,
        },
        theory_options=_precision(ns),
        progress=progress,
        recompute=ns.recompute,
        outputs=ns.outputs,
        on_price=None if shown is None else lambda what: shown.update(f"pricing {what}"),
    )


def cmd_synth(ns: argparse.Namespace) -> int:
    from collections import Counter

    from .cluster import Cluster

    check_model_spec(ns.model)  # usage errors -- the model's name, the cluster -- before torch is imported
    cluster = Cluster.load(ns.cluster)
    _without_gc_pauses(ns)
    if getattr(ns, "entry", False):  # the hapc process itself: sub-mesh kinds synthesized on 2 cores
        from .pipeline import stagecost

        stagecost.WORKERS = min(2, os.cpu_count() or 1)
    from .planner import kinds_table

    console = _console()
    model, inputs = load_model(ns.model, ns.arg)
    kind = "pipeline" if ns.pipeline else ns.kind
    if kind == "pipeline":
        return _synth_pipeline(ns, model, inputs, cluster, console)

    def progress(stats, score):
        console.print(f"[dim]  searching: {stats.expanded} expanded, {stats.generated} generated, score {score:.4g}[/]")

    # on a terminal, what is being priced (a cost-chosen default may price dozens of pipelines)
    waiting = console.status("planning") if console.is_terminal else contextlib.nullcontext()
    with waiting as shown:
        choice = _choose(ns, model, inputs, cluster, kind, progress, shown)
    if choice.kind == "pipeline":
        console.print(kinds_table(choice.kinds))
        unused = [o for o, v in (("--show-program", ns.show_program), ("--emit-code", ns.emit_code)) if v]
        if unused:
            console.print(f"[yellow]{', '.join(unused)}: for SPMD plans (the pipeline's stages are planned when "
                          "it compiles); pass --kind spmd for one[/]")  # fmt: skip
        return _synth_pipeline(ns, model, inputs, cluster, console, plan=choice.plan)
    if choice.kind == "segmented":  # per-segment ratios (HAP §5.2): each segment an SPMD plan of its own
        console.print(f"[bold]{ns.model}[/] on {cluster.describe()}: {choice.plan.summary()}", markup=True)
        console.print(kinds_table(choice.kinds))
        if ns.json:
            choice.plan.save(ns.json)
        return 0
    plan = choice.plan
    if ns.json:
        plan.save(ns.json)
    console.print(f"[bold]{ns.model}[/] on {cluster.describe()}" + (f" in {ns.precision}" if ns.precision else ""))
    console.print(str(plan), markup=False)
    ratios = _table("sharding ratios (per device of each type)")
    for col in ("device type", "devices", "ratio", "share of work", "memory used", "memory"):
        ratios.add_column(col, justify="right")
    for t, r, m in zip(plan.device_types, plan.ratios, plan.predicted["memory"]):
        ratios.add_row(t["name"], str(t["count"]), f"{r:.4f}", f"{r * t['count']:.1%}", _gib(m), _gib(t["memory"]))
    console.print(ratios)
    stages = _table("predicted time per direction")
    for col in ("direction", "stages", "communication ms", "compute ms", "total ms"):
        stages.add_column(col, justify="right")
    for d in ("forward", "backward", "gradients"):
        ss = [st for st in plan.stages if st.direction == d]
        c = sum(st.comm for st in ss)
        p = sum(max(st.comp, default=0.0) for st in ss)
        stages.add_row(d, str(len(ss)), f"{c * 1e3:.4g}", f"{p * 1e3:.4g}", f"{(c + p) * 1e3:.4g}")
    console.print(stages)
    kinds = Counter(f"{i.op}{'/' + i.variant if i.variant else ''}" for i in plan.collectives())
    console.print("collectives: " + (", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"))
    sfb = plan.sfb_sites()
    console.print("SFB sites: " + (", ".join(plan.node_names.get(i.ref, str(i.ref)) for i in sfb) or "none"))
    t = plan.timings
    console.print(
        "synthesis time: " + ", ".join(f"{k} {v:.3f}s" for k, v in t.items()) + f"; {len(plan.rounds)} Q/B round(s)"
    )
    console.print(kinds_table(choice.kinds))
    if ns.show_program:
        console.print("\n[bold]program[/] (one instruction per line; a collective opens a stage):")
        for line in plan.describe_program():
            console.print("  " + line, markup=False)
    if ns.json:
        console.print(f"plan written to {ns.json}")
    if ns.emit_code:
        from .codegen.emit import emit_code

        paths = emit_code(plan, plan._theory, ns.emit_code)  # type: ignore[attr-defined]
        console.print(f"per-rank code: {', '.join(str(p) for p in paths[:-1])} (plan: {paths[-1]})")
    return 0


def _precision(ns: argparse.Namespace) -> dict[str, Any]:
    """``--precision`` as a theory option (none given: the model's dtype, nothing added)."""
    return {"precision": ns.precision} if ns.precision else {}


def _synth_pipeline(
    ns: argparse.Namespace, model: Any, inputs: Any, cluster: Any, console: Any, plan: Any = None
) -> int:
    """``hapc synth --pipeline`` (or a pipeline the planner chose): HARP's plan (stage table as in
    its App. C), the warm-up counts, the schedule grid, the step time by Eq. 12 and by the simulator,
    and a Chrome trace of the replay."""
    from .pipeline import micro_batches, plan_pipeline
    from .pipeline.schedule import grid, schedule
    from .pipeline.simulate import chrome_trace, compare_policies, policy_table, simulate

    if plan is None and ns.micro is None:  # the planner's micro-batch search, the pipeline kind only
        from .planner import choose_plan, kinds_table

        choice = choose_plan(
            model, cluster, inputs, kinds=("pipeline",), theory_options=_precision(ns), recompute=ns.recompute
        )
        console.print(kinds_table(choice.kinds))
        plan = choice.plan
    if plan is None:
        from .theory import derive, trace

        batch = next(x.shape[0] for x in inputs if hasattr(x, "shape") and x.dim())
        micro = micro_batches(inputs, ns.micro, batch)[0]
        theory = derive(trace(model, micro), **_precision(ns))
        plan = plan_pipeline(model, cluster, micro, num_micro=ns.micro, theory=theory, recompute=ns.recompute)
    console.print(
        f"[bold]{ns.model}[/] pipelined on {cluster.describe()}" + (f" in {ns.precision}" if ns.precision else "")
    )
    console.print(plan.describe(), markup=False, highlight=False)
    fwd = [s.fwd for s in plan.stages]
    bwd = [s.bwd + s.sync / plan.num_micro for s in plan.stages]  # the step's gradient sync, spread
    comm = [s.comm for s in plan.stages[:-1]]
    sched = schedule(plan.warmups, plan.num_micro)
    console.print("[bold]H-1F1B schedule[/] (one column per time step; F = forward, B = backward):")
    console.print(grid(sched), markup=False, highlight=False)
    sim = simulate(sched, fwd, bwd, comm)
    tied = plan.tied_sync  # weights tied across stages: one all-reduce per step the schedule does not show
    extra = f" + {tied * 1e3:.3f} ms tied weights' all-reduce" if tied else ""
    console.print(f"step time: Eq. 12 {(plan.time - tied) * 1e3:.3f} ms, simulated {sim.step_time * 1e3:.3f} ms{extra}")
    if len(plan.stages) > 1:
        console.print(policy_table(compare_policies(fwd, bwd, comm, plan.num_micro, clamp=True)))
    if ns.trace:
        chrome_trace(sim, ns.trace)
        console.print(f"trace of the replay written to {ns.trace} (open in https://ui.perfetto.dev)")
    else:
        console.print("--trace FILE writes a Chrome trace of the replay (open in https://ui.perfetto.dev)")
    if ns.json:
        Path(ns.json).write_text(plan.dumps())
        console.print(f"pipeline plan written to {ns.json}")
    return 0


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g} GiB"


# -- hapc demo --------------------------------------------------------------------------------


def cmd_demo(ns: argparse.Namespace) -> int:
    import functools

    from .cluster import Cluster
    from .demo import run_demo

    cluster = Cluster.load(ns.cluster)
    load_model(ns.model, ns.arg)  # fail early on a bad model spec
    factory = functools.partial(load_model, ns.model, tuple(ns.arg))
    return run_demo(factory, ns.model, cluster, steps=ns.steps, out=ns.out, console=_console())


# -- hapc profile -------------------------------------------------------------------------------


def _profile_job(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    from .profile import profile

    cluster, raw = profile(**kwargs)
    return {"toml": cluster.to_toml(), "raw": json.dumps(raw)}


def cmd_profile(ns: argparse.Namespace) -> int:
    import torch.distributed as dist

    from .cluster import Cluster
    from .quantities import SIZE, TIME, parse_quantity

    console = _console()
    sizes = tuple(int(parse_quantity(s.strip(), "--sizes", SIZE)) for s in ns.sizes.split(","))
    half = [] if ns.half.strip().lower() in ("", "none") else [p.strip() for p in ns.half.split(",")]
    if any(p not in ("bf16", "fp16") for p in half):
        raise HapcError(f"--half takes bf16, fp16 or both separated by a comma (none: neither), got {ns.half!r}")
    kwargs = {"sizes": sizes, "reps": ns.reps, "gemm": ns.gemm, "half": half, "name": ns.name, "out": ns.out}
    if ns.gap is not None and not ns.marginal:
        raise HapcError("--gap is the computation between the collectives --marginal times: give it with --marginal")
    if ns.marginal:  # as benchmarks/fidelity.py profiles: what each collective adds to a program
        from .profile import MARGINAL_CALLS, MARGINAL_GAP

        gap = MARGINAL_GAP if ns.gap is None else parse_quantity(ns.gap.strip(), "--gap", TIME)
        if gap <= 0:
            raise HapcError(f"--gap must be a positive time (e.g. 5ms), got {ns.gap!r}")
        kwargs |= {"gap": gap, "marginal": True, "calls": MARGINAL_CALLS}
    if ns.speeds and ns.local is None:
        raise HapcError("--speeds emulates device speeds on local processes: give it with --local N")
    if ns.local is not None:
        from .testing import run_distributed

        try:
            speeds = [float(v) for v in ns.speeds.split(",")] if ns.speeds else None
        except ValueError:
            raise HapcError(
                f"--speeds takes fractions of a core separated by commas (e.g. 1,0.5), got {ns.speeds!r}"
            ) from None
        result = run_distributed(_profile_job, ns.local, kwargs, timeout=600, speeds=speeds)[0]
    else:
        if "RANK" not in os.environ and not dist.is_initialized():
            raise HapcError("hapc profile measures a running job: start it with torchrun, or pass --local N")
        if not dist.is_initialized():
            import torch

            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        result = _profile_job(dist.get_rank(), dist.get_world_size(), kwargs)
        if dist.get_rank() != 0:
            return 0
    cluster = Cluster.load(tomllib_loads(result["toml"]))
    raw = json.loads(result["raw"])
    console.print(cluster.describe())
    table = _table("collectives: t = alpha + beta * bytes (cost-model convention)")
    for col in ("primitive", "alpha (us)", "bandwidth 1/beta", "points (bytes: us)"):
        table.add_column(col, justify="right")
    for p, v in raw["collectives"].items():
        bw = f"{1 / v['beta'] / 1e9:.3g} GB/s" if v["beta"] > 0 else "inf"
        pts = ", ".join(f"{x}: {t * 1e6:.0f}" for x, t in v["points"])
        table.add_row(p, f"{v['alpha'] * 1e6:.1f}", bw, pts)
    console.print(table)
    if ns.json:
        with open(ns.json, "w") as f:
            f.write(result["raw"])
    if ns.out:
        console.print(f"cluster written to {ns.out} (use it: hapc synth MODEL --cluster {ns.out})")
    else:
        console.print(result["toml"], markup=False)
    return 0


def tomllib_loads(text: str) -> dict[str, Any]:
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib.loads(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _show_count(text: str) -> str | int:
    if text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of triples or 'all', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of triples or 'all', got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hapc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("rules", help="list every op the theory knows and how it may shard")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(fn=cmd_rules)

    t = sub.add_parser("theory", help="derive and print a model's Hoare-triple theory")
    t.add_argument("model", help="zoo alias or package.module:function")
    t.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for the factory")
    t.add_argument("--json", action="store_true", help="machine-readable output (every triple)")
    t.add_argument("--strict", action="store_true", help="an op without a rule is an error")
    t.add_argument("--raw", action="store_true", help="skip HAP §4.5 optimisations")
    t.add_argument("--verify", action="store_true", help="check every triple on simulated uneven devices")
    t.add_argument("--show", type=_show_count, default=20, help="how many triples to print ('all' for every one)")
    t.set_defaults(fn=cmd_theory)

    y = sub.add_parser("synth", help="synthesize the distributed program for a model on a cluster")
    y.add_argument("model", help="zoo alias or package.module:function")
    y.add_argument("--cluster", required=True, help="preset name (hap-testbed, local-cpu:3...) or TOML file")
    y.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for the factory")
    y.add_argument("--show-program", action="store_true", help="print the program, one instruction per line")
    y.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    y.add_argument("--baseline", choices=list(BASELINES), help="price a baseline instead")
    y.add_argument("--segments", default="node", choices=["node", "blocks", "none"], help="search decomposition")
    y.add_argument("--rounds", type=_positive_int, default=4, help="synthesis / LP alternations")
    y.add_argument("--solver", default="cbc", choices=["cbc", "highs"], help="LP solver")
    y.add_argument(
        "--time-limit",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="stop the exact program search after SECONDS and keep the best program found, marked "
        "unproven (default: no limit, the proven optimum)",
    )
    y.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="mixed precision: plan for a forward under torch.autocast to this dtype with fp32 master weights, "
        "priced at the groups' flops_bf16 / flops_fp16 (default: the model's dtype)",
    )
    y.add_argument(
        "--recompute",
        choices=["auto", "never", "always"],
        default="auto",
        help="a pipeline's activation recomputation: auto (default) lets the planner recompute a stage's "
        "activations in backward where memory binds (the stage table's recompute column), never, always",
    )
    y.add_argument("--no-memory", action="store_true", help="ignore device memory limits")
    y.add_argument("--emit-code", metavar="DIR", help="write DIR/rank{r}.py for every rank and DIR/plan.json")
    y.add_argument(
        "--kind",
        default="auto",
        choices=["auto", *KINDS],
        help="plan kind: auto (default) prices HAP SPMD, a HARP pipeline and per-segment ratios (HAP §5.2) "
        "and takes the fastest",
    )
    y.add_argument("--pipeline", action="store_true", help="same as --kind pipeline")
    y.add_argument(
        "--outputs",
        choices=["whole", "loss"],
        default="whole",
        help="what the training loop reads of the model's other returned tensors (hapc.compile's outputs=): "
        "whole (default; a pipeline is priced with their hand-back to every rank), loss (none: they come back "
        "as None, at no cost)",
    )
    y.add_argument(
        "--micro",
        type=_positive_int,
        default=None,
        help="micro-batches per step of a pipeline (default: the cheapest among the batch's divisors)",
    )
    y.add_argument("--trace", metavar="FILE", help="write a Chrome trace of a pipeline's simulated step to FILE")
    y.set_defaults(fn=cmd_synth)

    f = sub.add_parser("profile", help="measure the running cluster (under torchrun) and write a cluster file")
    f.add_argument("--out", help="write the cluster TOML here")
    f.add_argument(
        "--local", type=_positive_int, metavar="N", help="start N local gloo processes instead of using torchrun"
    )
    f.add_argument(
        "--sizes",
        default="1KiB,16KiB,128KiB,1MiB,4MiB,16MiB,32MiB",  # hapc.profile.DEFAULT_SIZES (no torch import here)
        help="message sizes for the alpha-beta fits (default: to past the 25 MB gradient bucket)",
    )
    f.add_argument("--reps", type=_positive_int, default=5, help="timed repetitions per measurement (median kept)")
    f.add_argument("--gemm", type=_positive_int, default=1024, help="matrix size for the flops measurement")
    f.add_argument("--name", default="profiled", help="cluster name")
    f.add_argument(
        "--half",
        default="bf16,fp16",
        help="half precisions whose GEMM rate is measured too (flops_bf16 / flops_fp16, for precision=); none: neither",
    )
    f.add_argument(
        "--speeds",
        metavar="S,S,...",
        help="with --local: each rank's speed as a fraction of one core, e.g. 1,0.5 (emulated: a rival takes the rest)",
    )
    f.add_argument(
        "--marginal",
        action="store_true",
        help="time each collective by what it adds between bursts of computation (0.5 ms, 4 calls per burst), "
        "as a program meets it, instead of alone after a barrier: closer measured step times on shared CPU hosts",
    )
    f.add_argument(
        "--gap",
        metavar="TIME",
        help="with --marginal: the computation between the timed collectives (default 0.5ms); give about what "
        "your program computes between its collectives -- on emulated slow ranks (--speeds) a collective "
        "after a longer burst also waits longer for the slow rank's turn on its core",
    )
    f.add_argument("--json", metavar="PATH", help="also write the raw measurements")
    f.set_defaults(fn=cmd_profile)

    d = sub.add_parser("demo", help="the README's main job: synthesize, train on local processes, compare")
    d.add_argument("--model", default="gpt-small", help="zoo alias or package.module:function")
    d.add_argument("--arg", action="append", default=["batch=6"], metavar="KEY=VALUE", help="factory keyword")
    d.add_argument("--cluster", default="local-cpu:3", help="one local process per device of this cluster")
    d.add_argument("--steps", type=_positive_int, default=5, help="training steps")
    d.add_argument("--out", default="hapc-demo", help="where the per-rank code is written")
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)  # before any heavy import: usage errors and --help are instant
    ns.entry = argv is None  # the process's own command line (the `hapc` script, python -m hapc)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # MODEL may be ./mymod.py, as under python -m
        sys.path.insert(0, cwd)
    try:
        rc = ns.fn(ns)
    except HapcError as exc:
        print(f"hapc: error: {exc}", file=sys.stderr)
        rc = 2
    if getattr(ns, "exit_now", False):
        _exit_now(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
