"""Pipelines of the models users bring: keyword inputs, tied weights, ``ModelOutput`` results.

A Hugging Face language model is called with keyword inputs (``model(**batch)``), returns a
``ModelOutput`` (loss and logits) and ties its output layer to its token embedding, so the two
ends of a pipeline each hold a copy of one weight. The pipeline binds calls as the model's
``forward`` does, hands back the model's structure (the loss in its place, the logits whole, or
``None`` under ``outputs="loss"``), sums a tied weight's gradient over the stages that use it (one
device accumulates both uses into one ``.grad``), and counts it once in gradient norms. The planner
chooses a pipeline for such a model by cost, the logits' hand-back priced
(tests/test_pipeline_outputs.py checks the logits' values).

Every distributed case trains in float64 on gloo processes and compares losses, gradient norms
and the final state with one device.
"""

from __future__ import annotations

import pytest
import torch
from harness import pipeline_spec, two_groups
from torch import nn

import hapc
from hapc import models
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.stages import balanced_cuts
from hapc.planner import choose_plan
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

realworld = pytest.importorskip("realworld")
pytest.importorskip("transformers")


def _gpt2(name: str = "gpt2") -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model, batch = getattr(realworld, name)(batch=8)
    return model.double(), batch


def test_the_planner_pipelines_a_keyword_model_returning_logits():
    """Keyword inputs do not rule the pipeline out, nor do the logits, which it hands back: priced
    with their broadcast over the 100 MB/s link (1.1 ms, which here makes it slower than SPMD), and
    chosen without it under ``outputs="loss"``."""
    model, batch = _gpt2()
    whole = choose_plan(model, two_groups(), batch, num_micro=4)
    piped = whole.kinds[1]
    assert piped.status in ("feasible", "chosen") and "outputs handed back" in piped.summary, whole.describe()
    loss = choose_plan(model, two_groups(), batch, num_micro=4, outputs="loss")
    assert loss.kind == "pipeline" and loss.time < piped.time


def _gpt2_job(rank, world, name):
    torch.set_num_threads(1)
    model, batch = _gpt2(name)
    module = hapc.compile(model, two_groups(), batch, outputs="loss", num_micro=4)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    out = module(**batch)  # DDP's habit: the model's own call, by keyword
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1e9)  # (no clipping: the norm alone)
    grads = module.full_gradients()
    optimizer.step()
    optimizer.zero_grad()
    second = module.train_step(batch["input_ids"], labels=batch["labels"])  # positional and keyword, bound alike
    optimizer.step()
    with pytest.raises(TypeError, match="missing model input"):
        module(labels=batch["labels"])
    return {
        "kind": type(module).__name__,
        "out": type(out).__name__,
        "logits": out.logits,
        "losses": [float(out.loss), float(second)],
        "dtype": str(second.dtype),
        "norm": float(norm),
        "grads": grads,
        "state": module.full_state_dict(),
    }


@pytest.mark.parametrize("name", ["gpt2", pytest.param("albert", marks=pytest.mark.slow)])
def test_a_hugging_face_language_model_pipelines_exactly(name):
    """GPT-2 (tiny; its output layer tied to the token embedding, in the first and the last stage)
    and ALBERT (masked LM; one layer's weights shared by every layer, so by both stages), called by
    keyword, pipelined on two ranks: the loss, the gradient norm (shared weights counted once),
    every gradient and the state after two steps equal one device's (float64)."""
    results = run_distributed(_gpt2_job, 2, name, timeout=300)
    model, batch = _gpt2(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for step in range(2):
        optimizer.zero_grad()
        out = model(**batch)
        out.loss.backward()
        want.append(float(out.loss))
        if step == 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        optimizer.step()
    state = model.state_dict()
    for got in results:
        assert got["kind"] == "PipelineModule" and got["out"] == type(out).__name__ and got["logits"] is None
        # the model computes its loss in float32 (transformers upcasts the logits); micro-batches' sum
        assert got["losses"] == pytest.approx(want, rel=1e-6) and got["dtype"] == str(out.loss.dtype)
        assert got["norm"] == pytest.approx(norm, rel=1e-10)
        for k, g in grads.items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-9, atol=1e-12, msg=k)
        assert set(got["state"]) == set(state)  # the tied weight under both its names
        for k, v in state.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)


class _Tied(nn.Module):
    """A language model whose output layer is its embedding (``head.weight = emb.weight``)."""

    def __init__(self, vocab: int = 96, dim: int = 24):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _tied() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (8, 6), generator=torch.Generator().manual_seed(1))
    return _Tied().double(), (idx, idx.roll(-1, dims=1))


