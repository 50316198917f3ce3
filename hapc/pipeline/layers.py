"""Fine-grained layer construction from the reference graph (HARP §5.1).

The planner partitions a *layer sequence*: contiguous runs of the graph's op nodes in topological
(index) order. Cutting between layers ``k`` and ``k+1`` sends every tensor that is *live* across
the cut -- produced at or before layer ``k`` and consumed after it -- so layers end where few
tensors are live. Construction, in HARP's two steps:

1. **Modules.** Split the op sequence at *single-tensor cuts* (points where one computed
   tensor, the residual stream, crosses; data-only tensors that parameters and inputs alone
   produce are not counted, as in :func:`hapc.synth.segments.find_cuts`). Each run between two
   cuts is a *unit*; units with equal structure (op, shapes, dtypes, constants, operands relative
   to the unit's first node) get equal signatures -- a transformer block's halves repeat ``n``
   times. A run of units without a compute-intensive op (an embedding sum, a final norm) joins
   the next unit unless that unit repeats (then it stays a layer of its own, so repeated units
   keep equal signatures).
2. **Clustering inside a unit.** HARP clusters each module's operators with Alpa's operator
   clustering; here a unit is cut greedily after ``min_compute`` compute-intensive ops (HARP's
   ``z``: matmul, linear, convolution, attention) at the first point where at most ``max_live``
   computed tensors are live, leaving at least one compute-intensive op for the next layer.
   Equal units are clustered identically, so their layers carry equal signatures too.

With the defaults a GPT block becomes 3 layers (attention core; projection and residual; MLP)
and GPT-39B (48 blocks) 146 layers, HARP's granularity for that model (HARP App. C).

:attr:`Layer.live_out` is exact: every op output produced in layers ``0..k`` with a user after
layer ``k`` (model inputs are available to every stage and never listed; parameters and buffers
are listed per layer in :attr:`Layer.params`, a parameter used by two layers -- tied embeddings --
appears in both). :func:`evaluate_by_layers` runs the graph carrying only those tensors.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import HapcError
from ..synth.segments import source_like
from ..theory.graph import BUFFER, INPUT, OP, PARAM, RefGraph, map_refs
from ..theory.trace import backward_work

#: ops counted as compute-intensive (HARP §5.1's "MatMul or Convolution"); any other op whose
#: forward does at least 16 flops per output element counts too (a contraction over >= 8).
COMPUTE_OPS = frozenset(
    {
        "linear",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "einsum",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "scaled_dot_product_attention",
    }
)


@dataclass
class Layer:
    """One layer: a contiguous run of op nodes. Costs are for the traced batch (one micro-batch)."""

    index: int
    nodes: list[int]  # op node indices, ascending
    params: list[int]  # parameter and buffer nodes the ops use
    signature: str  # equal for structurally identical layers (repeated blocks)
    unit: int  # the module (single-tensor-cut unit) it belongs to
    flops_fwd: float
    flops_bwd: float
    param_bytes: int  # trainable parameters only
    out_bytes: int  # bytes of live_out
    live_out: list[int] = field(default_factory=list)  # op outputs live across the cut after it

    @property
    def first(self) -> int:
        return self.nodes[0]

    @property
    def last(self) -> int:
        return self.nodes[-1]


def is_compute_intensive(node: Any) -> bool:
    """HARP's compute-intensive operator (MatMul, Convolution, attention)."""
    return node.kind == OP and (node.op in COMPUTE_OPS or node.flops >= 16 * max(node.meta.numel, 1))


