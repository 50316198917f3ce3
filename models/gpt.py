"""GPT decoder (GPT-3 family shapes, as used by Metis and HARP) with a causal LM loss.

Parameters: ``12 L h^2 + 13 L h`` in the blocks plus embeddings (vocab 50304, 2048 positions) and
an untied output layer, so each size is GPT-3's count (Brown et al. 2020, Table 2.1, tied head)
plus ``50304 h``: "1.3b" has 1.42B, "2.7b" 2.78B, "6.7b" 6.86B, "13b" 13.1B, "39b" 39.5B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Block, build, tokens


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int = 50304
    seq: int = 2048
    ffn_mult: int = 4


#: GPT-3 paper (Brown et al. 2020, Table 2.1) sizes; "39b" is HARP's largest (48 x 8192).
CONFIGS = {
    "tiny": GPTConfig(layers=2, hidden=32, heads=4, vocab=97, seq=16),
    "small": GPTConfig(layers=4, hidden=64, heads=4, vocab=256, seq=32),
    "125m": GPTConfig(layers=12, hidden=768, heads=12),
    "350m": GPTConfig(layers=24, hidden=1024, heads=16),
    "1.3b": GPTConfig(layers=24, hidden=2048, heads=16),
    "2.7b": GPTConfig(layers=32, hidden=2560, heads=32),
    "6.7b": GPTConfig(layers=32, hidden=4096, heads=32),
    "13b": GPTConfig(layers=40, hidden=5120, heads=40),
    "39b": GPTConfig(layers=48, hidden=8192, heads=64),
}


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, layers: int | None = None):
        super().__init__()
        n = cfg.layers if layers is None else layers
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.heads, cfg.ffn_mult * cfg.hidden, causal=True) for _ in range(n)
        )
        self.ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(b * t, -1), targets.view(b * t))


def gpt(
    size: str = "tiny",
    batch: int = 4,
    seq: int | None = None,
    layers: int | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A GPT of a named size with ``(tokens, targets)`` example inputs.

    ``device="meta"`` builds it without memory (for tracing paper-size models).
    """
    cfg = CONFIGS[size]
    seq = seq or cfg.seq
    model = build(lambda: GPT(cfg, layers), device, dtype, seed)
    idx = tokens((batch, seq), cfg.vocab, device, seed)
    targets = tokens((batch, seq), cfg.vocab, device, seed + 7)
    return model, (idx, targets)
