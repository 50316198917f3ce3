"""The equivalence harness itself (issue 16): it must reject a planted error of 1e-3.

Every equivalence test trusts ``harness.assert_close`` and ``harness.check_plan``; a tolerance
raised by mistake (or a comparison dropped) would let wrong programs pass silently. Here errors
of 1e-3 (relative) are planted in tensors, nested states, losses and a whole distributed run's
reference -- the loss, one gradient, the trained state -- and each must be caught.
"""

from __future__ import annotations

import harness
import pytest
import torch

import hapc
from hapc import models
from hapc.testing import cluster_of

PLANTED = 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_assert_close_rejects_a_relative_error_of_1e_3(dtype):
    want = torch.linspace(-2.0, 3.0, 24, dtype=dtype).reshape(4, 6)
    got = want.clone()
    got[1, 2] *= 1 + PLANTED
    with pytest.raises(AssertionError):
        harness.assert_close(got, want, dtype, "tensor")
    with pytest.raises(AssertionError):
        harness.assert_close({"a": want, "b": [want, got]}, {"a": want, "b": [want, want]}, dtype, "nested")
    with pytest.raises(AssertionError):
        harness.assert_close(1.0 + PLANTED, 1.0, dtype, "loss")
    harness.assert_close(want.clone(), want, dtype, "identical")  # and accepts an exact match


def _perturbed(ref: dict, where: str) -> dict:
    ref = dict(ref)
    if where == "nowhere":
        return ref
    if where == "loss":
        ref["loss"] *= 1 + PLANTED
        ref["losses"] = [ref["loss"], *ref["losses"][1:]]
    elif where == "grad":
        grads = dict(ref["grads"])
        k = next(iter(grads))
        grads[k] = grads[k] * (1 + PLANTED)
        ref["grads"] = grads
    else:
        model = dict(ref["state"]["model"])
        k = next(iter(model))
        model[k] = model[k] * (1 + PLANTED)
        ref["state"] = {**ref["state"], "model": model}
    return ref


@pytest.mark.parametrize("where", ["nowhere", "loss", "grad", "state"])
def test_check_plan_rejects_a_planted_error(where, monkeypatch):
    """A correct 2-rank run, compared with a reference 1e-3 off in one place, must fail (and
    pass when nothing is planted, so the failures are the planted errors')."""
    mkw = {"dtype": torch.float64}
    model, inputs = models.load("mlp", **mkw)
    cluster = cluster_of([2e9, 1e9])
    plan = hapc.synthesize(model, cluster, inputs)
    real = harness.single_device
    monkeypatch.setattr(harness, "single_device", lambda *a: _perturbed(real(*a), where))
    if where == "nowhere":
        harness.check_plan("mlp", mkw, cluster, plan, 2, steps=2)
        return
    with pytest.raises(AssertionError):
        harness.check_plan("mlp", mkw, cluster, plan, 2, steps=2)
