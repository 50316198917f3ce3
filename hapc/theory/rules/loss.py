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


@rule(["ctc_loss_masked", "ctc_loss"], doc="batch dim shards (sums -> Partial); time, classes, targets never")
def _ctc_loss(view: OpView):
    """``hapc.ops.ctc_loss_masked(log_probs [T, N, C], labels [N, S], mask [N, S], input_lengths [N],
    target_lengths [N])`` (the capture of ``ctc_loss`` on ``masked_select`` targets) and
    ``F.ctc_loss`` with padded targets ``[N, S]`` and tensor lengths: each sample's loss reads only its
    own column of ``log_probs``, row of targets and two lengths (the CTC recursion runs over ``T`` and
    ``S``, which never shard), so the batch shards; ``"sum"`` and ``"length_sum"`` (``sum_n loss_n /
    max(len_n, 1)``) sum over it -> ``Partial``, ``"none"`` -> sharded. ``zero_infinity`` is per sample.
    torch's ``"mean"`` is captured as ``length_sum / N`` (``hapc.theory.static_forms``); an
    uncaptured mean, 1-D concatenated targets or list lengths: replicated."""
    masked = view.node.op == "ctc_loss_masked"
    ranks = [o.rank for o in view.operands]
    if ranks != ([3, 2, 2, 1, 1] if masked else [3, 2, 1, 1]):
        return []
    reduction = view.arg(7 if masked else 5, "reduction", "sum" if masked else "mean")
    if reduction not in ("none", "sum", "length_sum"):
        return []
    spec = ["t^ n c^", "n s^", *(["n s^"] if masked else []), "n", "n"]
    return view.annotate(f"{', '.join(spec)} -> {'n' if reduction == 'none' else ''}")


@rule("checked", doc="the loss passes (Replicated or Partial); the model's check computed whole")
def _checked(view: OpView):
    """``hapc.ops.checked(loss, condition, ...)``: raises where the model's ``if condition: raise``
    would; the condition is read whole (``Replicated``) on every device, so all raise together."""
    return [Strategy((PARTIAL, REPLICATED), PARTIAL, scaled=False, name="partial")]


@rule("embedding", doc="tokens shard; embedding dim shards; vocabulary shards -> Partial")
def _embedding(view: OpView):
    """``F.embedding(idx, weight, padding_idx, scale_grad_by_freq=False)``.

    With ``scale_grad_by_freq`` each row's gradient is divided by the number of times its token
    occurs in ``idx``: counted over a shard of the tokens, the divisor would be the shard's count, not
    the batch's. The tokens then stay whole: only the embedding dim shards (every device looks up
    every token, in its columns; a consumer taking a shard of the rows backpropagates zeros for the
    others, so the counts are the batch's)."""
    if view.arg(5, "scale_grad_by_freq", False):
        idx = " ".join(f"{d}^" for d in labels(view.operands[0].rank, "t"))
        return view.annotate(f"{idx}, v^ e -> {idx} e")
    strategies = view.annotate("..., v^ e -> ... e")
    padding_idx = view.arg(2, "padding_idx")
    if view.operands[1].shape[0] > 1:
        local = LocalCall(hops.embedding_shard, (Operand(0), Operand(1), ShardStart(1, 0), padding_idx))
        strategies.append(Strategy((REPLICATED, shard(0)), PARTIAL, local=local, name="vocab"))
    return strategies
