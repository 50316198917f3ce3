"""Copies of a compiled module (``copy.deepcopy``, ``torch.optim.swa_utils.AveragedModel``): another
compiled module of the same plan on the same process groups, with its own weights. An EMA of the
weights evaluates as the single-device EMA does, and a copy trains as a copy of the model does,
without disturbing the original. float64, 2 gloo processes, default and parameter-sharding plans."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTER = cluster_of([3e9, 1e9])
PLANS = {"default": {}, "tp": {"baseline": "tp", "ratios": [0.6, 0.4]}}


def _run(module, inputs):
    """Three SGD steps with an EMA of the weights; then a copy trained two steps on its own, and the
    original two more: the EMA's eval loss, the losses of both, and both weights."""
    ema = torch.optim.swa_utils.AveragedModel(module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        module(*inputs).backward()
        opt.step()
        ema.update_parameters(module)
    with torch.no_grad():
        ema_loss = float(ema(*inputs))
    twin = copy.deepcopy(module)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(2):
        for m, o in ((twin, twin_opt), (module, opt)):
            o.zero_grad()
            loss = m(*inputs)
            loss.backward()
            o.step()
            losses.append(float(loss.detach()))
    return ema_loss, losses, twin, module


def _state(m):
    return m.full_state_dict() if hasattr(m, "full_state_dict") else {k: v.detach() for k, v in m.state_dict().items()}


def _job(rank, world, options):
    model, inputs = models.load("gpt", dtype=F64)
    module = hapc.compile(model, CLUSTER, inputs, **options)
    ema_loss, losses, twin, module = _run(module, inputs)
    return ema_loss, losses, _state(twin), _state(module)


@pytest.mark.parametrize("plan", list(PLANS))
def test_copies_and_ema_of_a_compiled_module_are_exact(plan):
    model, inputs = models.load("gpt", dtype=F64)
    ema_loss, losses, twin, model = _run(model, inputs)
    for rank, got in enumerate(run_distributed(_job, 2, PLANS[plan])):
        what = f"{plan}, rank {rank}"
        assert_close(got[0], ema_loss, F64, f"{what}: EMA eval loss")
        assert_close(got[1], losses, F64, f"{what}: losses of the copy and the original")
        assert_close(got[2], _state(twin), F64, f"{what}: the copy's weights")
        assert_close(got[3], _state(model), F64, f"{what}: the original's weights")


def _model_attributes(rank, world):
    model, inputs = models.load("gpt", dtype=F64)
    model.note = "mine"
    module = hapc.compile(model, CLUSTER, inputs)
    out = {"hasattr": hasattr(module, "configure"), "hasattr note": hasattr(module, "note")}
    for name in ("note", "no_such_thing"):
        try:
            getattr(module, name)
        except AttributeError as e:
            out[name] = (isinstance(e, hapc.HapcError), str(e))
    return out


def test_attributes_of_the_model_are_refused_by_name():
    """``module.generate(...)``, ``module.config``: the model's, not the compiled module's -- an
    AttributeError that is a HapcError naming ``unwrap()``; unknown names stay plain AttributeErrors."""
    for got in run_distributed(_model_attributes, 2):
        assert got["hasattr"] is False and got["hasattr note"] is False
        is_hapc, text = got["note"]
        assert is_hapc and "'note' belongs to the model given to hapc.compile" in text and "unwrap()" in text
        is_hapc, text = got["no_such_thing"]
        assert not is_hapc and "no attribute 'no_such_thing'" in text
