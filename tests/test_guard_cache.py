"""The original model's guard (:mod:`hapc.codegen.original`) remembers what it walked at every
forward of the module -- the model's module tree, and that the module has trained past the model --
and must still refuse exactly what it refused when it walked everything each time: a part of the
model switched alone after the tree changed, and a model changed after ``unwrap()`` while the
module has not moved since."""

from __future__ import annotations

import copy

import pytest
import torch

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTER = cluster_of([3e9, 1e9])


def _refusal(call) -> str:
    with pytest.raises(hapc.HapcError) as err:
        call()
    return str(err.value)


def _guard_job(rank: int, world: int) -> dict[str, str]:
    model, inputs = models.load("gpt", dtype=F64)
    module = hapc.compile(model, CLUSTER, inputs)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    out = {}
    for _ in range(2):  # trained: the guard has seen the module move and remembers the model's tree
        opt.zero_grad()
        module(*inputs).backward()
        opt.step()
    # a submodule replaced after compile, then switched alone: the remembered tree is out of date
    model.blocks[0].attn = copy.deepcopy(model.blocks[0].attn)
    model.blocks[0].attn.eval()
    out["switched"] = _refusal(lambda: module(*inputs))
    model.blocks[0].attn.train()
    module(*inputs)  # the whole model in one mode again: fine
    # in sync after unwrap(): the module has not moved since, so weights loaded into the model would
    # be trained past without being seen -- refused, as right after compile
    module.unwrap()
    with torch.no_grad():
        model.head.weight.mul_(0.5)
    out["changed"] = _refusal(lambda: module(*inputs))
    return out


def test_guard_refuses_after_the_tree_changes_and_after_unwrap():
    for out in run_distributed(_guard_job, 2):
        assert "switched to another train/eval mode on its own (blocks.0.attn" in out["switched"], out["switched"]
        assert "changed after compile" in out["changed"], out["changed"]
