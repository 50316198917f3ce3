"""Models prepared for PyTorch's own data parallelism, as users bring them: ``SyncBatchNorm``
(``convert_sync_batchnorm``) trains as batch norm over the global batch -- what it computes over
all ranks, and what one device computes -- and a model still wrapped in ``DistributedDataParallel``
or ``fully_shard`` is refused, naming the fix. Real gloo ranks, float64, uneven ratios."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close, sgd_steps
from torch import nn

import hapc
from hapc.errors import HapcError
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTERS = {2: cluster_of([5e9, 3e9]), 3: cluster_of([5e9, 3e9, 2e9])}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x, y):
        h = torch.relu(self.bn(self.conv(x)))
        return nn.functional.cross_entropy(self.fc(h.flatten(1)), y)


def _net():
    torch.manual_seed(0)
    model = Net().to(F64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, 3, 6, 6, generator=g, dtype=F64) * 3 + 5  # odd batch, a mean far from 0
    return model, (x, torch.randint(0, 10, (13,), generator=g))


def _steps(module, inputs):
    return sgd_steps(module, inputs, steps=2, lr=0.1, momentum=0.9)


def _sync_bn(rank, world):
    model, inputs = _net()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    m = hapc.compile(model, CLUSTERS[world], inputs)
    return _steps(m, inputs), m.full_state_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_sync_batch_norm_is_batch_norm_over_the_global_batch(world):
    model, inputs = _net()
    want = _steps(model, inputs)  # plain batch norm on one device: SyncBatchNorm's meaning
    for losses, state in run_distributed(_sync_bn, world):
        assert losses == pytest.approx(want, rel=1e-12)
        assert_close(state, model.state_dict(), F64, "state (running statistics included)")


def test_sync_batch_norm_over_a_subgroup_is_refused():
    model, inputs = _net()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.bn.process_group = "a subgroup"  # any group: statistics over part of the batch
    with pytest.raises(HapcError, match="SyncBatchNorm with a process_group"):
        hapc.trace(model, inputs)


def _wrapped(rank, world, how):
    model, inputs = _net()
    if how == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.fc)
        fully_shard(model)
    try:
        hapc.compile(model, cluster_of([5e9]), inputs)
    except HapcError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_a_model_wrapped_for_ddp_or_fsdp_is_refused(how):
    (msg,) = run_distributed(_wrapped, 1, how)
    assert msg is not None and "takes the model itself" in msg and "model.module" in msg
