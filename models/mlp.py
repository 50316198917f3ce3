"""A multi-layer perceptron classifier (the smallest model that still has sharding choices)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from .layers import build


class MLP(nn.Module):
    def __init__(self, widths: tuple[int, ...], classes: int):
        super().__init__()
        dims = list(widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.cross_entropy(self.head(x), y)


def mlp(
    batch: int = 16,
    widths: tuple[int, ...] = (24, 64, 48),
    classes: int = 10,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = build(lambda: MLP(widths, classes), device, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    if device is not None and torch.device(device).type == "meta":
        return model, (
            torch.empty(batch, widths[0], device="meta", dtype=dtype),
            torch.empty(batch, dtype=torch.int64, device="meta"),
        )
    x = torch.randn(batch, widths[0], generator=g).to(dtype=dtype, device=device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    return model, (x, y)
