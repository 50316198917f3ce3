"""Freezing and name-based parameter groups (issue 13, no silent divergence): the compiled module's
``named_parameters()`` carry the model's names, so rules written for the model (no weight decay on
biases and norms, a learning rate for one block, freezing a block) select the same parameters;
parameters frozen before compile stay frozen, freezing and unfreezing the module's parameters later
is exact, and a flag changed on the model object after compile is refused. float64, 2 gloo
processes, default plan and a forced parameter-sharding plan."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTER = cluster_of([3e9, 1e9])
PLANS = {"default": {}, "tp": {"baseline": "tp", "ratios": [0.6, 0.4]}}


def _groups(named):
    """GPT-style groups by name: no decay on biases and LayerNorms, a smaller rate for block 0."""
    named = [(n, p) for n, p in named if p.requires_grad]
    plain = [p for n, p in named if not n.startswith("blocks.0.") and not n.endswith("bias") and ".ln" not in n]
    no_decay = [p for n, p in named if not n.startswith("blocks.0.") and (n.endswith("bias") or ".ln" in n)]
    block0 = [p for n, p in named if n.startswith("blocks.0.")]
    return [
        {"params": plain, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": block0, "lr": 2e-3, "weight_decay": 0.1},
    ]


def _set_block(named, block: str, on: bool) -> None:
    for n, p in named:
        if n.startswith(block):
            p.requires_grad_(on)


def _train(module, inputs, frozen_before: bool):
    """AdamW over name-based groups; block 1 frozen at step 1, unfrozen at step 3."""
    opt = torch.optim.AdamW(_groups(module.named_parameters()), lr=1e-2)
    sizes = [len(g["params"]) for g in opt.param_groups]
    losses = []
    for step in range(4):
        if step == 1:
            _set_block(list(module.named_parameters()), "blocks.1.", False)
        if step == 3:
            _set_block(list(module.named_parameters()), "blocks.1.", True)
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, sizes


def _model(frozen_before: bool):
    model, inputs = models.load("gpt", dtype=F64)
    if frozen_before:
        _set_block(list(model.named_parameters()), "blocks.0.", False)
    return model, inputs


def _job(rank, world, plan_options, frozen_before):
    model, inputs = _model(frozen_before)
    module = hapc.compile(model, CLUSTER, inputs, **plan_options)
    names = [n for n, _ in module.named_parameters()]
    losses, sizes = _train(module, inputs, frozen_before)
    out = {"names": names, "losses": losses, "sizes": sizes, "state": module.full_state_dict()}
    for what, p in (("froze", next(model.parameters())), ("unfroze", None)):
        if p is None:  # a parameter frozen at compile, unfrozen on the model object
            p = dict(model.named_parameters()).get("blocks.0.attn.q.weight")
            if p is None or p.requires_grad:
                continue
        p.requires_grad_(not p.requires_grad)
        try:
            module(*inputs)
            out[what] = None
        except hapc.HapcError as e:
            out[what] = str(e)
        p.requires_grad_(not p.requires_grad)
    return out


@pytest.mark.parametrize("frozen_before", [False, True], ids=["trainable", "block0-frozen-at-compile"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_freezing_and_named_groups_train_as_on_one_device(plan, frozen_before):
    model, inputs = _model(frozen_before)
    want_names = [n for n, p in model.named_parameters() if p.requires_grad]
    losses, sizes = _train(model, inputs, frozen_before)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, got in enumerate(run_distributed(_job, 2, PLANS[plan], frozen_before)):
        what = f"{plan}, rank {rank}"
        assert sorted(got["names"]) == sorted(want_names), what
        assert got["sizes"] == sizes, what
        assert_close(got["losses"], losses, F64, f"{what}: losses")
        assert_close(got["state"], state, F64, f"{what}: parameters")
        assert "froze 'wte.weight' on the model given to hapc.compile" in got["froze"], got["froze"]
        if frozen_before:
            assert "call hapc.compile again" in got["unfroze"], got["unfroze"]
