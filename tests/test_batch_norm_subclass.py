"""A batch norm written out by a library (timm's ``BatchNormAct2d``: ``num_batches_tracked.add_(1)``
then ``F.batch_norm``) traces with fx and trains as one device, its counter and running statistics
included: the add is the runtime's own count (as for torch's ``BatchNorm2d`` and under
torch.export), not an in-place update of a buffer refused as unreplayable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, sgd_steps
from torch import nn

import hapc
from hapc.testing import run_distributed

F64 = torch.float64


class BatchNormAct(nn.BatchNorm2d):
    """timm's pattern: a BatchNorm2d subclass whose forward is batch norm then an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        stats = (self.running_mean, self.running_var)
        x = F.batch_norm(x, *stats, self.weight, self.bias, self.training, factor, self.eps)
        return F.relu(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = BatchNormAct(4)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.bn(self.conv(x)).mean((2, 3))), y)


def _build():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net().double(), (torch.randn(6, 3, 5, 5, generator=g, dtype=F64), torch.arange(6) % 5)


def _job(rank, world):
    model, batch = _build()
    module = hapc.compile(model, "local-cpu:2", batch, capture="fx")
    return sgd_steps(module, batch), module.full_state_dict()


def test_fx_traces_it_and_the_counter_is_not_an_op():
    model, batch = _build()
    graph = hapc.trace(model, batch, capture="fx")
    assert graph.capture == "fx"
    assert "add_" not in [n.op for n in graph] and "batch_norm" in [n.op for n in graph]


def test_it_trains_as_one_device_counter_and_running_stats_included():
    model, batch = _build()
    want = sgd_steps(model, batch)
    for losses, state in run_distributed(_job, 2):
        assert losses == [pytest.approx(v, rel=1e-12) for v in want]
        assert int(state["bn.num_batches_tracked"]) == 2
        assert_close(state, model.state_dict(), F64, "state after 2 steps")
