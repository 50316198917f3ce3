"""Issue 13 items 3-5: what a forward does besides computing the loss is exact or refused.

* a ``self.training`` branch (label smoothing in training only): the program is the traced mode's,
  so switching the module to the other mode raises, naming the node (not silently the old program);
* a buffer updated in forward (a running average, a step counter) and an in-place update of a
  parameter (``self.w.data.clamp_()``, ``with torch.no_grad(): p.clamp_()``): refused at capture
  with the line, by either capture (hapc does not replay them yet). Some other forms are still
  dropped silently by the fx capture (``buf.add_(1)``, ``buf[i] = h``, ``out=buf``,
  ``p.data = ...``, a Python counter): ``test_dropped_state_updates_are_exact_or_refused`` in
  tests/test_habits.py, xfail until hapc/theory/trace.py refuses or replays them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapc
from hapc.errors import HapcError, TraceError
from hapc.testing import run_distributed


class Smoothed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y, label_smoothing=0.1 if self.training else 0.0)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y)


def _switch(rank: int, world: int, cls: type) -> str:
    torch.manual_seed(0)
    model = cls().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.arange(8) % 4
    module = hapc.compile(model, "local-cpu:2", (x, y))
    module(x, y).backward()
    try:
        module.eval()
    except HapcError as exc:
        return str(exc)
    with torch.no_grad():
        return f"ok {float(module(x, y)):.12f}"


def test_a_training_branch_refuses_the_mode_switch():
    texts = run_distributed(_switch, 2, Smoothed)
    assert texts[0] == texts[1]
    assert "computes something else in eval mode" in texts[0] and "compile a second module" in texts[0]


def test_a_model_without_training_branch_switches_to_eval():
    texts = run_distributed(_switch, 2, Plain)
    assert texts[0].startswith("ok") and texts[0] == texts[1]


class EvalOffsets(nn.Module):
    """Eval mode adds offsets made in forward (a constant of the capture, kept on the model as
    ``_tensor_constant*``), training mode does not: a ``self.training`` branch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        h = self.lin(x)
        if not self.training:
            h = h + torch.tensor([0.5, -0.5, 0.25, 0.0], dtype=h.dtype)
        return F.cross_entropy(h, y)


def _constants_left(rank: int, world: int) -> tuple[list[str], str]:
    torch.manual_seed(0)
    model = EvalOffsets().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.arange(8) % 4
    module = hapc.compile(model, "local-cpu:2", (x, y), capture="export")
    left = sorted(k for k in vars(model) if k.startswith("_tensor_constant"))
    try:
        module.eval()
    except HapcError as exc:
        return left, str(exc)
    return left, "switched"


def test_the_other_modes_capture_leaves_nothing_on_the_model():
    """hapc.compile captures the other train/eval mode only to compare (``api._mode_branch``). Its
    constants were left on the model's root, where the runtime took them for state of the program
    (HF LeViT: a KeyError materialising one)."""
    for left, text in run_distributed(_constants_left, 2):
        assert left == []
        assert "computes something else in eval mode" in text


