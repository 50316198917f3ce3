"""Wav2Vec2 / HuBERT on padded audio (``attention_mask``) train as on one device
(``hapc.theory.static_forms``, form 3: item writes).

A batch of clips of different lengths, zero padded, is how CTC fine-tuning feeds these models.
With ``attention_mask`` transformers builds the frames' mask by writing into a fresh
``torch.zeros`` through ``(torch.arange(N), lengths - 1)`` and ``flip().cumsum().flip()``, zeroes the
padded frames with ``hidden_states[~mask] = 0`` (an in-place write through a boolean index), and
reads the CTC's ``input_lengths`` from ``attention_mask.sum(-1)``. The capture records the writes as
``scatter`` / ``masked_fill`` (the same tensors bit for bit), both sharded by the batch.

Here: the captured forms equal the writes (values, gradients, inf / nan, negative indices);
``Wav2Vec2ForCTC`` and ``HubertForCTC`` (tiny, float64, rows of 400 / 330 / 90 / 260 / 400 samples,
labels padded with -100, ``ctc_loss_reduction`` "sum" and "mean") and
``Wav2Vec2ForSequenceClassification`` match one device on 2 ranks and on 3 at uneven ratios (loss
and every gradient); writes that the capture cannot make exact are refused naming the cause.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hapc
from hapc.testing import run_distributed

realworld = pytest.importorskip("realworld")
pytest.importorskip("transformers")

F64 = torch.float64
N, T, C = 5, 6, 4
#: samples per clip: full, lightly padded, heavily padded (8 of 39 frames), half, full
LENGTHS = (400, 330, 90, 260, 400)
#: transcript lengths (each fits its clip's frames), padded with -100
LABELS = (5, 4, 2, 3, 1)


def _batch(head: str) -> dict[str, torch.Tensor]:
    batch = realworld.padded_speech(LENGTHS, LABELS, 400, 5, 20, dtype=F64, seed=3)
    if head.endswith("cls"):
        batch["labels"] = torch.tensor([0, 2, 1, 2, 1])
    return batch


def _model(kind: str, reduction: str) -> nn.Module:
    """A tiny ``Wav2Vec2ForCTC`` (also with the stable layer norm of the large checkpoints) /
    ``HubertForCTC`` / ``Wav2Vec2ForSequenceClassification`` (the config of ``realworld._ctc``),
    float64, seeded."""
    torch.manual_seed(0)
    cls, config = {
        "wav2vec2": ("Wav2Vec2ForCTC", "Wav2Vec2Config"),
        "hubert": ("HubertForCTC", "HubertConfig"),
        "wav2vec2-stable": ("Wav2Vec2ForCTC", "Wav2Vec2Config"),
        "wav2vec2-cls": ("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config"),
    }[kind]
    extra: dict[str, Any] = {"num_labels": 3} if kind.endswith("cls") else {"ctc_loss_reduction": reduction}
    if kind == "wav2vec2-stable":  # the large checkpoints' layout: layer norm first (the same write)
        extra |= {"feat_extract_norm": "layer", "do_stable_layer_norm": True}
    model, _ = realworld._ctc(cls, config, 1, padded_audio=False, **extra)
    return model.to(F64)


def _reference(kind: str, reduction: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(kind, reduction)
    loss = model(**_batch(kind)).loss
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _job(rank: int, world: int, kind: str, reduction: str, ratios: tuple | None) -> dict:
    torch.set_num_threads(1)
    batch = _batch(kind)
    module = hapc.compile(_model(kind, reduction), f"local-cpu:{world}", batch, ratios=ratios)
    program = "\n".join(map(str, module.plan.describe_program()))
    loss = module(**batch).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": module.full_gradients(), "program": program}


def _compare(results: list[dict], kind: str, reduction: str) -> None:
    """Every rank's loss and gradients against one device's. The CTC heads compute the loss in
    float32 (``log_softmax(..., dtype=float32)``), so its value, a sum over the batch's shards,
    compares to float32 rounding; the gradients (float64) to 1e-11 of the largest (measured: 5e-16)."""
    ref_loss, ref_grads = _reference(kind, reduction)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for r in results:
        assert "masked_fill <- compute[d0]" in r["program"], r["program"]  # hidden_states[~mask] = 0, batch-sharded
        torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-13 if kind.endswith("cls") else 1e-6, atol=0)
        assert set(r["grads"]) == set(ref_grads)
        for k, g in ref_grads.items():
            err = float((r["grads"][k] - g).abs().max())
            assert err <= 1e-11 * scale, f"{k}: off by {err:.3g} (scale {scale:.3g})"


CASES = [
    pytest.param("wav2vec2", "sum", 2, None, id="wav2vec2-sum-2"),
    pytest.param("hubert", "mean", 3, (0.4, 0.2), id="hubert-mean-3-uneven", marks=pytest.mark.slow),
    pytest.param("wav2vec2", "mean", 3, (0.3, 0.4), id="wav2vec2-mean-3-uneven", marks=pytest.mark.slow),
    pytest.param("hubert", "sum", 2, None, id="hubert-sum-2", marks=pytest.mark.slow),
    pytest.param("wav2vec2-stable", "mean", 2, None, id="wav2vec2-stable-mean-2", marks=pytest.mark.slow),
    pytest.param("wav2vec2-cls", "", 2, None, id="wav2vec2-cls-2", marks=pytest.mark.slow),
    pytest.param("wav2vec2-cls", "", 3, (0.45, 0.1), id="wav2vec2-cls-3-uneven", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "reduction", "world", "ratios"), CASES)
def test_padded_audio_matches_one_device(kind: str, reduction: str, world: int, ratios: tuple | None) -> None:
    """Clips of 400 / 330 / 90 / 260 / 400 samples with their ``attention_mask``: loss and every
    gradient as one device, on 2 ranks and on 3 at uneven ratios."""
    results = run_distributed(_job, world, kind, reduction, ratios, timeout=240 if world == 2 else 480)
    _compare(results, kind, reduction)


class _Writes(nn.Module):
    """The writes of transformers' padded-audio path, and the generic index form."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.fill = nn.Parameter(torch.randn(C))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        m = torch.zeros((N, T), dtype=lengths.dtype, device=x.device)
        m[(torch.arange(N, device=x.device), lengths - 1)] = 1  # a fresh tensor, a traced index (0 writes column -1)
        assert len(m) == N and m.shape == (N, T)  # what a write leaves unchanged is read as it is
        m = m.transpose(0, 1).flip([0]).cumsum(0).flip([0]).transpose(0, 1).bool()  # reads the written values
        h[~m.unsqueeze(-1).repeat(1, 1, C)] = 0  # a mask of h's shape
        h[~keep] = -1.5  # a mask over the leading dims
        h[rows] = self.fill  # index tensors, a traced value
        return h.tanh().sum() + m.sum()


