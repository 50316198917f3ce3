"""VGG (Simonyan & Zisserman 2014) on 32x32 CIFAR-10 images, as in HAP's evaluation (§7.1, Table 1).

Parameter count. HAP's Table 1 lists VGG19 at 133 "million" parameters. A VGG19 whose classifier
reads the 1x1x512 feature map of a 32x32 image has 39.0M (20.0M conv + 2.1M + 16.8M + 41k). HAP's
number is torchvision's VGG19 with 10 classes: its ``AdaptiveAvgPool2d((7, 7))`` stretches the 1x1
map to 7x7 (49 copies of each channel), so the first classifier layer is 25088 x 4096 (102.8M) and
the model has 139.6M parameters = 133.1 * 2**20 -- HAP counts in units of 2**20. ``pool=7`` (the
default for the paper sizes) builds exactly that model; ``pool=None`` the plain 39M CIFAR variant.

``small`` is VGG19 at a quarter of its width: every conv's channels / 4 (16 ... 128) and the
classifier's hidden width / 4 (1024), with the same 7x7 pool. Each weight matrix then has 1/16 of
VGG19's entries, so the parameters split as VGG19's do: 8,736,282 in all, 1,252,880 (14.3 %) in the
convolutions and 6,423,552 (73.5 %; VGG19 73.6 %) in the first classifier layer, 6272 x 1024. It is
the benchmarks' VGG-like case (``benchmarks/hetero_speedup.py``, batch 32 of 32x32 images): a CPU
step of tens of milliseconds for which hapc shards the first classifier layers, as HAP does VGG19's:
their gradient all-reduce costs more than the activation collectives that sharding needs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import build

#: channel counts per conv, "M" = 2x2 max-pool
CONFIGS = {
    "tiny": [8, "M", 16, "M"],
    "small": [16, 16, "M", 32, 32, "M", 64, 64, 64, 64, "M", 128, 128, 128, 128, "M", 128, 128, 128, 128, "M"],
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}
HIDDEN = {"tiny": 32, "small": 1024, "vgg11": 4096, "vgg19": 4096}
#: torchvision's adaptive average pool before the classifier (HAP's VGG19); None: none
POOL = {"tiny": None, "small": 7, "vgg11": 7, "vgg19": 7}
_DEFAULT = object()


class VGG(nn.Module):
    def __init__(
        self,
        cfg: list,
        hidden: int,
        classes: int = 10,
        image: int = 32,
        batch_norm: bool = False,
        pool: int | None = None,
    ):
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
        self.pool = nn.AdaptiveAvgPool2d(pool) if pool else nn.Identity()
        size = pool or size
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * size * size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.classifier(self.pool(self.features(x))), y)


def vgg(
    size: str = "tiny",
    batch: int = 8,
    image: int = 32,
    batch_norm: bool = False,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pool: int | None = _DEFAULT,  # type: ignore[assignment]
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A VGG of a named size; ``pool`` (default: 7 for small/vgg11/vgg19, none for tiny) is the side of
    torchvision's adaptive average pool before the classifier (see the module docstring)."""
    pool = POOL[size] if pool is _DEFAULT else pool
    model = build(
        lambda: VGG(CONFIGS[size], HIDDEN[size], image=image, batch_norm=batch_norm, pool=pool), device, dtype, seed
    )
    if device is not None and torch.device(device).type == "meta":
        return model, (
            torch.empty(batch, 3, image, image, device="meta", dtype=dtype),
            torch.empty(batch, dtype=torch.int64, device="meta"),
        )
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, image, image, generator=g).to(dtype=dtype, device=device)
    return model, (x, torch.randint(0, 10, (batch,), generator=g).to(device))
