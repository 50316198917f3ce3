"""VGG (Simonyan & Zisserman 2014) for 32x32 CIFAR-10 images, as in HAP's evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import build

#: channel counts per conv, "M" = 2x2 max-pool
CONFIGS = {
    "tiny": [8, "M", 16, "M"],
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
HIDDEN = {"tiny": 32, "vgg11": 4096, "vgg19": 4096}


class VGG(nn.Module):
    def __init__(self, cfg: list, hidden: int, classes: int = 10, image: int = 32, batch_norm: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        channels, size = 3, image
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                size //= 2
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1)]
                layers += [nn.BatchNorm2d(v)] if batch_norm else []
                layers += [nn.ReLU()]
                channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * size * size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.features(x)), y)


def vgg(
    size: str = "tiny",
    batch: int = 8,
    image: int = 32,
    batch_norm: bool = False,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = build(lambda: VGG(CONFIGS[size], HIDDEN[size], image=image, batch_norm=batch_norm), device, dtype, seed)
    if device is not None and torch.device(device).type == "meta":
        return model, (
            torch.empty(batch, 3, image, image, device="meta", dtype=dtype),
            torch.empty(batch, dtype=torch.int64, device="meta"),
        )
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, image, image, generator=g).to(dtype=dtype, device=device)
    return model, (x, torch.randint(0, 10, (batch,), generator=g).to(device))
