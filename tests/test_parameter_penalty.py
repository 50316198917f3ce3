"""A forward that computes on parameters taken from ``self.parameters()`` (an L2 penalty, an
orthogonality regulariser) trains exactly as on one device, or is refused.

fx makes a module's parameters graph values only where the forward reads them as attributes
(``self.fc.weight``); iterated from ``self.parameters()`` they are the real tensors, so
``sum(p.pow(2).sum() for p in self.parameters())`` was computed once while tracing and kept as a
constant: the loss kept the penalty of the initial weights and no gradient of it reached them
(the tiny GPT's loss off 0.16 after one SGD step, silently). The fx capture now refuses a tensor
with a gradient that it would keep as a constant, naming the line; the default capture then
takes ``torch.export``'s, which lifts every parameter into the graph: the penalty is traced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import sgd_steps
from torch import nn

import hapc
from hapc.errors import TraceError
from hapc.testing import run_distributed

F64 = torch.float64


class Penalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 16)
        self.l2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.l2(torch.tanh(self.l1(x))), y)
        return loss + 0.05 * sum(p.pow(2).sum() for p in self.parameters())


class HeldScale(nn.Module):
    """A tensor that wants a gradient held as a plain attribute (not an ``nn.Parameter``)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(6, 5)
        self.scale = torch.full((5,), 2.0, requires_grad=True)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.l1(x) * self.scale, y)


def _build(cls=Penalised):
    torch.manual_seed(0)
    model = cls().to(F64)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(10, 6, generator=g, dtype=F64), torch.randint(0, 5, (10,), generator=g))


def test_fx_refuses_parameters_computed_on_outside_the_trace():
    model, inputs = _build()
    with pytest.raises(TraceError, match="outside the trace") as err:
        hapc.trace(model, inputs, capture="fx")
    assert "self.parameters()" in str(err.value) and "weight_decay" in str(err.value)
    assert "test_parameter_penalty.py" in str(err.value)  # the line


def test_the_default_capture_traces_the_penalty():
    model, inputs = _build()
    graph = hapc.trace(model, inputs)
    powers = [n for n in graph if n.kind == "op" and n.op == "pow"]
    assert len(powers) == len(list(model.parameters()))
    assert all(n.requires_grad for n in powers)


def test_a_plain_attribute_that_wants_a_gradient_is_refused():
    model, inputs = _build(HeldScale)
    for capture in ("fx", "export"):
        with pytest.raises(TraceError, match=r"outside the trace|wants a gradient"):
            hapc.trace(model, inputs, capture=capture)


def _penalised(rank, world):
    torch.set_num_threads(1)
    model, inputs = _build()
    m = hapc.compile(model, "local-cpu:3", inputs)
    return sgd_steps(m, inputs, steps=3), m.full_state_dict()


def test_a_penalty_over_the_parameters_trains_as_one_device():
    model, inputs = _build()
    want = sgd_steps(model, inputs, steps=3)
    state = model.state_dict()
    for losses, got in run_distributed(_penalised, 3):
        assert losses == pytest.approx(want, rel=1e-10)
        for k, v in state.items():
            torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-12, msg=k)
