"""full_state_dict is the single-device state, shard for shard, under uneven ratios (issue 16).

The checkpoint round trip (tests/test_runtime.py) compares a checkpoint with its own reload, so a
gather and a slice that agree on a wrong order pass it. Here the state gathered from 3 gloo ranks
under an uneven tensor-parallel plan is compared with the plain model's: before training (the
weights), after two Adam steps (weights and moments, against single-device Adam), and after
loading a state unlike any the plan produced (every value distinct, so a misplaced shard shows).
"""

from __future__ import annotations

import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
SLOW3 = cluster_of([5e9, 3e9, 2e9], bandwidth="10 MB/s")


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2, eps=1e-6)


def _job(rank, world, plan, distinct):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, SLOW3, inputs, plan=plan)
    initial = m.full_state_dict()
    opt = _adam(m.parameters())
    for _ in range(2):
        opt.zero_grad()
        m(*inputs).backward()
        opt.step()
    trained = m.full_state_dict(opt)
    m.load_full_state_dict(distinct)
    return initial, trained, m.full_state_dict()


def test_full_state_dict_equals_single_device_state_for_uneven_shards():
    model, inputs = models.load("gpt", dtype=F64)
    plan = hapc.synthesize(model, SLOW3, inputs)
    theory = hapc.derive(hapc.trace(model, inputs))
    uneven = []
    for n in theory.graph.params:
        for lay in plan.layout_of(n.index):
            if lay.startswith("S(") and len(set(theory.local_sizes(n.index, int(lay[2:-1]), plan.device_ratios))) > 1:
                uneven.append(n.target)
                break
    assert uneven, "the plan must shard some parameter unevenly for this test to mean anything"

    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    distinct = {k: torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) / 7 + 1 for k, v in plain.items()}
    results = run_distributed(_job, 3, plan, distinct)

    opt = _adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(*inputs).backward()
        opt.step()
    want = hapc.checkpoint.full_state(model, opt)
    for rank, (initial, trained, loaded) in enumerate(results):
        for k in uneven:
            assert torch.equal(initial[k], plain[k]), f"rank {rank}: {k} gathered in the wrong order"
        assert_close(initial, plain, F64, f"rank {rank} initial state")
        assert_close(trained, want, F64, f"rank {rank} state after two Adam steps")
        for k, v in distinct.items():
            assert torch.equal(loaded[k], v), f"rank {rank}: {k} not sliced and gathered back exactly"
