"""Small tensor functions used by models and by the per-device code hapc generates.

Some strategies run something slightly different from the reference op on each device -- a mean
over a sharded dimension is a local sum divided by the *global* count, an embedding with a
vocabulary-sharded table looks up only the rows it holds. Those local forms live here, as plain
functions with readable names, so generated code stays ordinary PyTorch
(``hapc.ops.sum_div(x, dim=1, keepdim=False, divisor=128)``). Nothing here communicates.

Ops marked ``@custom_op`` are also single nodes of the reference graph with their own rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .theory.registry import custom_op


def sum_div(x: torch.Tensor, dim: int | Sequence[int] | None, keepdim: bool, divisor: float) -> torch.Tensor:
    """``x.sum(dim, keepdim) / divisor``: the local part of a mean over a sharded dimension."""
    s = x.sum() if dim is None else x.sum(dim, keepdim=keepdim)
    return s / divisor


def embedding_shard(
    idx: torch.Tensor, weight: torch.Tensor, start: int, padding_idx: int | None = None
) -> torch.Tensor:
    """Embedding lookup against rows ``start .. start + len(weight)`` of a vocabulary-sharded
    table: rows held elsewhere contribute zeros, so the sum over devices is the full lookup."""
    local = idx - start
    held = (local >= 0) & (local < weight.shape[0])
    pad = None
    if padding_idx is not None and start <= padding_idx < start + weight.shape[0]:
        pad = padding_idx - start
    out = F.embedding(local.clamp(0, max(weight.shape[0] - 1, 0)), weight, pad) if weight.shape[0] else None
    if out is None:
        return weight.new_zeros((*idx.shape, weight.shape[1]))
    return out * held.unsqueeze(-1).to(out.dtype)


@custom_op("... , c^ -> ", doc="target dims -> Partial (a weighted count); class weights replicated")
def target_weight_sum(target: torch.Tensor, weight: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Denominator of a ``reduction='mean'`` cross-entropy / NLL: the summed class weights of the
    targets that are not ``ignore_index`` (their count when every weight is one)."""
    valid = target != ignore_index
    w = weight[target.clamp(0, weight.shape[0] - 1)]
    return (w * valid.to(w.dtype)).sum()


@custom_op("... -> ", doc="target dims -> Partial (a count)")
def target_count(target: torch.Tensor, ignore_index: int = -100, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of targets that are not ``ignore_index``, as a floating-point scalar."""
    return (target != ignore_index).sum().to(dtype)


# -- Mixture of experts (GShard-style dispatch with a fixed capacity) ---------------------------
#
# Each token picks ``k`` experts (``expert_index[t, :k]``). Slots are handed out first to every
# token's first choice, in token order, then to second choices, and so on (GShard's priority);
# a copy that finds its expert's ``capacity`` slots full is dropped. ``moe_dispatch`` builds the
# experts' input buffers ``[E, C, M]``; ``moe_combine`` weighs the experts' outputs back into tokens.


def moe_slots(
    expert_index: torch.Tensor,
    num_experts: int,
    totals: torch.Tensor | None = None,
    earlier: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot of every (token, choice) in its expert's buffer, ``[T, k]`` (may exceed capacity).

    Slots go choice by choice, token by token. When the tokens are spread over devices,
    ``totals[c, e]`` is the number of choice-``c`` copies routed to expert ``e`` over *all* devices
    and ``earlier[c, e]`` the number on devices before this one; by default all tokens are here.
    """
    t, k = expert_index.shape
    onehot = F.one_hot(expert_index.t().reshape(-1), num_experts).to(torch.int64)
    per_choice = onehot.view(k, t, num_experts)  # [k, T, E], choice-major
    counts = per_choice.sum(1)
    totals = counts if totals is None else totals
    before = totals.cumsum(0) - totals  # slots taken by earlier choices, [k, E]
    if earlier is not None:
        before = before + earlier
    pos = per_choice.cumsum(1) - 1 + before.unsqueeze(1)
    return pos.gather(2, expert_index.t().unsqueeze(-1)).squeeze(-1).t()


@custom_op()
def moe_dispatch(x: torch.Tensor, expert_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Expert input buffers ``[E, capacity, M]`` from tokens ``x [T, M]`` routed by ``expert_index [T, k]``."""
    return moe_dispatch_range(x, expert_index, num_experts, capacity, 0, num_experts)


@custom_op()
def moe_combine(
    expert_out: torch.Tensor, expert_index: torch.Tensor, gates: torch.Tensor, capacity: int
) -> torch.Tensor:
    """Tokens ``[T, M]``: the gate-weighted sum of each token's experts' outputs (dropped copies add 0)."""
    return moe_combine_range(expert_out, expert_index, gates, capacity, expert_out.shape[0], 0)


def moe_dispatch_range(
    x: torch.Tensor,
    expert_index: torch.Tensor,
    num_experts: int,
    capacity: int,
    lo: int,
    hi: int,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Experts ``lo:hi`` of ``moe_dispatch``; ``slots`` overrides the locally computed slots."""
    pos = moe_slots(expert_index, num_experts) if slots is None else slots
    keep = (pos < capacity) & (expert_index >= lo) & (expert_index < hi)
    rows = (hi - lo) * capacity
    flat = torch.where(keep, (expert_index - lo) * capacity + pos, rows)  # dropped copies -> spare row
    t, k = expert_index.shape
    copies = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, x.shape[1])
    buf = x.new_zeros((rows + 1, x.shape[1])).index_add(0, flat.reshape(-1), copies)
    return buf[:rows].view(hi - lo, capacity, x.shape[1])


def moe_combine_range(
    expert_out: torch.Tensor,
    expert_index: torch.Tensor,
    gates: torch.Tensor,
    capacity: int,
    num_experts: int,
    lo: int,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_combine`` from experts ``lo .. lo + len(expert_out)`` only (the others contribute 0)."""
    e_local = expert_out.shape[0]
    if e_local == 0:
        return expert_out.new_zeros((expert_index.shape[0], expert_out.shape[-1]))
    pos = moe_slots(expert_index, num_experts) if slots is None else slots
    keep = (pos < capacity) & (expert_index >= lo) & (expert_index < lo + e_local)
    flat = (expert_index - lo).clamp(0, e_local - 1) * capacity + pos.clamp(0, capacity - 1)
    picked = expert_out.reshape(e_local * capacity, -1)[flat.reshape(-1)].view(*expert_index.shape, -1)
    return (picked * (gates * keep.to(gates.dtype)).unsqueeze(-1)).sum(1)
