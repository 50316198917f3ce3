"""Code in forward that changes the backward: exact or refused, never silently another gradient.

* ``with torch.no_grad():`` (or ``torch.inference_mode()``) around ops in forward: their results
  carry no gradient on one device, so the program detaches them (the fx capture recorded the ops
  alike before, and the gradient flowed through); an op returning its operand itself (``x.float()``
  of a float tensor, dropout in eval mode) keeps the gradient, as on one device;
* a ``torch.autograd.Function`` of the model's own (a gradient reversal layer): the fx capture records
  ``cls.apply`` as one op that the program calls, so its ``backward`` runs (replicated, or as
  ``hapc.register_op(cls, ...)`` lets it shard); torch.export, which would keep its forward alone, refuses;
* ``h.register_hook(fn)`` on a tensor in forward and ``torch.autograd.grad`` (a gradient penalty):
  refused by either capture (the program's backward would never call the hook; the capture records
  forward ops only).

float64 on 1-3 gloo processes with uneven ratios, against the same steps on one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, sgd_steps
from torch import nn

import hapc
from hapc.errors import TraceError
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

F64 = torch.float64


class Reverse(torch.autograd.Function):
    """Identity forward, the gradient reversed and halved (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -0.5 * g


class Net(nn.Module):
    """An MLP whose middle is one of the forward's gradient-changing constructs (``how``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        if self.how == "no_grad":  # a target computed without gradient, next to the same op with it
            with torch.no_grad():
                t = self.b(h)
            h = torch.tanh(self.b(h)) + 0.5 * t
        elif self.how == "inference_mode":
            with torch.inference_mode():
                t = (self.b(h) ** 2).mean(-1, keepdim=True)
            h = torch.tanh(self.b(h)) * t.clone()
        elif self.how == "no_grad_identity":  # x.float() of a float64 tensor is x: keeps its gradient
            with torch.no_grad():
                t = h.double()
            h = torch.tanh(self.b(t))
        elif self.how == "function":
            h = torch.tanh(self.b(Reverse.apply(h)))
        elif self.how == "hook":
            h = self.b(h)
            h.register_hook(lambda g: 3 * g)
        elif self.how == "penalty":  # a gradient penalty: the gradient of the output by the input
            xi = x.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.a(xi).sum(), xi, create_graph=True)
            h = self.b(h) + (g**2).sum()
        return F.cross_entropy(self.c(h), y)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(10, 6, generator=g, dtype=F64), torch.randint(0, 4, (10,), generator=g)


def _model(how: str) -> Net:
    torch.manual_seed(0)
    return Net(how).to(F64)


def _job(rank, world, how, cluster, options):
    x, y = _data()
    first_under_no_grad = options.pop("first_under_no_grad", False)
    if options.pop("register", False):  # in this rank's process only (forked): the test process keeps its registry
        hapc.register_op(Reverse, "... -> ...")
    module = hapc.compile(_model(how), cluster, (x, y), **options)
    if first_under_no_grad:  # a batch of another size: its program is traced at this call, under no_grad
        with torch.no_grad():
            module(x[:7], y[:7])
    losses = sgd_steps(module, (x, y), steps=3, lr=0.3)
    return losses, {k: v.clone() for k, v in module.state_dict().items()}


def _check(how, cluster, world, **options):
    results = run_distributed(_job, world, how, cluster, options)
    model = _model(how)
    x, y = _data()
    want = sgd_steps(model, (x, y), steps=3, lr=0.3)
    for rank, (losses, state) in enumerate(results):
        assert_close(losses, want, F64, f"rank {rank} losses")
        assert_close(state, dict(model.state_dict()), F64, f"rank {rank} state")


TP = {"baseline": "tp", "ratios": [0.6, 0.4]}
CASES = {
    "no_grad-3-ranks": ("no_grad", "local-cpu:3", 3, {}),
    "no_grad-tp": ("no_grad", cluster_of([3e9, 1e9]), 2, TP),
    "no_grad-first-call-under-no_grad": ("no_grad", "local-cpu:2", 2, {"first_under_no_grad": True}),
    "inference_mode": ("inference_mode", "local-cpu:3", 3, {}),
    "no_grad_identity": ("no_grad_identity", "local-cpu:3", 3, {}),
    "function-3-ranks": ("function", "local-cpu:3", 3, {}),
    "function-1-rank": ("function", "local-cpu:1", 1, {}),
    "function-tp": ("function", cluster_of([3e9, 1e9]), 2, TP),
    "function-registered": ("function", "local-cpu:3", 3, {"register": True}),  # elementwise: it shards
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_changing_code_in_forward_trains_as_one_device(case):
    how, cluster, world, options = CASES[case]
    _check(how, cluster, world, **options)


def test_no_grad_results_are_detached_in_the_graph():
    x, y = _data()
    graph = trace(_model("no_grad"), (x, y), capture="fx")
    detached = [n for n in graph if n.op == "detach"]  # t = self.b(h) under no_grad: the bias add's result
    assert len(detached) == 1 and graph.nodes[detached[0].operands[0]].name == "add_bias_1"
    kept = trace(_model("no_grad_identity"), (x, y), capture="fx")
    assert not [n for n in kept if n.op == "detach"]  # h.double() of a float64 h is h: nothing detached


def test_an_autograd_function_is_one_op_and_shards_by_its_registered_rule():
    x, y = _data()
    graph = trace(_model("function"), (x, y), capture="fx")
    (node,) = [n for n in graph if n.op.endswith("Reverse")]
    assert node.op == f"{Reverse.__module__}.{Reverse.__qualname__}"
    registry = hapc.theory.Registry()
    registry.register_op(Reverse, "... -> ...")
    assert registry.get(node.op) is not None  # hapc.register_op(Reverse, ...) names the same op


def test_the_export_capture_refuses_an_autograd_function():
    x, y = _data()
    with pytest.raises(TraceError, match=r"Reverse\.apply, a torch\.autograd\.Function .*capture='fx'"):
        trace(_model("function"), (x, y), capture="export")


@pytest.mark.parametrize("capture", ["fx", "export", "auto"])
def test_a_gradient_hook_in_forward_is_refused(capture):
    x, y = _data()
    with pytest.raises(TraceError, match=r"register_hook\(\) on a tensor \(test_backward_code.py:\d+") as info:
        trace(_model("hook"), (x, y), capture=capture)
    assert "torch.export could not capture it either" not in str(info.value)  # one refusal, not two


@pytest.mark.parametrize("capture", ["fx", "export", "auto"])
def test_a_gradient_penalty_in_forward_is_refused(capture):
    x, y = _data()
    with pytest.raises(TraceError, match=r"torch\.autograd\.grad \(test_backward_code.py:\d+") as info:
        trace(_model("penalty"), (x, y), capture=capture)
    assert "torch.export could not capture it either" not in str(info.value)


class Deep(nn.Module):
    """A chain of 1500 ops from the parameter, then a no_grad region reading its end."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = x * self.w
        for _ in range(1500):
            h = h * 1.001
        with torch.no_grad():
            t = h * 2
        return (h + t).sum()


def test_a_no_grad_region_after_a_deep_chain_traces():
    """Whether a no_grad result could carry a gradient is found without recursion (graphs are deeper
    than Python's recursion limit)."""
    graph = trace(Deep(), (torch.ones(4, 3),), capture="fx")
    assert [n.op for n in graph if n.op == "detach"] == ["detach"]
