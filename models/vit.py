"""Vision Transformer (Dosovitskiy et al. 2020) for 32x32 CIFAR-10 images, as in HAP's evaluation.

HAP's ViT (Table 1: 54 x 2**20 parameters; the layer count is not given) is ``vit("base", layers=8)``:
768 wide, 12 heads, 4x4 patches (65 tokens), 7.09M per layer, 56.8M = 54.2 * 2**20 in all
(zoo alias ``vit-hap``). HAP's Fig. 19 varies the layer count; so does ``layers``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Block, build

CONFIGS = {
    "tiny": {"hidden": 32, "heads": 4, "patch": 8},
    "base": {"hidden": 768, "heads": 12, "patch": 4},
}


class ViT(nn.Module):
    def __init__(self, hidden: int, heads: int, layers: int, patch: int, image: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, hidden, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos = nn.Parameter(torch.zeros(1, tokens, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads, 4 * hidden, causal=False) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln(x[:, 0])), labels)


def vit(
    size: str = "tiny",
    layers: int = 2,
    batch: int = 8,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    cfg = CONFIGS[size]
    model = build(lambda: ViT(cfg["hidden"], cfg["heads"], layers, cfg["patch"]), device, dtype, seed)
    if device is not None and torch.device(device).type == "meta":
        return model, (
            torch.empty(batch, 3, 32, 32, device="meta", dtype=dtype),
            torch.empty(batch, dtype=torch.int64, device="meta"),
        )
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(dtype=dtype, device=device)
    return model, (x, torch.randint(0, 10, (batch,), generator=g).to(device))