def build_layers(graph: RefGraph, *, min_compute: int = 2, max_live: int = 2) -> list[Layer]:
    """The fine-grained layer sequence of ``graph`` (see module docstring).

    Args:
        min_compute: HARP's ``z``, compute-intensive ops a layer gathers before it may end.
        max_live: the most computed (non data-only) tensors a cut inside a unit may cross.
    """
    if min_compute < 1 or max_live < 1:
        raise HapcError(f"min_compute and max_live must be >= 1, got {min_compute}, {max_live}")
    ops = [n.index for n in graph if n.kind == OP]
    if not ops:
        raise HapcError("the graph has no op nodes to build layers from")
    nodes = graph.nodes
    last_use = {n.index: max(n.users) for n in graph if n.users}
    sources = source_like(graph)
    # computed (non data-only) tensors live after each op position
    live_count: list[int] = []
    live: set[int] = set()
    for x in ops:
        if x not in sources and last_use.get(x, -1) > x:
            live.add(x)
        live = {y for y in live if last_use[y] > x}
        live_count.append(len(live))
    heavy = [is_compute_intensive(nodes[x]) for x in ops]

    # 1. units between single-tensor cuts
    units: list[list[int]] = []  # op positions
    cur: list[int] = []
    for p in range(len(ops)):
        cur.append(p)
        if live_count[p] == 1 and p < len(ops) - 1:
            units.append(cur)
            cur = []
    if cur:
        units.append(cur)
    unit_sigs = [_signature(graph, [ops[p] for p in u]) for u in units]
    counts = Counter(unit_sigs)
    merged: list[list[int]] = []
    pending: list[int] = []
    for u, sig in zip(units, unit_sigs):
        if not any(heavy[p] for p in u):
            pending += u
            continue
        if pending and counts[sig] > 1:
            merged.append(pending)
            pending = []
        merged.append(pending + u)
        pending = []
    if pending:
        if merged:
            merged[-1] += pending
        else:
            merged.append(pending)

    # 2. greedy clustering inside each unit
    groups: list[tuple[int, list[int]]] = []
    for ui, u in enumerate(merged):
        remaining = sum(heavy[p] for p in u)
        start, seen = 0, 0
        for k, p in enumerate(u):
            seen += heavy[p]
            remaining -= heavy[p]
            if seen >= min_compute and remaining >= 1 and live_count[p] <= max_live and k < len(u) - 1:
                groups.append((ui, u[start : k + 1]))
                start, seen = k + 1, 0
        groups.append((ui, u[start:]))

    layers = []
    for li, (ui, grp) in enumerate(groups):
        idx = [ops[p] for p in grp]
        end = idx[-1]
        used = sorted({o for x in idx for o in nodes[x].operands if nodes[o].kind in (PARAM, BUFFER)})
        produced_before = [x for x in ops if x <= end]
        live_out = [x for x in produced_before if last_use.get(x, -1) > end]
        layers.append(
            Layer(
                index=li,
                nodes=idx,
                params=used,
                signature=_signature(graph, idx),
                unit=ui,
                flops_fwd=sum(nodes[x].flops for x in idx),
                flops_bwd=sum(backward_work(nodes[x], nodes)[0] for x in idx),
                param_bytes=sum(nodes[o].meta.nbytes for o in used if nodes[o].kind == PARAM),
                out_bytes=sum(nodes[x].meta.nbytes for x in live_out),
                live_out=live_out,
            )
        )
    return layers


def _signature(graph: RefGraph, idx: Sequence[int]) -> str:
    """Structure of a run of op nodes relative to its first node (equal runs, equal hash)."""
    base = idx[0]
    inside = set(idx)
    h = hashlib.sha256()
    nodes = graph.nodes

    def rel(r: Any) -> Any:
        n = nodes[r.index]
        if r.index in inside:
            return ("in", r.index - base)
        return ("ext", n.kind, repr(n.meta))

    for x in idx:
        n = nodes[x]
        h.update(f"{n.op}|{n.meta!r}|{n.out_index}|{n.is_method}|".encode())
        h.update(repr(map_refs((n.args, n.kwargs), rel)).encode())
    return h.hexdigest()[:16]


def evaluate_by_layers(graph: RefGraph, layers: Sequence[Layer], inputs: Mapping[str, Any]) -> Any:
    """Run ``graph`` layer by layer, carrying across each cut only the model inputs and the
    previous layer's :attr:`Layer.live_out` (what a pipeline sends); returns the loss. A wrong
    liveness raises ``KeyError`` naming the missing tensor."""
    from ..theory.graph import _getattr, _with_device

    state = dict(graph.module.named_parameters())
    state.update(graph.module.named_buffers())
    device = next((v.device for v in inputs.values() if hasattr(v, "device")), None)
    carried: dict[int, Any] = {}
    static = {}
    for n in graph:
        if n.kind == INPUT:
            static[n.index] = inputs[n.name]
    out = None
    for layer in layers:
        values = dict(carried)
        for p in layer.params:
            n = graph[p]
            values[p] = state[n.target] if n.target in state else _getattr(graph.module, n.target)

        get = functools.partial(_lookup, values, static, graph, layer.index)
        for x in layer.nodes:
            n = graph[x]
            a, k = map_refs((n.args, n.kwargs), get)
            a, k = _with_device((a, k), device)
            values[x] = out = n.call(*a, **k)
        carried = {x: values[x] for x in layer.live_out}
    return out


def _lookup(values: dict, static: dict, graph: RefGraph, layer: int, r: Any) -> Any:
    if r.index in values:
        return values[r.index]
    if r.index in static:
        return static[r.index]
    raise KeyError(f"layer {layer}: tensor %{r.index} ({graph[r.index].name}) is not live here")
