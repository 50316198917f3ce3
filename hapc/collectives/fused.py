"""Ops whose distributed form communicates inside: synchronised batch norm, sufficient-factor
broadcasting, and expert-parallel MoE dispatch / combine.

Each matches the ``simulate`` semantics of its strategy in ``hapc.theory.rules`` / ``sfb``:
the same answer as the single-device op, computed from uneven shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import ops as hops
from .ops import Group, all_gather, all_reduce, flush_losses, gather_impl, reduce_scatter


def sync_batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    group: Group = None,
) -> torch.Tensor:
    """Batch norm over a batch sharded on dim 0: every rank normalises with the statistics of
    the whole batch, computed in two passes as one device computes them,

        mean = all_reduce(sum x) / n,    var = all_reduce(sum (x - mean)^2) / n,

    not from one all-reduce of ``sum x`` and ``sum x^2`` (``var = E[x^2] - mean^2``), which cancels
    catastrophically where ``|mean| >> std``: float32 activations of mean 10 and std 0.1 lost
    three digits of the output that way and mean 1000 gave NaN (a negative variance). Statistics
    accumulate in float32 at least (a half-precision input's, as ``F.batch_norm``'s do). The
    backward all-reduces follow from the autograd of :func:`all_reduce` (self-adjoint)."""
    dims = [0] + list(range(2, x.dim()))
    c = x.shape[1]
    xs = x.float() if x.element_size() < 4 else x  # accumulate half-precision inputs in float32
    count = torch.tensor([float(x.numel() // c)], dtype=xs.dtype, device=x.device)
    first = all_reduce(torch.cat([xs.sum(dims), count]), group)
    n = first[-1]
    mean = first[:c] / n
    shape = [1, c] + [1] * (x.dim() - 2)
    centred = xs - mean.view(shape)
    var = all_reduce((centred * centred).sum(dims), group) / n
    y = centred * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    y = y.to(x.dtype)
    if training and running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = var.detach() * n / torch.clamp(n - 1, min=1)
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return y


class _SFBLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, sizes, dim, group):
        ctx.save_for_backward(x, w)
        ctx.args = (sizes, dim, group)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        sizes, dim, group = ctx.args
        dx = dy @ w
        xs = gather_impl(x.contiguous(), dim, sizes, group, "padded")  # the two sufficient factors
        dys = gather_impl(dy.contiguous(), dim, sizes, group, "padded")
        dw = dys.reshape(-1, dys.shape[-1]).t() @ xs.reshape(-1, xs.shape[-1])
        return dx, dw, None, None, None


def sfb_linear(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int], dim: int, group: Group = None) -> torch.Tensor:
    """``F.linear(x, w)`` on a batch sharded on ``dim``; the weight gradient is rebuilt whole on
    every rank from all-gathered inputs and output gradients (no gradient all-reduce)."""
    return _SFBLinear.apply(x, w, list(sizes), dim, group)


# -- mixture of experts ------------------------------------------------------------------------


def _global_slots(idx: torch.Tensor, num_experts: int, group: Group) -> torch.Tensor:
    """Slots of this rank's tokens as numbered over all ranks' tokens (in rank order)."""
    k = idx.shape[1]
    onehot = F.one_hot(idx.t().reshape(-1), num_experts).to(torch.int64).view(k, idx.shape[0], num_experts)
    counts = onehot.sum(1)  # [k, E]
    world = dist.get_world_size(group)
    bufs = [torch.empty_like(counts) for _ in range(world)]
    flush_losses()
    dist.all_gather(bufs, counts.contiguous(), group=group)
    me = dist.get_rank(group)
    totals = sum(bufs[1:], bufs[0])
    earlier = sum(bufs[:me], torch.zeros_like(counts))
    return hops.moe_slots(idx, num_experts, totals, earlier)


def moe_dispatch_tokens(x: torch.Tensor, idx: torch.Tensor, num_experts: int, capacity: int, group: Group = None):
    """This rank's tokens scattered into full expert buffers (Partial: the sum over ranks is the
    single-device dispatch)."""
    slots = _global_slots(idx, num_experts, group)
    return hops.moe_dispatch_range(x, idx, num_experts, capacity, 0, num_experts, slots)


def moe_dispatch_all_to_all(
    x: torch.Tensor,
    idx: torch.Tensor,
    num_experts: int,
    capacity: int,
    expert_sizes: Sequence[int],
    group: Group = None,
) -> torch.Tensor:
    """Tokens (sharded) to the ranks that own their experts (experts sharded unevenly)."""
    return reduce_scatter(moe_dispatch_tokens(x, idx, num_experts, capacity, group), 0, expert_sizes, group)


def moe_combine_tokens(
    expert_out: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor, capacity: int, group: Group = None
) -> torch.Tensor:
    """Combine for this rank's tokens from replicated expert outputs (slots numbered globally)."""
    slots = _global_slots(idx, expert_out.shape[0], group)
    return hops.moe_combine_range(expert_out, idx, gates, capacity, expert_out.shape[0], 0, slots)


def moe_combine_all_to_all(
    expert_out: torch.Tensor,
    idx: torch.Tensor,
    gates: torch.Tensor,
    capacity: int,
    expert_sizes: Sequence[int],
    group: Group = None,
) -> torch.Tensor:
    """Expert outputs (experts sharded) back to the ranks holding their tokens."""
    return moe_combine_tokens(all_gather(expert_out, 0, expert_sizes, group), idx, gates, capacity, group)
