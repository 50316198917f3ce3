"""The HARP pipeline planner: layers -> stage costs -> DP -> a :class:`PipelinePlan` (HARP §5).

``plan_pipeline(model, cluster, example_inputs, num_micro=B)`` traces the model (the example
inputs are one micro-batch), builds the layer sequence (:mod:`hapc.pipeline.layers`, HARP §5.1),
prices every layer on every sub-mesh kind with the SPMD synthesizer
(:mod:`hapc.pipeline.stagecost`), orders the device groups and runs the DP of
:mod:`hapc.pipeline.dp` (HARP Eq. 12-19 with exact memory, Eq. 18).

* **Group order** (HARP §5.2.1): groups with a higher memory-to-compute ratio
  (``memory / flops`` per device) come first, since early stages of a 1F1B-style schedule keep more
  micro-batches in flight; ``order=[...]`` fixes it instead.
* **Inter-stage communication** ``c`` (one way, one micro-batch): ``latency + out_bytes / bandwidth``
  of the link between the two sub-meshes -- the groups' ``between`` link (or the inter-host link)
  across groups; inside a group the intra-host link when sender and receiver share one host, else
  the inter-host link. One transfer per micro-batch (the relay of HetAuto §5.2 sends the whole
  activation once).
* **Stage time** ``t = fwd + bwd + sync / B`` per micro-batch: the gradient all-reduce of a stage's
  replicated weights happens once per step, so it is spread over the ``B`` micro-batches.
* **Predicted step time** Eq. 12 ``T = Σ (t_s + 2 c_s) + (B-1) t_max`` and the load balance η of
  Eq. 20, ``1 - Σ_d (td_max - td_d) F_d / (td_max Σ_d F_d)`` over devices ``d`` with ``td`` their
  stage's compute time per micro-batch and ``F`` their peak flop/s.
* **Hosts inside a group**: sub-meshes are parts of one host or whole hosts, so a group spanning
  hosts may be cut at a host boundary; that cut's ``c`` is priced on the inter-host link.
* **Activation recomputation** (``recompute="auto"|"never"|"always"``, :mod:`hapc.pipeline.dp`):
  a stage may recompute its activations in backward -- its backward time grows by its forward and
  its memory is ``mem_p + N in + mem_a`` (its input per in-flight micro-batch, one micro-batch's
  activations) instead of ``mem_p + N mem_a``. ``"auto"`` (default): the DP chooses per stage
  where that lets it fit or hold more micro-batches in flight. Collectives are not recomputed:
  their outputs count as kept with the input (``mem_in``, :mod:`hapc.pipeline.stagecost`).
* **Data-parallel replicas** (``replicas=R``, :mod:`hapc.pipeline.replicas`): the DP runs on one
  replica's devices with ``B = M / R`` micro-batches, the all-reduce across replicas added to each
  layer's ``sync``; Eq. 12 is then one replica's step, every replica's (they run side by side).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..cluster import Cluster, Link
from ..errors import HapcError
from .dp import RECOMPUTE, CostTable, GroupSpec, Links, Option, PipelineDP, step_lower_bound
from .layers import Layer, build_layers
from .schedule import HARP_EPSILON
from .stagecost import StageCoster, submesh_sizes
from .tied import tied_sync_seconds

#: skip a candidate whose synthesis-free bound (:func:`step_bound`) is no better than ``above``
#: before its stage costs are synthesized (exact; False: only the bound over the synthesized costs)
PRICE_BOUND = True
#: 2: data-parallel replicas (``replicas``, ``layout``, a stage's ``replica_sync``); 3: a stage's
#: ``recompute`` and ``mem_in`` (a version-2 plan reads as one without recomputation)
VERSION = 3


class PlanningError(HapcError):
    """No pipeline plan satisfies the cluster's memory and links."""


