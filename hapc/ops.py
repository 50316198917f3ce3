"""Small tensor functions used by models and by the per-device code hapc generates.

Some strategies run something slightly different from the reference op on each device -- a mean
over a sharded dimension is a local sum divided by the *global* count, an embedding with a
vocabulary-sharded table looks up only the rows it holds. Those local forms live here, as plain
functions with readable names, so generated code stays ordinary PyTorch
(``hapc.ops.sum_div(x, dim=1, keepdim=False, divisor=128)``). Nothing here communicates.

Ops marked ``@custom_op`` are also single nodes of the reference graph with their own rules.
"""

from __future__ import annotations

import functools
import hashlib
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .theory.registry import custom_op


def sum_div(x: torch.Tensor, dim: int | Sequence[int] | None, keepdim: bool, divisor: float) -> torch.Tensor:
    """``x.sum(dim, keepdim) / divisor``: the local part of a mean over a sharded dimension."""
    s = x.sum() if dim is None else x.sum(dim, keepdim=keepdim)
    return s / divisor


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``y + bias`` in ``y``'s dtype: the bias add of ``nn.Linear`` / ``nn.Conv*d``, kept apart from the
    product (a row-parallel linear adds it after the reduction). ``F.linear(x, w, b)`` under
    ``torch.autocast`` casts ``b`` with ``x`` and ``w``, so its result is bfloat16; a plain
    ``y + b`` of a bfloat16 product and a float32 bias would promote to float32. Outside autocast the
    two dtypes agree and the cast is a no-op. The rules are those of ``add`` (``__hapc_op__``)."""
    return y + bias.to(y.dtype)


add_bias.__hapc_op__ = "add"  # type: ignore[attr-defined]


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


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """``F.ctc_loss`` as the capture records it (:mod:`hapc.theory.static_forms`): the same call,
    plus shapes on the meta device (torch has no meta kernel for it) and the reduction
    ``"length_sum" = sum_n loss_n / max(target_lengths_n, 1)`` -- torch's ``"mean"`` times the batch
    size, which the capture divides by: a sum over samples, so a batch shard is a ``Partial`` sum."""
    if log_probs.device.type == "meta":
        batched = log_probs.dim() == 3
        return log_probs.new_empty((log_probs.shape[1],) if reduction == "none" and batched else ())
    torch_reduction = "none" if reduction == "length_sum" else reduction
    loss = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, blank, torch_reduction, zero_infinity)
    if reduction == "length_sum":
        return (loss / target_lengths.clamp_min(1).to(loss.dtype)).sum()
    return loss


ctc_loss.__hapc_op__ = "ctc_loss"  # type: ignore[attr-defined]


def ctc_loss_masked(
    log_probs: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    reduction: str = "sum",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """``F.ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1), ...)`` with
    the targets in the padded form ``(N, S)`` that ``ctc_loss`` also accepts, so that no length
    depends on values (the capture of Hugging Face's CTC heads, :mod:`hapc.theory.static_forms`).

    ``masked_select`` concatenates row ``i``'s kept labels, in order, after rows ``0 .. i-1``; the
    concatenated form reads sample ``i``'s targets at offset ``sum_{j<i} target_lengths[j]``, the
    padded form at row ``i``'s first ``target_lengths[i]`` entries. A stable sort of each row by
    "not kept" moves its kept labels to the front in their order: the same targets, so the same loss
    per sample; the entries past ``target_lengths[i]`` are never read (they are set to ``blank``).
    ``target_lengths`` must be ``mask.sum(-1)`` (the capture checks the node). ``reduction``: as
    :func:`ctc_loss` (``"none"``, ``"sum"``, ``"length_sum"``).
    """
    if log_probs.device.type != "meta":
        order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)
        labels = torch.where(mask.gather(1, order), labels.gather(1, order), torch.full_like(labels, blank))
    return ctc_loss(log_probs, labels, input_lengths, target_lengths, blank, reduction, zero_infinity)


ctc_loss_masked.__hapc_op__ = "ctc_loss_masked"  # type: ignore[attr-defined]


def checked(loss: torch.Tensor, condition: torch.Tensor, raise_when: bool, message: str, error: str) -> torch.Tensor:
    """``loss``, after the check a model makes with ``if condition: raise ...`` (``raise_when=True``)
    or ``if not condition: raise ...`` (``assert``): the capture cannot branch on a value, so the
    check becomes this node, which raises ``error`` (a built-in exception's name) where one device
    would have raised. ``condition`` is computed whole on every device (its rule), so every rank
    raises together."""
    if condition.device.type != "meta" and bool(condition) == raise_when:
        import builtins

        kind = getattr(builtins, error, None)
        kind = kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError
        raise kind(message)
    return loss


checked.__hapc_op__ = "checked"  # type: ignore[attr-defined]


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


# -- Rank-consistent randomness (DESIGN §9 "Randomness") ----------------------------------------
#
# A random op's values are a pure function of (seed, step, op, global element index): a
# counter-based draw, no generator state. Element ``i`` of a tensor of global shape ``S`` gets the
# 64-bit hash ``splitmix64(key + (i + 1) * GAMMA)`` with ``key`` mixed from the seed, the module's
# step and the op's name; it is kept when its top 53 bits are at least ``p * 2**53``. A rank holding
# a slice (any dims, any starts) computes the global indices of its elements and so draws exactly
# the slice of the whole tensor's mask: N ranks equal one rank bit for bit, under any sharding.

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(v: int) -> int:
    v &= _M64
    return v - (1 << 64) if v >= 1 << 63 else v


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (exact 64-bit arithmetic)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch shifts arithmetically)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiplication, logical shifts)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


class RandomStream:
    """The run-time state random ops read: ``seed`` (agreed by every rank), ``step`` (advanced by
    the module on every training-mode forward) and ``drops`` (false once a module compiled in
    training mode is switched to eval: dropout is then the identity). One object per module.

    A pipeline stage runs its program on one micro-batch at a time, each a slice of the batch's
    rows; ``micro = (m, n)`` (micro-batch ``m`` of ``n``, set by the pipeline around each forward)
    and ``batch_dims`` (op -> the dim along which its tensor splits into micro-batches) place the
    draw of op's tensor in the *batch's* tensor (:meth:`locate`), so that micro-batch ``m`` draws
    exactly the masks of its rows in the one-rank run of the whole batch (one step per batch). An op
    whose tensor does not split by micro-batch (not in ``batch_dims``) draws as the batch draws
    it once: the same masks for every micro-batch."""

    def __init__(self, seed: int = 0, step: int = 0, drops: bool = True):
        self.seed, self.step, self.drops = seed, step, drops
        self.micro: tuple[int, int] | None = None
        self.batch_dims: dict[str, int] = {}

    def locate(self, op: str, starts: tuple, full: tuple) -> tuple[tuple, tuple]:
        """``(starts, full_shape)`` of a draw of ``op`` in the batch's tensor: along the op's micro-batch
        dim ``d``, micro-batch ``m`` of ``n`` starts ``m * full[d]`` rows further, of ``n * full[d]``.

        >>> s = RandomStream(); s.micro, s.batch_dims = (2, 4), {"drop": 0}
        >>> s.locate("drop", (1, 0), (3, 8))
        ((7, 0), (12, 8))
        """
        d = self.batch_dims.get(op) if self.micro is not None else None
        if d is None:
            return starts, full
        m, n = self.micro  # type: ignore[misc]
        return (*starts[:d], starts[d] + m * full[d], *starts[d + 1 :]), (*full[:d], n * full[d], *full[d + 1 :])

    def key(self, op: str) -> int:
        """The 64-bit key of op ``op``'s draw at this step (a signed int64 value)."""
        h = int.from_bytes(hashlib.blake2b(op.encode(), digest_size=8).digest(), "little")
        return _signed(_mix64(_mix64(_mix64(self.seed) + self.step) ^ h))

    def __repr__(self) -> str:
        return f"RandomStream(seed={self.seed}, step={self.step}, drops={self.drops})"


def global_index(
    local_shape: Sequence[int], starts: Sequence[int], full_shape: Sequence[int], device: torch.device | None = None
) -> torch.Tensor:
    """Row-major index into ``full_shape`` of every element of the slice of shape ``local_shape``
    that begins at ``starts`` (int64, shaped like the slice)."""
    n = len(full_shape)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in range(n - 1, -1, -1):
        ar = torch.arange(starts[d], starts[d] + local_shape[d], dtype=torch.int64, device=device) * stride
        idx = idx + ar.view(*([1] * d), local_shape[d], *([1] * (n - d - 1)))
        stride *= full_shape[d]
    return idx.expand(tuple(local_shape)) if n else idx


def keep_mask(
    key: int, p: float, local_shape: Sequence[int], starts: Sequence[int], full_shape: Sequence[int], device=None
) -> torch.Tensor:
    """Boolean keep mask (keep probability ``1 - p``) of a slice of a ``full_shape`` tensor."""
    z = (global_index(local_shape, starts, full_shape, device) + 1) * _signed(_GAMMA) + key
    u = _shr(_mix64_tensor(z), 11)  # 53 uniform bits
    return u >= round(p * 2**53)


def dropout(
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    *,
    stream: RandomStream | None = None,
    op: str = "dropout",
    starts: Sequence[int] | None = None,
    full_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``F.dropout`` with a counter-based mask: element ``i`` of the whole tensor (``full_shape``;
    this tensor is its slice starting at ``starts``) is kept or dropped as a function of the
    stream's seed and step, ``op`` and ``i`` alone. ``p == 0``, ``training=False`` or a stream in
    eval mode give ``input`` itself."""
    stream = stream if stream is not None else RandomStream()
    if p == 0 or not training or not stream.drops:
        return input
    if p >= 1:
        return input * 0.0
    full = tuple(input.shape) if full_shape is None else tuple(full_shape)
    starts = (0,) * input.dim() if starts is None else tuple(starts)
    starts, full = stream.locate(op, starts, full)  # a pipeline's micro-batch: its rows of the batch's draw
    return input * _mask_scale(stream, op, p, tuple(input.shape), starts, full, input.device, input.dtype)


def stochastic_depth(
    input: torch.Tensor,
    p: float,
    mode: str,
    training: bool = True,
    *,
    stream: RandomStream | None = None,
    op: str = "stochastic_depth",
    starts: Sequence[int] | None = None,
    full_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``torchvision.ops.stochastic_depth`` with a counter-based draw: mode ``"row"`` keeps sample
    ``i`` of the whole batch (dim 0 of ``full_shape``; this tensor is the slice starting at
    ``starts``) as a function of the stream's seed and step, ``op`` and ``i`` alone, and scales it
    by ``1 / (1 - p)``; mode ``"batch"`` keeps or drops the whole tensor with one draw. So every
    rank holding a slice along any dim draws the same decision for the same sample. ``p == 0``,
    ``training=False`` or a stream in eval mode give ``input``; ``p == 1`` gives zeros."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ("batch", "row"):
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    return _drop_samples(input, p, mode == "row", True, training, stream, op, starts, full_shape)


def drop_path(
    x: torch.Tensor,
    drop_prob: float = 0.0,
    training: bool = False,
    scale_by_keep: bool = True,
    *,
    stream: RandomStream | None = None,
    op: str = "drop_path",
    starts: Sequence[int] | None = None,
    full_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """timm's ``drop_path`` (``timm.layers.drop``) with :func:`stochastic_depth`'s per-sample
    counter-based draw (mode ``"row"``); kept samples are scaled by ``1 / (1 - drop_prob)`` only
    when ``scale_by_keep``, as timm does."""
    return _drop_samples(x, drop_prob, True, scale_by_keep, training, stream, op, starts, full_shape)


def _drop_samples(
    input: torch.Tensor,
    p: float,
    per_row: bool,
    scale: bool,
    training: bool,
    stream: RandomStream | None,
    op: str,
    starts: Sequence[int] | None,
    full_shape: Sequence[int] | None,
) -> torch.Tensor:
    """``input`` times a keep mask drawn per sample along dim 0 (``per_row``) or once: the draw of
    sample ``i`` is element ``i`` of :func:`keep_mask` over the batch, global index ``i``."""
    stream = stream if stream is not None else RandomStream()
    if p == 0 or not training or not stream.drops:
        return input
    if p >= 1:
        return input * 0.0
    if per_row and input.dim() > 0:
        full = tuple(input.shape) if full_shape is None else tuple(full_shape)
        start = 0 if starts is None else int(starts[0])
        shape = (input.shape[0],)
        first, whole = stream.locate(op, (start,), (full[0],))  # a micro-batch's samples (dim 0)
    else:
        shape, first, whole = (1,), (0,), (1,)
    noise = _mask_scale(stream, op, p, shape, first, whole, input.device, input.dtype)
    if not scale:
        noise = (noise != 0).to(input.dtype)
    return input * noise.view(*shape, *([1] * (input.dim() - 1))) if input.dim() else input * noise[0]


def eager_under_compile(fn: Callable) -> Callable:
    """``torch.compiler.disable(fn)``, applied on the first call made while ``torch._dynamo`` is
    loaded: decorating at import would import dynamo (and inductor), about 1 s of every cold start.
    Without dynamo loaded nothing can be compiling, so ``fn`` runs as is."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return inner


@eager_under_compile  # eager under torch.compile: int64 wrap-around must not be constant-folded
def _mask_scale(
    stream: RandomStream, op: str, p: float, shape: tuple, starts: tuple, full: tuple, device: Any, dtype: Any
) -> torch.Tensor:
    """``keep / (1 - p)`` as ``dtype``: what the input is multiplied by."""
    with torch.no_grad():
        keep = keep_mask(stream.key(op), p, shape, starts, full, device)
        return keep.to(dtype) * (1.0 / (1.0 - p))


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    stream: RandomStream | None = None,
    op: str = "scaled_dot_product_attention",
    starts: Sequence[int] | None = None,
    full_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` whose attention dropout is :func:`dropout` on the
    probabilities ``[..., Tq, Tk]`` (global shape ``full_shape``, this rank's slice at ``starts``):
    explicit attention when it drops, the fused kernel (without dropout) when it does not."""
    stream = stream if stream is not None else RandomStream()
    if dropout_p == 0 or not stream.drops:
        kw = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale=scale, **kw)
    lq, lk = query.shape[-2], key.shape[-2]
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        rep = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * factor
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = dropout(scores.softmax(-1), dropout_p, True, stream=stream, op=op, starts=starts, full_shape=full_shape)
    return probs @ value
