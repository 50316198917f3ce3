"""``nn.Embedding`` / ``F.embedding`` options, and table modules whose settings their functional
form does not cover: exact or refused, never silently different (no silent divergence).

* ``scale_grad_by_freq=True`` divides each row's gradient by its token's count in the batch: the
  normalised module keeps the flag, the rule keeps the tokens whole (a shard's counts are not the
  batch's), and a pipeline (whose micro-batches would count on their own) is refused;
* ``max_norm`` renormalises the weight in place during forward, ``sparse=True`` makes sparse
  gradients: refused at capture with the line, by either capture;
* a convolution with ``padding_mode="reflect"``, a max pool returning its indices: traced through
  (``F.pad`` then the convolution), exact; batch norm with ``momentum=None`` refused by name.

float64 on gloo processes (1-3 ranks, uneven ratios), against the same steps on one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, sgd_steps, two_groups
from torch import nn

import hapc
from hapc.errors import HapcError, TraceError
from hapc.planner import choose_plan
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

F64 = torch.float64
VOCAB, DIM, CLASSES = 11, 12, 5


class Tokens(nn.Module):
    """Token ids -> embedding -> a small MLP per token -> mean over tokens -> class logits."""

    def __init__(self, functional: bool = False, depth: int = 2, **emb):
        super().__init__()
        self.functional = functional
        self.emb = nn.Embedding(VOCAB, DIM, **emb)
        self.emb_options = emb
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(depth)])
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, x, y):
        if self.functional:
            h = F.embedding(x, self.emb.weight, **self.emb_options)
        else:
            h = self.emb(x)
        return F.cross_entropy(self.out(self.body(h).mean(1)), y)


class Reflect(nn.Module):
    """A convolution padded by reflection, then a max pool returning its indices."""

    def __init__(self, padding_mode: str = "reflect"):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1, padding_mode=padding_mode)
        self.pool = nn.MaxPool1d(2, return_indices=True)
        self.out = nn.Linear(DIM, CLASSES)

    def forward(self, x, y):
        h, _ = self.pool(torch.tanh(self.conv(self.emb(x).transpose(1, 2))))
        return F.cross_entropy(self.out(h.mean(2)), y)


def _data(batch: int = 12, tokens: int = 7):
    # 84 tokens from 11 ids: every id repeats, so a shard's counts differ from the batch's
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, tokens), generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def _model(cls, kwargs):
    torch.manual_seed(0)
    return cls(**kwargs).to(F64)


def _job(rank, world, cls, kwargs, cluster, options):
    x, y = _data()
    module = hapc.compile(_model(cls, kwargs), cluster, (x, y), **options)
    losses = sgd_steps(module, (x, y), steps=3, lr=0.5)
    return losses, {k: v.clone() for k, v in module.state_dict().items()}


def _check(cls, kwargs, cluster, world, **options):
    results = run_distributed(_job, world, cls, kwargs, cluster, options)
    model = _model(cls, kwargs)
    x, y = _data()
    want = sgd_steps(model, (x, y), steps=3, lr=0.5)
    for rank, (losses, state) in enumerate(results):
        assert_close(losses, want, F64, f"rank {rank} losses")
        assert_close(state, dict(model.state_dict()), F64, f"rank {rank} state")


CASES = {
    "module-3-ranks": (Tokens, {"scale_grad_by_freq": True}, "local-cpu:3", 3, {}),
    "functional-3-ranks": (Tokens, {"functional": True, "scale_grad_by_freq": True}, "local-cpu:3", 3, {}),
    "module-padding-tp": (
        Tokens,
        {"scale_grad_by_freq": True, "padding_idx": 0},
        cluster_of([3e9, 1e9]),
        2,
        {"baseline": "tp", "ratios": [0.6, 0.4]},
    ),
    "module-segmented": (Tokens, {"scale_grad_by_freq": True, "depth": 4}, two_groups(), 2, {"segmented": True}),
    "module-1-rank": (Tokens, {"scale_grad_by_freq": True}, "local-cpu:1", 1, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_scale_grad_by_freq_trains_as_one_device(case):
    """The counts are the whole batch's on every plan kind the planner may choose for it (before,
    the module dropped the flag and a token-sharded lookup counted its shard's tokens)."""
    cls, kwargs, cluster, world, options = CASES[case]
    _check(cls, kwargs, cluster, world, **options)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_the_flag_reaches_the_graph(capture):
    x, y = _data()
    graph = trace(_model(Tokens, {"scale_grad_by_freq": True}), (x, y), capture=capture)
    (node,) = [n for n in graph if n.op == "embedding"]
    assert node.kwargs.get("scale_grad_by_freq") is True


def test_the_planner_leaves_the_pipeline_out():
    x, y = _data()
    choice = choose_plan(_model(Tokens, {"scale_grad_by_freq": True, "depth": 4}), two_groups(), (x, y))
    pipeline = next(k for k in choice.kinds if k.plan_kind == "pipeline")
    assert pipeline.status == "not applicable"
    assert "scale_grad_by_freq=True" in pipeline.reason and "each micro-batch" in pipeline.reason
    assert choice.kind != "pipeline"


def _explicit_pipeline(rank, world):
    x, y = _data()
    model = _model(Tokens, {"functional": True, "scale_grad_by_freq": True, "depth": 4})
    try:
        hapc.compile(model, two_groups(), (x, y), pipeline=True, num_micro=4)
    except HapcError as exc:
        return str(exc)
    return "compiled"


def test_an_explicit_pipeline_is_refused():
    texts = run_distributed(_explicit_pipeline, 2)
    assert texts[0] == texts[1]
    assert "scale_grad_by_freq=True" in texts[0] and "pipeline=False" in texts[0]


REFUSED = {
    "max_norm": ({"max_norm": 1.0}, "embedding with max_norm"),
    "max_norm-functional": ({"functional": True, "max_norm": 1.0}, "embedding with max_norm"),
    "sparse": ({"sparse": True}, "embedding with sparse=True"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_options_the_program_cannot_replay_are_refused_with_the_line(case):
    kwargs, text = REFUSED[case]
    x, y = _data()
    with pytest.raises(TraceError, match=text) as info:
        trace(_model(Tokens, kwargs), (x, y))
    assert "test_embedding_options.py" in str(info.value)  # the model's line


@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"sparse": True}])
def test_the_export_capture_refuses_them_too(kwargs):
    x, y = _data()
    with pytest.raises(TraceError, match=r"embedding_renorm_|sparse=True"):
        trace(_model(Tokens, kwargs), (x, y), capture="export")


def test_batch_norm_with_a_cumulative_average_is_refused_by_name():
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.bn = nn.BatchNorm1d(DIM, momentum=None)

        def forward(self, x, y):
            return F.cross_entropy(self.bn(self.emb(x).mean(1))[:, :CLASSES], y)

    x, y = _data()
    refusal = r"module 'bn' \(BatchNorm1d\): batch norm with momentum=None.*give it a momentum"
    with pytest.raises(TraceError, match=refusal):
        trace(Cumulative(), (x, y))
    assert trace(Cumulative().eval(), (x, y)) is not None  # eval mode reads the running statistics: fine


@pytest.mark.parametrize("padding_mode", ["reflect", "circular"])
def test_a_reflect_padded_convolution_is_traced_through_and_exact(padding_mode):
    _check(Reflect, {"padding_mode": padding_mode}, "local-cpu:3", 3)