#: (stage weights, ranks per stage, flops per rank, warm-ups, micro-batches, replicas, the last
#: stage's memory per device)
TIED = {
    # the tied weight's stages are not neighbours: the middle one holds it under neither name
    "three stages": ([1, 1, 2], [[0], [1], [2]], [1e10, 1e10, 1e10], [3, 2, 1], 4, None, "4 GiB"),
    # the last stage on two ranks at uneven speeds, too little memory for a whole copy: it is sharded
    "sharded last stage": ([1, 1], [[0], [1, 2]], [1e10, 8e9, 3e9], [2, 1], 4, None, "60 KiB"),
    "two replicas": ([1, 1], [[0], [1]], [1e10] * 4, [2, 1], 4, [[[0], [1]], [[2], [3]]], "4 GiB"),
}


def _tied_job(rank, world, weights, ranks, flops, warmups, num_micro, replicas, memory):
    torch.set_num_threads(1)
    model, inputs = _tied()
    spec = pipeline_spec(model, inputs, weights, ranks, flops, warmups, num_micro, replicas, memory)
    pm = PipelineModule(model, inputs, spec)
    optimizer = torch.optim.Adam(pm.parameters(), lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for _ in range(3):
        optimizer.zero_grad()
        losses.append(float(pm.train_step(*inputs)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5)))  # clips: the norm is > 0.5
        optimizer.step()
    mod = pm.stage_module
    sharded = sorted(mod.theory.graph[ref].target for ref, lay in mod._layouts.values() if lay.is_sharded)
    state = pm.full_state_dict()
    optimizer.zero_grad()  # gradient accumulation: two steps' gradients add up, the tied ones too
    pm.train_step(*inputs)
    pm.train_step(*(x.flip(0) for x in inputs))
    return {"losses": losses, "norms": norms, "state": state, "sharded": sharded, "stage": pm.stage,
            "accumulated": pm.full_gradients()}  # fmt: skip


