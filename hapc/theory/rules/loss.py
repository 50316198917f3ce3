"""Losses and embeddings.

Mean-reduced losses never reach these rules: the tracer rewrites them to ``sum / denominator``
(``hapc.theory.trace``), so a batch-sharded loss is an ordinary ``Partial`` sum.

The embedding has three strategies besides replication: tokens shard (the table replicated), the
embedding dim shards (the table column-sharded), and the *vocabulary* shards -- each device looks
up only the rows it holds (``hapc.ops.embedding_shard``) and the result is ``Partial``.
"""

from __future__ import annotations

from ... import ops as hops
from ..props import PARTIAL, REPLICATED, shard
from ..registry import OpView
from ..strategy import LocalCall, Operand, ShardStart, Strategy
from . import labels, rule


@rule(["cross_entropy", "nll_loss"], doc="batch and position dims shard (sum -> Partial); classes never")
def _cross_entropy(view: OpView):
    """``F.cross_entropy(x [N, C, d...], t [N, d...] or probabilities, reduction='sum'|'none')``."""
    x, t = view.operands[0], view.operands[1]
    if x.rank == 1:
        return []
    rest = labels(x.rank - 2, "p")
    xs = " ".join(["n", "c^", *rest])
    ts = xs if t.rank == x.rank else " ".join(["n", *rest])
    spec = [xs, ts] + ["c^"] * (view.num_operands - 2)  # class weights
    reduction = view.arg(6, "reduction", "mean")
    out = "" if reduction == "sum" else " ".join(["n", *rest])
    if reduction not in ("sum", "none"):
        return []  # mean that could not be rewritten (weighted label smoothing): replicate
    return view.annotate(f"{', '.join(spec)} -> {out}")


@rule(["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"], doc="every dim shards (sum -> Partial)")
def _pointwise_loss(view: OpView):
    """``F.mse_loss(x, t, reduction='sum'|'none')``."""
    reduction = view.arg(2 if view.node.op == "huber_loss" else 4, "reduction", "mean")
    if reduction not in ("sum", "none"):
        return []
    return view.annotate(f"..., ... -> {'' if reduction == 'sum' else '...'}")


@rule("embedding", doc="tokens shard; embedding dim shards; vocabulary shards -> Partial")
def _embedding(view: OpView):
    """``F.embedding(idx, weight, padding_idx)``."""
    strategies = view.annotate("..., v^ e -> ... e")
    padding_idx = view.arg(2, "padding_idx")
    if view.operands[1].shape[0] > 1:
        local = LocalCall(hops.embedding_shard, (Operand(0), Operand(1), ShardStart(1, 0), padding_idx))
        strategies.append(Strategy((REPLICATED, shard(0)), PARTIAL, local=local, name="vocab"))
    return strategies
