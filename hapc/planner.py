"""The planner: which kind of plan a model gets on a cluster, chosen by predicted step time.

This layer sits below the façade (:mod:`hapc.api`) and above the two runtimes: the SPMD runtime
(:mod:`hapc.codegen`) and the pipeline runtime (:mod:`hapc.pipeline.runtime`, which synthesizes its
stages' SPMD programs with :func:`synthesize_theory` from here). It knows two *plan kinds*:

* ``"spmd"`` -- HAP: one SPMD program over every device of the cluster, with uneven sharding
  ratios (:func:`synthesize_theory`: A*/DP synthesis alternating with the ratio LP, HAP Eq. 1-2);
* ``"pipeline"`` -- HARP: stages over sub-meshes of device groups (or of hosts inside a group),
  each stage an SPMD program on its sub-mesh (:func:`hapc.pipeline.plan_pipeline`, HARP §5); and
  ``R`` data-parallel replicas of such a pipeline, each on ``1/R`` of the devices with ``1/R`` of
  the micro-batches, gradients all-reduced across replicas (:mod:`hapc.pipeline.replicas`; priced
  for every ``R > 1`` dividing ``num_micro`` and every layout that tiles the cluster, each listed
  as ``pipeline xR (layout)``). Without a given ``num_micro`` the micro-batch count is chosen by
  cost too: a local search over the divisors of the batch (:func:`search_micro`,
  :func:`micro_candidates`), every count it prices listed (``pipeline xR (layout) [B micro]``);
* ``"segmented"`` -- HAP §5.2: the model cut into ``g`` segments, each its own SPMD program and
  ratio vector on the whole cluster, all-to-alls re-sharding the rows at the cuts
  (:mod:`hapc.segmented`; priced for 2 segments cut by flops and by op count, and for 3 where 2
  beat SPMD, each listed as ``segmented (g segments (flops|ops))``; time
  ``Σ_k T_k + Σ_cuts (a2a_fwd + a2a_bwd)``). Not applicable on one device group (every segment
  would get the same ratios).

:func:`choose_plan` prices every kind that applies and picks the least predicted step time.

**Why the two times are comparable.** Both are seconds per training step -- forward, backward and
gradient synchronisation, the optimizer step excluded in both -- for the *same global batch*
(``example_inputs``), under the same cost model (:class:`hapc.synth.cost.CostModel`: HAP §3.2's
stages of ``collective + slowest device's compute``, alpha-beta collectives derived from the
cluster's links, flops / memory bandwidth / ``op_overhead`` per device type, parameters x 4 for
weights, gradients and two Adam moments in memory):

* SPMD: :attr:`Plan.time` -- the program over the whole batch, ``Σ_stages (comm + max_j comp_j)``
  plus the bucketed gradient all-reduce, at the balanced ratios;
* pipeline: :attr:`PipelinePlan.time` -- HARP Eq. 12, ``Σ_s (t_s + 2 c_s) + (B - 1) t_max`` over
  ``B = num_micro`` micro-batches of ``batch / B`` rows, where ``t_s = fwd + bwd + sync / B`` is a
  stage's time per micro-batch from the same CostModel on the stage's sub-mesh (the gradient sync
  paid once per step) and ``c_s`` the one-way transfer of a micro-batch's boundary activations on
  the link between the stages.

Known differences. Against the pipeline: its stage costs are those of the whole-model program's
layers on the sub-mesh (an upper bound of the stage's own optimum, :mod:`hapc.pipeline.stagecost`),
and a profiled cluster's fitted ``[collectives]`` (fitted over all of its devices) are dropped on
sub-meshes, whose collectives are derived from the links instead. For SPMD: the bucketed gradient
all-reduce charges latency per byte (``alpha / bucket_bytes``), so a model smaller than one 25 MB
bucket pays a fraction of one latency, while every pipeline transfer pays a whole one -- on tiny
models with slow-latency links SPMD is predicted a little fast. Memory is checked by each kind's
own model: SPMD's LP with every device's share of the batch's activations, the pipeline's DP with
its in-flight micro-batches (HARP Eq. 18). A kind that cannot run is reported with the reason:
``"infeasible"`` (no program or no pipeline fits the memory, too few layers for the stages) or
``"not applicable"`` (e.g. a pipeline on a cluster of virtual hosts, a batch that does not split
into ``num_micro`` micro-batches, an option only the SPMD runtime supports) -- never a crash,
unless no kind is left.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ._util import without_gc
from .balance.loop import balance
from .cluster import Cluster
from .errors import HapcError, InfeasibleError
from .plan import Plan, PlanStage, program_from_triples
from .synth.baselines import BASELINES, needs_param_comm, restrict
from .synth.cost import CostModel
from .synth.search import Progress
from .synth.synthesizer import SynthSpace, replicated_triples, searches_until, shardable_triples
from .theory.graph import OP
from .theory.trace import backward_work

#: the plan kinds :func:`choose_plan` knows, in the order it prices (and prefers, on a tie) them
KINDS = ("spmd", "pipeline", "segmented")
#: options of :func:`synthesize_theory` that :func:`hapc.compile` accepts
SYNTH_OPTIONS = ("segments", "rounds", "solver", "memory", "baseline", "ratios", "time_limit")
#: options of :func:`hapc.derive` that :func:`hapc.compile` accepts
THEORY_OPTIONS = ("sfb", "variants", "param_comm", "strict", "precision")


@without_gc
def synthesize_theory(
    theory: Any,
    cluster: Cluster,
    *,
    segments: str = "node",
    rounds: int = 4,
    solver: str = "cbc",
    baseline: str | None = None,
    ratios: Sequence[float] | None = None,
    memory: bool = True,
    progress: Progress | None = None,
    timings: dict[str, float] | None = None,
    options: dict[str, Any] | None = None,
    time_limit: float | None = None,
    row_sharded: Sequence[int] = (),
) -> Plan:
    """:func:`hapc.synthesize` for an already derived theory (benchmarks reuse one theory).
    ``row_sharded``: inputs the program must source sharded along dim 0 (a segment's incoming
    activations arrive so, :mod:`hapc.segmented`; making them whole is then the program's to price)."""
    if baseline is not None and baseline not in BASELINES:
        raise HapcError(f"unknown baseline {baseline!r}; one of {', '.join(BASELINES)}")
    if time_limit is not None and not time_limit > 0:
        raise HapcError(f"time_limit must be a positive number of seconds (or None: no limit), got {time_limit!r}")
    deadline = None if time_limit is None else time.monotonic() + time_limit
    t0 = time.perf_counter()
    precision = getattr(theory, "precision", None)  # the forward's autocast: half-precision flop rates
    model = CostModel(cluster, precision=precision)
    allowed = shardable_triples(theory, model.m)
    initial = None
    if baseline is not None:
        allowed &= restrict(theory, baseline, model.m)
        initial = model.proportional_ratios() if baseline == "dp-cp" else model.even_ratios()
    if ratios is not None:
        initial = _check_ratios(ratios, model)
    if model.m == 1 and baseline is None and not row_sharded:
        # one device: the all-replicated program is optimal (no collective, every op once at full
        # size; a layout saves nothing), so the search runs over it alone. Exact, and it keeps the
        # search from the ties of equal-cost layouts: ALBERT's shared layers took 36 s here.
        allowed &= replicated_triples(theory)
    if row_sharded:
        rows = set(row_sharded)

        def by_rows(i: Any) -> bool:
            return type(i).__name__ != "Source" or i.ref not in rows or (i.layout.is_sharded and i.layout.dim == 0)

        allowed = {k for k in allowed if all(by_rows(i) for i in theory.triples[k].instrs)}
    space = SynthSpace(theory, model.m, segments, allowed)
    t1 = time.perf_counter()
    best = balance(
        space,
        model,
        rounds=rounds,
        initial=initial,
        fixed=baseline is not None or ratios is not None,
        memory=memory,
        solver=solver,
        progress=progress,
        deadline=deadline,
    )
    t2 = time.perf_counter()
    ratios = best.ratios
    stages, comm, comp, grads = [], 0.0, 0.0, 0.0
    all_costs = []
    for si, part in enumerate(best.result.parts):
        costs = [theory.triples[k].cost for k in part]
        all_costs += costs
        for st in model.breakdown(costs, ratios).stages:
            stages.append(PlanStage(si, st.direction, st.comm, st.comp))
            if st.direction == "gradients":
                grads += st.comm
            else:
                comm += st.comm
                comp += max(st.comp, default=0.0)
    mem = model.memory(all_costs, ratios)
    g = theory.graph
    total_flops = model_flops(g)
    plan = Plan(
        program=program_from_triples(theory, best.result.parts),
        ratios=list(ratios),
        device_types=[
            {"name": t.name, "count": t.count, "flops": t.flops, "memory": t.memory, "inner": t.inner}
            for t in model.types
        ],
        device_ratios=model.device_ratios(ratios),
        graph_fingerprint=g.fingerprint(),
        cluster_fingerprint=cluster.fingerprint(),
        cluster_name=cluster.name,
        predicted={
            "time": best.cost,
            "comm": comm,
            "comp": comp,
            "gradients": grads,
            "memory": list(mem),
            # False: time_limit stopped the program search before it proved its program optimal;
            # the gap bounds how far above the optimum it can be (at the ratios searched)
            "proven_optimal": best.result.proven,
            "optimality_gap": best.result.cost / best.result.floor if best.result.floor > 0 else 1.0,
        },
        stages=stages,
        options={
            **(options or {}),
            **({"precision": precision} if precision else {}),  # the runtime runs the forward under autocast
            "segments": segments,
            "rounds": rounds,
            "solver": solver,
            "memory": memory,
            "time_limit": time_limit,
        },
        baseline=baseline,
        total_flops=total_flops,
        peak_flops=sum(t.count * t.flops for t in model.types),
        rounds=[
            {
                "ratios_in": list(r.ratios_in),
                "search_cost": r.search_cost,
                "ratios_out": list(r.ratios_out),
                "cost": r.cost,
            }
            for r in best.rounds
        ],
        timings={
            **(timings or {}),
            "space": t1 - t0,
            "search": best.seconds_search,
            "lp": best.seconds_lp,
            "balance": t2 - t1,
        },
        node_names={n.index: n.name for n in g},
    )
    plan._theory = theory  # type: ignore[attr-defined]  # kept in memory for codegen, never saved
    plan._parts = best.result.parts  # type: ignore[attr-defined]
    return plan


def model_flops(graph: Any) -> float:
    """The step's arithmetic: every op's forward flops and its backward's."""
    return sum(n.flops + backward_work(n, graph.nodes)[0] for n in graph if n.kind == OP)


def ideal_seconds(graph: Any, cluster: Cluster, precision: str | None = None) -> float:
    """The step's model flops over the cluster's peak flop/s (at ``precision``'s rates): the time of
    a perfect plan, the numerator of every efficiency (``Plan.efficiency``, ``KindEstimate``)."""
    return model_flops(graph) / sum(t.count * t.flops for t in cluster.device_types(precision))


def _check_ratios(ratios: Sequence[float], model: CostModel) -> tuple[float, ...]:
    names = [t.name for t in model.types]
    if len(ratios) != len(names):
        raise HapcError(
            f"ratios has {len(ratios)} entries but the cluster has {len(names)} device groups ({', '.join(names)}); "
            "give one ratio per group"
        )
    if any(not (r > 0) for r in ratios):
        raise HapcError(f"ratios must be positive, got {list(ratios)}")
    total = sum(r * c for r, c in zip(ratios, model.counts))
    if abs(total - 1) > 1e-6:
        raise HapcError(
            f"ratios weighted by group sizes {list(model.counts)} sum to {total:.6g}, not 1 "
            "(each device of a group gets its group's ratio)"
        )
    return tuple(float(r) for r in ratios)


# -- plan kinds ---------------------------------------------------------------------------------


@dataclass
class KindEstimate:
    """One plan kind as :func:`choose_plan` priced it.

    ``status``: ``"chosen"``, ``"feasible"`` (priced, not the least), ``"pruned"`` (a pipeline or
    segmented plan whose step time is bounded below by one already priced: not planned), ``"infeasible"`` (it cannot run
    on this cluster: memory, too few layers), ``"not applicable"`` (not considered: ``reason`` says
    why) or ``"overridden"`` (the caller fixed the kind). ``time``: predicted seconds per step for
    the global batch (``math.inf`` unless priced)."""

    kind: str  # "spmd", "pipeline", "pipeline x2 (strided)" for replicas of a pipeline, "segmented (2 segments (ops))"
    status: str
    time: float = math.inf
    reason: str = ""
    summary: str = ""  # e.g. "2 stages, 8 micro-batches" / "ratios v100 0.07, p100 0.05"
    seconds: float = 0.0  # planning time
    replicas: int = 1  # data-parallel replicas of a pipeline
    num_micro: int = 0  # a pipeline's micro-batches per step of the global batch (0: not a pipeline)
    #: (the step's model flops / the cluster's peak flop/s) / time, as ``Plan.efficiency``; 0: not priced
    efficiency: float = 0.0

    @property
    def plan_kind(self) -> str:
        """The kind of plan (``"spmd"``, ``"pipeline"`` or ``"segmented"``) whatever the replica count or cuts."""
        return self.kind.split()[0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["time"] = None if math.isinf(self.time) else self.time
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> KindEstimate:
        return KindEstimate(**{**d, "time": math.inf if d.get("time") is None else float(d["time"])})

    def line(self) -> str:
        """``spmd: 12.3 ms (chosen) -- summary`` / ``pipeline: infeasible -- reason``."""
        when = f"{self.time * 1e3:.4g} ms" if math.isfinite(self.time) else "-"
        if self.efficiency:
            when += f", efficiency {self.efficiency:.1%}"
        tail = self.summary if self.status in ("chosen", "feasible") else self.reason
        return f"{self.kind}: {when} ({self.status})" + (f" -- {tail}" if tail else "")


@dataclass
class PlanChoice:
    """What :func:`choose_plan` returns: the chosen kind, its plan (a :class:`~hapc.plan.Plan` or a
    :class:`~hapc.pipeline.PipelinePlan`) and every kind as priced."""

    kind: str  # "spmd", "pipeline" (a pipeline plan says its replica count: plan.replicas) or "segmented"
    plan: Any
    kinds: list[KindEstimate] = field(default_factory=list)

    @property
    def chosen(self) -> KindEstimate:
        return next(k for k in self.kinds if k.status == "chosen")

    @property
    def time(self) -> float:
        return self.chosen.time

    def describe(self) -> str:
        """One line per kind considered, with its predicted step time."""
        return "plan kinds considered:\n" + "\n".join("  " + k.line() for k in self.kinds)


def kinds_table(kinds: Sequence[KindEstimate | dict[str, Any]]) -> Any:
    """A rich table of the kinds considered (``hapc synth``)."""
    from rich.table import Table

    tab = Table(title="plan kinds considered (predicted step time for the same global batch)")
    columns = (
        ("kind", "left"),
        ("predicted ms", "right"),
        ("efficiency", "right"),
        ("status", "left"),
        ("plan, or why not", "left"),
    )
    for col, just in columns:
        tab.add_column(col, justify=just, overflow="fold")
    for k in kinds:
        k = k if isinstance(k, KindEstimate) else KindEstimate.from_json(k)
        when = f"{k.time * 1e3:.4g}" if math.isfinite(k.time) else "-"
        eff = f"{k.efficiency:.1%}" if k.efficiency else "-"
        tab.add_row(k.kind, when, eff, k.status, k.summary if k.status in ("chosen", "feasible") else k.reason)
    return tab


def pipeline_blocker(
    model: torch.nn.Module, cluster: Cluster, example_inputs: Any, num_micro: int | None = None
) -> str | None:
    """Why the pipeline runtime cannot take this model, cluster and batch (None: it can).
    ``num_micro``: the micro-batch count asked for (None: the planner chooses one that divides the batch)."""
    if cluster.virtual != "gpu":
        return "pipelines place stages on devices: the cluster describes virtual hosts (virtual = 'host')"
    if cluster.num_devices < 2:
        return "one device: nothing to pipeline over"
    batch = _batch_size(example_inputs)
    if batch is None:
        return "no input has a batch dimension to split into micro-batches"
    norms = [q for q, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms:
        return f"batch norm {norms[0]!r} in training mode would normalise each micro-batch on its own"
    return None


def segmented_blocker(cluster: Cluster, example_inputs: Any) -> str | None:
    """Why per-segment ratios (:mod:`hapc.segmented`) cannot help or run here (None: they can)."""
    if cluster.virtual != "gpu":
        return "per-segment ratios run one process per device: the cluster describes virtual hosts"
    if len(cluster.device_types()) < 2:
        return "one device group: every segment's balanced ratios would be the same"
    if _batch_size(example_inputs) is None:
        return "no input has a batch dimension whose rows segments could re-shard"
    return None


def outputs_blocker(
    model: torch.nn.Module,
    graph: Any,
    example_inputs: Any,
    trace_options: Any = None,
    micro: Any = None,
    parts: int | None = None,
) -> str | None:
    """Why the plan-kind choice leaves the pipeline out for a model returning more than its loss
    under ``outputs="whole"`` (None: it can hand them back). A pipeline computes them a micro-batch
    at a time and hands them back concatenated along dim 0 (:mod:`hapc.pipeline.runtime`), exact
    for a tensor whose dim 0 is the batch's rows: one that is not (a scalar metric) is refused by
    the runtime where the batch is split, so the choice must not pick it (the SPMD module hands
    such a tensor back whole). Checked by :func:`hapc.pipeline.runtime.check_batch_major` against
    the model traced at ``batch / d`` rows (``d`` the batch's least divisor above 1; ``graph`` is
    the batch's). ``outputs="loss"`` (they come back ``None``) lets the planner choose it; an
    explicit pipeline still plans (``hapc.compile(pipeline=True)`` then refuses naming the fix).
    Per-segment ratios hand every returned tensor back as the SPMD module does: never blocked.
    ``micro`` / ``parts``: the model traced at one of ``parts`` micro-batches, where the caller has
    it (:func:`choose_plan`'s row check traced it)."""
    from .pipeline.rows import micro_trace
    from .pipeline.runtime import check_batch_major

    if not any(r is not None for k, r in enumerate(graph.outputs) if k != graph.loss_leaf):
        return None
    batch = _batch_size(example_inputs)
    d = next((d for d in range(2, (batch or 1) + 1) if batch % d == 0), None)
    if d is None:  # a batch of one row: a single micro-batch, nothing concatenated
        return None
    if micro is None or parts is None:
        micro, parts = micro_trace(model, example_inputs, d, batch, **(trace_options or {})), d
    try:
        check_batch_major(graph, micro, parts)
    except HapcError as exc:
        return (
            f"{exc} (the plan-kind choice leaves the pipeline out; pipeline=True (hapc synth --kind pipeline) "
            "plans it, and compiles under outputs='loss')"
        )
    return None


def outputs_seconds(micro: Any, cluster: Cluster, num_micro: int, replicas: int = 1) -> float:
    """Predicted seconds per step of a pipeline handing the model's other returned tensors back to
    every rank (``outputs="whole"``; :meth:`hapc.pipeline.runtime.PipelineModule._hand_back`): per
    tensor and replica one broadcast over the whole cluster of that replica's ``num_micro / R``
    micro-batches' values, so with ``n`` such tensors of ``b`` bytes per micro-batch (``micro``: the
    model traced at one micro-batch; the traced dtype, which they travel in)
    ``n R alpha + beta num_micro sum(b)``, the cluster's broadcast alpha-beta (argument: the message).
    0 for a model returning its loss alone."""
    from .pipeline.stages import _itemsize

    metas = [micro[r].meta for r in extra_outputs(micro)]
    if not metas:
        return 0.0
    ab = cluster.alpha_beta("broadcast")
    nbytes = num_micro * sum(m.numel * _itemsize(m.dtype) for m in metas)
    return len(metas) * replicas * ab.alpha + ab.beta * nbytes


def gather_seconds(plan: Plan, graph: Any, refs: Sequence[int], cluster: Cluster) -> float:
    """Predicted seconds an SPMD program spends making the model's other returned tensors ``refs``
    (nodes of ``graph``, the program's reference graph) whole on every rank after its step
    (``outputs="whole"``: :meth:`hapc.codegen.program.RankProgram._extra_outputs` and
    :func:`hapc.collectives.output_whole`). Per tensor, in the layout the program holds it in (as the
    code generator picks: replicated if it has it, else sharded, else partial): nothing when
    replicated; sharded, a padded all-gather of the largest share (``max(device_ratios)`` of its
    bytes, the argument all-gathers take: one shard); partial, an all-reduce of the whole tensor. A
    tensor the program never computes (the loss does not read it) comes back ``None``: nothing."""
    from .theory.instructions import Collective, Compute, Source

    wanted = {r for r in refs if r is not None}
    if not wanted or len(plan.device_ratios) <= 1:
        return 0.0
    held: dict[int, list[Any]] = {}
    for ins in plan.instructions:
        if ins.ref not in wanted:
            continue
        lay = ins.layout if isinstance(ins, Source) else ins.output if isinstance(ins, Compute) else (
            ins.dst if isinstance(ins, Collective) else None)  # fmt: skip
        if lay is not None:
            held.setdefault(ins.ref, []).append(lay)
    share = max(plan.device_ratios)
    total = 0.0
    for ref, lays in held.items():
        if any(lay.is_replicated for lay in lays):
            continue
        nbytes = graph[ref].meta.nbytes
        if any(lay.is_sharded for lay in lays):
            total += cluster.alpha_beta("all_gather").time(share * nbytes)
        else:
            total += cluster.alpha_beta("all_reduce").time(nbytes)
    return total


def extra_outputs(graph: Any) -> list[int]:
    """The reference-graph nodes of the model's other returned tensors (all but the loss)."""
    return [r for k, r in enumerate(graph.outputs) if k != graph.loss_leaf and r is not None]


def micro_mismatch(batch: int, num_micro: int) -> str:
    """The refusal of a ``num_micro`` that does not divide the batch, naming the fix."""
    divisors = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
    return (
        f"the batch of {batch} does not split into {num_micro} equal micro-batches (num_micro); "
        f"give a num_micro that divides it ({divisors}) or leave num_micro unset for the planner to choose"
    )


def _check_parts(batch: int | None, num_micro: int | None) -> int:
    """The micro-batch count the pipeline's checks trace the model at: ``num_micro`` where it is given
    and divides the batch, else the batch's least divisor above 1 (1: nothing is split)."""
    if not batch:
        return 1
    if num_micro is not None:
        return num_micro if batch % num_micro == 0 else 1
    return next(d for d in range(2, batch + 1) if batch % d == 0) if batch > 1 else 1


def _batch_size(example_inputs: Any) -> int | None:
    from .pipeline.runtime import batch_rows

    return batch_rows(example_inputs)


#: the micro-batch count the search starts from (the largest divisor of the batch up to it): HARP's
#: and this planner's former fixed default
START_MICRO = 8
#: micro-batch counts are searched up to this many per device of the cluster (see :func:`micro_candidates`)
MICRO_PER_DEVICE = 4


def micro_candidates(batch: int, devices: int) -> list[int]:
    """The micro-batch counts :func:`choose_plan` may price for a global batch of ``batch`` rows on
    ``devices`` devices: the divisors of ``batch`` (equal micro-batches, as the runtime splits them)
    up to ``max(START_MICRO, MICRO_PER_DEVICE * devices)``. The bound: a pipeline has at most one
    stage per device, and with ``B >= 4 S`` micro-batches the H-1F1B bubble ``(S - 1) / (B + S - 1)``
    is already under a fifth of the step, while every further micro-batch adds its per-op overheads
    and link latencies (HARP Eq. 12 with affine stage times ``t_s(b) = a_s + b_s b`` is convex in
    ``B``, its minimum near ``sqrt(N sum_{s != max} b_s / a_max)``)."""
    cap = max(START_MICRO, MICRO_PER_DEVICE * devices)
    return [d for d in range(1, min(batch, cap) + 1) if batch % d == 0]


def search_micro(price: Any, candidates: Sequence[int], start: int) -> int:
    """The micro-batch count among ``candidates`` that a local search over ``price`` (count -> least
    predicted step time at that count, ``inf`` when nothing fits) settles on.

    A first-improvement descent from ``start``: the neighbours of ``B`` are the next larger and
    next smaller candidate and the candidates ``B p`` and ``B / p`` for a prime ``p`` (more
    micro-batches first, ascending, then fewer, descending); it moves to the first cheaper one and
    stops where none is. Where nothing fits yet it moves to the next larger count (smaller
    micro-batches need less memory). Why the prime steps: replica counts must divide the count, so
    the least time over replicas jumps between, say, 6 and 3 and 2 -- the descent goes 6 -> 2 where
    the sorted neighbour 3 is dearer than both. With the sorted neighbours it is exact when the step
    time is unimodal in ``B`` (Eq. 12 with affine stage times is convex); the caller takes the least of
    everything priced, so the answer is never worse than ``start``'s. Returns the count chosen."""
    cands = sorted(set(candidates))
    times: dict[int, float] = {}

    def at(B: int) -> float:
        if B not in times:
            times[B] = price(B)
        return times[B]

    def prime(n: int) -> bool:
        return n > 1 and all(n % k for k in range(2, math.isqrt(n) + 1))

    def neighbours(B: int) -> list[int]:
        i = cands.index(B)
        up = [c for k, c in enumerate(cands) if c > B and (k == i + 1 or (c % B == 0 and prime(c // B)))]
        down = [c for k, c in enumerate(cands) if c < B and (k == i - 1 or (B % c == 0 and prime(B // c)))]
        return up + down[::-1]

    B = start
    while True:
        here = at(B)
        if math.isinf(here):
            nxt = next((c for c in neighbours(B) if c > B), None)
            if nxt is None:
                break
            B = nxt
            continue
        nxt = next((c for c in neighbours(B) if at(c) < here), None)
        if nxt is None:
            break
        B = nxt
    return min(times, key=lambda k: (times[k], k))


def _quiet(label: str) -> None:
    """The default ``on_price`` of the pricing helpers: announce nothing."""


def choose_plan(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Any,
    *,
    kinds: Sequence[str] = KINDS,
    num_micro: int | None = None,
    theory: Any = None,
    synth_options: dict[str, Any] | None = None,
    theory_options: dict[str, Any] | None = None,
    trace_options: dict[str, Any] | None = None,
    pipeline_blocked: str | None = None,
    progress: Progress | None = None,
    replicas: Sequence[int] | None = None,
    recompute: str = "auto",
    prune: bool = True,
    outputs: str = "whole",
    on_price: Callable[[str], None] | None = None,
) -> PlanChoice:
    """Price every plan kind in ``kinds`` for ``model`` on ``cluster`` and pick the fastest.

    ``example_inputs`` is the global batch (the pipeline splits it into ``num_micro``
    micro-batches). ``num_micro``: the pipeline's micro-batch count, fixed (a count that does not
    divide the batch is refused: HapcError naming the divisors); ``None`` (default): chosen by
    predicted step time among the divisors of the batch (:func:`micro_candidates`) by a local
    search from the largest divisor up to :data:`START_MICRO` (:func:`search_micro`) -- each count
    priced with every replica count, and every pipeline entry priced is listed (``[B micro]`` in its
    label; ``KindEstimate.num_micro``). ``theory``: the SPMD theory of that batch when already derived (else traced with
    ``trace_options`` and derived with ``theory_options``). ``synth_options`` go to
    :func:`synthesize_theory`; a ``baseline`` or fixed ``ratios`` are SPMD-only, so they leave the
    pipeline out. ``pipeline_blocked``: a reason the caller cannot run a pipeline (e.g. a
    ``group=``). Kinds left out of ``kinds`` are reported as ``"overridden"``. Ties go to SPMD,
    then to fewer replicas. ``replicas``: the data-parallel replica counts of a pipeline to price
    (default: every ``R > 1`` dividing ``num_micro`` for which a layout tiles the cluster; ``()``:
    none); each (count, layout) is one more entry ``pipeline xR (layout)``. ``recompute``: the
    pipeline's activation recomputation (:func:`hapc.pipeline.plan_pipeline`; ``"auto"``: chosen per
    stage where memory binds, ``"never"``, ``"always"``). ``prune`` (default on, exact): a pipeline
    candidate whose Eq. 12 lower bound -- first one without a synthesis, then one over its
    synthesized stage costs -- is no better than a pipeline already priced skips its syntheses or
    its DP and is listed ``"pruned"`` (:func:`_price_pipelines`); the choice, every time priced and
    the counts searched are those of ``prune=False``. ``outputs``: what the caller needs of a
    model's other returned tensors (``hapc.compile``'s ``outputs=``): ``"loss"`` (none: they come
    back ``None``, at no cost); otherwise every kind hands them back whole, and a pipeline's time
    adds their broadcast from the stage computing them to every rank (:func:`outputs_seconds`),
    while a choice between kinds leaves the pipeline out for a model returning one whose dim 0 is
    not the batch (:func:`outputs_blocker`), and the SPMD and per-segment kinds add their programs'
    gather of them (``hapc.collectives.output_whole``; :func:`gather_seconds`). ``on_price``: called
    with each entry's label (``"spmd"``, ``"segmented (2 segments (flops))"``, ``"pipeline x2
    (strided) [16 micro]"``) just before it is priced (``hapc synth`` shows it while it waits); a
    pipeline or per-segment entry pruned without pricing is announced too. A ``time_limit`` in
    ``synth_options`` bounds the SPMD search and, with a budget of its own, every search of the
    pipeline's pricing (:func:`~hapc.synth.synthesizer.searches_until`): planning takes about twice
    it at most, plus tracing, deriving and the pipelines' non-search work.

    Raises:
        InfeasibleError: no kind can run; the message gives each kind's reason.
        HapcError: an explicit ``num_micro`` that does not divide the batch (where a pipeline applies).
    """
    from .theory import derive, trace

    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise HapcError(f"unknown plan kind(s) {unknown or list(kinds)}; choose from {', '.join(KINDS)}")
    cluster = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    announce = on_price or _quiet
    synth_options = dict(synth_options or {})
    theory_options = {"sfb": True, "variants": ("padded", "grouped"), "param_comm": False, "strict": False,
                      **(theory_options or {})}  # fmt: skip
    theory_options["variants"] = tuple(theory_options["variants"])
    if needs_param_comm(synth_options.get("baseline")):  # fsdp gathers sharded parameters
        theory_options["param_comm"] = True
    out: list[KindEstimate] = []
    plans: dict[str, Any] = {}
    theory_graph: Any = None  # the batch's graph where no SPMD theory was derived (the pipeline's checks)
    for kind in KINDS:
        if kind not in kinds:
            out.append(KindEstimate(kind, "overridden", reason="not requested"))
            continue
        t0 = time.perf_counter()
        if kind == "spmd":
            announce(kind)
            timings = {}
            if theory is None:
                graph = trace(model, example_inputs, **(trace_options or {}))
                timings["trace"] = time.perf_counter() - t0
                theory = derive(graph, **theory_options)
                timings["derive"] = time.perf_counter() - t0 - timings["trace"]
            recorded = {**theory_options, "variants": list(theory_options["variants"])}
            try:
                plan = synthesize_theory(
                    theory, cluster, options=recorded, progress=progress, timings=timings, **synth_options
                )
            except InfeasibleError as exc:
                out.append(KindEstimate(kind, "infeasible", reason=str(exc), seconds=time.perf_counter() - t0))
                continue
            ratios = ", ".join(f"{t['name']} {r:.3g}" for t, r in zip(plan.device_types, plan.ratios))
            summary = f"{len(plan.device_ratios)} devices, ratios {ratios}"
            extras = extra_outputs(theory.graph) if outputs != "loss" else []
            gathered = gather_seconds(plan, theory.graph, extras, cluster)
            if gathered:  # the model's other returned tensors made whole on every rank (outputs="whole")
                summary += f", outputs gathered {gathered * 1e3:.3g} ms"
            plans[kind] = plan
            out.append(KindEstimate(kind, "feasible", plan.time + gathered, summary=summary,
                                    seconds=time.perf_counter() - t0))  # fmt: skip
            continue
        if kind == "segmented":
            spmd_only = [k for k in ("baseline", "ratios") if synth_options.get(k) is not None]
            blocker = (
                pipeline_blocked
                or (f"SPMD-only option(s) given: {', '.join(spmd_only)}" if spmd_only else None)
                or segmented_blocker(cluster, example_inputs)
            )
            if blocker is None and theory is None:
                theory = derive(trace(model, example_inputs, **(trace_options or {})), **theory_options)
            # (the model's other returned tensors come back as the SPMD module's do: no blocker)
            if blocker is not None:
                out.append(KindEstimate(kind, "not applicable", reason=blocker))
                continue
            # the SPMD kind's time as priced (its gather of the other outputs included), like the segments'
            spmd_time = next((k.time for k in out if k.kind == "spmd" and k.status == "feasible"), math.inf)
            least = min((k.time for k in out if k.status == "feasible"), default=math.inf)
            priced = _price_segmented(
                theory,
                cluster,
                theory_options,
                synth_options,
                spmd_time,
                above=least if prune else None,
                outputs=outputs,
                on_price=announce,
            )
            for est, splan in priced:
                out.append(est)
                if splan is not None:
                    plans[est.kind] = splan
            continue
        # the pipeline
        spmd_only = [k for k in ("baseline", "ratios") if synth_options.get(k) is not None]
        blocker = (
            pipeline_blocked
            or (f"SPMD-only option(s) given: {', '.join(spmd_only)}" if spmd_only else None)
            or pipeline_blocker(model, cluster, example_inputs, num_micro)
        )
        micro_graph: Any = None  # the model at one of `parts` micro-batches (the checks below)
        batch = _batch_size(example_inputs)
        parts = _check_parts(batch, num_micro)
        if blocker is None and parts > 1:
            # micro-batches must compute what the batch does: no op couples the batch's rows (a batch
            # statistic, topk over the batch, torch.arange(batch)), nor its backward (scale_grad_by_freq)
            from .pipeline.rows import micro_trace, rows_coupled
            from .pipeline.runtime import batch_coupled

            if theory is None:
                theory_graph = trace(model, example_inputs, **(trace_options or {}))
            whole = theory.graph if theory is not None else theory_graph
            blocker = batch_coupled(whole)
            if blocker is None:
                micro_graph = micro_trace(model, example_inputs, parts, batch, **(trace_options or {}))
        if blocker is None and "spmd" in kinds and theory is not None and outputs != "loss":
            # a choice between the kinds (the SPMD theory is there: it was priced first) must not pick a
            # pipeline that cannot hand the model's other returned tensors back
            blocker = outputs_blocker(model, theory.graph, example_inputs, trace_options, micro_graph, parts)
        if blocker is None and micro_graph is not None:
            blocker = rows_coupled(whole, micro_graph, parts, outputs=outputs != "loss")
        if blocker is not None:
            out.append(KindEstimate(kind, "not applicable", reason=blocker))
            continue
        if num_micro is not None and batch is not None and batch % num_micro:  # an explicit count: an override
            raise HapcError(micro_mismatch(batch, num_micro))
        assert batch is not None  # pipeline_blocker checked
        if num_micro is not None:
            counts, start = [num_micro], num_micro
        else:
            counts = micro_candidates(batch, cluster.num_devices)
            start = max(d for d in counts if d <= START_MICRO)
        searched = num_micro is None
        # time_limit bounds the pipeline's pricing too (its stage costs' searches), with a budget
        # of its own: the SPMD search spent up to one already
        limit = synth_options.get("time_limit")
        scope = searches_until(None if limit is None else time.monotonic() + limit)

        def price(B: int, batch: int = batch, searched: bool = searched) -> float:
            # the least pipeline time priced so far: a candidate whose Eq. 12 lower bound is not below
            # it skips its DP (status "pruned"; see _price_pipelines for why the search is unchanged)
            above = min((k.time for k in out if k.plan_kind == "pipeline" and k.status == "feasible"), default=math.inf)
            entries = _price_pipelines(
                model, cluster, example_inputs, batch, B, theory_options, replicas, labelled=searched,
                t0=time.perf_counter(), recompute=recompute, above=above if prune else None,
                outputs=outputs, on_price=announce,
            )  # fmt: skip
            for est, pplan in entries:
                out.append(est)
                if pplan is not None:
                    plans[est.kind] = pplan
            return min((e.time for e, p in entries if p is not None), default=math.inf)

        with scope:
            search_micro(price, counts, start)
    priced = [k for k in out if k.status == "feasible"]
    if not priced:
        why = "; ".join(f"{k.kind}: {k.status}: {k.reason}" for k in out)
        raise InfeasibleError(f"no plan kind can run {cluster.name!r}: {why}")
    best = min(priced, key=lambda k: k.time)  # the first priced (SPMD, then fewer replicas) on a tie
    best.status = "chosen"
    if theory is None:  # the SPMD kind was not asked for: trace for the model's flops
        graph = theory_graph if theory_graph is not None else trace(model, example_inputs, **(trace_options or {}))
    else:
        graph = theory.graph
    ideal = ideal_seconds(graph, cluster, getattr(theory, "precision", None) or theory_options.get("precision"))
    for k in priced:
        k.efficiency = ideal / k.time if k.time > 0 else 0.0
    chosen = plans[best.kind]
    if best.plan_kind == "spmd":
        chosen.predicted["kinds"] = [k.to_json() for k in out]
    else:
        chosen.kinds = [k.to_json() for k in out]
    return PlanChoice(best.plan_kind, chosen, out)


def _price_pipelines(
    model: torch.nn.Module,
    cluster: Cluster,
    example_inputs: Any,
    batch: int,
    num_micro: int,
    theory_options: dict[str, Any],
    replicas: Sequence[int] | None,
    *,
    labelled: bool,
    t0: float,
    recompute: str = "auto",
    above: float | None = None,
    outputs: str = "whole",
    on_price: Callable[[str], None] = _quiet,
) -> list[tuple[KindEstimate, Any]]:
    """The pipeline, and its data-parallel replicas, priced at ``num_micro`` micro-batches: one
    ``(estimate, plan or None)`` per replica count and layout. ``labelled``: say the count in the
    labels (the planner searched it). Unless ``outputs="loss"``, each estimate's time adds the
    hand-back of the model's other returned tensors (:func:`outputs_seconds`; the plan's own
    ``time`` is the schedule's).

    ``above`` (exact pruning; None: off): the least pipeline time priced before. A candidate is
    synthesized only where its synthesis-free lower bound (:func:`hapc.pipeline.planner.step_bound`)
    is below the least of ``above`` and the times priced here so far, and its DP runs only where the
    Eq. 12 lower bound over its synthesized stage costs (:func:`hapc.pipeline.dp.step_lower_bound`)
    is too; a candidate that is not is listed ``"pruned"``, its time unknown but no less than that
    least. Where the count is searched (``labelled``) the candidates are priced in the order of their
    synthesis-free bound (the likeliest winner first, so more of the others are pruned; listed in
    their usual order), and one listed before a candidate priced here is pruned only by a bound
    *above* that candidate's time (it would win a tie); a fixed count keeps the listed order. Neither
    the choice nor :func:`search_micro`'s path changes: the least over this count's candidates comes
    out exact wherever it is below ``above`` (a pruned one is no better than one priced), and at or
    above ``above`` otherwise, and the search moves to a count only if that count beats the least
    so far (which ``above`` is)."""
    from .pipeline import stagecost
    from .pipeline.layers import build_layers
    from .pipeline.planner import stage_kinds, step_bound
    from .pipeline.replicas import layouts
    from .pipeline.runtime import micro_batches
    from .theory import derive, trace

    kind = "pipeline"
    tag = f" [{num_micro} micro]" if labelled else ""
    if isinstance(example_inputs, dict):  # keyword inputs: each micro-batch a dict (the module binds them alike)
        inputs: Any = example_inputs
    else:
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    micro = micro_batches(inputs, num_micro, batch)[0]
    try:
        th = derive(trace(model, micro), **theory_options)  # as the pipeline runtime traces its stages
    except HapcError as exc:
        est = KindEstimate(kind + tag, "infeasible", reason=str(exc), seconds=time.perf_counter() - t0,
                           num_micro=num_micro)  # fmt: skip
        return [(est, None)]
    cache: dict[str, Any] = {}  # stage costs shared by the replica counts
    counts = [1] + replica_counts(cluster, num_micro, replicas)
    candidates = [(n, lay) for n in counts for lay in (layouts(cluster, n) if n > 1 else ["blocked"])]
    rows = batch // num_micro
    layers = build_layers(th.graph, min_compute=2)  # plan_pipeline's, once for every candidate
    visit = list(range(len(candidates)))
    if above is not None and labelled:  # a searched count: the likeliest first (see the docstring)
        bounds = [step_bound(th, layers, cluster, num_micro, replicas=R, layout=lay, cache=cache)
                  for R, lay in candidates]  # fmt: skip
        visit.sort(key=lambda i: (bounds[i], i))
    slots: list[tuple[KindEstimate, Any] | None] = [None] * len(candidates)
    if stagecost.WORKERS > 1 and hasattr(os, "fork") and len(candidates) > 1:
        # a second process synthesizes the candidates' sub-mesh kinds in this order, ahead of need
        kinds = [k for i in visit for k in stage_kinds(cluster, *candidates[i])]
        cache["ahead"] = stagecost.Ahead(th, layers, kinds, cache)
    try:
        _price_candidates(
            model, cluster, micro, th, layers, candidates, visit, slots, cache,
            num_micro=num_micro, rows=rows, tag=tag, t0=t0, recompute=recompute, above=above,
            outputs=outputs, on_price=on_price,
        )  # fmt: skip
    finally:
        ahead = cache.pop("ahead", None)
        if ahead is not None:
            ahead.close()
    return [x for x in slots if x is not None]


def _price_candidates(
    model: torch.nn.Module,
    cluster: Cluster,
    micro: Any,
    th: Any,
    layers: Any,
    candidates: list[tuple[int, str]],
    visit: list[int],
    slots: list[tuple[KindEstimate, Any] | None],
    cache: dict[str, Any],
    *,
    num_micro: int,
    rows: int,
    tag: str,
    t0: float,
    recompute: str,
    above: float | None,
    outputs: str = "whole",
    on_price: Callable[[str], None] = _quiet,
) -> None:
    """:func:`_price_pipelines`' loop: each candidate in ``visit`` order planned (or pruned, or found
    infeasible) into its slot. A candidate is pruned against estimates that include the hand-back
    of the outputs, its own bound without it: a pruned one is still no better (the hand-back is
    never negative)."""
    from .pipeline.planner import PipelinePruned, plan_pipeline

    kind = "pipeline"
    for i in visit:
        R, layout = candidates[i]
        label = (kind if R == 1 else f"{kind} x{R} ({layout})") + tag
        on_price(label)
        t1 = time.perf_counter()
        least = above
        for j, done in enumerate(slots):
            if least is not None and done is not None and done[1] is not None:
                # one listed after this candidate loses a tie to it: prune only a bound above its time
                least = min(least, done[0].time if j < i else math.nextafter(done[0].time, math.inf))
        try:
            pplan = plan_pipeline(
                model,
                cluster,
                micro,
                num_micro=num_micro,
                theory=th,
                layers=layers,
                replicas=R,
                layout=layout,
                cache=cache,
                recompute=recompute,
                above=least,
            )
        except PipelinePruned as exc:
            seconds = time.perf_counter() - (t0 if R == 1 else t1)
            est = KindEstimate(label, "pruned", reason=str(exc), seconds=seconds, replicas=R, num_micro=num_micro)
            slots[i] = (est, None)
            continue
        except HapcError as exc:  # PlanningError: no pipeline fits (memory, layers, links)
            seconds = time.perf_counter() - (t0 if R == 1 else t1)
            why = str(exc) if R == 1 else f"one replica ({cluster.num_devices // R} devices): {exc}"
            est = KindEstimate(label, "infeasible", reason=why, seconds=seconds, replicas=R, num_micro=num_micro)
            slots[i] = (est, None)
            continue
        groups = sorted({s.group for s in pplan.stages})
        summary = (
            f"{len(pplan.stages)} stage(s) over {', '.join(groups)}, {num_micro} micro-batches of {rows}"
            f", eta {pplan.eta:.0%}"
        )
        if R > 1:
            devices = cluster.num_devices // R
            sync = max(s.replica_sync for s in pplan.stages)
            summary = (
                f"{R} replicas x {len(pplan.stages)} stage(s) on {devices} devices over {', '.join(groups)}, "
                f"{pplan.num_micro} of {num_micro} micro-batches of {rows} each, all-reduce across replicas "
                f"<= {sync * 1e3:.3g} ms per stage, eta {pplan.eta:.0%}"
            )
        recomputing = [str(k + 1) for k, s in enumerate(pplan.stages) if s.recompute]
        if recomputing:  # activations recomputed in backward where memory binds (hapc.pipeline.dp)
            summary += f", stage(s) {', '.join(recomputing)} recompute"
        handback = outputs_seconds(th.graph, cluster, num_micro, R) if outputs != "loss" else 0.0
        if handback:  # the model's other returned tensors broadcast to every rank (outputs="whole")
            summary += f", outputs handed back {handback * 1e3:.3g} ms"
        seconds = time.perf_counter() - (t0 if R == 1 else t1)
        est = KindEstimate(label, "feasible", pplan.time + handback, summary=summary, seconds=seconds, replicas=R,
                           num_micro=num_micro)  # fmt: skip
        slots[i] = (est, pplan)


def segmented_floor(cluster: Cluster, cuts: int, precision: str | None = None) -> float:
    """A lower bound on the step time of every segmented plan with ``cuts`` cuts on ``cluster``,
    without deriving or synthesizing a segment: ``cuts x min(alpha_all_reduce, 2 alpha_all_to_all)``.
    The time is ``Σ_k T_k + Σ_cuts (fwd + bwd)`` (:attr:`hapc.segmented.SegmentedPlan.time`) with
    every ``T_k >= 0``, and each boundary (:meth:`hapc.segmented.Boundary.seconds`) is either a
    replicated output (its backward one all-reduce, ``>= alpha_all_reduce``) or an all-to-all each
    way (``>= alpha_all_to_all`` each), on a cluster of more than one device (segments need two
    device groups)."""
    from .synth.cost import CostModel

    model = CostModel(cluster, precision=precision)
    if model.m <= 1:
        return 0.0
    return cuts * min(model.ab["all_reduce"].alpha, 2 * model.ab["all_to_all"].alpha)


def _price_segmented(
    theory: Any,
    cluster: Cluster,
    theory_options: dict[str, Any],
    synth_options: dict[str, Any],
    spmd_time: float = math.inf,
    above: float | None = None,
    outputs: str = "whole",
    on_price: Callable[[str], None] = _quiet,
) -> list[tuple[KindEstimate, Any]]:
    """Per-segment ratios (HAP §5.2) at the candidate cut sets (:func:`hapc.segmented.candidate_cuts`):
    one ``(estimate, plan or None)`` each, as the pipeline's micro-batch counts only those priced. Two
    segments are always priced; three only where a two-segment plan beat ``spmd_time`` (the SPMD
    plan's, ``inf`` when not priced): each segment's synthesis costs about a whole-model one's share,
    and each further cut adds two all-to-alls.

    ``above`` (exact pruning; None: off): the least time of the kinds priced before. A cut set whose
    :func:`segmented_floor` (the boundaries' latencies alone) is not below it is listed ``"pruned"``
    without splitting, deriving or synthesizing its segments: its time is at least ``above``, so it
    cannot be chosen (ties go to the kinds priced first). A pruned two-segment set opens no
    three-segment one: their floor (two cuts) is no lower, so they are no better either.

    ``outputs`` (``"whole"``): each segment's program gathers the model's other returned tensors it
    computes, as the SPMD program does (:func:`gather_seconds`, in the segment's own layout and
    ratios), added to the plan's time; ``"loss"``: none."""
    from .segmented import candidate_cuts, plan_segmented, segment_outputs_seconds

    out: list[tuple[KindEstimate, Any]] = []
    cands = candidate_cuts(theory.graph)
    if not cands:
        why = "no cut leaves every segment training work without sharing a weight across it"
        return [(KindEstimate("segmented", "infeasible", reason=why), None)]
    recorded = {**theory_options, "variants": list(theory_options["variants"])}
    best = spmd_time
    for label, cuts in cands:
        if len(cuts) > 1 and best >= spmd_time:  # more segments only where two already paid (not listed)
            continue
        t0 = time.perf_counter()
        name = f"segmented ({label})"
        on_price(name)
        floor = segmented_floor(cluster, len(cuts), theory_options.get("precision"))
        if above is not None and floor >= above:
            why = (
                f"not priced: its step time is at least {floor * 1e3:.4g} ms (the latencies of its {len(cuts)} "
                f"boundary all-to-all(s) alone), no better than the {above * 1e3:.4g} ms already priced"
            )
            out.append((KindEstimate(name, "pruned", reason=why, seconds=time.perf_counter() - t0), None))
            continue
        try:
            splan = plan_segmented(theory.graph, cluster, cuts, theory_options=recorded, synth_options=synth_options)
            gathered = segment_outputs_seconds(theory.graph, splan, cluster) if outputs != "loss" else 0.0
        except HapcError as exc:  # InfeasibleError: a segment's program does not fit; an output no segment makes
            out.append((KindEstimate(name, "infeasible", reason=str(exc), seconds=time.perf_counter() - t0), None))
            continue
        summary = splan.summary() + (f", outputs gathered {gathered * 1e3:.3g} ms" if gathered else "")
        est = KindEstimate(name, "feasible", splan.time + gathered, summary=summary, seconds=time.perf_counter() - t0)
        out.append((est, splan))
        best = min(best, splan.time + gathered)
    return out


def replica_counts(cluster: Cluster, num_micro: int, replicas: Sequence[int] | None = None) -> list[int]:
    """Data-parallel replica counts ``R > 1`` of a pipeline worth pricing: ``R`` divides
    ``num_micro`` (each replica an equal share of the micro-batches) and some layout tiles the
    cluster into ``R`` equal replicas (:func:`hapc.pipeline.replicas.layouts`)."""
    from .pipeline.replicas import layouts

    wanted = range(2, cluster.num_devices + 1) if replicas is None else replicas
    bad = [R for R in wanted if not isinstance(R, int) or R < 1]
    if bad:
        raise HapcError(f"replica counts must be positive integers, got {bad}")
    return sorted({R for R in wanted if R > 1 and num_micro % R == 0 and layouts(cluster, R)})


__all__ = [
    "KINDS",
    "SYNTH_OPTIONS",
    "THEORY_OPTIONS",
    "KindEstimate",
    "PlanChoice",
    "choose_plan",
    "gather_seconds",
    "kinds_table",
    "micro_candidates",
    "outputs_blocker",
    "outputs_seconds",
    "pipeline_blocker",
    "replica_counts",
    "search_micro",
    "segmented_blocker",
    "synthesize_theory",
]
