"""CTC losses on masked-select targets and checks that raise (``hapc.theory.static_forms``).

Hugging Face's CTC heads (Wav2Vec2, HuBERT, ...) check ``labels.max() >= vocab_size`` with an
``if ... raise`` and pass ``F.ctc_loss`` the concatenated targets ``labels.masked_select(labels >= 0)``,
whose length depends on the values. The capture turns the first into a :func:`hapc.ops.checked`
node and the second into :func:`hapc.ops.ctc_loss_masked` (padded targets ``(N, S)``), which the
``ctc_loss`` rule shards by the batch. Here: the padded form equals torch's concatenated form in
float64 (loss and gradient, every reduction, ``zero_infinity``, interior and trailing ``-100``, an
empty transcript, an infeasible one); a small CTC model trains as on one device on 2 and 3 gloo
ranks (uneven ratios) with the CTC computed batch-sharded; the check raises where one device does;
forms the capture does not recognise stay refused, naming the form. (tests/test_realworld.py has
tiny Wav2Vec2ForCTC and HubertForCTC in the slow suite; tests/test_ctc_padded.py has them on padded
audio, with an ``attention_mask``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapc
from hapc import ops as hops
from hapc.testing import run_distributed

F64 = torch.float64
VOCAB, T, N = 6, 9, 5


def _labels() -> torch.Tensor:
    """Rows of 3, 0, 4 (one -100 inside), 2 and 5 (longer than its 3 frames: infeasible) targets."""
    return torch.tensor(
        [[1, 2, 2, -100, -100], [-100, -100, -100, -100, -100], [3, -100, 1, 4, 5], [5, 5, -100, -100, -100],
         [1, 2, 3, 4, 5]]
    )  # fmt: skip


def _input_lengths() -> torch.Tensor:
    return torch.tensor([9, 7, 9, 4, 3])


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_padded_targets_equal_concatenated(reduction: str, zero_infinity: bool) -> None:
    """``ctc_loss_masked`` (``"mean"`` as ``length_sum / N``) equals ``F.ctc_loss`` on
    ``masked_select`` targets: values and the gradient of the log-probabilities, in float64."""
    labels, lengths = _labels(), _input_lengths()
    mask = labels >= 0
    if not zero_infinity:  # the infeasible row's loss is inf, its gradient nan: leave it out
        labels, lengths, mask = labels[:4], lengths[:4], mask[:4]
    logits = torch.randn(T, len(labels), VOCAB, dtype=F64, generator=torch.Generator().manual_seed(0))
    got_in, want_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    red = "length_sum" if reduction == "mean" else reduction
    got = hops.ctc_loss_masked(got_in.log_softmax(-1), labels, mask, lengths, mask.sum(-1), 0, red, zero_infinity)
    if reduction == "mean":
        got = got / len(labels)
    want = F.ctc_loss(want_in.log_softmax(-1), labels.masked_select(mask), lengths, mask.sum(-1),
                      reduction=reduction, zero_infinity=zero_infinity)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(got_in.grad, want_in.grad, rtol=1e-12, atol=1e-15)


class CTCHead(nn.Module):
    """A frame encoder and a CTC head written as transformers writes Wav2Vec2ForCTC's loss."""

    def __init__(self, reduction: str = "sum", zero_infinity: bool = True):
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.head = nn.Linear(16, VOCAB)
        self.reduction, self.zero_infinity = reduction, zero_infinity

    def forward(self, x: torch.Tensor, labels: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        if labels.max() >= VOCAB:
            raise ValueError(f"Label values must be < {VOCAB}")
        logits = self.head(torch.tanh(self.enc(x)))  # (N, T, C)
        mask = labels >= 0
        log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)
        return F.ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1), blank=0,
                          reduction=self.reduction, zero_infinity=self.zero_infinity)  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(N, T, 8, dtype=F64, generator=torch.Generator().manual_seed(1))
    return x, _labels(), _input_lengths()


def _model(reduction: str) -> CTCHead:
    torch.manual_seed(0)
    return CTCHead(reduction).to(F64)


def _job(rank: int, world: int, reduction: str, cluster: str, ratios: tuple | None) -> dict:
    torch.set_num_threads(1)
    module = hapc.compile(_model(reduction), cluster, _batch(), ratios=ratios)
    program = "\n".join(map(str, module.plan.describe_program()))
    loss = module(*_batch())
    loss.backward()
    return {"loss": loss.detach(), "grads": module.full_gradients(), "program": program}


@pytest.mark.parametrize(
    ("reduction", "world", "ratios"), [("sum", 2, None), ("mean", 2, None), ("mean", 3, (0.4, 0.2))]
)
def test_ctc_model_matches_one_device(reduction: str, world: int, ratios: tuple | None) -> None:
    """Loss and every gradient equal one device's in float64; the plan computes the CTC loss on
    each rank's samples only (its batch-sharded strategy ``n``, a ``Partial`` sum)."""
    model = _model(reduction)
    ref = model(*_batch())
    ref.backward()
    results = run_distributed(_job, world, reduction, f"local-cpu:{world}", ratios, timeout=240)
    for r in results:
        assert "ctc_loss_masked <- compute[n]" in r["program"], r["program"]
        torch.testing.assert_close(r["loss"], ref.detach(), rtol=1e-13, atol=0)
        for k, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][k], p.grad, rtol=1e-11, atol=1e-14)


def test_the_check_raises_where_one_device_does() -> None:
    """``if labels.max() >= VOCAB: raise ValueError`` is a node on the loss: the captured graph
    raises ValueError on a label out of range, and computes the loss otherwise."""
    model = _model("sum")
    x, labels, lengths = _batch()
    graph = hapc.trace(model, (x, labels, lengths))
    assert [n.op for n in graph.nodes if n.op in ("checked", "ctc_loss_masked")] == ["ctc_loss_masked", "checked"]
    torch.testing.assert_close(graph.run(dict(x=x, labels=labels, input_lengths=lengths)), model(x, labels, lengths))
    bad = labels.clone()
    bad[1, 0] = VOCAB
    with pytest.raises(ValueError):
        model(x, bad, lengths)
    with pytest.raises(ValueError, match=r"labels.max\(\) >= VOCAB.*raises here on one device"):
        graph.run(dict(x=x, labels=bad, input_lengths=lengths))


class _Branch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch that computes: not a check
            x = x * 2
        return x.sum()


class _Caught(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            if x.sum() > 0:  # a raise one device may catch: not a check
                raise ValueError("positive")
        except ValueError:
            x = x * 2
        return x.sum()


class _OtherLengths(nn.Module):
    def forward(self, lp: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = labels >= 0
        return F.ctc_loss(lp, labels.masked_select(mask), lengths, (labels >= 1).sum(-1), reduction="sum")


def test_other_forms_stay_refused() -> None:
    """Control flow that computes on a value, and a raise inside a ``try``, are refused as before
    (fx's control-flow error); masked_select targets whose
    lengths are not the mask's row counts are refused naming the captured form."""
    with pytest.raises(hapc.HapcError, match="control flow"):
        hapc.trace(_Branch(), (torch.randn(3, dtype=F64),))
    with pytest.raises(hapc.HapcError, match="the model caught the capture's error"):
        hapc.trace(_Caught(), (torch.randn(3, dtype=F64),))  # fx's error is a ValueError
    lp = torch.randn(T, N, VOCAB, dtype=F64).log_softmax(-1).requires_grad_()
    with pytest.raises(hapc.HapcError, match=r"masked_select\(mask\), input_lengths, mask.sum\(-1\)"):
        hapc.trace(_OtherLengths(), (lp, _labels(), _input_lengths()), capture="fx")
