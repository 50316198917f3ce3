"""Hooks train as on one device or are refused, naming the fix. Gradient hooks on parameters
(``Tensor.register_hook``, ``register_post_accumulate_grad_hook``): one on the model's parameters
before ``hapc.compile`` would be dropped (the module trains parameters of its own), one added to the
compiled module's parameters with several ranks would run on this rank's partial gradient -- both
refused; on one rank the compiled module's gradient is whole and a hook is exact. Module forward
(pre-)hooks are captured with the forward, a ``torch.nn`` layer's too; module backward hooks would
not run in the program's backward -- refused. Real gloo ranks, float64."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.errors import HapcError
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
TWO = cluster_of([5e9, 3e9])
ONE = cluster_of([5e9])


def _clamp(g: torch.Tensor) -> torch.Tensor:  # not linear: on a partial sum it differs from one device
    return g.clamp(-1e-3, 1e-3)


def _clamp_in_place(p: torch.Tensor) -> None:
    p.grad.clamp_(-1e-3, 1e-3)


def _hook(p: torch.Tensor, kind: str):
    return p.register_hook(_clamp) if kind == "tensor" else p.register_post_accumulate_grad_hook(_clamp_in_place)


def _before_compile(rank, world, kind):
    model, inputs = models.load("mlp", dtype=F64)
    _hook(next(model.parameters()), kind)
    try:
        hapc.compile(model, TWO if world == 2 else ONE, inputs)
    except HapcError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_hook_on_the_model_before_compile_is_refused(world, kind):
    for msg in run_distributed(_before_compile, world, kind):
        assert msg is not None, "the hook would be dropped silently"
        assert "of the model has a gradient hook" in msg and "transform p.grad after loss.backward()" in msg


def _after_compile(rank, world, kind):
    model, inputs = models.load("mlp", dtype=F64)
    m = hapc.compile(model, TWO, inputs)
    handles = [_hook(p, kind) for p in m.parameters()]
    try:
        m(*inputs).backward()
    except HapcError as exc:
        refused = str(exc)
    else:
        refused = None
    for h in handles:  # without the hook, the module trains on exactly
        h.remove()
    m.zero_grad()
    m(*inputs).backward()
    return refused, m.full_gradients()


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_a_hook_added_to_the_compiled_module_is_refused_with_several_ranks(kind):
    model, inputs = models.load("mlp", dtype=F64)
    model(*inputs).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for refused, grads in run_distributed(_after_compile, 2, kind):
        assert refused is not None, "a hook on a partial gradient must not pass silently"
        assert "added after hapc.compile" in refused and "partial sum" in refused
        assert_close(grads, want, F64, "gradients after the hook is removed")


def _one_rank(rank, world, kind):
    model, inputs = models.load("mlp", dtype=F64)
    m = hapc.compile(model, ONE, inputs)
    for p in m.parameters():
        _hook(p, kind)
    m(*inputs).backward()
    return m.full_gradients()


@pytest.mark.parametrize("kind", ["tensor", "post_accumulate"])
def test_a_hook_on_one_rank_is_exact(kind):
    model, inputs = models.load("mlp", dtype=F64)
    for p in model.parameters():
        _hook(p, kind)
    model(*inputs).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    (got,) = run_distributed(_one_rank, 1, kind)
    assert_close(got, want, F64, "gradients through the hooks")


def _module_hooked(kind: str):
    model, inputs = models.load("mlp", dtype=F64)
    layer = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][1]  # a layer fx keeps whole
    if kind == "forward":
        layer.register_forward_hook(lambda m, i, o: o * 0.5)
    elif kind == "forward_pre":
        layer.register_forward_pre_hook(lambda m, i: (i[0] * 0.5,))
    elif kind == "full_backward":
        layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    elif kind == "backward_pre":
        layer.register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,))
    return model, inputs


def _forward_hooks(rank, world, kind, capture):
    model, inputs = _module_hooked(kind)
    m = hapc.compile(model, TWO, inputs, capture=capture)
    loss = m(*inputs)
    loss.backward()
    return float(loss), m.full_gradients()


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_module_forward_hooks_are_captured_with_the_forward(kind, capture):
    model, inputs = _module_hooked(kind)
    loss = model(*inputs)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for got_loss, grads in run_distributed(_forward_hooks, 2, kind, capture):
        assert got_loss == pytest.approx(float(loss), rel=1e-12), "the hook changes the loss on one device"
        assert_close(grads, want, F64, "gradients")


@pytest.mark.parametrize("kind", ["full_backward", "backward_pre"])
def test_module_backward_hooks_are_refused(kind):
    model, inputs = _module_hooked(kind)
    with pytest.raises(HapcError, match=r"module 'layers\.1' \(Linear\) has a backward hook"):
        hapc.trace(model, inputs)


def _compiled(rank, world, hook=False):
    model, inputs = models.load("mlp", dtype=F64)
    inner = hapc.compile(model, TWO, inputs)
    m = torch.compile(inner)
    loss = m(*inputs)
    loss.backward()
    if hook:  # added once the module runs compiled: its forward's check is not in the compiled graph
        next(inner.parameters()).register_hook(lambda g: g * 2)
        inner.zero_grad()
        loss = m(*inputs)
        try:
            loss.backward()
        except HapcError as e:
            return str(e)
        return None
    return float(loss), m.full_gradients()


def test_a_hook_on_a_module_that_runs_compiled_is_refused_at_its_backward():
    for refused in run_distributed(_compiled, 2, True, timeout=300):
        assert refused is not None and "gradient hook added after hapc.compile" in refused


def test_torch_compile_of_the_module_is_not_mistaken_for_a_hook():
    """Under ``torch.compile`` dynamo's view of a parameter's hooks differs from the parameter's:
    the check is left to eager calls, and the compiled module trains as one device does."""
    model, inputs = models.load("mlp", dtype=F64)
    loss = model(*inputs)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for got_loss, grads in run_distributed(_compiled, 2, timeout=300):
        assert got_loss == pytest.approx(float(loss), rel=1e-12)
        assert_close(grads, want, F64, "gradients")


def _compiled_guard(rank, world):
    model, inputs = models.load("mlp", dtype=F64)
    inner = hapc.compile(model, TWO, inputs)
    m = torch.compile(inner)
    m(*inputs).backward()
    norm = float(next(model.parameters()).detach().norm())  # in sync: the model's weights read
    refused = []
    model.layers[0].eval()  # a part switched alone, after the module ran compiled
    try:
        m(*inputs)
    except HapcError as e:
        refused.append(str(e))
    model.train()
    with torch.no_grad():  # a manual step: no optimizer hook sees it
        for p in inner.parameters():
            p.sub_(0.05 * p.grad)
    try:
        next(model.parameters()).sum()
    except HapcError as e:
        refused.append(str(e))
    return norm, refused


def test_the_models_guard_runs_at_every_call_of_a_module_under_torch_compile():
    """The guard's checks before each forward run eagerly under ``torch.compile`` (a graph break):
    traced, dynamo met the model's guarded parameters' version counters and recursed through
    their ``__torch_function__``. A part of the model switched to eval alone is refused at the next
    compiled call, and a manual step makes the model's parameters refuse a read at once."""
    model, _ = models.load("mlp", dtype=F64)
    want = float(next(model.parameters()).detach().norm())
    for norm, refused in run_distributed(_compiled_guard, 2, timeout=300):
        assert norm == pytest.approx(want, rel=1e-12)
        assert len(refused) == 2, refused
        assert "switched to another train/eval mode on its own" in refused[0]
        assert "trained past" in refused[1] and "module.unwrap()" in refused[1]
