"""The user-facing entry points: ``hapc.synthesize`` (and, with the runtime, ``hapc.compile``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from .cluster import Cluster
from .errors import HapcError
from .plan import Plan
from .planner import KINDS, SYNTH_OPTIONS, THEORY_OPTIONS, choose_plan, synthesize_theory
from .synth.baselines import needs_param_comm
from .synth.search import Progress
from .theory.draws import refuse_random_ops
from .theory.program_key import follows_mode as _follows_mode
from .theory.program_key import program_key as _mode_key

__all__ = ["KINDS", "SYNTH_OPTIONS", "THEORY_OPTIONS", "choose_plan", "compile", "synthesize", "synthesize_theory"]


def synthesize(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Any,
    *,
    segments: str = "node",
    rounds: int = 4,
    solver: str = "cbc",
    baseline: str | None = None,
    ratios: Sequence[float] | None = None,
    memory: bool = True,
    strict: bool = False,
    sfb: bool = True,
    variants: Sequence[str] = ("padded", "grouped"),
    param_comm: bool = False,
    leaf_modules: Sequence[type] = (),
    capture: str = "auto",
    loss: str | int | None = None,
    progress: Progress | None = None,
    time_limit: float | None = None,
    precision: str | None = None,
) -> Plan:
    """Synthesize the distributed program and sharding ratios for ``model`` on ``cluster``.

    Traces the model, derives its theory, then alternates A*/DP synthesis with the ratio LP
    (HAP Eq. 1-2) and returns the best :class:`~hapc.plan.Plan`. No processes are started.

    Args:
        segments: ``"node"`` (default, fast), ``"blocks"`` or ``"none"`` (HAP's whole-program
            A*); see :mod:`hapc.synth.synthesizer`.
        rounds: maximum synthesis/balance alternations.
        solver: ``"cbc"`` or ``"highs"`` for the LP.
        baseline: ``"dp-ev"``, ``"dp-cp"``, ``"ep"``, ``"tp"`` or ``"fsdp"`` to price a baseline
            instead (:mod:`hapc.synth.baselines`); ``"fsdp"`` derives with ``param_comm=True`` itself.
        ratios: fix the sharding ratios (one per device group of the cluster, in its order,
            weighted by group size summing to 1) instead of balancing them with the LP; the
            program is still synthesized for them.
        memory: respect each device's memory.
        strict / sfb / variants / param_comm: passed to :func:`hapc.derive`.
        capture / loss: passed to :func:`hapc.trace` (how the model is captured; which output is the loss).
        time_limit: seconds the program search may take (off by default: the search is exact).
            When they run out, the best program found so far is used and the plan says so:
            ``plan.predicted["proven_optimal"]`` is False and ``plan.predicted["optimality_gap"]``
            bounds how far above the optimum it may be (see :mod:`hapc.synth.synthesizer`).
            Every search stops at it; where none completed a program, the all-replicated one is
            used. :func:`compile` may spend about twice it: the pipeline kind is priced under a
            budget of its own.
        precision: ``"bf16"`` / ``"fp16"``: mixed precision as ``torch.autocast`` runs it -- the
            forward under autocast to that dtype, fp32 master weights, gradients and Adam state
            (:mod:`hapc.theory.precision`). The plan prices activations and communicated tensors at
            their autocast dtypes, adds autocast's half copy of each matmul weight to memory, and
            prices compute at the groups' ``flops_bf16`` / ``flops_fp16`` (a cluster without the key
            is refused, naming it); the compiled module runs its forward under autocast. Default
            (``None``, or ``"fp32"``): the model's own dtype, no autocast.
    """
    from .theory import derive, trace

    cluster = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    t0 = time.perf_counter()
    graph = trace(model, example_inputs, leaf_modules=leaf_modules, capture=capture, loss=loss)
    t1 = time.perf_counter()
    param_comm = param_comm or needs_param_comm(baseline)  # fsdp gathers sharded parameters
    theory = derive(graph, strict=strict, sfb=sfb, variants=variants, param_comm=param_comm, precision=precision)
    t2 = time.perf_counter()
    return synthesize_theory(
        theory,
        cluster,
        segments=segments,
        rounds=rounds,
        solver=solver,
        baseline=baseline,
        ratios=ratios,
        memory=memory,
        progress=progress,
        timings={"trace": t1 - t0, "derive": t2 - t1},
        options={
            "sfb": sfb,
            "variants": list(variants),
            "param_comm": param_comm,
            "strict": strict,
            **({"precision": precision} if precision is not None else {}),
        },
        time_limit=time_limit,
    )


def compile(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Any,
    plan: Plan | str | None = None,
    *,
    group: Any = None,
    device: Any = None,
    leaf_modules: Sequence[type] = (),
    seed: int = 0,
    init: Any = None,
    timeout: float | None = None,
    pipeline: bool | None = None,
    num_micro: int | None = None,
    schedule: str = "h1f1b",
    loss_sync: str = "lazy",
    capture: str = "auto",
    loss: str | int | None = None,
    outputs: str = "whole",
    recompute: str = "auto",
    segmented: bool | None = None,
    **options: Any,
) -> Any:
    """This rank's part of ``model`` under ``plan`` (synthesized here when not given).

    Call under an initialised process group (e.g. ``torchrun``); every rank calls it with the
    same model (same initial weights) and example inputs. Without ``plan``, rank 0 synthesizes
    and sends the plan to the others as JSON. The returned module takes the model's inputs -- the
    global batch, or this rank's share of it (the kind is settled on the first call; given the
    whole batch, token counts of a mean loss are computed locally instead of all-reduced) -- and
    returns the loss (its full value on every rank); use it with any ``torch.optim`` optimizer.

    Args:
        plan: a :class:`Plan` or the path of a saved one; checked against the model, the
            cluster and the world size.
        group: the process group to run on (default: the whole job).
        device: where this rank's shards live (default: ``cuda:current`` under NCCL, else CPU).
        seed / init: for a model built on the meta device (too large for one host): each module's
            parameters are drawn by its ``reset_parameters()`` seeded by ``(seed, module name)``
            (or by ``init(name, tensor)``) and only this rank's slices are kept; the same values
            as :func:`hapc.materialize.materialize` gives a single-device copy.
        timeout: seconds after which a collective of this module (and the plan broadcast) gives
            up and raises, so a crashed, hung or absent rank stops every other rank instead of
            holding it for the job's default (torch: 30 min gloo, 10 min NCCL). Default: the
            process group's own timeout.
        pipeline: ``True``: pipeline the model over the cluster's device groups (HARP,
            :mod:`hapc.pipeline`), each stage an SPMD program on its sub-mesh; ``False``: one SPMD
            program over all devices (HAP). The default (``None``, no ``plan``) lets the planner
            price both -- and data-parallel replicas of the pipeline (``R`` copies on ``1/R`` of the
            devices each, :mod:`hapc.pipeline.replicas`) -- for the same global batch and take the faster
            (:func:`hapc.planner.choose_plan`; the kinds priced are in ``module.plan.predicted["kinds"]``
            or ``module.plan_kinds``); options only the SPMD runtime takes (``group``, ``device``,
            ``init``, ``leaf_modules``, ``capture``, ``loss``, ``outputs="local"``, a ``baseline`` or
            ``ratios``; refused with ``pipeline=True``), and under ``outputs="whole"`` a model returning a
            tensor besides its loss whose dim 0 is not the batch (a scalar metric: the micro-batches'
            values would not concatenate into the batch's), leave the pipeline out. A
            pipelined result is a :class:`~hapc.pipeline.PipelineModule`, called like the model
            (positional or keyword inputs): train with
            ``loss = module.train_step(*batch)`` (forward and backward of ``num_micro`` micro-batches by
            ``schedule``: ``"h1f1b"``, ``"1f1b"`` or ``"eager-1f1b"``), then step the optimizer;
            ``train_step`` exists on the SPMD module too, and DDP's ``loss = module(*batch);
            loss.backward()`` runs on both (on a pipeline in GPipe's order). ``num_micro``: the pipeline's
            micro-batch count; default (``None``): the planner's cheapest among the divisors of the
            batch (:func:`hapc.planner.search_micro`); a count that does not divide the batch is
            refused (HapcError).
        segmented: per-segment sharding ratios (HAP §5.2, :mod:`hapc.segmented`): the model cut into
            segments, each an SPMD program with its own ratios on every device, rows re-sharded by
            an all-to-all at each cut. ``None`` (default): one of the kinds the planner prices
            (chosen where predicted faster); ``True``: forced (the planner picks the cuts);
            ``False``: left out. A :class:`~hapc.segmented.SegmentedPlan` (or its saved file) as
            ``plan`` runs it as planned. The result is a :class:`~hapc.segmented.SegmentedModule`
            (``train_step``, or ``module(*batch)`` + ``backward()``; the global batch on every rank).
            Options it cannot honour (``init``, ``leaf_modules``, ``capture``, ``loss``,
            ``outputs="local"``, ``num_micro``, a ``baseline`` or single ``ratios``) are refused; it
            is called like the model and returns its structure, other tensors as ``outputs`` says.
        recompute: a pipeline's activation recomputation: ``"auto"`` (default) -- the planner has a
            stage recompute its activations in backward where memory binds (an extra forward per
            micro-batch for fewer bytes held, :mod:`hapc.pipeline.dp`); ``"never"``; ``"always"``.
        loss_sync: when the all-reduce of the returned loss's value starts. ``"lazy"`` (default;
            gloo): at its first read, right before the backward's first gradient bucket, at the
            next call of a hapc module or 50 ms after the forward, whichever is first
            (:class:`hapc.collectives.LossChannel`) -- a background all-reduce during the forward
            costs CPU training 5-10% of a step. ``"eager"``: at the end of the forward (what NCCL
            and pipeline stages always do).
        capture / loss: how the model is captured and which of its outputs is the loss (see
            :func:`hapc.trace`); example inputs may be keyword arguments (a dict), and the module
            is then called with them (``module(**batch)``).
        outputs: the model's other returned tensors (logits, hidden states), handed back in the
            structure the model returns (a ``ModelOutput``, dict or tuple, the loss in its place):
            ``"whole"`` (default: gathered to the full tensor on every rank), ``"local"`` (this rank's
            piece as the program computed it, no communication) or ``"loss"`` (``None``: no cost).
            They are for metrics: a backward through them raises (compute loss terms in forward).
            A pipeline and per-segment ratios take ``"whole"`` and ``"loss"``: a pipeline's stage
            computing them (the last, for logits) hands its micro-batches' values to every rank
            concatenated along the batch dimension (a tensor whose dim 0 is not the batch is refused
            there), the planner pricing that broadcast in the pipeline's step time; per-segment
            ratios gather them as the SPMD module does. ``train_step`` returns the loss alone.
        options: for synthesis when no plan is given -- ``segments``, ``rounds``, ``solver``,
            ``memory``, ``baseline``, ``ratios`` (see :func:`synthesize`) and the theory options
            ``sfb``, ``variants``, ``param_comm``, ``strict``, ``precision`` (see :func:`hapc.derive`;
            ``precision="bf16"``: planned for, and run under, ``torch.autocast`` -- a plan made so
            carries it, and its module runs the forward of every call under autocast).

    Raises:
        HapcError: no process group, an unknown option, or the world size does not match the
            plan / cluster.
        PlanError: the plan was made for another model or cluster.
    """
    import torch.distributed as dist

    from .codegen.constants import constant_inputs
    from .codegen.module import CompiledModule
    from .theory import derive, trace

    _refuse_gradient_hooks(model)
    unknown = sorted(set(options) - set(SYNTH_OPTIONS) - set(THEORY_OPTIONS))
    if unknown:
        raise HapcError(
            f"hapc.compile got unknown option(s) {unknown}; known: {', '.join(SYNTH_OPTIONS + THEORY_OPTIONS)}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise HapcError(
            "hapc.compile runs inside a distributed job: start it with torchrun (or call "
            "torch.distributed.init_process_group first); for planning alone use hapc.synthesize"
        )
    from .codegen.original import ensure_fresh, guard, refuse_held_gradients

    ensure_fresh(model)  # a model an earlier module trained past would start this one from stale weights
    cluster = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    if segmented and pipeline is not None:
        raise HapcError(f"segmented=True and pipeline={pipeline} ask for two plan kinds: give one")
    if pipeline:
        if group is not None or plan is not None:
            raise HapcError("a pipelined compile runs on the whole job and plans itself: drop group= and plan=")
        refused = _pipeline_blocked(
            device=device, init=init, leaf_modules=tuple(leaf_modules), capture=capture, loss=loss, outputs=outputs
        )
        if refused is not None:  # not ignored: a loss= or capture= left out would train another program
            raise HapcError(f"pipeline=True cannot honour it: {refused}; drop it, or compile with pipeline=False")
        return _compile_pipeline(
            model, cluster, example_inputs, None, num_micro, schedule, timeout, options, recompute=recompute, seed=seed,
            outputs=outputs,
        )  # fmt: skip
    blocked = _pipeline_blocked(
        plan=None if _is_segmented(plan) else plan, group=group, device=device, init=init,
        leaf_modules=tuple(leaf_modules), capture=capture, loss=loss, outputs=outputs,
    )  # fmt: skip
    if timeout is not None:
        group = _group_with_timeout(group, timeout)
    world = dist.get_world_size(group)
    if isinstance(plan, str):
        from .segmented import SegmentedPlan, is_segmented_file

        plan = SegmentedPlan.load(plan) if is_segmented_file(plan) else Plan.load(plan)
    if _is_segmented(plan) or segmented:
        refused = _pipeline_blocked(
            init=init, leaf_modules=tuple(leaf_modules), capture=capture, loss=loss, outputs=outputs,
            num_micro=num_micro,
        )  # fmt: skip
        return _compile_segmented(
            model, cluster, example_inputs, plan, group, device, seed, refused, options, outputs=outputs
        )
    if plan is None and cluster.num_devices != world and cluster.virtual == "gpu":
        raise HapcError(
            f"cluster {cluster.name!r} has {cluster.num_devices} devices but the job has {world} processes; "
            f"start {cluster.num_devices} processes or describe the {world} you have"
        )
    graph = trace(model, example_inputs, leaf_modules=leaf_modules, capture=capture, loss=loss)
    mode_branch = _mode_branch(model, example_inputs, graph, leaf_modules=leaf_modules, capture=capture, loss=loss)
    refuse_random_ops(graph, world)
    theory_opts = {"sfb": True, "variants": ("padded", "grouped"), "param_comm": False, "strict": False}
    source = plan.options if plan is not None else options
    theory_opts.update({k: source[k] for k in THEORY_OPTIONS if k in source})
    if needs_param_comm(plan.baseline if plan is not None else options.get("baseline")):
        theory_opts["param_comm"] = True  # fsdp gathers sharded parameters
    theory_opts["variants"] = tuple(theory_opts["variants"])
    theory = derive(graph, **theory_opts)
    _verify_user_rules(theory, graph, example_inputs)
    if plan is None:
        kinds = ("spmd",) if pipeline is False else KINDS if segmented is None else ("spmd", "pipeline")
        kind, plan, priced = _agree_on_choice(
            model, example_inputs, theory, cluster, group, options, theory_opts, kinds, num_micro, blocked, recompute,
            outputs,
        )  # fmt: skip
        if kind == "pipeline":
            return _compile_pipeline(
                model, cluster, example_inputs, plan, num_micro, schedule, timeout, options, priced, seed=seed,
                outputs=outputs,
            )  # fmt: skip
        if kind == "segmented":
            return _compile_segmented(
                model, cluster, example_inputs, plan, group, device, seed, None, options, outputs=outputs
            )
    plan.check(graph=theory.graph, cluster=cluster, world_size=world)  # the theory's: autocast dtypes
    refuse_held_gradients(model, "spmd", group)  # a frozen parameter's: the module holds it as a constant
    module = CompiledModule(
        model, theory, plan, group=group, device=device, seed=seed, init=init, loss_sync=loss_sync, outputs=outputs
    )
    module._mode_branch = mode_branch
    module._constant_inputs = constant_inputs(model, example_inputs, graph, leaf_modules=tuple(leaf_modules), loss=loss)
    module._trace_options = {"leaf_modules": tuple(leaf_modules)}  # an odd batch is traced again likewise
    module.carry_gradients(model)  # gradients of a backward before compile: the module's next backward adds to them
    guard(model, module)  # the model raises while stale: module.unwrap() writes the trained weights back
    return module


_VERIFIED: dict[tuple, str] = {}  # (op, node shapes) -> "" (sound) or the failure, per process


def _refuse_gradient_hooks(model: torch.nn.Module) -> None:
    """A gradient hook on one of the model's parameters (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``) would be dropped silently: the compiled module trains
    parameters of its own (whole copies or this rank's shards), which do not carry it."""
    from .codegen.module import gradient_hooks

    for name, p in model.named_parameters():
        if gradient_hooks(p) != (0, 0):
            raise HapcError(
                f"parameter {name!r} of the model has a gradient hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook): the compiled module trains parameters of its own, which "
                "would not run it, and with several ranks a hook would see a partial gradient (replicated "
                "parameters' gradients are summed across ranks after they are accumulated). Remove the hook and "
                "transform p.grad after loss.backward() returns, when it holds the single-device gradient; "
                "step optimizers after the backward rather than in a hook"
            )


def _verify_user_rules(theory: Any, graph: Any, example_inputs: Any) -> None:
    """Check every op whose rule the user registered (``hapc.register_op`` / ``register_rule``) with
    :func:`hapc.verify` on the example inputs, once per op and shape: a wrong annotation must not
    train silently. Where the inputs or weights are on the meta device nothing can be simulated:
    a warning names ``hapc.verify``."""
    import warnings

    from .theory.registry import default_registry
    from .theory.verify import verify

    def key(n: Any) -> tuple:
        return (n.op, n.meta, tuple(graph[o].meta for o in n.operands))

    user = [n for n in graph if n.kind == "op" and (r := default_registry.get(n.op)) is not None and not r.builtin]
    todo = [n for n in user if key(n) not in _VERIFIED]
    if todo:
        values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
        values = (values,) if isinstance(values, torch.Tensor) else tuple(values)
        meta = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in values) or any(
            p.device.type == "meta" for p in graph.module.parameters()
        )
        if meta:
            warnings.warn(
                f"the rules registered for {sorted({n.op for n in todo})} could not be checked on meta tensors; "
                "check them with hapc.verify(theory, real_inputs, [[0.5, 0.3, 0.2]]) before training",
                stacklevel=3,
            )
            return
        from .theory.capture import bind_keywords

        names = [n.name for n in graph.inputs]
        inputs = bind_keywords(graph.module, example_inputs)[0]  # by the forward's signature
        failures = verify(theory, {k: v for k, v in inputs.items() if k in names}, [[0.5, 0.3, 0.2], [0.6, 0.4]],
                          nodes=[n.index for n in todo])  # fmt: skip
        bad = {f.op: str(f) for f in failures}
        for n in todo:
            _VERIFIED[key(n)] = bad.get(n.op, "")
    wrong = sorted({(n.op, _VERIFIED[key(n)]) for n in user if _VERIFIED.get(key(n))})
    if wrong:
        op, what = wrong[0]
        raise HapcError(
            f"the sharding rule registered for {op!r} is unsound: {what}. Fix its annotation or rule function "
            "(hapc.verify(hapc.derive(hapc.trace(model, inputs)), inputs, [[0.5, 0.3, 0.2]]) reproduces it)"
        )


def _mode_branch(model: torch.nn.Module, example_inputs: Any, graph: Any, **trace_opts: Any) -> str | None:
    """Where the model's forward computes something else in the other train/eval mode (a
    ``self.training`` branch: label smoothing in training only, an auxiliary loss), or None. The
    program is the traced mode's: switching modes must then be refused, never run silently."""
    from .theory import trace
    from .theory.trace import constants_kept

    mode = model.training
    # the other mode's constants are only compared here, and could be shapes only (a meta trace):
    # they must not stay on the model, where the runtime would take them for the program's state
    try:
        with constants_kept(model):
            model.train(not mode)
            other = trace(model, example_inputs, **trace_opts)
    except Exception as exc:  # the other mode does not even capture: it is certainly different
        return f"the model in {'eval' if mode else 'training'} mode ({type(exc).__name__}: {str(exc)[:120]})"
    finally:
        model.train(mode)
    a, b = _mode_key(graph), _mode_key(other)
    if a == b:
        return None
    first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    nodes = [n for n in graph if n.kind == "op" and not _follows_mode(n)]
    where = nodes[first] if first < len(nodes) else graph.loss
    return f"{where.name} ({where.source or 'model'})"


def _group_with_timeout(group: Any, seconds: float) -> Any:
    """The same ranks as ``group`` in a new process group whose operations time out after
    ``seconds``."""
    from ._util import same_ranks_group

    if not seconds > 0:
        raise HapcError(f"timeout must be a positive number of seconds, got {seconds!r}")
    return same_ranks_group(group, seconds)


def _pipeline_blocked(**given: Any) -> str | None:
    """Why this compile call cannot run a pipeline (None: it can): options that only the SPMD
    runtime honours leave the pipeline out of the planner's choice instead of being ignored."""
    # the others' default is None or empty; a pipeline hands the model's other outputs back whole (the
    # default) or not at all (outputs="loss"), never as a rank's piece ("local")
    fine = {"capture": ("auto",), "outputs": ("whole", "loss")}
    used = [k for k, v in given.items() if (v not in fine[k] if k in fine else v is not None and v != ())]
    if not used:
        return None
    return f"{', '.join(k + '=' for k in used)} given: only the SPMD runtime takes {'them' if len(used) > 1 else 'it'}"


def _compile_pipeline(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    plan: Any,
    num_micro: int | None,
    schedule: str,
    timeout: float | None,
    options: dict[str, Any],
    kinds: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Any:
    """:func:`hapc.pipeline.compile_pipeline`, its module guarding ``model`` and recording the kinds priced."""
    from .codegen.original import guard, refuse_held_gradients
    from .pipeline import compile_pipeline

    refuse_held_gradients(model, "pipeline")
    piped = compile_pipeline(
        model, cluster, example_inputs, plan, num_micro=num_micro, schedule=schedule, timeout=timeout,
        **options, **extra,
    )  # fmt: skip
    piped.plan_kinds = kinds or []
    guard(model, piped)  # the model raises while stale: piped.unwrap() writes the trained weights back
    return piped


def _is_segmented(plan: Any) -> bool:
    from .segmented import SegmentedPlan

    return isinstance(plan, SegmentedPlan)


def _compile_segmented(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    plan: Any,
    group: Any,
    device: Any,
    seed: int,
    blocked: str | None,
    options: dict[str, Any],
    outputs: str = "whole",
) -> Any:
    """A :class:`~hapc.segmented.SegmentedModule` under ``plan`` (planned here, forced, when None:
    rank 0 prices the segmented kind alone and sends the plan as JSON), handing back the model's
    other outputs as ``outputs`` says ("whole" or "loss")."""
    import torch.distributed as dist

    from ._util import broadcast_json
    from .codegen.original import guard, refuse_held_gradients
    from .segmented import SegmentedModule, SegmentedPlan

    if blocked is not None:
        raise HapcError(f"per-segment ratios cannot run: {blocked}; drop them, or compile another plan kind")
    spmd_only = [k for k in ("baseline", "ratios") if options.get(k) is not None]
    if spmd_only:
        raise HapcError(
            f"{', '.join(spmd_only)} given: one ratio vector / baseline is an SPMD plan's; per-segment ratios are "
            "planned per segment (hapc.segmented.plan_segmented(..., ratios=[...per segment...]) fixes them)"
        )
    from .theory import trace

    refuse_random_ops(trace(model, example_inputs), dist.get_world_size(group))
    if plan is None:
        world = dist.get_world_size(group)
        if cluster.num_devices != world:
            raise HapcError(
                f"cluster {cluster.name!r} has {cluster.num_devices} devices but the job has {world} processes; "
                "a segmented plan runs one process per device"
            )
        synth = {k: v for k, v in options.items() if k in SYNTH_OPTIONS}
        theory_opts = {k: v for k, v in options.items() if k in THEORY_OPTIONS}

        def make() -> dict[str, Any]:  # an error here is raised on every rank (broadcast_json)
            ch = choose_plan(
                model, cluster, example_inputs, kinds=("segmented",), synth_options=synth,
                theory_options=theory_opts,
            )  # fmt: skip
            return ch.plan.to_json()

        plan = SegmentedPlan.from_json(broadcast_json(make, group=group))
    plan.check(cluster=cluster)
    refuse_held_gradients(model, "segmented", group)
    module = SegmentedModule(model, example_inputs, plan, group=group, device=device, seed=seed, outputs=outputs)
    guard(model, module)  # the model raises while stale: module.unwrap() writes the trained weights back
    return module


def _agree_on_choice(
    model: torch.nn.Module,
    example_inputs: Any,
    theory: Any,
    cluster: Cluster,
    group: Any,
    options: dict[str, Any],
    theory_opts: dict[str, Any],
    kinds: Sequence[str],
    num_micro: int | None,
    blocked: str | None,
    recompute: str = "auto",
    outputs: str = "whole",
) -> tuple[str, Any, list[dict[str, Any]]]:
    """Rank 0 prices the plan kinds (:func:`hapc.planner.choose_plan`) and everyone receives the
    chosen kind, its plan and the kinds priced as JSON bytes (never pickle). A planning error on rank
    0 is sent too, and raised on every rank (no rank is left waiting for a plan)."""
    import torch.distributed as dist

    from ._util import broadcast_json
    from .pipeline.planner import PipelinePlan

    dev = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )

    def make() -> dict[str, Any]:  # an error here is raised on every rank, with its class (broadcast_json)
        synth_opts = {k: v for k, v in options.items() if k in SYNTH_OPTIONS}
        ch = choose_plan(
            model, cluster, example_inputs, kinds=kinds, num_micro=num_micro, theory=theory,
            synth_options=synth_opts, theory_options=theory_opts, pipeline_blocked=blocked, recompute=recompute,
            outputs=outputs,
        )  # fmt: skip
        return {"kind": ch.kind, "plan": ch.plan.to_json(), "kinds": [k.to_json() for k in ch.kinds]}

    waiting = (
        "rank 0 did not send the plan within the process group's timeout: it is still planning (an exact search "
        "on a large or unusual model can take minutes) or it died. Bound the search (hapc.compile(..., "
        "time_limit=60): the best plan found by then), give the wait longer (hapc.compile(..., timeout=...)), or "
        "plan once ahead on one process (hapc.synthesize(model, cluster, inputs).save('plan.json'), then "
        "hapc.compile(..., plan='plan.json'))"
    )
    data = broadcast_json(make, group=group, device=dev, waiting=waiting)
    if data["kind"] == "segmented":
        from .segmented import SegmentedPlan

        return "segmented", SegmentedPlan.from_json(data["plan"]), data["kinds"]
    plan = PipelinePlan.from_json(data["plan"]) if data["kind"] == "pipeline" else Plan.from_json(data["plan"])
    return data["kind"], plan, data["kinds"]