class PipelinePruned(HapcError):
    """:func:`plan_pipeline` with ``above``: no plan of this candidate can be faster than ``above``
    (its Eq. 12 lower bound, :func:`hapc.pipeline.dp.step_lower_bound`, is not below it), so its DP
    was not run."""

    def __init__(self, bound: float, above: float):
        super().__init__(
            f"not priced: its step time is at least {bound * 1e3:.4g} ms (Eq. 12's lower bound over its stage "
            f"costs), no better than the {above * 1e3:.4g} ms already priced"
        )
        self.bound, self.above = bound, above


@dataclass
class PipelineStage:
    """One stage: layers ``lo..hi-1`` on devices ``devices`` (indices within ``group``)."""

    lo: int
    hi: int
    group: str
    devices: list[int]
    fwd: float  # seconds per micro-batch
    bwd: float
    sync: float  # gradient all-reduce, once per step
    time: float  # fwd + bwd + sync / B, the t_s of Eq. 12
    comm: float  # one-way transfer of one micro-batch to the next stage
    link: str  # intra_host / inter_host / between / end
    mem_param: float  # bytes per device: parameters x memory_factor
    mem_act: float  # bytes per device per in-flight micro-batch
    warmup: int  # H-1F1B warm-up forwards (in-flight micro-batches, capped by num_micro)
    memory: float  # peak bytes per device: mem_param + min(warmup, num_micro) * mem_act
    nodes: tuple[int, int] = (0, 0)  # first and last op node of the stage in the reference graph
    replica_sync: float = 0.0  # the all-reduce across the replicas of this stage, once per step (in sync)
    # activations recomputed in backward: bwd includes the forward run again, and memory is
    # mem_param + min(warmup, num_micro) * mem_in + mem_act (mem_in: the stage's input per micro-batch
    # and the outputs of its forward collectives, which are kept, not run again)
    recompute: bool = False
    mem_in: float = 0.0