@pytest.mark.parametrize("case", list(TIED))
def test_tied_weights_across_stages_train_as_one_device(case):
    """One weight used by the first and the last stage: its copies' gradients are summed and both
    copies step alike, the gradient norm counts it once (clipping active), Adam for three steps;
    then two steps accumulate their gradients (no ``zero_grad`` between) as one device's two
    backwards do -- each step sums this step's contributions alone across stages and replicas."""
    ranks, replicas = TIED[case][1], TIED[case][5]
    world = sum(len(rs) for rep in (replicas or [ranks]) for rs in rep)
    results = run_distributed(_tied_job, world, *TIED[case], timeout=300)
    model, inputs = _tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for _ in range(3):
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(float(loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
    assert min(norms) > 0.5
    state = model.state_dict()
    optimizer.zero_grad()
    model(*inputs).backward()
    model(*(x.flip(0) for x in inputs)).backward()
    for got in results:
        for k, p in model.named_parameters():
            what = f"{case}: accumulated {k}"
            torch.testing.assert_close(got["accumulated"][k], p.grad, rtol=1e-9, atol=1e-12, msg=what)
        assert got["losses"] == pytest.approx(losses, rel=1e-10) and got["norms"] == pytest.approx(norms, rel=1e-10)
        assert set(got["state"]) == set(state)
        for k, v in state.items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=f"{case}: {k}")
    if case == "sharded last stage":  # the path that gathers and slices a sharded copy's gradient ran
        assert any("emb.weight" in got["sharded"] for got in results if got["stage"] == 1), results


def _explicit_job(rank, world):
    model, inputs = _tied()
    out = {}
    for given in ({"loss": 0}, {"outputs": "local"}, {"capture": "export"}):
        with pytest.raises(hapc.HapcError) as err:
            hapc.compile(model, two_groups(), inputs, pipeline=True, **given)
        out[next(iter(given))] = str(err.value)
    return out


def test_an_explicit_pipeline_refuses_the_options_it_would_ignore():
    """``pipeline=True`` with ``loss=``, ``outputs="local"`` or ``capture=`` would train or return
    something else than asked, silently: refused, naming the option."""
    results = run_distributed(_explicit_job, 2, timeout=120)
    for got in results:
        for option, message in got.items():
            assert f"{option}=" in message and "pipeline=True cannot honour" in message, message


def _bert() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model, batch = realworld.bert_cls(batch=6)
    return model.double(), batch


def _segmented_job(rank, world):
    torch.set_num_threads(1)
    model, batch = _bert()
    module = hapc.compile(model, cluster_of([1e10, 3e9]), batch, segmented=True)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    out = module(**batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    second = module.train_step(**batch)
    optimizer.step()
    return {"kind": type(module).__name__, "out": type(out).__name__, "logits": out.logits.detach(),
            "losses": [float(out.loss), float(second)], "state": module.full_state_dict()}  # fmt: skip


def test_per_segment_ratios_take_a_keyword_model():
    """BERT (tiny, sequence classification) called by keyword under per-segment ratios on two ranks
    at uneven speeds: the ``ModelOutput`` comes back with the loss, and two steps equal one device's;
    the logits come back whole (one device's); the planner weighs the kind whatever ``outputs``."""
    model, batch = _bert()
    for outputs in ("whole", "loss"):
        choice = choose_plan(model, cluster_of([1e10, 3e9]), batch, kinds=("spmd", "segmented"), outputs=outputs)
        assert choice.kinds[2].status in ("feasible", "chosen", "pruned", "infeasible"), choice.describe()
    results = run_distributed(_segmented_job, 2, timeout=300)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for _ in range(2):
        optimizer.zero_grad()
        out = model(**batch)
        out.loss.backward()
        want.append(float(out.loss))
        optimizer.step()
    fresh, batch = _bert()
    logits = fresh(**batch).logits.detach()  # the first step's forward, before any update
    for got in results:
        assert got["kind"] == "SegmentedModule" and got["out"] == type(out).__name__
        torch.testing.assert_close(got["logits"], logits, rtol=1e-9, atol=1e-12)
        assert got["losses"] == pytest.approx(want, rel=1e-10)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)


def test_synth_pipelines_a_keyword_model_returning_logits(capsys, tmp_path, monkeypatch):
    """``hapc synth`` of a user's factory returning a Hugging Face model and a dict batch prices the
    pipeline with the logits' hand-back (which here leaves it slower than SPMD); ``--outputs loss``
    prices it without, and plans it."""
    from hapc.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hfzoo.py").write_text(
        "import realworld\n\ndef gpt2():\n    return realworld.gpt2(batch=8)\n", encoding="utf-8"
    )
    (tmp_path / "slow.toml").write_text(two_groups().to_toml(), encoding="utf-8")
    args = ["synth", "hfzoo:gpt2", "--cluster", "slow.toml", "--micro", "4"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "handed back" in out, out  # (the table wraps the summary)
    assert main([*args, "--outputs", "loss"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "pipelined on" in out and "handed back" not in out


def _replicas_accumulate(rank, world):
    torch.set_num_threads(1)
    model, (idx, targets) = models.load("gpt", batch=8, dtype=torch.float64)
    graph = trace(model, micro_batches((idx, targets), 4, 8)[0])
    spec = PipelineSpec(
        cuts=balanced_cuts(graph, [1, 1]), ranks=[[0], [1]], clusters=[cluster_of([1e10])] * 2, warmups=[2, 1],
        num_micro=4, replicas=[[[0], [1]], [[2], [3]]],
    )  # fmt: skip
    pm = PipelineModule(model, (idx, targets), spec)
    pm.train_step(idx, targets)
    loss = pm(idx.flip(0), targets.flip(0))  # DDP's call, accumulating onto the first step's gradients
    loss.backward()
    return pm.full_gradients()


def test_gradients_accumulate_over_steps_of_pipeline_replicas():
    """Two data-parallel replicas of a 2-stage GPT (no tied weights): two steps without
    ``zero_grad`` between hold the sum of one device's two backwards. (Summing the replicas' whole
    gradients after the second step counted the first step's twice: 0.046 off, silently.)"""
    results = run_distributed(_replicas_accumulate, 4, timeout=300)
    model, (idx, targets) = models.load("gpt", batch=8, dtype=torch.float64)
    model(idx, targets).backward()
    model(idx.flip(0), targets.flip(0)).backward()
    for got in results:
        for k, p in model.named_parameters():
            torch.testing.assert_close(got[k], p.grad, rtol=1e-9, atol=1e-12, msg=k)


def test_the_planner_prices_the_tied_weights_all_reduce():
    """A plan whose stages share a weight adds the all-reduce of its gradient to the step time:
    ring all-reduce of the weight's bytes over the sharing stages' devices, on the slowest link
    between their groups (here the 100 MB/s one); the same model untied adds nothing."""
    from hapc.pipeline import plan_pipeline

    model, inputs = _tied()
    micro = micro_batches(inputs, 4, 8)[0]
    plan = plan_pipeline(model, two_groups(), micro, num_micro=4)
    assert len(plan.stages) == 2 and {s.group for s in plan.stages} == {"fast", "slow"}
    nbytes = 96 * 24 * 8  # emb.weight, float64
    alpha, beta = 2 * 100e-6, 2 * 1 / (2 * 100e6)  # 2 devices over the 100 MB/s, 100 us link
    assert plan.tied_sync == pytest.approx(alpha + beta * nbytes, rel=1e-12)
    assert "tied across stages" in plan.describe()
    untied = _Tied().double()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    other = plan_pipeline(untied, two_groups(), micro, num_micro=4)
    assert other.tied_sync == 0.0 and other.cuts() == plan.cuts()
    assert plan.time - plan.tied_sync == pytest.approx(other.time, rel=1e-9)