class PairLogits(nn.Module):
    """CLIP's shape: the loss reads ``logits``; the model also returns their transpose, which no
    loss term reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        logits = self.lin(x)
        return {"loss": F.cross_entropy(logits, y), "logits": logits, "logits_t": logits.t()}


def _dropped(rank: int, world: int, capture: str) -> tuple[list[str], bool, bool]:
    import warnings

    torch.manual_seed(0)
    model = PairLogits().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.arange(8) % 4
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = hapc.compile(model, "local-cpu:2", (x, y), capture=capture)
    out = module(x, y)
    texts = [str(w.message) for w in seen if issubclass(w.category, hapc.errors.DroppedOutputWarning)]
    # equal up to rounding: a rank's rows go through a matmul of another row count, whose kernel
    # may sum in another order (this CPU: rows 5..7 of 8 differ by 1 ulp computed as 3 rows)
    return texts, out["logits_t"] is None, torch.allclose(out["logits"], model.lin(x), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_returned_tensor_the_loss_does_not_read_is_warned_of(capture):
    """The program computes what the loss depends on: a returned tensor outside it comes back as
    None, and rank 0 says so at compile time, naming where it sits in the output."""
    (texts0, none0, logits0), (texts1, none1, logits1) = run_distributed(_dropped, 2, capture)
    assert none0 and none1 and logits0 and logits1
    assert len(texts0) == 1 and "['logits_t']" in texts0[0] and "returns None there" in texts0[0]
    assert texts1 == []  # rank 0 alone


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, double=False):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        if double:
            y = y * 2
        return y.square().mean()


def _calls_with_other_constants(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    model = OptionalMask().double()
    x, mask = torch.randn(6, 4, dtype=torch.float64), torch.rand(6, 4, dtype=torch.float64)
    module = hapc.compile(model, "local-cpu:2", {"x": x})
    want = float(model(x))
    out = []
    for kw in ({}, {"mask": None}, {"double": False}, {"mask": mask}, {"double": True}):
        try:
            got = float(module(x, **kw))
            out.append("same" if abs(got - want) <= 1e-12 * abs(want) else f"differs {got} {want}")
        except HapcError as exc:
            out.append(str(exc))
    return out


def test_a_call_giving_a_constant_input_another_value_is_refused():
    """An optional input left at None and a flag are constants of the capture: a call passing a mask
    or the other flag ran the traced program and returned the unmasked loss -- silent divergence.
    Now refused, naming the input and the fix; the traced values still run."""
    for texts in run_distributed(_calls_with_other_constants, 2):
        assert texts[:3] == ["same"] * 3
        assert "input 'mask' is a tensor of shape (6, 4), but the plan was made with mask=None" in texts[3]
        assert "input 'double' is True, but the plan was made with double=False" in texts[4]
        assert "compile again" in texts[3] and "compile again" in texts[4]


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        self.steps += 1
        return self.lin(x).sum()


class Average(Counter):
    def forward(self, x):
        h = self.lin(x)
        self.avg = 0.9 * self.avg + 0.1 * h.mean(0).detach()
        return h.sum()


class ClampData(Counter):
    def forward(self, x):
        self.lin.weight.data.clamp_(-1, 1)
        return self.lin(x).sum()


class ClampNoGrad(Counter):
    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-1, 1)
        return self.lin(x).sum()


@pytest.mark.parametrize("cls", [Counter, Average, ClampData, ClampNoGrad])
@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_updates_of_state_in_forward_are_refused(cls, capture):
    model = cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # (export alone cannot say the line of a ``.data`` write: it names the construct and the fix)
    with pytest.raises(TraceError, match=r"(in-place|updates parameters or buffers|assigns|through `.data`)"):
        hapc.trace(model, (torch.randn(3, 4),), capture=capture)
    # capturing did not change the model's state
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@hapc.custom_op("b h, h -> b")  # wrong: sharding h claims a Partial sum, but the sum is squared
def _wrong_rowsum(x, w):
    return (x * w).sum(-1) ** 2


@hapc.custom_op("b h, h -> b h")
def _right_scale(x, w):
    return x * w


class Custom(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.fn = fn

    def forward(self, x):
        return self.fn(x, self.w).sum()


def _compile_custom(rank: int, world: int, fn) -> str:
    torch.manual_seed(0)
    model = Custom(fn)
    x = torch.randn(8, 6, dtype=torch.float64)
    try:
        hapc.compile(model, "local-cpu:2", (x,))
    except HapcError as exc:
        return str(exc)
    return "compiled"


def test_a_custom_op_with_a_wrong_annotation_is_refused_at_compile():
    texts = run_distributed(_compile_custom, 2, _wrong_rowsum)
    assert texts[0] == texts[1] and "is unsound" in texts[0] and "_wrong_rowsum" in texts[0]
    assert run_distributed(_compile_custom, 2, _right_scale) == ["compiled", "compiled"]
