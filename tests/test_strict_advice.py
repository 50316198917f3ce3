"""The ``hapc.register_op`` advice of an op without a rule (``strict=True`` raises it, the default
warns it) is right for the op's operand count and shapes (issue 12).

The old advice named every operand ``d0 d1 ...``: for ``x[4, 8] @ w[8, 5]`` it suggested
``"d0 d1, d0 d1 -> d0 d1"``, which the annotation parser refuses (``d1`` has sizes 8 and 5), and
it named a leaf module's instance (``Hardsigmoid()``) instead of its class. Each suggested line is
taken from the message and registered as it stands: the safe form must derive under ``strict``
and keep the op replicated; the elementwise form (offered only when every operand broadcasts to
the result) must derive sound strategies for an op that is elementwise.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from torch import nn

import hapc
from hapc.errors import UnsupportedOpError
from hapc.theory.props import REPLICATED
from hapc.theory.registry import default_registry


@hapc.custom_op()
def unary_op(x: torch.Tensor) -> torch.Tensor:  # elementwise
    return torch.special.erfcx(x)


@hapc.custom_op()
def proj_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # a contraction: not elementwise
    return x @ w


@hapc.custom_op()
def fma_op(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # elementwise, broadcasting
    return a * b + c


class Squash(nn.Module):
    """A leaf module without a rule (one operand, another shape out: not elementwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x[:, :3])


class Net(nn.Module):
    def __init__(self, which: str):
        super().__init__()
        self.which = which
        self.w = nn.Parameter(torch.randn(8, 5, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.squash = Squash()

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = x @ self.w  # [4, 5]
        if self.which == "unary":
            h = unary_op(h)
        elif self.which == "proj":
            h = proj_op(x, self.w)
        elif self.which == "fma":
            h = fma_op(h, self.b, c)
        else:
            h = self.squash(h)
        return (h**2).sum()


INPUTS = {
    "x": torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
    "c": torch.randn(4, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
}

# which -> (the name the advice must spell, the op in the graph, its safe form, its elementwise form)
CASES: dict[str, tuple[Any, str, str, str | None]] = {
    "unary": (unary_op, "unary_op", "a0^ a1^ -> r0^ r1^", "d0 d1 -> d0 d1"),
    "proj": (proj_op, "proj_op", "a0^ a1^, b0^ b1^ -> r0^ r1^", None),
    "fma": (fma_op, "fma_op", "a0^ a1^, b0^, c0^ c1^ -> r0^ r1^", "d0 d1, d1, d0 d1 -> d0 d1"),
    "leaf": (Squash, "Squash", "a0^ a1^ -> r0^ r1^", None),
}


def _refusal(which: str) -> tuple[Any, str]:
    graph = hapc.trace(Net(which), INPUTS, leaf_modules=[Squash])
    with pytest.raises(UnsupportedOpError) as err:
        hapc.derive(graph, strict=True)
    return graph, str(err.value)


def _derive_with(graph: Any, target: Any, annotation: str) -> Any:
    """Derive under ``strict`` with ``annotation`` registered for ``target`` in a copy of the
    registry (the default one stays as it was for the other tests)."""
    registry = copy.copy(default_registry)
    registry._rules = dict(default_registry._rules)
    registry.register_op(target, annotation)
    return hapc.derive(graph, strict=True, registry=registry)


@pytest.mark.parametrize("which", list(CASES))
def test_advice_fits_the_operands_and_is_right(which: str) -> None:
    target, spelled, safe, elementwise = CASES[which]
    graph, msg = _refusal(which)
    suggested = re.findall(r'hapc\.register_op\(([^,]+), "([^"]*)"\)', msg)
    assert suggested, msg
    assert {name for name, _ in suggested} == {spelled}, msg  # the class or function, not an instance
    forms = [ann for _, ann in suggested]
    assert forms[0] == safe and "never sharded" in msg
    assert forms[1:] == ([elementwise] if elementwise else []), msg
    node = next(n for n in graph if n.op.endswith(spelled))
    n_ops = len(node.operands)
    assert f"{n_ops} tensor operand" in msg and str(tuple(node.shape)) in msg

    theory = _derive_with(graph, target, safe)  # the safe form: derives, the op stays replicated
    assert all(s.output == REPLICATED and set(s.inputs) == {REPLICATED} for s in theory.strategies[node.index])
    if elementwise:  # an elementwise op registered as suggested shards on each dimension, soundly
        theory = _derive_with(graph, target, elementwise)
        outs = {s.output for s in theory.strategies[node.index]}
        assert {hapc.shard(0), hapc.shard(1)} <= outs
        assert not hapc.verify(theory, INPUTS, [[0.5, 0.5], [0.75, 0.25]], nodes=[node.index])


def test_unknown_op_warning_carries_the_same_advice() -> None:
    graph = hapc.trace(Net("proj"), INPUTS)
    with pytest.warns(hapc.UnsupportedOpWarning) as rec:
        hapc.derive(graph)
    msg = str(next(w.message for w in rec if "proj_op" in str(w.message)))
    assert 'hapc.register_op(proj_op, "a0^ a1^, b0^ b1^ -> r0^ r1^")' in msg
    assert "d0 d1, d0 d1" not in msg  # the old advice, which the parser refuses for these shapes
