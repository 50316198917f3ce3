"""Wide-ResNet as Metis (ATC'24, Table 2) and Alpa benchmark it: ResNet-50 bottlenecks on 224x224
images, 1000 classes, with a base channel count ``C`` and a width factor ``W``.

Stage ``i`` (stride 2 from the second on) holds bottlenecks of ``f = C * 2**i`` filters::

    x -> conv1x1(cin -> f) -> BN -> ReLU -> conv3x3(f -> f*W, stride) -> BN -> ReLU
      -> conv1x1(f*W -> 4f) -> BN  (+ projection conv1x1(cin -> 4f, stride) + BN when shapes differ)
      -> ReLU(sum)

after a 7x7/2 stem of ``C`` channels and a 3x3/2 max-pool; global average pool, then one linear.
The width factor widens only the 3x3 convolution's output, which is why the parameter count grows
linearly in ``W`` and quadratically in ``C``: (C, W) = (320, 2), (448, 2), (640, 2), (320, 16) give
1.005B, 1.965B, 4.000B and 6.727B parameters -- Metis's 1B / 2B / 4B / 6.8B (Alpa's
``wresnet_specs`` use the same four pairs with 50 layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import build


@dataclass(frozen=True)
class WideResNetConfig:
    channels: int  # C
    width: int  # W
    stages: tuple[int, ...] = (3, 4, 6, 3)  # ResNet-50
    image: int = 224
    classes: int = 1000


CONFIGS = {
    "tiny": WideResNetConfig(channels=4, width=2, stages=(1, 1), image=16, classes=10),
    "1b": WideResNetConfig(channels=320, width=2),
    "2b": WideResNetConfig(channels=448, width=2),
    "4b": WideResNetConfig(channels=640, width=2),
    "6.8b": WideResNetConfig(channels=320, width=16),
}


class Bottleneck(nn.Module):
    def __init__(self, cin: int, filters: int, width: int, stride: int):
        super().__init__()
        out = 4 * filters
        self.conv1 = nn.Conv2d(cin, filters, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(filters)
        self.conv2 = nn.Conv2d(filters, filters * width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(filters * width)
        self.conv3 = nn.Conv2d(filters * width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.proj = None
        if cin != out or stride != 1:
            self.proj = nn.Sequential(nn.Conv2d(cin, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.proj(x) if self.proj is not None else x))


class WideResNet(nn.Module):
    def __init__(self, cfg: WideResNetConfig):
        super().__init__()
        c = cfg.channels
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks, cin = [], c
        for i, n in enumerate(cfg.stages):
            for j in range(n):
                blocks.append(Bottleneck(cin, c * 2**i, cfg.width, 2 if i > 0 and j == 0 else 1))
                cin = 4 * c * 2**i
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, cfg.classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(images))
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


def wide_resnet(
    size: str = "tiny",
    batch: int = 8,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A Wide-ResNet of a named size (``tiny``, ``1b``, ``2b``, ``4b``, ``6.8b``) with
    ``(images, labels)`` example inputs; ``device="meta"`` builds it without memory."""
    cfg = CONFIGS[size]
    model = build(lambda: WideResNet(cfg), device, dtype, seed)
    shape = (batch, 3, cfg.image, cfg.image)
    if device is not None and torch.device(device).type == "meta":
        return model, (
            torch.empty(shape, device="meta", dtype=dtype),
            torch.empty(batch, dtype=torch.int64, device="meta"),
        )
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    return model, (x, torch.randint(0, cfg.classes, (batch,), generator=g).to(device))