@dataclass
class PipelinePlan:
    stages: list[PipelineStage]
    num_micro: int
    t_max: float
    warmups: list[int]
    time: float  # Eq. 12
    eta: float  # Eq. 20, in [0, 1]
    group_order: list[str]
    epsilon: float
    num_layers: int
    cluster_name: str = ""
    memory_factor: float = 4.0
    timings: dict[str, float] = field(default_factory=dict)
    search: dict[str, int] = field(default_factory=dict)
    kinds: list[dict[str, Any]] = field(default_factory=list)  # the plan kinds priced (hapc.planner.choose_plan)
    # data-parallel replicas of this pipeline (hapc.pipeline.replicas): each runs num_micro
    # micro-batches on one replica's devices (stage devices index that replica's groups)
    replicas: int = 1
    layout: str = "blocked"
    # the all-reduce of weights tied across stages, once per step, included in ``time``
    # (hapc.pipeline.tied: the runtime sums the stages' copies' gradients after the step)
    tied_sync: float = 0.0
    version: int = VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> PipelinePlan:
        if data.get("version") not in (2, VERSION):
            raise HapcError(
                f"pipeline plan format version {data.get('version')!r}, but this hapc reads version {VERSION} "
                "(version 2 added data-parallel replicas, 3 recomputation); plan again with this hapc "
                "(hapc synth --pipeline --json PLAN, or hapc.pipeline.plan_pipeline)"
            )
        d = dict(data)
        d["version"] = VERSION
        d["stages"] = [PipelineStage(**{**s, "nodes": tuple(s["nodes"])}) for s in d["stages"]]
        return PipelinePlan(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    def cuts(self) -> list[int]:
        """Graph cut points for :func:`hapc.pipeline.stages.split_graph`: the first op node of
        every stage after the first (stage ``k`` holds ops with ``cuts[k-1] <= index < cuts[k]``)."""
        return [s.nodes[0] for s in self.stages[1:]]

    def time_split(self) -> dict[str, float]:
        """Eq. 12's parts: the first micro-batch's compute and links, then the steady phase."""
        comp = sum(s.time for s in self.stages)
        comm = sum(2 * s.comm for s in self.stages)
        return {"first_compute": comp, "first_comm": comm, "steady": (self.num_micro - 1) * self.t_max}

    def describe(self) -> str:
        """A stage table like HARP App. C (layer range, group, sub-mesh, time, memory)."""
        from rich.console import Console
        from rich.table import Table

        title = f"pipeline: {len(self.stages)} stages, {self.num_micro} micro-batches"
        if self.replicas > 1:
            title = (
                f"{self.replicas} data-parallel replicas ({self.layout}) of a pipeline of {len(self.stages)} stages, "
                f"{self.num_micro} micro-batches each (sub-mesh: devices of one replica)"
            )
        tab = Table(title=title)
        cols = ("stage", "layers", "group", "sub-mesh", "fwd ms", "bwd ms", "t ms", "c ms", "link", "N", "GiB")
        cols += ("recompute",)
        for col in cols:
            tab.add_column(col, justify="right")
        for k, s in enumerate(self.stages):
            devs = f"{s.devices[0]}..{s.devices[-1]}" if len(s.devices) > 1 else str(s.devices[0])
            tab.add_row(
                str(k + 1),
                f"[{s.lo}, {s.hi - 1}]",
                s.group,
                f"{len(s.devices)} ({devs})",
                f"{s.fwd * 1e3:.2f}",
                f"{s.bwd * 1e3:.2f}",
                f"{s.time * 1e3:.2f}",
                f"{s.comm * 1e3:.2f}",
                s.link,
                str(s.warmup),
                f"{s.memory / 2**30:.2f}",
                "full" if s.recompute else "-",
            )
        con = Console(width=140, record=True, file=_Null())
        con.print(tab)
        split = self.time_split()
        con.print(
            f"t_max {self.t_max * 1e3:.3f} ms, warm-ups {self.warmups}, Eq. 12 step time "
            f"{self.time - self.tied_sync:.4f} s (first micro-batch {split['first_compute']:.4f} s compute + "
            f"{split['first_comm']:.4f} s links, steady {split['steady']:.4f} s), eta {self.eta * 100:.1f}%"
        )
        if self.tied_sync:
            con.print(
                f"weights tied across stages: their gradients' all-reduce adds {self.tied_sync:.4f} s per step "
                f"(step time {self.time:.4f} s)"
            )
        if self.replicas > 1:
            sync = ", ".join(f"{s.replica_sync * 1e3:.3g}" for s in self.stages)
            con.print(
                f"{self.replicas} replicas ({self.layout}), {self.replicas * self.num_micro} micro-batches per step; "
                f"all-reduce across replicas per stage (ms, once per step, in t as sync / B): {sync}"
            )
        if self.kinds:
            from ..plan import kinds_line

            con.print(kinds_line(self.kinds))
        return con.export_text()


class _Null:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


def group_order(cluster: Cluster, order: Sequence[str] | None = None) -> list[str]:
    """HARP §5.2.1: higher memory-to-compute ratio first (ties keep the cluster's order)."""
    names = [g.name for g in cluster.groups]
    if order is not None:
        if sorted(order) != sorted(names):
            raise HapcError(f"order must list every group once: {names}, got {list(order)}")
        return list(order)
    return [g.name for g in sorted(cluster.groups, key=lambda g: -g.memory / g.flops)]


def cluster_links(cluster: Cluster, names: Sequence[str]) -> Links:
    def pair(a: str, b: str) -> tuple[float, float]:
        link: Link = cluster.inter_host
        for gs, between in cluster.between:
            if gs == frozenset((a, b)):
                link = between
        return (link.bandwidth, link.latency)

    return Links(
        (cluster.intra_host.bandwidth, cluster.intra_host.latency),
        (cluster.inter_host.bandwidth, cluster.inter_host.latency),
        tuple(pair(a, b) for a, b in itertools.pairwise(names)),
    )


def stage_kinds(
    cluster: Cluster,
    replicas: int = 1,
    layout: str = "blocked",
    order: Sequence[str] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[tuple[Cluster, str, int]]:
    """The sub-mesh kinds :func:`plan_pipeline` prices for these arguments, in :func:`cost_table`'s
    order: ``(one replica's cluster, group, size)`` (what :class:`~hapc.pipeline.stagecost.Ahead`
    synthesizes ahead of need)."""
    from .replicas import replica_cluster

    whole = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    sub = replica_cluster(whole, replicas, layout)
    groups = {g.name: g for g in sub.groups}
    return [
        (sub, name, n)
        for name in group_order(sub, order)
        for n in submesh_sizes(groups[name])
        if sizes is None or n in sizes
    ]


def cost_table(
    coster: StageCoster, layers: Sequence[Layer], names: Sequence[str], sizes: Sequence[int] | None = None
) -> CostTable:
    """Per-layer costs of every (group, sub-mesh size) option; ``sizes``: only these sizes."""
    groups = {g.name: g for g in coster.cluster.groups}
    wanted = [(name, n) for name in names for n in submesh_sizes(groups[name]) if sizes is None or n in sizes]
    coster.prefetch(wanted)  # side by side where stagecost.WORKERS > 1
    options, rows = [], []
    for k, name in enumerate(names):
        for n in submesh_sizes(groups[name]):
            if sizes is not None and n not in sizes:
                continue
            options.append(Option(k, n))
            rows.append(coster.layer_costs(name, n))
    if not rows:
        raise PlanningError(f"no group has a sub-mesh of {list(sizes or [])} devices")
    stack = {key: np.stack([getattr(r, key) for r in rows]) for key in ("fwd", "bwd", "sync", "mem_param", "mem_act")}
    # a recomputing stage keeps its forward collectives' outputs (hapc.pipeline.recompute)
    keep = np.stack([r.keep if r.keep is not None else np.zeros_like(r.fwd) for r in rows])
    return CostTable(options, **stack, out_bytes=np.array([float(x.out_bytes) for x in layers]), keep=keep)


def lower_table(
    coster: StageCoster,
    layers: Sequence[Layer],
    names: Sequence[str],
    whole: Cluster,
    replicas: int,
    layout: str,
    num_micro: int,
    sizes: Sequence[int] | None = None,
) -> CostTable:
    """A cost table bounding :func:`cost_table`'s from below, without a synthesis: each option's
    row is :meth:`StageCoster.lower_per_micro` (per layer, at most the ``fwd + bwd + sync / B`` the
    DP charges, the all-reduce across ``replicas`` included), put in ``fwd`` (``bwd = sync = 0``).
    :func:`~hapc.pipeline.dp.step_lower_bound` only grows with each entry of ``fwd + bwd + sync / B``
    (sums, minima and maxima of them), so its value on this table is a lower bound of its value on
    the synthesized table, hence of every plan's Eq. 12 time. ``num_micro``: per replica."""
    from .replicas import sync_seconds_per_byte

    groups = {g.name: g for g in coster.cluster.groups}
    options, rows = [], []
    for k, name in enumerate(names):
        for n in submesh_sizes(groups[name]):
            if sizes is not None and n not in sizes:
                continue
            per_byte = sync_seconds_per_byte(whole, replicas, layout, name, n) if replicas > 1 else 0.0
            options.append(Option(k, n))
            rows.append(coster.lower_per_micro(name, n, num_micro, per_byte))
    if not rows:
        raise PlanningError(f"no group has a sub-mesh of {list(sizes or [])} devices")
    lb = np.stack(rows)
    zero = np.zeros_like(lb)
    return CostTable(options, lb, zero, zero, zero, zero, out_bytes=np.array([float(x.out_bytes) for x in layers]))


def step_bound(
    theory: Any,
    layers: Sequence[Layer],
    cluster: Cluster,
    num_micro: int,
    *,
    replicas: int = 1,
    layout: str = "blocked",
    cache: dict | None = None,
    order: Sequence[str] | None = None,
    memory_factor: float = 4.0,
    sizes: Sequence[int] | None = None,
    baseline: str | None = None,
) -> float:
    """A lower bound on the Eq. 12 time of every plan :func:`plan_pipeline` can return for these
    arguments (``num_micro``: the global batch's micro-batches), without synthesizing a stage:
    :func:`~hapc.pipeline.dp.step_lower_bound` over :func:`lower_table`. Milliseconds where a
    plan takes seconds; the planner prices candidates in the order of it and skips those it
    proves no better (:func:`hapc.planner.choose_plan`)."""
    from .replicas import replica_cluster

    whole = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    sub = replica_cluster(whole, replicas, layout)
    names = group_order(sub, order)
    coster = StageCoster(theory, layers, sub, memory_factor=memory_factor, cache=cache, baseline=baseline)
    per = num_micro // replicas
    return step_lower_bound(lower_table(coster, layers, names, whole, replicas, layout, per, sizes),
                            cluster_links(sub, names), per)  # fmt: skip


def solve(
    table: CostTable,
    groups: list[GroupSpec],
    links: Links,
    num_micro: int,
    *,
    epsilon: float = HARP_EPSILON,
    layers: Sequence[Layer] | None = None,
    memory_factor: float = 4.0,
    cluster_name: str = "",
    recompute: str = "auto",
) -> PipelinePlan:
    """Run the DP on a cost table and turn the optimum into a :class:`PipelinePlan`."""
    if num_micro < 1:
        raise HapcError(f"num_micro must be >= 1, got {num_micro}")
    _check_recompute(recompute)
    t0 = time.perf_counter()
    dp = PipelineDP(table, groups, links, num_micro, epsilon, recompute)
    t1 = time.perf_counter()
    sol = dp.solve()
    t2 = time.perf_counter()
    if sol is None:
        raise PlanningError(_why_infeasible(table, groups, num_micro, recompute))
    stages = []
    for sc, n in zip(sol.stages, sol.warmups):
        opt = table.options[sc.option]
        g = groups[opt.group]
        local = sc.start - dp.offsets[opt.group]
        rng = slice(sc.lo, sc.hi)
        mp, ma = float(table.mem_param[sc.option, rng].sum()), float(table.mem_act[sc.option, rng].sum())
        nodes = (layers[sc.lo].first, layers[sc.hi - 1].last) if layers is not None else (0, 0)
        fwd, bwd = float(table.fwd[sc.option, rng].sum()), float(table.bwd[sc.option, rng].sum())
        kept = float(table.keep[sc.option, rng].sum()) if table.keep is not None else 0.0
        mi = float(table.in_bytes()[sc.lo]) + kept if sc.recompute else 0.0
        held = mp + min(n, num_micro) * mi + ma if sc.recompute else mp + min(n, num_micro) * ma
        stages.append(
            PipelineStage(
                sc.lo,
                sc.hi,
                g.name,
                list(range(local, local + opt.size)),
                fwd,
                bwd + fwd if sc.recompute else bwd,  # HARP fn. 2: recomputation is in the backward
                float(table.sync[sc.option, rng].sum()),
                sc.time,
                sc.comm,
                sc.link,
                mp,
                ma,
                n,
                held,
                nodes,
                recompute=sc.recompute,
                mem_in=mi,
            )
        )
    return PipelinePlan(
        stages=stages,
        num_micro=num_micro,
        t_max=sol.t_max,
        warmups=sol.warmups,
        time=sol.value,
        eta=load_balance(stages, groups),
        group_order=[g.name for g in groups],
        epsilon=epsilon,
        num_layers=table.num_layers,
        cluster_name=cluster_name,
        memory_factor=memory_factor,
        timings={"index": t1 - t0, "dp": t2 - t1},
        search={"dp_runs": sol.dp_runs, "t_max_candidates": sol.candidates, "memory_bounds": dp.K},
    )


def load_balance(stages: Sequence[PipelineStage], groups: Sequence[GroupSpec]) -> float:
    """HARP Eq. 20 over devices: td = the device's stage compute time, F = its peak flop/s."""
    flops = {g.name: g.flops for g in groups}
    td = [(s.fwd + s.bwd, flops[s.group]) for s in stages for _ in s.devices]
    tmax = max(t for t, _ in td)
    if tmax <= 0:
        return 1.0
    return 1.0 - sum((tmax - t) * f for t, f in td) / (tmax * sum(f for _, f in td))


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise HapcError(
            f"recompute must be one of {', '.join(map(repr, RECOMPUTE))} (the planner chooses, none, every stage), "
            f"got {recompute!r}"
        )


def _why_infeasible(table: CostTable, groups: Sequence[GroupSpec], num_micro: int, recompute: str = "auto") -> str:
    fewest = 0  # every device is used, a stage per sub-mesh: the fewest stages the groups allow
    for k, g in enumerate(groups):
        biggest = max((o.size for o in table.options if o.group == k), default=0)
        if not biggest:
            sizes = sorted({o.size for o in table.options})
            return (
                f"group {g.name!r} ({g.devices} devices, {g.devices_per_host} to a host) has no sub-mesh of "
                f"{sizes} devices"
            )
        fewest += g.devices // biggest + (g.devices % biggest > 0)
    if fewest > table.num_layers:
        return (
            f"the {len(groups)} device groups ({', '.join(g.name for g in groups)}) need at least {fewest} "
            f"pipeline stages but the model has only {table.num_layers} layers; build finer layers "
            "(build_layers(min_compute=1)) or plan on fewer groups"
        )
    need = float(table.mem_param[0].sum() + table.mem_act[0].sum())
    have = sum(g.devices * g.memory for g in groups)
    gib = 2**30
    if need > have:
        return (
            f"the model does not fit the cluster's memory: it needs at least {need / gib:.2f} GiB "
            f"(parameters x memory_factor plus one micro-batch of activations) but the cluster has "
            f"{have / gib:.2f} GiB in all, short by {(need - have) / gib:.2f} GiB; add devices, shrink the "
            "micro-batch or the model"
        )
    hint = " or recompute='auto' (activations recomputed in backward)," if recompute == "never" else ""
    return (
        f"no pipeline fits: the model needs {need / gib:.2f} GiB of the cluster's {have / gib:.2f} GiB but no split "
        "into stages keeps every device within its memory (HARP Eq. 18 with the H-1F1B in-flight counts) and "
        "every link within t_max; use fewer micro-batches in flight (smaller num_micro), a smaller micro-batch,"
        f"{hint} or more memory"
    )


def plan_pipeline(
    model: Any,
    cluster: Cluster | str,
    example_inputs: Any,
    *,
    num_micro: int = 8,
    order: Sequence[str] | None = None,
    epsilon: float = HARP_EPSILON,
    memory_factor: float = 4.0,
    min_compute: int = 2,
    theory: Any = None,
    layers: Sequence[Layer] | None = None,
    replicas: int = 1,
    layout: str = "blocked",
    cache: dict | None = None,
    sizes: Sequence[int] | None = None,
    baseline: str | None = None,
    recompute: str = "auto",
    above: float | None = None,
) -> PipelinePlan:
    """Plan a HARP pipeline of ``model`` over ``cluster`` (``example_inputs``: one micro-batch).

    ``replicas``: ``R`` data-parallel replicas of the pipeline in ``layout``
    (:mod:`hapc.pipeline.replicas`); ``num_micro`` is then the global batch's micro-batch count,
    which ``R`` must divide, and the plan's ``num_micro`` each replica's share. ``cache``: a dict
    shared by calls for the same theory (stage costs computed once). ``sizes``: the sub-mesh sizes
    a stage may take (default: 1, 2, 4 .. a host, then whole hosts); ``baseline``: each stage's
    program restricted to that baseline's triples (:class:`StageCoster`). The Megatron-3D baseline
    is ``sizes=[t], baseline="tp"`` with ``R`` replicas: TP of degree ``t`` inside a host, stages
    across hosts, ``R``-way data parallelism. ``recompute``: ``"auto"`` (the DP chooses per stage
    where memory binds), ``"never"`` or ``"always"`` (every stage, where its layers allow it).
    ``above``: a step time already achieved (seconds, the global batch's); where the Eq. 12 lower
    bound of this candidate's stage costs (:func:`~hapc.pipeline.dp.step_lower_bound`) is not below
    it, :class:`PipelinePruned` is raised before the DP runs (exact: no plan of it beats ``above``)."""
    from ..theory import derive, trace
    from .replicas import replica_cluster, sync_seconds_per_byte

    _check_recompute(recompute)
    whole = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    if replicas > 1 and num_micro % replicas:
        raise HapcError(
            f"{replicas} replicas each take an equal share of the {num_micro} micro-batches: choose a replica "
            "count that divides num_micro"
        )
    cluster = replica_cluster(whole, replicas, layout)
    num_micro //= replicas
    t0 = time.perf_counter()
    if theory is None:
        theory = derive(trace(model, example_inputs))
    t1 = time.perf_counter()
    layers = list(layers) if layers is not None else build_layers(theory.graph, min_compute=min_compute)
    t2 = time.perf_counter()
    names = group_order(cluster, order)
    coster = StageCoster(theory, layers, cluster, memory_factor=memory_factor, cache=cache, baseline=baseline)
    links = cluster_links(cluster, names)
    if above is not None and above < math.inf and PRICE_BOUND:
        # before any synthesis: the bound over per-layer lower bounds of the stage costs
        bound = step_lower_bound(lower_table(coster, layers, names, whole, replicas, layout, num_micro, sizes),
                                 links, num_micro)  # fmt: skip
        if bound >= above:
            raise PipelinePruned(bound, above)
    table = cost_table(coster, layers, names, sizes)
    extra = np.zeros_like(table.sync)
    if replicas > 1:  # the all-reduce across replicas: one more once-per-step sync of each stage
        for o, opt in enumerate(table.options):
            per_byte = sync_seconds_per_byte(whole, replicas, layout, names[opt.group], opt.size)
            extra[o] = table.mem_param[o] / memory_factor * per_byte
        table.sync = table.sync + extra
    t3 = time.perf_counter()
    if above is not None and above < math.inf:
        bound = step_lower_bound(table, links, num_micro)
        if bound >= above:
            raise PipelinePruned(bound, above)
    by_name = {g.name: g for g in cluster.groups}
    groups = [
        GroupSpec(n, by_name[n].devices, min(by_name[n].devices_per_host, by_name[n].devices), by_name[n].memory,
                  by_name[n].rate(getattr(theory, "precision", None)))
        for n in names
    ]  # fmt: skip
    plan = solve(
        table,
        groups,
        links,
        num_micro,
        epsilon=epsilon,
        layers=layers,
        memory_factor=memory_factor,
        cluster_name=whole.name,
        recompute=recompute,
    )
    plan.replicas, plan.layout = replicas, layout
    for s in plan.stages:
        o = next(k for k, opt in enumerate(table.options) if names[opt.group] == s.group and opt.size == len(s.devices))
        s.replica_sync = float(extra[o, s.lo : s.hi].sum())
    # weights tied across stages: their copies' gradients are summed once per step, after the DP's
    # Eq. 12 time (which does not see it: hapc.pipeline.tied)
    plan.tied_sync = tied_sync_seconds(theory.graph, layers, plan.stages, cluster)
    plan.time += plan.tied_sync
    plan.timings = {"trace+derive": t1 - t0, "layers": t2 - t1, "costing": t3 - t2, **plan.timings}
    plan.search["syntheses"] = coster.syntheses
    return plan
