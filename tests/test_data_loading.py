"""Data as DDP users load it (issue 13): ``DistributedSampler`` shares under an uneven plan.

Each rank iterates its own ``DistributedSampler`` (``batch / world`` rows per step, strided
indices); the plan's ratios are uneven, so the module all-gathers the shares into the global batch
and splits it by its ratios. Losses and weights after every step equal single-device training on
the union of the ranks' rows (float64).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hapc
from hapc import models
from hapc.testing import run_distributed

ROWS, PER_RANK, STEPS = 36, 2, 3


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(ROWS, 24, generator=g, dtype=torch.float64), torch.randint(0, 10, (ROWS,), generator=g)
    )


def _job(rank: int, world: int, cluster: str) -> dict:
    model, example = models.load("mlp", batch=PER_RANK * world, dtype=torch.float64)
    module = hapc.compile(model, cluster, example)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=PER_RANK, sampler=DistributedSampler(_data(), world, rank, shuffle=False))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = module(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": module.full_state_dict(), "ratios": module.plan.device_ratios}


def _reference(world: int) -> dict:
    model, _ = models.load("mlp", batch=PER_RANK * world, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    shares = [list(DistributedSampler(data, world, r, shuffle=False)) for r in range(world)]
    losses = []
    for step in range(STEPS):
        rows = [i for r in range(world) for i in shares[r][step * PER_RANK : (step + 1) * PER_RANK]]
        x, y = data[rows]
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": model.state_dict()}


def test_distributed_sampler_shares_under_an_uneven_plan():
    world = 3
    ref = _reference(world)
    results = run_distributed(_job, world, "local-cpu:3")
    assert len(set(results[0]["ratios"])) > 1  # the plan's shares are not the sampler's
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-12)
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-10, atol=1e-12)
