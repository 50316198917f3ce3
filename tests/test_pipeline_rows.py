"""A pipeline trains exactly what one device does only if no value the loss reads mixes the
batch's rows (:mod:`hapc.pipeline.rows`): each micro-batch runs on its own. Models whose forward
couples rows -- a statistic over the batch, ``topk`` / ``sort`` / ``cumsum`` / ``softmax`` / ``roll``
/ ``flip`` along it, a ``z @ z.T`` similarity, ``torch.arange(batch)`` labels or weights -- trained
silently wrong as pipelines (the loss off by up to 8 after one step, found by a probe on 3 ranks);
now the planner leaves the pipeline out and an explicit one is refused, naming the node and its
line. Models whose rows are independent -- including tensors the forward makes from the batch's
size that are the same in every row (``torch.zeros(b, d)``), ``nn.MultiheadAttention`` (its rows
interleaved with heads by a reshape), masks, weighted and label-smoothed cross-entropy -- still
pipeline, and train as on one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, pipeline_spec, sgd_steps, two_groups
from torch import nn

import hapc
from hapc.errors import HapcError
from hapc.pipeline.rows import _refactor, rows_coupled
from hapc.pipeline.runtime import PipelineModule, micro_batches
from hapc.planner import choose_plan
from hapc.testing import run_distributed
from hapc.theory import trace

F64 = torch.float64
WEIGHTS = [1.0, 2.0, 3.0, 0.5, 1.5]


class Rows(nn.Module):
    """Tokens -> embedding -> mean over tokens -> ``depth`` tanh layers -> ``head(h, x, y)``."""

    def __init__(self, head: str, depth: int = 4):
        super().__init__()
        self.head = head
        self.emb = nn.Embedding(20, 8)
        self.body = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.out = nn.Linear(8, 5)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True) if head == "attention" else None

    def forward(self, x, y):
        e = self.emb(x)
        if self.att is not None:
            e = e + self.att(e, e, e, key_padding_mask=x < 3)[0]
        h = e.mean(1)
        for layer in self.body:
            h = torch.tanh(layer(h))
        return HEADS[self.head](self, h, x, y)


def _ce(m, h, y, **kw):
    return F.cross_entropy(m.out(h), y, **kw)


def _rows_loss(m, h, y):
    return F.cross_entropy(m.out(h), y, reduction="none")


HEADS = {
    # rows coupled: each micro-batch would compute these over its own rows
    "batch-statistic": lambda m, h, x, y: _ce(m, (h - h.mean(0)) / (h.std(0) + 1e-3), y),
    "batch-max": lambda m, h, x, y: _ce(m, h - h.max(0).values, y),
    "topk": lambda m, h, x, y: _rows_loss(m, h, y).topk(4).values.mean(),
    "sort": lambda m, h, x, y: _rows_loss(m, h, y).sort(descending=True).values[:5].sum(),
    "cumsum": lambda m, h, x, y: _ce(m, h.cumsum(0) / 4, y),
    "softmax-weights": lambda m, h, x, y: (torch.softmax(_rows_loss(m, h, y).detach(), 0) * _rows_loss(m, h, y)).sum(),
    "roll": lambda m, h, x, y: _ce(m, h + 0.5 * h.roll(1, 0), y),
    "flip": lambda m, h, x, y: _ce(m, h * h.flip(0), y),
    "similarity": lambda m, h, x, y: F.cross_entropy(F.normalize(h, dim=-1) @ F.normalize(h, dim=-1).T, y),
    "arange-labels": lambda m, h, x, y: _ce(m, h, torch.arange(x.shape[0]) % 5),
    "linspace-weights": lambda m, h, x, y: (_rows_loss(m, h, y) * torch.linspace(0, 1, x.shape[0])).mean(),
    "arange-as-data": lambda m, h, x, y: _ce(m, h + torch.arange(x.shape[0]).unsqueeze(1), y),
    # a divisor fixed at the batch's size: each micro-batch's loss would be divided by it too
    "sum-over-12": lambda m, h, x, y: F.cross_entropy(m.out(h), y, reduction="sum") / 12.0,
    # rows independent
    "sum-over-rows": lambda m, h, x, y: F.cross_entropy(m.out(h), y, reduction="sum") / x.shape[0],
    "zeros-state": lambda m, h, x, y: _ce(m, h + torch.zeros(x.shape[0], 8) + 1, y),
    "attention": lambda m, h, x, y: _ce(m, h, y),
    "ignore-index": lambda m, h, x, y: _ce(m, h, y.masked_fill(x[:, 0] < 4, -100), ignore_index=-100),
    "class-weights": lambda m, h, x, y: _ce(m, h, y, weight=torch.tensor(WEIGHTS, dtype=h.dtype)),
    "label-smoothing": lambda m, h, x, y: _ce(m, h, y, label_smoothing=0.1),
    "scaled-loss": lambda m, h, x, y: _ce(m, h, y) * 2 / 4,
    # each row picks its own row (HF's pooling at the last token: logits[torch.arange(b), lengths])
    "row-gather": lambda m, h, x, y: _ce(m, torch.stack([h, -h], 1)[torch.arange(x.shape[0]), x[:, 0] % 2], y),
    # a weight tiled over the batch (DeBERTa-v2's relative positions repeated per row)
    "tiled-weight": lambda m, h, x, y: _ce(m, h + m.body[0].bias.unsqueeze(0).repeat(x.shape[0], 1), y),
}
COUPLED = {
    "batch-statistic": "reduction over the batch's rows",
    "batch-max": "other than by a sum or mean",
    "topk": "other than by a sum or mean",
    "sort": "'sort'",
    "cumsum": "'cumsum'",
    "softmax-weights": "'softmax'",
    "roll": "'roll'",
    "flip": "'flip'",
    "similarity": "[12, 12] for the batch but [6, 6]",
    "arange-labels": "torch.arange",
    "linspace-weights": "torch.arange",
    "arange-as-data": "the indices 0 .. 11 of the batch's rows",
    "sum-over-12": "divided by 12.0 for the batch and by 12.0",
}
SEPARABLE = [h for h in HEADS if h not in COUPLED]


def _data(batch: int = 12):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 20, (batch, 7), generator=g), torch.randint(0, 5, (batch,), generator=g)


def _model(head: str) -> nn.Module:
    torch.manual_seed(0)
    return Rows(head).to(F64)


def _traces(head: str, parts: int = 2):
    model, inputs = _model(head), _data()
    return trace(model, inputs), trace(model, micro_batches(inputs, parts, 12)[0])


@pytest.mark.parametrize("head", list(COUPLED))
def test_a_model_coupling_the_rows_is_found_with_its_line(head):
    why = rows_coupled(*_traces(head), 2)
    assert why is not None and COUPLED[head] in why, why
    assert "test_pipeline_rows.py" in why and "pipeline=False" in why


@pytest.mark.parametrize("head", SEPARABLE)
def test_a_model_with_independent_rows_passes(head):
    assert rows_coupled(*_traces(head), 2) is None


def test_the_rows_of_a_reshape_are_followed_through_interleaving():
    # nn.MultiheadAttention (batch_first) merges tokens with the batch: [7, 12, 2, 8] -> [84, 16]
    # holds row b at 7 positions (outer 7), and [84, 16] -> [7, 12, 16] gives them back as dim 1
    assert _refactor((7, 12, 2, 8), (1, 1, 1), (84, 16)) == (0, 7, 1)
    assert _refactor((84, 16), (0, 7, 1), (7, 12, 16)) == (1, 1, 1)
    assert _refactor((12, 7, 16), (0, 1, 1), (12, 7, 2, 8)) == (0, 1, 1)
    assert _refactor((7, 12, 16), (1, 1, 1), (7, 24, 8)) == (1, 1, 2)  # heads inside the batch dim
    assert _refactor((12, 6), (0, 1, 1), (6, 12)) is None  # a view that splits the rows


def test_the_planner_leaves_the_pipeline_out_and_keeps_it_for_independent_rows():
    x, y = _data()
    coupled = choose_plan(_model("batch-statistic"), two_groups(), (x, y))
    pipeline = next(k for k in coupled.kinds if k.plan_kind == "pipeline")
    assert pipeline.status == "not applicable" and "couples the batch's rows" in pipeline.reason
    assert coupled.kind != "pipeline"
    fine = choose_plan(_model("zeros-state"), two_groups(), (x, y), kinds=("pipeline",))
    assert fine.kind == "pipeline"


def _explicit(rank, world, head):
    x, y = _data()
    try:
        hapc.compile(_model(head), two_groups(), (x, y), pipeline=True, num_micro=2)
    except HapcError as exc:
        return str(exc)
    return "compiled"


def test_an_explicit_pipeline_is_refused_on_every_rank():
    texts = run_distributed(_explicit, 2, "topk")
    assert texts[0] == texts[1] and "topk" in texts[0] and "pipeline=False" in texts[0]


def _runtime(rank, world, head):
    # the runtime's own check, under the planner: a pipeline spec given directly
    x, y = _data()
    model = _model(head)
    try:
        PipelineModule(model, (x, y), pipeline_spec(model, (x, y), [1, 1], [[0], [1]], [1e10, 1e10], [2, 1], 2))
    except HapcError as exc:
        return str(exc)
    return "built"


def test_the_runtime_refuses_a_spec_given_directly():
    texts = run_distributed(_runtime, 2, "arange-labels")
    assert all("torch.arange" in t for t in texts), texts


def _train(rank, world, head):
    x, y = _data()
    module = hapc.compile(_model(head), two_groups(), (x, y), pipeline=True, num_micro=2)
    losses = []
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(float(module.train_step(x, y)))
        optimizer.step()
    return losses, module.full_state_dict()


@pytest.mark.parametrize("head", ["zeros-state", "attention", "row-gather", "sum-over-rows"])
def test_independent_rows_pipeline_exactly(head):
    results = run_distributed(_train, 2, head)
    model = _model(head)
    want = sgd_steps(model, _data(), steps=3, lr=0.5)
    for rank, (losses, state) in enumerate(results):
        assert_close(losses, want, F64, f"rank {rank} losses")
        assert_close(state, dict(model.state_dict()), F64, f"rank {rank} state")
