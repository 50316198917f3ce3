"""Synchronised batch norm computes the whole batch's variance as one device does (two passes).

Batch norm's statistics in training span the whole batch, so a plan that shards the batch
all-reduces them (``hapc.collectives.sync_batch_norm``). The variance must not come from one
all-reduce of ``sum x`` and ``sum x^2`` (``var = E[x^2] - mean^2``): where ``|mean| >> std`` the
two terms cancel. Activations of mean 10 and std 0.1 in float32 lost three digits of the
normalised output that way (2.2e-3 off, one device 7.6e-6) and mean 1000 gave NaN; in float64 a
mean of 1000 was 3.5e-8 off. Here the output and every gradient are compared with the float64
single-device batch norm: within a few times one device's own float32 error, and to 1e-9 through
``hapc.compile`` in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hapc
import hapc.collectives as C
from hapc.testing import run_distributed
from hapc.theory.instructions import Compute

MEAN, STD = 10.0, 0.1  # |mean| / std = 100: a shifted activation, not an extreme one


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, 3, 4, 4, generator=g, dtype=torch.float64) * STD + MEAN
    w = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(3, generator=g, dtype=torch.float64)
    c = torch.randn(10, 3, 4, 4, generator=g, dtype=torch.float64)  # the output's gradient
    return x, w, b, c


def _batch_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Output, x-gradient and weight-gradient of F.batch_norm (training) on one device."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    (y * c).sum().backward()
    return y.detach(), x.grad, w.grad


def _job(rank: int, world: int, sizes: list[int], dtype: torch.dtype) -> tuple[float, float, float]:
    x, w, b, c = _data()
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    xs = x[lo:hi].to(dtype).requires_grad_()
    ws = w.to(dtype).requires_grad_()
    y = C.sync_batch_norm(xs, None, None, ws, b.to(dtype), True, 0.1, 1e-5)
    (y * c[lo:hi].to(dtype)).sum().backward()
    want_y, want_x, want_w = _batch_norm(x, w, b, c)
    w_grad = C.all_reduce(ws.grad.clone())  # Partial: summed over ranks
    return (
        float((y.double() - want_y[lo:hi]).abs().max()),
        float((xs.grad.double() - want_x[lo:hi]).abs().max() / want_x.abs().max()),
        float((w_grad.double() - want_w).abs().max() / want_w.abs().max()),
    )


def test_float32_shards_of_a_shifted_batch_keep_one_devices_accuracy() -> None:
    """Uneven shards on 2 and 3 ranks, float32: output and gradients as accurate as one device's
    float32 batch norm (within 4x its error; here one device's output is 8.0e-6 off), where the
    one-pass variance put the output 1.5e-3 off."""
    x, w, b, c = _data()
    one = _batch_norm(x.float(), w.float(), b.float(), c.float())
    exact = _batch_norm(x, w, b, c)
    # one device's float32 error: the output's absolute, the gradients' relative to their largest
    own = [float((o.double() - e).abs().max() / (e.abs().max() if i else 1)) for i, (o, e) in
           enumerate(zip(one, exact))]  # fmt: skip
    assert own[0] < 2e-5, own  # one device's own float32 error: the bound below is relative to it
    for sizes in ([6, 4], [5, 2, 3]):
        for rank_errs in run_distributed(_job, len(sizes), sizes, torch.float32):
            for got, base in zip(rank_errs, own):
                assert got <= 4 * base + 1e-6, (sizes, rank_errs, own)


class _ShiftedConvNet(nn.Module):
    """A convolution whose output has mean ~10 and std ~0.1 per channel (a constant bias shift),
    batch-normalised in training, then a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 8 * 8, 5)
        with torch.no_grad():
            self.conv.weight.mul_(0.05)
            self.conv.bias.fill_(1000.0)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.bn(self.conv(x)).flatten(1)), y)


def _model_job(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _ShiftedConvNet().double()
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 5
    module = hapc.compile(model, f"local-cpu:{world}", (x, y), baseline="dp-ev")  # the batch shards
    keys = [i.strategy_key for i in module.plan.instructions if isinstance(i, Compute)]
    assert any(k.startswith("sync-batch") for k in keys), f"batch norm not synchronised: {keys}"
    module(x, y).backward()
    return module.full_gradients()


def test_compiled_model_with_a_shifted_batch_norm_input_matches_one_device() -> None:
    """float64, 2 ranks, batch sharded: every gradient within 1e-9 of the largest (the one-pass
    variance put them 1.7e-6 off, 1.4e-7 of the largest, at a channel mean of about 1000)."""
    torch.manual_seed(0)
    model = _ShiftedConvNet().double()
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 5
    model(x, y).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    scale = max(float(g.abs().max()) for g in want.values())
    for got in run_distributed(_model_job, 2):
        for k, g in want.items():
            assert float((got[k] - g).abs().max()) <= 1e-9 * scale, k
