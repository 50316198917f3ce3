"""Optimizers over sharded parameters (issue 13, no silent divergence): elementwise optimizers
(SGD, Adam, ... and declared ones) train exactly as on one device; optimizers that read across the
elements of a tensor (Adafactor, Muon) or across tensors (LBFGS, unknown ones) are refused with a
``HapcError`` on a plan that shards parameters -- they would silently update each slice otherwise
-- and run unchanged where the plan replicates every parameter. float64, 2 gloo processes."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTER = cluster_of([3e9, 1e9])
TP = {"baseline": "tp", "ratios": [0.6, 0.4]}
DP = {"baseline": "dp-ev"}


class SoftSign(torch.optim.Optimizer):
    """A user optimizer, elementwise (Lion-like, a soft sign: a gradient that is zero up to rounding,
    such as an attention key bias's, must not be amplified to a full step)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                u = b1 * m + (1 - b1) * p.grad
                p.add_(u / (1e-3 + u.abs()), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class DeclaredSoftSign(SoftSign):
    pass


hapc.elementwise_optimizer(DeclaredSoftSign)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "declared-softsign": lambda ps: DeclaredSoftSign(ps, lr=1e-2),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "softsign": lambda ps: SoftSign(ps, lr=1e-2),
}
REFUSED_ON_SHARDS = {"adafactor": "reads across the elements", "softsign": "hapc.elementwise_optimizer(SoftSign)"}


def _train(module, inputs, make, steps=3):
    opt = make(list(module.parameters()))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _job(rank, world, plan, names):
    out = {}
    for name in names:
        model, inputs = models.load("gpt", dtype=F64)
        module = hapc.compile(model, CLUSTER, inputs, plan=plan)
        try:
            out[name] = (_train(module, inputs, OPTIMIZERS[name]), module.full_state_dict())
        except hapc.HapcError as e:
            out[name] = str(e)
    return out


def _one_device(name):
    model, inputs = models.load("gpt", dtype=F64)
    return _train(model, inputs, OPTIMIZERS[name]), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["tp", "dp"])
def test_optimizers_train_exactly_or_are_refused_on_sharded_parameters(kind):
    model, inputs = models.load("gpt", dtype=F64)
    plan = hapc.synthesize(model, CLUSTER, inputs, **(TP if kind == "tp" else DP))
    shards = any(
        i.layout.is_sharded
        for i in plan.instructions
        if type(i).__name__ == "Source" and "weight" in plan.node_names[i.ref]
    )
    assert shards == (kind == "tp")
    results = run_distributed(_job, 2, plan, list(OPTIMIZERS))
    for name in OPTIMIZERS:
        for rank, res in enumerate(results):
            got = res[name]
            if kind == "tp" and name in REFUSED_ON_SHARDS:
                assert isinstance(got, str) and REFUSED_ON_SHARDS[name] in got, (name, got)
                continue
            assert not isinstance(got, str), (name, got)
            losses, state = _one_device(name)
            assert_close(got[0], losses, F64, f"{kind} {name} rank {rank}: losses")
            # an attention key bias has a zero gradient up to rounding (softmax ignores a per-query
            # constant); scale-free updates (Adafactor's, the soft sign's) turn that rounding into steps
            keep = {k: v for k, v in state.items() if not k.endswith("attn.k.bias")}
            assert len(keep) < len(state)
            assert_close({k: got[1][k] for k in keep}, keep, F64, f"{kind} {name} rank {rank}: parameters")


def test_the_kinds_of_optimizers():
    from hapc.codegen.optimizers import _kind

    p = [torch.nn.Parameter(torch.zeros(2))]

    class MyAdam(torch.optim.Adam):  # overrides step: unknown until declared
        def step(self, closure=None):
            return super().step(closure)

    class PlainAdam(torch.optim.Adam):  # inherits step: elementwise
        pass

    assert _kind(torch.optim.SGD(p, lr=0.1)) == "elementwise"
    assert _kind(PlainAdam(p)) == "elementwise"
    assert _kind(MyAdam(p)) == "unknown"
    assert _kind(torch.optim.LBFGS(p)) == "unknown"
    assert _kind(torch.optim.Adafactor(p)) == "per tensor"
    with pytest.raises(hapc.HapcError, match="Optimizer subclass"):
        hapc.elementwise_optimizer(object)