def _writes_inputs(inf: bool = False) -> dict[str, torch.Tensor]:
    x = torch.randn(N, T, C, dtype=F64, generator=torch.Generator().manual_seed(0))
    if inf:  # at frames the masks write over: the program must fill them, not multiply
        x[0, 2:] = float("inf")
        x[1, :, 0] = float("nan")
    keep = torch.rand(N, T, generator=torch.Generator().manual_seed(1)) > 0.3
    return dict(x=x, lengths=torch.tensor([6, 0, 3, 1, 5]), keep=keep, rows=torch.tensor([1, 3]))


def _writes_model() -> _Writes:
    torch.manual_seed(0)
    return _Writes().to(F64)


@pytest.mark.parametrize("inf", [False, True])
def test_item_writes_equal_the_writes(inf: bool) -> None:
    """The captured graph (``scatter``, ``masked_fill`` twice, ``index_put``: no item assignment
    left) computes what the in-place writes do, bit for bit, also where the written-over values are
    inf / nan and where a length of 0 writes column -1; gradients (finite inputs) equal too."""
    model, inputs = _writes_model(), _writes_inputs(inf)
    graph = hapc.trace(model, inputs, capture="fx")
    ops = [n.op for n in graph.nodes]
    assert ops.count("masked_fill") == 2 and "scatter" in ops and "index_put" in ops, ops
    want = model(**inputs)
    got = graph.run(inputs)
    assert torch.equal(got, want) if not inf else torch.equal(got.isnan(), want.isnan()), (got, want)
    if inf:
        return
    want.backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    graph.run(inputs).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=0, atol=0)


