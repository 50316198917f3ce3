"""Cutting the reference graph into pipeline stages (HARP §3, DESIGN §6).

A pipeline plan assigns every op of the reference graph to one of ``S`` stages by *cut points*
in the graph's topological order: stage ``k`` holds the ops with ``cuts[k-1] <= index < cuts[k]``.
Each stage becomes a reference graph of its own, which the SPMD layer (theory, A*, LP, codegen)
handles like any model:

* **inputs** -- the model inputs the stage reads (every rank is given the batch, so these are never
  sent) and the *activations* that cross into it: every tensor that depends on a parameter, is
  produced before the stage and is consumed in it or after it. A tensor produced in stage 0 and
  read in stage 3 crosses cuts 1, 2 and 3: stages 1 and 2 pass it through, so each stage talks to
  its neighbours only.
* **data-only values** (no parameter behind them: a token count, a causal mask, ``arange``) are
  recomputed by every stage that needs them instead of being sent.
* **output** -- the last stage ends in the loss; every other stage ends in ``stage_pack``, the
  flattened concatenation of the activations it sends on, required *replicated*, so one relay
  rank holds all of it (the stage's own program pays for making it whole).

The adjoint of the cut is exact: ``stage_pack``'s backward splits the gradient received from the
next stage, and the gradient of each incoming activation is summed over the ranks of the stage
(DESIGN §3: a replicated tensor's gradient is Partial), which is what the previous stage needs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import HapcError
from ..theory.graph import BUFFER, INPUT, OP, PARAM, Ref, RefGraph, RefNode, TensorMeta, map_refs
from ..theory.props import shard
from ..theory.registry import register_rule
from ..theory.strategy import Strategy


def stage_pack(*xs: torch.Tensor) -> torch.Tensor:
    """The activations a stage sends on, flattened into one buffer (one message per micro-batch)."""
    return torch.cat([x.reshape(-1) for x in xs])


def stage_pack_rows(*xs: torch.Tensor) -> torch.Tensor:
    """The activations a stage sends on, as rows: ``[batch, features]``, each tensor's features
    side by side. Batch-sharded activations pack into batch-sharded rows, so each rank can send its
    own rows (HetAuto §5.2's per-slice relays) instead of gathering them first."""
    return torch.cat([x.reshape(x.shape[0], -1) for x in xs], dim=1)


# replicated only: a relay rank must hold the whole buffer (the theory adds that strategy itself)
register_rule(stage_pack, lambda op: iter(()), doc="replicated only: one relay sends the whole buffer")


@register_rule(stage_pack_rows, doc="rows shard with the batch of every packed activation")
def _pack_rows_rule(op):
    yield Strategy(tuple(shard(0) for _ in op.operands), shard(0), name="rows")


@dataclass
class StageGraph:
    """One stage's reference graph and how it connects to its neighbours.

    ``receives`` / ``sends`` are the original graph's node indices of the activations crossing
    the stage's first / last cut, in the order they lie in the flat message; ``shapes`` and the
    dtype of the message follow from them."""

    index: int
    graph: RefGraph
    receives: list[int]
    sends: list[int]
    recv_meta: list[TensorMeta]
    send_meta: list[TensorMeta]

    @property
    def recv_numel(self) -> int:
        return sum(m.numel for m in self.recv_meta)

    @property
    def send_numel(self) -> int:
        return sum(m.numel for m in self.send_meta)

    @property
    def by_rows(self) -> bool:
        """The messages into this stage are ``[rows, features]`` (every activation has the same leading
        size), else flat."""
        return _by_rows(self.recv_meta)

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The incoming activations from a received buffer (all rows, or this rank's rows)."""
        if not self.by_rows:
            parts = buf.reshape(-1).split([m.numel for m in self.recv_meta])
            return [p.view(m.shape) for p, m in zip(parts, self.recv_meta)]
        rows = buf.reshape(buf.shape[0], -1)
        parts = rows.split([m.numel // m.shape[0] for m in self.recv_meta], dim=1)
        return [p.reshape(rows.shape[0], *m.shape[1:]) for p, m in zip(parts, self.recv_meta)]

    @property
    def model_inputs(self) -> list[str]:
        """Names of the model inputs this stage reads (its first placeholders, in this order)."""
        return [n.name for n in self.graph.inputs if not n.name.startswith(ACT_PREFIX)]


ACT_PREFIX = "act__"


def _depends_on_params(g: RefGraph) -> list[bool]:
    dep = [False] * len(g)
    for n in g:
        # an incoming activation of a stage graph (an input that requires grad) counts as a parameter
        dep[n.index] = (
            n.kind == PARAM
            or (n.kind == INPUT and n.requires_grad)
            or (n.kind == OP and any(dep[o] for o in n.operands))
        )
    return dep


def split_graph(g: RefGraph, cuts: Sequence[int]) -> list[StageGraph]:
    """Cut ``g`` before each node index in ``cuts`` (strictly increasing, inside the graph).

    Raises :class:`HapcError` for bad cuts, a stage with no parameter-dependent op, or crossing
    activations of different dtypes (one flat message per micro-batch needs one dtype)."""
    cuts = list(cuts)
    ops = [n.index for n in g if n.kind == OP]
    if any(b <= a for a, b in itertools.pairwise(cuts)) or any(not (ops[0] < c <= ops[-1]) for c in cuts):
        raise HapcError(
            f"pipeline cuts {cuts} must increase strictly and lie inside the graph's ops ({ops[0] + 1}..{ops[-1]})"
        )
    bounds = [0, *cuts, len(g)]
    dep = _depends_on_params(g)
    stage_of = {}
    for n in g:
        if n.kind == OP and dep[n.index]:
            stage_of[n.index] = next(k for k in range(len(bounds) - 1) if bounds[k] <= n.index < bounds[k + 1])
    last_use: dict[int, int] = {}
    for n in g:
        for o in n.operands:
            if o in stage_of and n.index in stage_of:
                last_use[o] = max(last_use.get(o, -1), stage_of[n.index])
    num = len(bounds) - 1
    # crossing[k]: activations live across the cut between stage k and k + 1, by node index
    crossing = [sorted(i for i, s in stage_of.items() if s <= k < last_use.get(i, -1)) for k in range(num - 1)]
    out = []
    for k in range(num):
        if not any(s == k for s in stage_of.values()):
            raise HapcError(
                f"pipeline stage {k} (nodes {bounds[k]}..{bounds[k + 1] - 1}) has no op that depends on a "
                "parameter: move the cut so every stage does some training work"
            )
        receives = crossing[k - 1] if k > 0 else []
        sends = crossing[k] if k < num - 1 else []
        dtypes = {g[i].meta.dtype for i in sends}
        if len(dtypes) > 1:
            raise HapcError(
                f"activations crossing the cut after stage {k} have several dtypes {sorted(map(str, dtypes))}; "
                "cut elsewhere (one flat message per micro-batch needs one dtype)"
            )
        out.append(_stage_graph(g, k, num, stage_of, dep, receives, sends))
    return out


def _stage_graph(
    g: RefGraph, k: int, num: int, stage_of: dict[int, int], dep: list[bool], receives: list[int], sends: list[int]
) -> StageGraph:
    own = {i for i, s in stage_of.items() if s == k}
    needed: set[int] = set()  # data-only ops recomputed here, and params / buffers / inputs read
    stack = [o for i in own for o in g[i].operands if o not in own and o not in receives]
    stack += [i for i in sends if i not in own and i not in receives]
    while stack:
        i = stack.pop()
        if i in needed or i in own or i in receives:
            continue
        if g[i].kind == OP and dep[i]:
            raise AssertionError(f"activation {g[i].name} should have crossed the cut into stage {k}")
        needed.add(i)
        if g[i].kind == OP:
            stack.extend(g[i].operands)
    remap: dict[int, int] = {}
    nodes: list[RefNode] = []

    def add(n: RefNode, **changes) -> None:
        remap[n.index] = len(nodes)
        args, kwargs = map_refs((n.args, n.kwargs), lambda r: Ref(remap[r.index]))
        nodes.append(dataclasses.replace(n, index=len(nodes), args=args, kwargs=kwargs, users=[], **changes))

    input_names = [n.name for n in g.inputs if n.index in needed]
    for n in g.inputs:
        if n.index in needed:
            add(n)
    for i in receives:
        src = g[i]
        remap[i] = len(nodes)
        nodes.append(
            RefNode(len(nodes), ACT_PREFIX + src.name, INPUT, "input", src.name, meta=src.meta, requires_grad=True)
        )
        input_names.append(ACT_PREFIX + src.name)
    for n in g:
        if n.kind in (PARAM, BUFFER) and n.index in needed:
            add(n)
    for n in g:
        if n.kind == OP and (n.index in own or n.index in needed):
            add(n)
    if k < num - 1:
        metas = [g[i].meta for i in sends]
        total = sum(m.numel for m in metas)
        dtype = metas[0].dtype if metas else torch.float32
        if _by_rows(metas):  # one leading (batch) size: pack as rows
            b = metas[0].shape[0]
            fn, shape = stage_pack_rows, (b, total // b)
        else:
            fn, shape = stage_pack, (total,)
        nodes.append(
            RefNode(
                len(nodes),
                "stage_output",
                OP,
                f"hapc.pipeline.stages.{fn.__name__}",
                fn,
                args=tuple(Ref(remap[i]) for i in sends),
                meta=TensorMeta(shape, dtype),
                requires_grad=True,
                mem_bytes=2.0 * total * _itemsize(dtype),
            )
        )
    elif nodes[-1].name != g.loss.name:
        raise AssertionError("the last stage must end in the loss")
    graph = RefGraph(nodes, g.module, input_names)
    graph.aliases = dict(g.aliases)  # tied weights' other names (a stage holding the weight answers to them all)
    return StageGraph(k, graph, receives, sends, [g[i].meta for i in receives], [g[i].meta for i in sends])


def _by_rows(metas: Sequence[TensorMeta]) -> bool:
    return bool(metas) and all(m.rank for m in metas) and len({m.shape[0] for m in metas}) == 1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def balanced_cuts(g: RefGraph, weights: Sequence[float]) -> list[int]:
    """Cut points giving stage ``k`` about ``weights[k] / sum(weights)`` of the forward flops: a
    simple placement for tests and examples (the planner, :mod:`hapc.pipeline.planner`, chooses
    cuts by the HARP DP instead). A cut that would send activations of mixed dtypes moves later."""
    ops = [n for n in g if n.kind == OP]
    total = sum(n.flops for n in ops) or float(len(ops))
    share = [sum(weights[: k + 1]) / sum(weights) for k in range(len(weights) - 1)]
    cuts: list[int] = []
    acc = 0.0
    for n in ops:
        while len(cuts) < len(share) and acc >= share[len(cuts)] * total:
            cuts.append(n.index)
        acc += n.flops if total != len(ops) else 1.0
    cuts = sorted(set(cuts))
    for k in range(len(cuts)):
        for c in [c for c in (n.index for n in ops) if c >= cuts[k]]:
            if (k + 1 < len(cuts) and c >= cuts[k + 1]) or c == ops[0].index:
                continue
            try:
                split_graph(g, [*cuts[:k], c])
            except HapcError:
                continue
            cuts[k] = c
            break
    split_graph(g, cuts)  # raises with the reason if no valid placement was found
    return cuts


def loss_weighting(g: RefGraph) -> tuple[str, int | None]:
    """How the batch loss combines the micro-batches' losses: ``("count", node)`` for a mean
    ``sum / count`` whose count depends on the data (``ignore_index``): weights ``count_m /
    sum(count)``; ``("mean", None)``: ``1/M``; ``("sum", None)``: ``1``. Anything else is refused
    (a silent wrong weighting would train another model)."""
    loss = g.loss
    dep = _depends_on_params(g)
    if loss.kind == OP and loss.op in ("div", "truediv"):
        ops = loss.operands
        if len(ops) == 2 and g[ops[1]].kind == OP and not dep[ops[1]]:
            return "count", ops[1]
        if len(ops) == 1:  # divided by a constant: the micro-batch's numel or count
            return "mean", None
    if loss.kind == OP and loss.op == "mean":
        return "mean", None
    if loss.kind == OP and loss.op == "sum":
        return "sum", None
    reduction = loss.kwargs.get("reduction") if loss.kind == OP else None
    if reduction in ("sum", "mean"):
        return reduction, None
    raise HapcError(
        f"a pipelined loss must be a mean or a sum over the batch (micro-batch losses are combined by "
        f"weights), but the model's loss is {loss.op!r} at {loss.source or loss.name}; end the forward in "
        "`.mean()`, `.sum()` or a loss function with reduction='mean'/'sum'"
    )
