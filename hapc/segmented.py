"""Different sharding ratios across the model (HAP §5.2): the ``"segmented"`` plan kind.

HAP partitions the model's tensors into ``g`` segments and gives each its own ratio vector, so the
ratios ``B`` become a ``g x m`` matrix; at every segment boundary an All-To-All re-shards the
tensors crossing it from ``B_k`` to ``B_{k+1}``, and each segment's ratio problem (HAP Eq. 3) is
solved on its own. Here a segment is a stage reference graph of :mod:`hapc.pipeline.stages` (the
model cut at node indices ``cuts``; the activations crossing a cut packed as ``[rows, features]``,
the batch being the rows), and every segment runs an SPMD program of its own -- synthesized and
LP-balanced independently (:func:`hapc.planner.synthesize_theory`) -- on the **whole** cluster,
one after the other. No stage waits for another: it is a pipeline of one micro-batch whose stages
all share every device.

**The boundary** (:class:`Boundary`). Segment ``k``'s program leaves its packed output either
batch-sharded -- rank ``r`` holds rows ``[H_r, H_{r+1})`` at ``B_k``'s row sizes -- or replicated
(every rank all rows). Segment ``k + 1``'s program takes its incoming activations either
batch-sharded at ``B_{k+1}``'s row sizes, rank ``q`` rows ``[N_q, N_{q+1})`` -- what its synthesis
is held to by default (``row_sharded``: a program that wants them whole all-gathers them itself,
priced in its search; else the search would take them whole for free) -- or whole. Forward:
rank ``r`` sends rank ``q`` the rows ``[H_r, H_{r+1}) ∩ [N_q, N_{q+1})`` in **one** uneven
``all_to_all`` (a replicated output needs none: each rank slices its rows). Backward, the transpose
(DESIGN §3): rank ``q`` returns the gradient of the same overlaps, and rank ``r`` *sums* what it
receives for each row -- a row several ranks took (a whole input: every rank took every row) has a
Partial gradient; into a replicated output every rank needs the whole summed gradient, one
``all_reduce`` of the zero-padded ``[rows, features]`` gradients.

**Predicted step time** (what :func:`hapc.planner.choose_plan` compares with the other kinds'):
``Σ_k T_k + Σ_cuts (a2a_fwd + a2a_bwd)``, where ``T_k`` is segment ``k``'s :attr:`Plan.time`
(forward, backward and its bucketed gradient all-reduce, HAP §3.2's cost model) and an all-to-all
moving at most ``V`` bytes into or out of one rank costs ``alpha + beta V / (m - 1)`` (the cluster's
``all_to_all`` alpha-beta, whose argument is one rank's shard to each peer); a replicated output's
backward is one all-reduce of the whole boundary gradient. As HAP, a boundary is charged at least
its latency even where nothing moves. The kind pays where segments' best ratios differ: devices
whose flops and memory bandwidth rank differently (a compute-bound segment wants ratios by flops,
a memory-bound one by bandwidth), or a communication-heavy segment (ratios pushed towards even)
after a compute-heavy one.

**Runtime** (:class:`SegmentedModule`): one :class:`~hapc.codegen.module.CompiledModule` per
segment on the same process group; the forward runs them in order, the backward runs the segments'
backwards in reverse, each a backward pass of its own (so each segment's gradient buckets are
summed by its module, as a pipeline stage's are), with the boundary's transposed all-to-all in
between. It takes the global batch on every rank (each segment reads the model inputs it needs),
returns the batch loss, and exposes what the other kinds do: ``train_step``, ``module(*batch)`` +
``loss.backward()``, ``parameters()`` / ``named_parameters()`` (the model's names),
``clip_grad_norm_`` (each segment's sharded gradients' norms are whole), ``full_gradients``,
``full_state_dict`` / ``load_full_state_dict`` (single-device state, optimizer state by name),
``state_dict`` / ``load_state_dict``, ``train()`` / ``eval()``, ``no_sync()``, ``unwrap()``. Dropout draws are
keyed by op name and step (:class:`hapc.ops.RandomStream`), the same in every segment as in one
program. Calls bind as the model's ``forward`` binds them (positionally or by keyword,
:class:`hapc.codegen.calls.ModelCall`), and the forward returns the model's structure with the loss
in its place and the other returned tensors (logits) as ``outputs`` says: ``"whole"`` (default) --
the segment computing each (:func:`~hapc.codegen.calls.route_outputs`; the last, for logits) returns
it from its program made whole on every rank, as the SPMD module does (an all-gather of its shards;
unpriced, as the SPMD kind's), detached (a backward through it raises) -- or ``"loss"`` (``None``, no
cost); ``train_step`` returns the loss alone. Refused (HapcError naming the fix): a
parameter read by two segments (tied weights across a cut: no such cut is planned), inputs other
than the traced global batch (a rank's share, another batch size).

A plan is :class:`SegmentedPlan`: the cuts and one :class:`~hapc.plan.Plan` per segment, saved as
versioned JSON (``"format": "hapc-segmented-plan"``; never pickle).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .cluster import Cluster
from .codegen.calls import ModelCall, route_outputs
from .codegen.original import HapcModule
from .collectives import flush_losses
from .errors import HapcError, PlanError
from .plan import Plan

VERSION = 1
FORMAT = "hapc-segmented-plan"


# -- the boundary ------------------------------------------------------------------------------------
@dataclass
class Boundary:
    """One cut's packed activations ``[rows, features]``: the rows each rank holds of the sending
    segment's output (``held``; ``None``: replicated, every rank all) and the rows each rank's next
    program takes (``need``; ``None``: all of them), both in rank order."""

    rows: int
    features: int
    itemsize: int
    held: list[int] | None
    need: list[int] | None

    def held_range(self, r: int) -> tuple[int, int]:
        return _range(self.held, r, self.rows)

    def need_range(self, q: int) -> tuple[int, int]:
        return _range(self.need, q, self.rows)

    def overlap(self, r: int, q: int) -> int:
        """Rows rank ``r`` holds that rank ``q`` takes."""
        (a, b), (c, d) = self.held_range(r), self.need_range(q)
        return max(0, min(b, d) - max(a, c))

    def seconds(self, model: Any) -> tuple[float, float]:
        """Predicted forward and backward seconds (see the module docstring)."""
        m = model.m
        if m <= 1:
            return 0.0, 0.0
        row = self.features * self.itemsize
        if self.held is None:  # each rank slices locally; the backward sums the whole gradient
            ab = model.ab["all_reduce"]
            return 0.0, ab.alpha + ab.beta * self.rows * row
        moved = 0
        for r in range(m):
            out = sum(self.overlap(r, q) for q in range(m) if q != r)
            into = sum(self.overlap(q, r) for q in range(m) if q != r)
            moved = max(moved, out, into)
        ab = model.ab["all_to_all"]
        t = ab.alpha + ab.beta * moved * row / (m - 1)
        return t, t

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "features": self.features,
            "itemsize": self.itemsize,
            "held": self.held,
            "need": self.need,
        }


def _range(sizes: list[int] | None, r: int, rows: int) -> tuple[int, int]:
    if sizes is None:
        return 0, rows
    lo = sum(sizes[:r])
    return lo, lo + sizes[r]


def boundary(sender: Any, sender_plan: Plan, receiver: Any, receiver_plan: Plan) -> Boundary:
    """How the packed output of a segment (theory ``sender`` under ``sender_plan``) reaches the
    next (``receiver``): who holds and who takes which rows, from the two plans' layouts."""
    from .pipeline.runtime import _output_layout, _source_layouts
    from .pipeline.stages import ACT_PREFIX

    out = sender.graph.loss
    rows = out.meta.shape[0] if out.meta.rank == 2 else out.meta.numel
    lay = _output_layout(sender_plan, out.index)
    held = list(sender.local_sizes(out.index, 0, sender_plan.device_ratios)) if lay.is_sharded else None
    if held is not None and (lay.dim != 0 or out.meta.rank != 2):
        raise AssertionError(f"a segment's packed output is sharded along dim {lay.dim}, not its rows")
    need = None
    if out.meta.rank == 2:
        acts = [n for n in receiver.graph.inputs if n.name.startswith(ACT_PREFIX)]
        layouts = [_source_layouts(receiver_plan, n.index) for n in acts]
        if all(ls and all(x.is_sharded and x.dim == 0 for x in ls) for ls in layouts):
            per = {tuple(receiver.local_sizes(n.index, 0, receiver_plan.device_ratios)) for n in acts}
            if len(per) == 1:
                need = list(per.pop())
    itemsize = torch.empty((), dtype=out.meta.dtype).element_size()
    return Boundary(rows, out.meta.numel // rows, itemsize, held, need)


def reshard_forward(b: Boundary, x: torch.Tensor, rank: int, world: int, group: Any) -> torch.Tensor:
    """Segment ``k``'s local output rows ``x`` -> the rows this rank's next program takes."""
    x = x.detach().reshape(-1, b.features)
    if b.held is None:  # every rank holds all rows
        lo, hi = b.need_range(rank)
        return x[lo:hi].clone()
    a, _ = b.held_range(rank)
    recvs = [b.overlap(r, rank) for r in range(world)]
    # what this rank sends each peer: its rows that q takes; held slices are contiguous in rank
    # order, so the pieces arrive as rows [N_q, N_{q+1})
    return _exchange(x, a, [b.need_range(q) for q in range(world)], recvs, group)


def _exchange(x: torch.Tensor, base: int, ranges: list[tuple[int, int]], recvs: list[int], group: Any) -> torch.Tensor:
    """One uneven ``all_to_all``: this rank holds rows ``[base, base + len(x))`` and sends rank ``q``
    their overlap with ``ranges[q]``; it receives ``recvs[q]`` rows from rank ``q``, in rank order."""
    pieces, sends = [], []
    for lo, hi in ranges:
        lo, hi = max(lo, base), min(hi, base + x.shape[0])
        n = max(0, hi - lo)
        sends.append(n)
        if n:
            pieces.append(x[lo - base : hi - base])
    out = torch.empty((sum(recvs), x.shape[1]), dtype=x.dtype, device=x.device)
    inp = torch.cat(pieces) if pieces else x.new_empty((0, x.shape[1]))
    dist.all_to_all_single(out, inp.contiguous(), recvs, sends, group=group)
    return out


def reshard_backward(b: Boundary, g: torch.Tensor, rank: int, world: int, group: Any) -> torch.Tensor:
    """The transpose of :func:`reshard_forward`: the gradient of this rank's taken rows ``g`` -> the
    gradient of the rows it held (summed over every rank that took them; whole if replicated)."""
    g = g.reshape(-1, b.features)
    c, d = b.need_range(rank)
    if b.held is None:
        full = torch.zeros((b.rows, b.features), dtype=g.dtype, device=g.device)
        full[c:d] = g
        dist.all_reduce(full, group=group)
        return full
    recvs = [b.overlap(rank, q) for q in range(world)]
    # the gradient of the rows rank r held that this rank took
    got = _exchange(g, c, [b.held_range(r) for r in range(world)], recvs, group)
    a, e = b.held_range(rank)
    out = torch.zeros((e - a, b.features), dtype=g.dtype, device=g.device)
    at = 0
    for q, n in enumerate(recvs):  # a row several ranks took: their gradients add up (DESIGN §3)
        if n:
            lo = max(a, b.need_range(q)[0])
            out[lo - a : lo - a + n] += got[at : at + n]
            at += n
    return out


# -- the plan ---------------------------------------------------------------------------------------
@dataclass
class SegmentedPlan:
    """Cuts (reference-graph node indices where segments ``1..g-1`` begin) and each segment's SPMD
    plan on the whole cluster (its own ratios: row ``k`` of HAP's ``B``); ``boundaries[k]`` how the
    cut after segment ``k`` moves rows, with its predicted forward / backward seconds."""

    cuts: list[int]
    plans: list[Plan]
    boundaries: list[dict[str, Any]]
    graph_fingerprint: str
    cluster_fingerprint: str
    cluster_name: str
    kinds: list[dict[str, Any]] = field(default_factory=list)
    version: int = VERSION

    @property
    def time(self) -> float:
        """Predicted seconds per step: the segments' times plus the boundaries' all-to-alls."""
        return sum(p.time for p in self.plans) + sum(b["forward"] + b["backward"] for b in self.boundaries)

    @property
    def ratios(self) -> list[list[float]]:
        """HAP's ``g x m`` ratio matrix (per device type)."""
        return [list(p.ratios) for p in self.plans]

    @property
    def device_ratios(self) -> list[list[float]]:
        return [list(p.device_ratios) for p in self.plans]

    @property
    def num_devices(self) -> int:
        return len(self.plans[0].device_ratios)

    def summary(self) -> str:
        parts = []
        for k, p in enumerate(self.plans):
            ratios = ", ".join(f"{t['name']} {r:.3g}" for t, r in zip(p.device_types, p.ratios))
            parts.append(f"segment {k + 1} {p.time * 1e3:.3g} ms (ratios {ratios})")
        moves = sum(b["forward"] + b["backward"] for b in self.boundaries)
        return f"{len(self.plans)} segments: " + "; ".join(parts) + f"; all-to-alls {moves * 1e3:.3g} ms"

    def check(self, *, graph: Any = None, cluster: Cluster | None = None, world_size: int | None = None) -> None:
        """Raise :class:`PlanError` if this plan was made for another model, cluster or world size."""
        if graph is not None and graph.fingerprint() != self.graph_fingerprint:
            raise PlanError(
                f"the segmented plan was made for another model (graph {self.graph_fingerprint}, this model is "
                f"{graph.fingerprint()}): plan again for this model (hapc.segmented.plan_segmented)"
            )
        if cluster is not None and cluster.fingerprint() != self.cluster_fingerprint:
            raise PlanError(
                f"the segmented plan was made for cluster {self.cluster_name!r}, not {cluster.name!r}: plan again "
                "for this cluster"
            )
        if world_size is not None and world_size != self.num_devices:
            raise PlanError(
                f"the segmented plan is for {self.num_devices} devices but the job has {world_size} processes; "
                f"start {self.num_devices} or plan again"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "cuts": list(self.cuts),
            "plans": [p.to_json() for p in self.plans],
            "boundaries": self.boundaries,
            "graph_fingerprint": self.graph_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
            "cluster_name": self.cluster_name,
            "kinds": self.kinds,
        }

    @staticmethod
    def from_json(data: Any) -> SegmentedPlan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError(f"not a segmented plan (no 'format': {FORMAT!r}); was it written by SegmentedPlan.save?")
        if data.get("version") != VERSION:
            raise PlanError(
                f"segmented plan format version {data.get('version')!r}, but this hapc reads version {VERSION}; "
                "plan again with this hapc (hapc.segmented.plan_segmented)"
            )
        return SegmentedPlan(
            cuts=[int(c) for c in data["cuts"]],
            plans=[Plan.from_json(p) for p in data["plans"]],
            boundaries=[dict(b) for b in data["boundaries"]],
            graph_fingerprint=str(data["graph_fingerprint"]),
            cluster_fingerprint=str(data["cluster_fingerprint"]),
            cluster_name=str(data["cluster_name"]),
            kinds=list(data.get("kinds", [])),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @staticmethod
    def load(path: str | Path) -> SegmentedPlan:
        return SegmentedPlan.from_json(json.loads(Path(path).read_text()))


def is_segmented_file(path: str | Path) -> bool:
    """Whether the JSON file at ``path`` holds a segmented plan (else, e.g., an SPMD plan)."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def split(graph: Any, cuts: Sequence[int]) -> list[Any]:
    """The segments' stage graphs (:func:`hapc.pipeline.stages.split_graph`), refusing a parameter
    or buffer that two segments read: each segment's program holds its own copy, and a tied weight
    would train as two."""
    from .pipeline.stages import split_graph
    from .theory.graph import BUFFER, PARAM

    stages = split_graph(graph, cuts)
    owner: dict[str, int] = {}
    for s in stages:
        for n in s.graph:
            if n.kind in (PARAM, BUFFER):
                k = owner.setdefault(n.target, s.index)
                if k != s.index:
                    raise HapcError(
                        f"{n.target!r} is read by segments {k + 1} and {s.index + 1}: per-segment ratios keep one "
                        "copy of a tensor per segment, so a tied weight would train as two. Cut where no weight is "
                        "shared (other cuts), or train without per-segment ratios (pipeline=False / kind spmd)"
                    )
    return stages


def plan_segmented(
    graph: Any,
    cluster: Cluster,
    cuts: Sequence[int],
    *,
    ratios: Sequence[Sequence[float] | None] | None = None,
    theory_options: dict[str, Any] | None = None,
    synth_options: dict[str, Any] | None = None,
    rows_arrive_sharded: bool = True,
) -> SegmentedPlan:
    """Each segment of ``graph`` (the model's reference graph of the global batch) cut at ``cuts``
    synthesized and balanced on all of ``cluster`` by itself (HAP §5.2: Eq. 3 per segment), and the
    boundaries priced. ``ratios``: fixed ratios per segment (one vector per device group, or None:
    balanced) -- tests force segments' ratios to differ with it. ``rows_arrive_sharded`` (default):
    a segment's program must source its incoming packed rows sharded by rows -- as the all-to-all
    delivers them at its own ratios -- so a program that wants them whole pays the all-gather in its
    own synthesis instead of taking them free and leaving the boundary to move every row to every
    rank (``False``: any layout, the boundary priced after; where no program takes them by rows,
    that is the fallback)."""
    from .errors import InfeasibleError
    from .pipeline.stages import ACT_PREFIX
    from .planner import synthesize_theory
    from .synth.cost import CostModel
    from .theory import derive

    stages = split(graph, cuts)
    if ratios is not None and len(ratios) != len(stages):
        raise HapcError(f"ratios gives {len(ratios)} vectors for {len(stages)} segments; give one per segment")
    topts = dict(theory_options or {})
    if "variants" in topts:
        topts["variants"] = tuple(topts["variants"])
    sopts = {k: v for k, v in (synth_options or {}).items() if k != "ratios"}
    theories = [derive(s.graph, **topts) for s in stages]
    recorded = {**topts, **({"variants": list(topts["variants"])} if "variants" in topts else {})}
    plans = []
    for k, (s, t) in enumerate(zip(stages, theories)):
        fixed = None if ratios is None else ratios[k]
        acts = [n.index for n in t.graph.inputs if n.name.startswith(ACT_PREFIX)] if k and s.by_rows else []
        plan = None
        if acts and rows_arrive_sharded:
            try:  # the rows arrive at B_k's shares: sourcing them whole is an all-gather the program prices
                plan = synthesize_theory(t, cluster, options=recorded, **sopts, ratios=fixed, row_sharded=acts)
            except InfeasibleError:
                plan = None  # no program takes them by rows (too few rows for the devices...): any layout
        if plan is None:
            plan = synthesize_theory(t, cluster, options=recorded, **sopts, ratios=fixed)
        plans.append(plan)
    if sopts.get("memory", True):
        _check_memory(plans)
    model = CostModel(cluster, precision=topts.get("precision"))
    bounds = []
    for k in range(len(stages) - 1):
        b = boundary(theories[k], plans[k], theories[k + 1], plans[k + 1])
        fwd, bwd = b.seconds(model)
        bounds.append({**b.to_json(), "forward": fwd, "backward": bwd})
    return SegmentedPlan(
        cuts=list(cuts),
        plans=plans,
        boundaries=bounds,
        graph_fingerprint=graph.fingerprint(),
        cluster_fingerprint=cluster.fingerprint(),
        cluster_name=cluster.name,
    )


def segment_outputs_seconds(graph: Any, plan: SegmentedPlan, cluster: Cluster) -> float:
    """Predicted seconds the segments' programs spend making the model's other returned tensors
    whole on every rank (``outputs="whole"``): each tensor in the segment computing it
    (:func:`~hapc.codegen.calls.route_outputs`), priced by :func:`hapc.planner.gather_seconds` in
    that segment's layout and ratios. Raises :class:`~hapc.errors.HapcError` where no segment
    computes one (a model input returned as it is), as :class:`SegmentedModule` does."""
    from .planner import gather_seconds

    stages = split(graph, plan.cuts)
    total = 0.0
    for r in route_outputs(graph, stages):
        g = stages[r.stage].graph
        total += gather_seconds(plan.plans[r.stage], g, [g.outputs[1 + r.position]], cluster)
    return total


def _check_memory(plans: Sequence[Plan]) -> None:
    """Every segment lives on every device at once (weights, gradients, optimizer state and the
    activations saved for the backward): the segments' predicted per-device bytes add up. Each
    segment's LP bounded its own; raise :class:`InfeasibleError` where the sum does not fit."""
    from .errors import InfeasibleError

    types = plans[0].device_types
    for i, t in enumerate(types):
        need = sum(float(p.predicted["memory"][i]) for p in plans)
        if t.get("memory") and need > float(t["memory"]):
            raise InfeasibleError(
                f"the {len(plans)} segments need {need / 2**20:.4g} MiB on a {t['name']} device together, which "
                f"has {float(t['memory']) / 2**20:.4g} MiB (each segment fits alone, but all of them live on every "
                "device): use fewer segments, or another plan kind"
            )


def candidate_cuts(graph: Any, counts: Sequence[int] = (2, 3)) -> list[tuple[str, list[int]]]:
    """Cut sets the planner prices: for each segment count, cuts balancing the forward flops
    (:func:`~hapc.pipeline.stages.balanced_cuts`) and cuts balancing the number of ops (a
    memory-bound tail has few flops but many ops); invalid ones (a segment without training work,
    a weight shared across a cut) are skipped. Labelled ``"g segments (flops|ops)"``."""
    from .pipeline.stages import balanced_cuts
    from .theory.graph import OP

    ops = [n.index for n in graph if n.kind == OP]
    out: list[tuple[str, list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for g in counts:
        tries = []
        try:
            tries.append(("flops", balanced_cuts(graph, [1.0] * g)))
        except HapcError:
            pass
        tries.append(("ops", [ops[len(ops) * k // g] for k in range(1, g)]))
        for how, cuts in tries:
            if len(set(cuts)) != g - 1 or tuple(cuts) in seen:
                continue
            try:
                split(graph, cuts)
            except HapcError:
                continue
            seen.add(tuple(cuts))
            out.append((f"{g} segments ({how})", list(cuts)))
    return out


# -- the runtime ----------------------------------------------------------------------------------------
class SegmentedModule(HapcModule):
    """This rank's share of every segment of a :class:`SegmentedPlan` (see the module docstring).
    ``loss = module.train_step(*batch)`` or ``loss = module(*batch); loss.backward()``, then step any
    optimizer over ``module.parameters()``."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Sequence[Any],
        plan: SegmentedPlan,
        *,
        group: Any = None,
        device: Any = None,
        seed: int = 0,
        options: dict[str, Any] | None = None,
        outputs: str = "whole",
    ):
        """``outputs``: the model's other returned tensors, ``"whole"`` (every rank, the batch's) or
        ``"loss"`` (``None``); see the module docstring."""
        super().__init__()
        from .codegen.module import CompiledModule
        from .theory import derive, trace
        from .theory.graph import BUFFER, PARAM

        if not dist.is_initialized():
            raise HapcError("a segmented module runs inside a distributed job: start it with torchrun")
        if outputs not in ("whole", "loss"):
            raise HapcError(
                f"a segmented module takes outputs='whole' (the model's other returned tensors on every rank) or "
                f"'loss' (None), got {outputs!r}"
            )
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if isinstance(example_inputs, dict):  # keyword inputs (a Hugging Face batch)
            inputs: Any = dict(example_inputs)
        else:
            inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
        graph = trace(model, inputs)
        plan.check(graph=graph, world_size=self.world)
        self.plan = plan
        self.input_names = list(graph.input_names)
        # calls bind as the model's forward binds them; its structure comes back with the loss in
        # its place and the other tensors from the segments computing them (hapc.codegen.calls)
        self._call = ModelCall(model, inputs, graph)
        self._shapes = {n.name: (tuple(n.shape), n.meta.dtype) for n in graph.inputs}
        stages = split(graph, plan.cuts)
        self._routed = route_outputs(graph, stages) if outputs == "whole" else []
        topts = _theory_options(plan.plans[0].options)
        theories = [derive(s.graph, **topts) for s in stages]
        keys = set(model.state_dict())
        owned = [{n.target for n in s.graph if n.kind in (PARAM, BUFFER) and n.target in keys} for s in stages]
        modules = []
        for k, (th, p) in enumerate(zip(theories, plan.plans)):
            p.check(graph=th.graph, world_size=self.world, where=f"segment {k + 1}'s plan")
            m = CompiledModule(
                model, th, p, group=group, device=device, seed=seed,
                elsewhere=set().union(*owned) - owned[k], loss_sync="eager",
            )  # fmt: skip
            # the model inputs are the global batch and the activations this plan's shares, always
            m._batch_mode, m._odd, m._whole_inputs, m._input_grads_refused = "plan", None, [], False
            modules.append(m)
        self.segments = nn.ModuleList(modules)
        self.stage_graphs = stages
        self._reads = [s.model_inputs for s in stages]
        self._names = [list(s.graph.input_names) for s in stages]
        self.boundaries = [
            boundary(theories[k], plan.plans[k], theories[k + 1], plan.plans[k + 1]) for k in range(len(stages) - 1)
        ]
        self._dtypes = [s.graph.loss.meta.dtype for s in stages]
        self.device = modules[0].device
        self.plan_kinds: list[dict[str, Any]] = list(plan.kinds)

    # -- the step -----------------------------------------------------------------------------------------
    def _forwards(
        self, args: tuple, kwargs: dict[str, Any], others: dict[int, Any] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every segment's forward: their outputs and the boundaries' received rows (the leaves the
        backward reads); the model's other returned tensors into ``others`` (by output position)."""
        bound = dict(zip(self.input_names, self._call.bind(args, kwargs, "the segmented module")))
        for name, x in bound.items():
            shape, dtype = self._shapes[name]
            if isinstance(x, torch.Tensor) and (tuple(x.shape) != shape or x.dtype != dtype):
                raise HapcError(
                    f"input {name!r} is {tuple(x.shape)} {x.dtype}, but a segmented module takes the global batch "
                    f"it was compiled for, {shape} {dtype}, on every rank (each segment splits it by its own "
                    "ratios): pass every rank the whole batch, or compile without per-segment ratios for a rank's "
                    "share or another batch size"
                )
        flush_losses()  # another hapc module's deferred loss all-reduce goes first, on every rank
        self._check_same_batch(bound)
        outs: list[torch.Tensor] = []
        leaves: list[torch.Tensor] = []
        grad = torch.is_grad_enabled()
        for k, m in enumerate(self.segments):
            args = [bound[n] for n in self._reads[k]]
            if k > 0:
                rows = reshard_forward(self.boundaries[k - 1], outs[-1], self.rank, self.world, self.group)
                leaf = rows.requires_grad_(grad)
                leaves.append(leaf)
                args += self.stage_graphs[k].unpack(leaf)
            out, extras = m._run(**dict(zip(self._names[k], args)))
            if others is not None:  # made whole on every rank by the segment's program, detached
                for r in self._routed:
                    if r.stage == k:
                        others[r.leaf] = extras[r.position] if r.position < len(extras) else None
            if k < len(self.segments) - 1 and out.dtype != self._dtypes[k]:
                out = out.to(self._dtypes[k])  # an autocast segment's half output travels in the traced dtype
            outs.append(out)
        return outs, leaves

    def _backwards(self, outs: list[torch.Tensor], leaves: list[torch.Tensor], scale: float) -> None:
        loss = outs[-1]
        loss.backward(torch.tensor(scale, dtype=loss.dtype, device=loss.device))
        for k in range(len(outs) - 2, -1, -1):
            x = leaves[k]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            back = reshard_backward(self.boundaries[k], g, self.rank, self.world, self.group)
            outs[k].backward(back.view(outs[k].shape))

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the batch; the batch loss (detached). Inputs bind as for
        :meth:`forward`."""
        outs, leaves = self._forwards(args, kwargs)
        self._backwards(outs, leaves, 1.0)
        return outs[-1].detach()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``loss = module(*batch)`` then ``loss.backward()``, as with DDP: the segments' backwards run
        when the loss's does, seeded with its gradient (the same on every rank). Under
        ``torch.no_grad()`` only the forwards run. Inputs bind as the model's ``forward`` binds
        them (positionally or by keyword); the result is the model's structure with the loss in its
        place and the other tensors whole on every rank (``outputs="whole"``: one device's values for
        the batch, detached -- a backward through them raises) or ``None`` (``outputs="loss"``)."""
        others: dict[int, Any] = {}
        outs, leaves = self._forwards(args, kwargs, others)
        loss = outs[-1].detach()
        if not torch.is_grad_enabled():
            return self._call.structured(loss, others)
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return self._call.structured(_SegmentedLoss.apply(anchor, loss, self, (outs, leaves)), others)

    def _agree_on_scale(self, scale: float) -> None:
        """The gradient seeding the loss must be the same on every rank (each seeds the last segment
        with its own): one MAX all-reduce of ``(scale, -scale)``."""
        if self.world == 1:
            return
        agree = torch.tensor([scale, -scale], dtype=torch.float64, device=self.device)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=self.group)
        if float(agree[0]) != -float(agree[1]):
            raise HapcError(
                f"the gradient seeding the segmented module's loss differs between the ranks (from "
                f"{-float(agree[1]):g} to {float(agree[0]):g}): every rank holds the same batch loss and must "
                "backpropagate it alike, e.g. loss.backward() or (loss / accumulation_steps).backward() on every rank"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate this rank's Partial gradients without summing them
        across ranks (``DistributedDataParallel.no_sync``): every segment's
        :meth:`~hapc.codegen.module.CompiledModule.no_sync`; the next backward outside sums them all."""
        with contextlib.ExitStack() as stack:
            for m in self.segments:
                stack.enter_context(m.no_sync())
            yield

    def _check_same_batch(self, bound: dict[str, Any]) -> None:
        """Every rank must be given the same global batch (each segment reads its own copy): one
        all-reduce of each input's 20-bit hash ``h`` and ``h^2`` (equal iff ``world sum h^2 == (sum h)^2``)."""
        from .codegen.module import _hash_batch

        if self.world == 1:
            return
        named = [(n, x) for n, x in bound.items() if isinstance(x, torch.Tensor)]
        hashes = [float(_hash_batch({n: x}) & (2**20 - 1)) for n, x in named]
        value = torch.tensor([v for h in hashes for v in (h, h * h)], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, group=self.group)
        for i, (name, _) in enumerate(named):
            if self.world * float(value[2 * i + 1]) != float(value[2 * i]) ** 2:
                raise HapcError(
                    f"input {name!r} differs between the ranks, but every rank of a segmented module must be given "
                    f"the same global batch (each segment splits it by its own ratios); give every rank the same "
                    f"{name!r}, drawing per-step randomness from a generator seeded alike on every rank"
                )

    # -- parameters and state ---------------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """Every segment's local parameters under the model's names."""
        for m in self.segments:
            yield from m.named_parameters(prefix, recurse, remove_duplicate)

    def sharded_state_dict(self) -> dict[str, Any]:
        """``state_dict`` for ``torch.distributed.checkpoint`` without gathering: every segment's
        :meth:`~hapc.codegen.module.CompiledModule.sharded_state_dict` (no tensor is in two segments:
        a weight shared across a cut is refused), under the model's names. ``dcp.save`` /
        ``dcp.load`` (in place) as with the SPMD module."""
        out: dict[str, Any] = {}
        for m in self.segments:
            out.update(m.sharded_state_dict())
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every segment's parameters: the single-device total
        norm on every rank (every rank calls)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, **kwargs)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's whole gradient by ``state_dict`` name (all ranks call; all get it)."""
        out: dict[str, torch.Tensor | None] = {}
        for m in self.segments:
            out.update(m.full_gradients())
        return out

    def full_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The single-device ``state_dict`` (with the optimizer: ``{"model", "optimizer"}``, its state
        by parameter name), gathered from every segment (all ranks call; all get it)."""
        parts = [m.full_state_dict(optimizer) for m in self.segments]
        if optimizer is None:
            return {k: v for p in parts for k, v in p.items()}
        state = {k: v for p in parts for k, v in p["optimizer"]["state"].items()}
        model = {k: v for p in parts for k, v in p["model"].items()}
        return {"model": model, "optimizer": {"state": state, "param_groups": parts[0]["optimizer"]["param_groups"]}}

    def load_full_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load a single-device state (or ``{"model", "optimizer"}``): each segment slices its part."""
        for m in self.segments:
            m.load_full_state_dict(state, optimizer, partial=True)

    def state_dict(  # type: ignore[override]
        self, *, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The whole model's single-device ``state_dict`` (every rank calls, every rank gets it)."""
        out: dict[str, Any] = destination if destination is not None else {}
        for key, value in self.full_state_dict().items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a single-device ``state_dict``: each segment copies its slices."""
        known = {k for m in self.segments for k in m._state_keys}
        unexpected = [k for k in state_dict if k not in known]
        missing = [k for k in known if k not in state_dict]
        if strict and (unexpected or missing):
            raise RuntimeError(
                f"Error(s) in loading state_dict for SegmentedModule: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        for m in self.segments:
            m.load_full_state_dict({k: v for k, v in state_dict.items() if k in m._state_keys}, partial=True)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def unwrap(self) -> nn.Module:
        """Write the trained weights into the model this module was compiled from and return it
        (every rank calls; see ``CompiledModule.unwrap``)."""
        from .codegen.original import write_back

        return write_back(self, self.full_state_dict())

    @property
    def code(self) -> str:
        """This rank's program of every segment, plain PyTorch."""
        return "\n\n".join(f"# segment {k + 1}\n{m.code}" for k, m in enumerate(self.segments))


class _SegmentedLoss(torch.autograd.Function):
    """The batch loss of :meth:`SegmentedModule.forward`, whose backward runs the segments'."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, loss: torch.Tensor, sm: SegmentedModule, state: Any) -> torch.Tensor:
        ctx.sm, ctx.state = sm, state
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        if ctx.state is None:
            raise HapcError("this loss of a segmented module was backpropagated already: one backward per forward")
        outs, leaves = ctx.state
        ctx.state = None
        ctx.sm._agree_on_scale(float(grad))
        with torch.enable_grad():
            ctx.sm._backwards(outs, leaves, float(grad))
        return None, None, None, None


def _theory_options(options: dict[str, Any]) -> dict[str, Any]:
    from .planner import THEORY_OPTIONS

    out = {k: options[k] for k in THEORY_OPTIONS if k in options}
    if "variants" in out:
        out["variants"] = tuple(out["variants"])
    return out


__all__ = [
    "Boundary",
    "SegmentedModule",
    "SegmentedPlan",
    "boundary",
    "candidate_cuts",
    "plan_segmented",
    "reshard_backward",
    "reshard_forward",
]
