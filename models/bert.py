"""BERT-style encoder with a masked-LM style loss; optional MoE every other layer (HAP's BERT-MoE).

Sizes. ``bert("base")`` has 132.1M parameters: BERT-Base's 12 x 768 encoder (85.1M), 30522 x 768
token and 128 x 768 position embeddings, and an *untied* 768 -> 30522 output layer (23.5M). HAP's
Table 1 lists 102 (x 2**20 = 107M): BERT with the output layer tied to the embeddings has 108.6M
= 103.6 * 2**20, the closest standard reading. The flops are the same either way; the untied layer
adds 23.5M replicated gradients, so our data-parallel baselines carry more gradient traffic than
HAP's. BERT-MoE (``experts=E``): 6 of the 12 feed-forwards become E biasless experts of 4.7M each
plus a 768 x E gate; HAP scales E with the device count (one expert per GPU, §7.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Block, build, tokens


@dataclass(frozen=True)
class BertConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int = 30522
    seq: int = 128
    ffn_mult: int = 4


CONFIGS = {
    "tiny": BertConfig(layers=2, hidden=32, heads=4, vocab=101, seq=16),
    "block": BertConfig(layers=1, hidden=32, heads=4, vocab=101, seq=16),
    "base": BertConfig(layers=12, hidden=768, heads=12),
    "large": BertConfig(layers=24, hidden=1024, heads=16),
}


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig, layers: int | None = None, experts: int = 0, capacity: int | None = None):
        super().__init__()
        n = cfg.layers if layers is None else layers
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.ln_in = nn.LayerNorm(cfg.hidden)
        ffn = cfg.ffn_mult * cfg.hidden
        self.blocks = nn.ModuleList(
            Block(
                cfg.hidden,
                cfg.heads,
                ffn,
                causal=False,
                experts=experts if (experts and i % 2 == 1) else 0,
                capacity=capacity,
            )
            for i in range(n)
        )
        self.ln = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.ln_in(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(b * t, -1), targets.view(b * t))


def bert(
    size: str = "tiny",
    batch: int = 4,
    seq: int | None = None,
    layers: int | None = None,
    experts: int = 0,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    capacity: int | None = None,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A BERT encoder of a named size; ``experts`` > 0 gives BERT-MoE: GShard top-2 routing in every
    other layer (the 2nd, 4th...), any number of experts; ``capacity`` fixes each expert's token
    slots (default: GShard's ``ceil(1.25 * tokens * 2 / experts)``)."""
    cfg = CONFIGS[size]
    seq = seq or cfg.seq
    model = build(lambda: Bert(cfg, layers, experts, capacity), device, dtype, seed)
    return model, (tokens((batch, seq), cfg.vocab, device, seed), tokens((batch, seq), cfg.vocab, device, seed + 7))


def moe_block(
    batch: int = 4, experts: int = 3, device: str | None = None, dtype: torch.dtype = torch.float32, seed: int = 0
):
    """One encoder block whose feed-forward is a 3-expert MoE (an expert count no device count divides)."""
    cfg = CONFIGS["block"]
    model = build(lambda: Bert(cfg, layers=2, experts=experts), device, dtype, seed)
    return model, (
        tokens((batch, cfg.seq), cfg.vocab, device, seed),
        tokens((batch, cfg.seq), cfg.vocab, device, seed + 7),
    )
