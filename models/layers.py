"""Building blocks of the zoo models: attention, MLP, a GShard-style MoE feed-forward, blocks.

Plain PyTorch, written the way people write these layers; nothing here knows about hapc except
that the MoE layer routes tokens with ``hapc.ops.moe_dispatch`` / ``moe_combine`` (single-device
semantics, GShard capacity and priority) so the theory can shard experts unevenly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

import hapc.ops


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (what Megatron shards by heads)."""

    def __init__(self, hidden: int, heads: int, causal: bool):
        super().__init__()
        assert hidden % heads == 0, "hidden must be a multiple of heads"
        self.heads, self.causal = heads, causal
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        d = h // self.heads
        q = self.q(x).view(b, t, self.heads, d).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, d).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Top-2 mixture of experts with a fixed capacity (GShard). Any number of experts.

    Each expert takes ``capacity = ceil(capacity_factor * tokens * k / experts)`` token slots, unless
    ``capacity`` fixes it (the padded expert-parallel baseline keeps the real model's per-expert
    capacity while adding dummy experts).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        capacity_factor: float = 1.25,
        k: int = 2,
        capacity: int | None = None,
    ):
        super().__init__()
        self.experts, self.k, self.capacity_factor, self.fixed_capacity = experts, k, capacity_factor, capacity
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(hidden))
        self.w_down = nn.Parameter(torch.randn(experts, ffn, hidden) / math.sqrt(ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)
        probs = self.gate(tokens).softmax(-1)
        weights, idx = probs.topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        capacity = self.fixed_capacity or max(1, math.ceil(self.capacity_factor * b * t * self.k / self.experts))
        buf = hapc.ops.moe_dispatch(tokens, idx, self.experts, capacity)  # [E, C, H]
        hid = F.gelu(torch.einsum("ech,ehf->ecf", buf, self.w_up))
        out = torch.einsum("ecf,efh->ech", hid, self.w_down)
        return hapc.ops.moe_combine(out, idx, weights, capacity).view(b, t, h)


class Block(nn.Module):
    """Pre-norm transformer block; ``experts`` > 0 makes the feed-forward a mixture of experts."""

    def __init__(self, hidden: int, heads: int, ffn: int, causal: bool, experts: int = 0, capacity: int | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, causal)
        self.ln2 = nn.LayerNorm(hidden)
        self.ffn = MoE(hidden, ffn, experts, capacity=capacity) if experts else MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


#: ``torch.nn.init`` fills skipped while a model is built on the meta device (see :func:`_no_fill`)
FILLS = ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
         "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def _no_fill() -> Iterator[None]:
    """``torch.nn.init``'s fills as no-ops: a meta tensor holds no values, so filling one only costs.
    It costs a lot once: the meta kernel of ``normal_`` (an embedding's init) is a Python reference
    whose first call imports ``torch._dynamo`` and ``torch._inductor`` (1.5 s of building GPT-39B
    for ``benchmarks/planner_speed.py`` and ``hapc synth gpt-39b``; 0.4 s after this)."""
    saved = {name: getattr(nn.init, name) for name in FILLS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build(factory, device: str | torch.device | None, dtype: torch.dtype, seed: int) -> nn.Module:
    """Construct a model, on the meta device when asked (no memory, no initial values), else seeded
    on the CPU."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"), _no_fill():
            return factory().to(dtype)
    torch.manual_seed(seed)
    return factory().to(dtype=dtype, device=device)


def tokens(shape: tuple[int, ...], vocab: int, device, seed: int) -> torch.Tensor:
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(shape, dtype=torch.int64, device="meta")
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab, shape, generator=g).to(device)