class _RowWrites(nn.Module):
    """Row writes through ``torch.arange``: as made, and written into after it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        m = torch.zeros((N, T), dtype=h.dtype, device=x.device)
        m[(torch.arange(N, device=x.device), lengths - 1)] = 1.0  # 0..N-1: a scatter
        rows = torch.arange(0, N, 1, device=x.device)
        rows[0] = 1  # no longer 0..N-1: row 1 is written twice, row 0 never
        m[(rows, lengths - 1)] = 2.0
        return (h * m[..., None]).sum()


def test_item_writes_capture_on_meta() -> None:
    """Built on the meta device (published sizes are planned so), the models capture the graph they
    capture on real tensors: the row write through ``torch.arange(N)``, whose values meta does not
    hold, is the ``scatter`` (known by how the forward made the index: ``torch.arange`` counting
    from 0, not written since); a written ``arange`` is the ``index_put`` it runs, on either."""
    for model, inputs in ((_writes_model(), _writes_inputs()), (_RowWrites().to(F64), _writes_inputs())):
        inputs = {k: inputs[k] for k in inputs if k in ("x", "lengths") or isinstance(model, _Writes)}
        real = [n.op for n in hapc.trace(model, inputs, capture="fx").nodes]
        graph = hapc.trace(model.to("meta"), {k: v.to("meta") for k, v in inputs.items()}, capture="fx")
        assert [n.op for n in graph.nodes] == real
        assert real.count("scatter") == 1 and real.count("index_put") == 1, real
    model, inputs = _RowWrites().to(F64), {k: v for k, v in _writes_inputs().items() if k in ("x", "lengths")}
    torch.testing.assert_close(hapc.trace(model, inputs, capture="fx").run(inputs), model(**inputs), rtol=0, atol=0)


def test_item_writes_shard_by_the_batch() -> None:
    """The rules of the captured forms offer the batch dim sharded (``d0``): the rows are
    independent. (``index_put`` keeps its indexed dim whole.)"""
    graph = hapc.trace(_writes_model(), _writes_inputs(), capture="fx")
    theory = hapc.derive(graph, strict=True)
    for n in graph.nodes:
        if n.op in ("scatter", "masked_fill", "where"):
            assert "d0" in [s.name for s in theory.strategies[n.index]], n.op


def test_item_writes_train_as_one_device() -> None:
    """The writes module on 3 ranks at uneven ratios: loss and every gradient as one device."""
    model, inputs = _writes_model(), _writes_inputs()
    ref = model(**inputs)
    ref.backward()
    results = run_distributed(_writes_job, 3, timeout=240)
    for r in results:
        torch.testing.assert_close(r["loss"], ref.detach(), rtol=1e-14, atol=0)
        for k, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][k], p.grad, rtol=1e-13, atol=1e-15)


def _writes_job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    module = hapc.compile(_writes_model(), f"local-cpu:{world}", _writes_inputs(), ratios=(0.4, 0.2))
    loss = module(**_writes_inputs())
    loss.backward()
    return {"loss": loss.detach(), "grads": module.full_gradients()}


class _ViewReadLater(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        flat = h.view(-1)  # shares h's storage: one device reads the write through it
        h[~keep] = 0
        return flat.sum() + h.sum()


class _InputWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x[~keep] = 0  # the caller's tensor
        return self.lin(x).sum()


class _AttributeWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.seen = torch.zeros(N, T)  # a plain attribute: one device keeps the writes across calls

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        self.seen[keep] = 1
        return (self.lin(x) * self.seen[..., None]).sum()


class _SliceWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h[:, 0] = 0
        return h.sum()


class _SharedWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        m = torch.zeros(N, T, dtype=x.dtype)
        first = m[0]  # a view: one device reads the write through it
        m[keep] = h.sum(-1)[keep]
        return (h * m[..., None]).sum() + first.sum()


def _refusal_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(N, T, C, dtype=F64, generator=torch.Generator().manual_seed(0))
    return x, torch.rand(N, T, generator=torch.Generator().manual_seed(1)) > 0.3


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_ViewReadLater, r"writes into .*, whose storage view(_\d+)? shares and .* reads after the write"),
        (_InputWrite, r"in-place item assignment at .* updates the model input x: hapc does not replay"),
        (_AttributeWrite, r"in-place item assignment at .* updates the tensor attribute seen with traced values"),
        (_SliceWrite, r"indexes with slices, integers, None or a 0-dim tensor"),
        (_SharedWrite, r"writes traced values into a tensor that shares its storage with another"),
    ],
)
def test_writes_the_capture_cannot_make_exact_are_refused(cls: type, message: str) -> None:
    """A write whose old value a view reads later, into a model input, into a tensor the forward
    did not make, into one a view shares, or through slices is refused by the fx capture, naming the
    cause; with ``capture="auto"`` torch.export (which functionalises writes) captures what it can:
    one device's loss exactly, or a refusal."""
    model = cls().to(F64)
    x, keep = _refusal_inputs()
    with pytest.raises(hapc.HapcError, match=message):
        hapc.trace(model, (x, keep), capture="fx")
    try:
        graph = hapc.trace(model, (x.clone(), keep))
    except hapc.HapcError:
        return
    torch.testing.assert_close(graph.run(dict(x=x.clone(), keep=keep)), model(x.clone(), keep), rtol=0, atol=0)


def test_numpy_draws_are_refused_naming_spec_augment() -> None:
    """transformers' SpecAugment (``mask_time_prob > 0``, in training) draws its masks with NumPy:
    the capture would freeze one draw into the program. Refused, naming the config fix; the same
    model in eval mode (no draw) captures."""
    model = _model("wav2vec2", "sum")
    model.config.mask_time_prob = 0.5
    batch = _batch("wav2vec2")
    with pytest.raises(hapc.HapcError, match=r"draws random numbers with NumPy .*config.mask_time_prob = 0"):
        hapc.trace(model, batch)
    model.eval()
    hapc.trace(model, batch)
