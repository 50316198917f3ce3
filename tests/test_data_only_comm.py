"""A collective on a value of the inputs alone costs nothing and opens no stage.

A mean loss divides by its token count, a sum over the batch's targets: with the batch sharded,
each rank holds a partial count, and the program all-reduces it. The runtime never waits for that
all-reduce: given the whole batch, every rank computes the sum itself (the ``*_global`` argument,
:meth:`CompiledModule._whole_batch_values`); given its share, the all-reduce starts at the top of
the program and runs behind the forward (``RankProgram._hoist_data_only``). The theory prices it
so -- no time, no stage cut (HAP Fig. 6) -- in every program, the DP baselines included, whose
predicted times otherwise carried a collective their runs never pay (issue 15, hetero_speedup).
An all-reduce of anything a parameter flows into keeps its alpha-beta price.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapc
from hapc import models
from hapc.testing import cluster_of
from hapc.theory.cost import CostProfile
from hapc.theory.graph import PARAM
from hapc.theory.instructions import Collective


def _all_reduces(theory):
    graph = theory.graph
    for t in theory.triples:
        for ins in t.instrs:
            if isinstance(ins, Collective) and ins.op == "all_reduce":
                kinds = {graph[i].kind for i in graph.ancestors(ins.ref)} | {graph[ins.ref].kind}
                yield t, PARAM not in kinds


def test_the_token_count_all_reduce_is_free_and_a_parameters_is_not():
    model, inputs = models.load("mlp", batch=12)
    plan = hapc.synthesize(model, cluster_of([5e9, 3e9, 2e9]), inputs)
    found = list(_all_reduces(plan._theory))
    free = [t for t, param_free in found if param_free]
    priced = [t for t, param_free in found if not param_free]
    assert free and priced  # the mean's count, and the partial sums of sharded matmuls
    assert all(t.cost == CostProfile() for t in free)
    assert all(t.cost.fwd_comm for t in priced)


class CountsHits(nn.Module):
    """Counts the rows whose largest output is at column 0 -- an integer, so without gradient, but
    a parameter flows into it: its all-reduce waits for the forward that computes it, priced."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        hits = (h.argmax(-1) == 0).sum()
        return ((h - y) ** 2).mean() * (1 + hits)


def test_a_no_grad_value_a_parameter_flows_into_keeps_its_price():
    inputs = (torch.randn(12, 8), torch.randn(12, 8))
    plan = hapc.synthesize(CountsHits(), cluster_of([5e9, 3e9, 2e9]), inputs, baseline="dp-cp")
    graph = plan._theory.graph
    hits = [t for t, _ in _all_reduces(plan._theory) if graph[t.instrs[-1].ref].name == "sum_1"]
    assert hits and not graph[hits[0].instrs[-1].ref].requires_grad
    assert all(t.cost.fwd_comm for t in hits)
    assert any(s.comm > 0 for s in plan.stages if s.direction == "forward")  # the DP program waits for it


@pytest.mark.parametrize("baseline", ["dp-ev", "dp-cp"])
def test_data_parallel_baselines_pay_only_the_gradient_sync(baseline):
    # a data-parallel program of an MLP communicates nothing in forward or backward: its time is the
    # slowest rank's compute plus the gradient all-reduce, whatever the loss's count needs
    model, inputs = models.load("mlp", batch=12)
    plan = hapc.synthesize(model, cluster_of([5e9, 3e9, 2e9]), inputs, baseline=baseline)
    steps = [s for s in plan.stages if s.direction in ("forward", "backward")]
    assert steps and all(s.comm == 0 for s in steps), steps
    assert any(s.comm > 0 for s in plan.stages if s.direction == "gradients")
