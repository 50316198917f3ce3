"""A pipeline's and a segmented module's other outputs (logits) handed back whole.

Under ``outputs="whole"`` (the default) the forward of a :class:`~hapc.pipeline.PipelineModule`
and of a :class:`~hapc.segmented.SegmentedModule` returns the model's structure with every tensor
besides the loss equal to what one device returns for the whole batch, on every rank: the stage
computing it (the last, for logits) returns it from its program made whole over its ranks, a
micro-batch at a time; the micro-batches' values are concatenated along the batch dimension in
order and broadcast to every rank, across pipeline replicas too (each holds a range of
micro-batches). A returned tensor whose dim 0 is not the batch is refused where the batch is
split; ``outputs="loss"`` returns ``None`` at no cost; ``train_step`` returns the loss alone. The
planner prices the hand-back (the broadcasts' alpha-beta) and may then choose a pipeline for a
model returning logits.

Every distributed case runs on gloo processes in float64 and compares with one device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import pipeline_spec, two_groups
from torch import nn

import hapc
from hapc import models
from hapc.models.gpt import CONFIGS, GPT
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.stages import balanced_cuts
from hapc.planner import choose_plan
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

TOL = {"rtol": 1e-9, "atol": 1e-12}


class _Logits(GPT):
    """The zoo's tiny GPT returning ``{"loss", "logits", "hidden"}`` (``hidden``: the first block's
    output, computed by the first stage) -- or, with ``scalar``, ``{"loss", "mean"}``: the output
    head's mean weight, which the loss subtracts from the logits (cross-entropy is unchanged by
    it), returned for logging: a scalar with no batch dimension. (A returned tensor the loss does
    not depend on is not captured: ``None`` in any kind. A mean over the batch's rows that the loss
    reads couples the micro-batches: tests/test_pipeline_rows.py.)"""

    def __init__(self, cfg, scalar: bool = False):
        super().__init__(cfg)
        self.scalar = scalar

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        hidden = x = self.blocks[0](x)
        for block in self.blocks[1:]:
            x = block(x)
        logits = self.head(self.ln(x))
        if self.scalar:
            mean = self.head.weight.mean()
            return {"loss": F.cross_entropy((logits - mean).view(b * t, -1), targets.view(b * t)), "mean": mean}
        loss = F.cross_entropy(logits.view(b * t, -1), targets.view(b * t))
        return {"loss": loss, "logits": logits, "hidden": hidden}


def _gpt(scalar: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    plain, inputs = models.load("gpt", batch=8, dtype=torch.float64)
    torch.manual_seed(0)
    model = _Logits(CONFIGS["tiny"], scalar).double()
    model.load_state_dict(plain.state_dict())
    return model, inputs


#: (stage weights, ranks per stage, flops per rank, warm-ups, micro-batches, replicas, the last
#: stage's memory per device)
CASES = {
    "two stages": ([1, 1], [[0], [1]], [1e10, 1e10], [2, 1], 4, None, "4 GiB"),
    "three stages": ([1, 1, 2], [[0], [1], [2]], [1e10] * 3, [3, 2, 1], 4, None, "4 GiB"),
    "two replicas": ([1, 1], [[0], [1]], [1e10] * 4, [2, 1], 4, [[[0], [1]], [[2], [3]]], "4 GiB"),
    # the last stage an SPMD program on two ranks at uneven speeds: its logits sharded by rows, gathered
    "sharded last stage": ([1, 1], [[0], [1, 2]], [1e10, 8e9, 3e9], [2, 1], 4, None, "4 GiB"),
}


def _outputs_job(rank, world, case):
    torch.set_num_threads(1)
    model, inputs = _gpt()
    pm = PipelineModule(model, inputs, pipeline_spec(model, inputs, *CASES[case]))
    out = pm(*inputs)  # training: the logits with the loss, the backward through the loss alone
    with pytest.raises(hapc.HapcError, match="metrics only"):
        out["logits"].sum().backward()
    out["loss"].backward()
    grads = pm.full_gradients()
    with torch.no_grad():
        evaluated = pm(*inputs)
    step = pm.train_step(*inputs)
    # the stage's program makes its sharded logits whole over its ranks (CompiledModule's outputs="whole")
    sharded = any("output_whole" in line and "'S'" in line for line in pm.stage_module.program.code.splitlines())
    return {"train": {k: v.detach() for k, v in out.items()}, "eval": evaluated, "grads": grads,
            "step": step, "stage": pm.stage, "sharded": sharded, "grad": out["logits"].requires_grad}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_hands_back_the_whole_batch_logits(case):
    """The logits (last stage) and a hidden state (first stage) of the tiny GPT pipelined on 2 to 4
    ranks -- two and three stages, two replicas, a last stage sharded over two ranks -- equal one
    device's for the whole batch on every rank, in training (beside a loss whose backward gives one
    device's gradients) and under ``no_grad``; a backward through them raises; ``train_step``
    returns the loss tensor alone."""
    ranks, replicas = CASES[case][1], CASES[case][5]
    world = sum(len(rs) for rep in (replicas or [ranks]) for rs in rep)
    results = run_distributed(_outputs_job, world, case, timeout=300)
    model, inputs = _gpt()
    want = model(*inputs)
    want["loss"].backward()
    for got in results:
        for mode in ("train", "eval"):
            out = got[mode]
            assert set(out) == {"loss", "logits", "hidden"}
            for key in ("logits", "hidden"):
                torch.testing.assert_close(out[key], want[key].detach(), **TOL, msg=f"{case}, {mode}: {key}")
                assert not out[key].requires_grad or mode == "train"
            assert float(out["loss"]) == pytest.approx(float(want["loss"].detach()), rel=1e-10)
        assert got["grad"]  # under grad mode: marked, so that a backward through it is refused
        for k, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][k], p.grad, **TOL, msg=f"{case}: {k}")
        assert isinstance(got["step"], torch.Tensor) and got["step"].dim() == 0
    if case == "sharded last stage":  # the stage's own gather of its row-sharded logits ran
        assert any(got["sharded"] for got in results if got["stage"] == 1), results


def _loss_only_job(rank, world):
    torch.set_num_threads(1)
    model, inputs = _gpt()
    pm = PipelineModule(model, inputs, pipeline_spec(model, inputs, *CASES["two stages"]), outputs="loss")
    out = pm(*inputs)
    out["loss"].backward()
    return {k: v if v is None else float(v) for k, v in out.items()}, pm._routed


def test_outputs_loss_hands_back_none_at_no_cost():
    """``outputs="loss"``: the other tensors ``None``, no stage program returns them (nothing routed)."""
    for got, routed in run_distributed(_loss_only_job, 2, timeout=300):
        assert got["logits"] is None and got["hidden"] is None and routed == []
        assert got["loss"] is not None


def _refused_job(rank, world, outputs):
    torch.set_num_threads(1)
    model, inputs = _gpt(scalar=True)
    try:
        pm = PipelineModule(model, inputs, pipeline_spec(model, inputs, *CASES["two stages"]), outputs=outputs)
    except hapc.HapcError as exc:
        return str(exc)
    return pm(*inputs)["mean"]


def test_an_output_without_a_batch_dimension_is_refused():
    """A scalar besides the loss would come back as the micro-batches' values concatenated -- not
    the batch's: refused on every rank, naming ``outputs='loss'``; under
    ``outputs="loss"`` the same pipeline runs (the scalar ``None``)."""
    for message in run_distributed(_refused_job, 2, "whole", timeout=300):
        assert "['mean']" in message and "outputs='loss'" in message and "dim 0" in message, message
    assert run_distributed(_refused_job, 2, "loss", timeout=300) == [None, None]


def _hf_pipeline_job(rank, world, stages):
    tk = pytest.importorskip("test_pipeline_keywords")
    torch.set_num_threads(1)
    model, batch = tk._gpt2()
    if stages == 2:  # the user's path: hapc.compile, keyword calls
        module = hapc.compile(model, two_groups(), batch, pipeline=True, num_micro=4)
    else:
        graph = trace(model, micro_batches(batch, 4, 8)[0])
        spec = PipelineSpec(
            cuts=balanced_cuts(graph, [1] * stages), ranks=[[r] for r in range(stages)],
            clusters=[cluster_of([1e10])] * stages, warmups=list(range(stages, 0, -1)), num_micro=4,
        )  # fmt: skip
        module = PipelineModule(model, batch, spec)
    out = module(**batch)
    out.loss.backward()
    grads = module.full_gradients()
    module.eval()
    with torch.no_grad():
        evaluated = module(**batch)
    return {"kind": type(module).__name__, "logits": out.logits.detach(), "eval": evaluated.logits,
            "loss": float(out.loss.detach()), "grads": grads}  # fmt: skip


@pytest.mark.parametrize("stages", [2, 3])
def test_a_hugging_face_gpt2_pipeline_hands_back_its_logits(stages):
    """The tiny GPT-2 (its output layer tied to the token embedding), called by keyword, pipelined
    on two ranks by ``hapc.compile(pipeline=True)`` and on three by a three-stage spec: ``out.logits``
    equals one device's logits on every rank, in training and in eval mode under ``no_grad``."""
    tk = pytest.importorskip("test_pipeline_keywords")
    results = run_distributed(_hf_pipeline_job, stages, stages, timeout=300)
    model, batch = tk._gpt2()
    want = model(**batch)
    want.loss.backward()
    for got in results:
        assert got["kind"] == "PipelineModule"
        torch.testing.assert_close(got["logits"], want.logits.detach(), **TOL)
        torch.testing.assert_close(got["eval"], want.logits.detach(), **TOL)
        assert got["loss"] == pytest.approx(float(want.loss), rel=1e-6)  # (transformers' float32 loss)
        for k, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][k], p.grad, rtol=1e-9, atol=1e-12, msg=k)


def _segmented_plan(world: int):
    from hapc.segmented import SegmentedPlan, plan_segmented

    model, inputs = _gpt()
    graph = trace(model, inputs)
    ratios = [[0.6, 0.4], [0.25, 0.75]] if world == 2 else [[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]
    plan = plan_segmented(graph, cluster_of([1e10, 5e9, 3e9][:world]), balanced_cuts(graph, [1, 1]), ratios=ratios)
    return SegmentedPlan.from_json(plan.to_json())


def _segmented_job(rank, world, plan, outputs):
    torch.set_num_threads(1)
    model, inputs = _gpt()
    module = hapc.compile(model, cluster_of([1e10, 5e9, 3e9][:world]), inputs, plan=plan, outputs=outputs)
    out = module(*inputs)
    if outputs == "whole":
        with pytest.raises(hapc.HapcError, match="metrics only"):
            out["logits"].sum().backward()
    out["loss"].backward()
    grads = module.full_gradients()
    module.eval()
    with torch.no_grad():
        evaluated = module(*inputs)
    return {"kind": type(module).__name__, "train": {k: v if v is None else v.detach() for k, v in out.items()},
            "eval": evaluated, "grads": grads}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_per_segment_ratios_hand_back_the_whole_batch_logits(world):
    """The tiny GPT in two segments at different ratios (each segment's rows split unevenly, and
    differently) on two and three ranks: the logits (last segment) and the hidden state (first)
    equal one device's on every rank, in training and under ``no_grad``; ``outputs="loss"``: ``None``."""
    plan = _segmented_plan(world)
    assert plan.plans[0].device_ratios != plan.plans[1].device_ratios
    model, inputs = _gpt()
    want = model(*inputs)
    want["loss"].backward()
    for outputs in ("whole", "loss"):
        for got in run_distributed(_segmented_job, world, plan, outputs, timeout=300):
            assert got["kind"] == "SegmentedModule"
            for mode in ("train", "eval"):
                for key in ("logits", "hidden"):
                    if outputs == "loss":
                        assert got[mode][key] is None
                        continue
                    torch.testing.assert_close(got[mode][key], want[key].detach(), **TOL, msg=f"{mode}: {key}")
                assert float(got[mode]["loss"]) == pytest.approx(float(want["loss"].detach()), rel=1e-10)
            for k, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][k], p.grad, **TOL, msg=k)


def test_the_planner_pipelines_a_model_returning_logits_and_prices_their_hand_back():
    """Under ``outputs="whole"`` the choice between kinds may now pick a pipeline for a model
    returning logits (the slow link makes it faster than SPMD), its time the schedule's plus the
    hand-back: one broadcast per returned tensor and replica over the cluster (100 us, 100 MB/s
    between the groups) of the batch's float64 logits and hidden states -- exactly the difference
    from ``outputs="loss"``, entry by entry. A model returning a scalar besides its loss is left to
    SPMD (the refusal names ``outputs='loss'``), which lets the pipeline be chosen again."""
    model, inputs = _gpt()
    whole = choose_plan(model, two_groups(), inputs, num_micro=4)
    loss = choose_plan(model, two_groups(), inputs, num_micro=4, outputs="loss")
    assert whole.kind == "pipeline" and whole.time < whole.kinds[0].time, whole.describe()
    assert "outputs handed back" in whole.chosen.summary
    nbytes = 8 * (8 * 16 * 97 + 8 * 16 * 32)  # logits [8, 16, 97] and hidden [8, 16, 32], float64
    without = {k.kind: k for k in loss.kinds if k.status in ("feasible", "chosen")}
    priced = [k for k in whole.kinds if k.plan_kind == "pipeline" and k.status in ("feasible", "chosen")]
    assert priced and all(k.kind in without for k in priced)
    for k in priced:
        handback = 2 * k.replicas * 100e-6 + nbytes / 100e6
        assert k.time == pytest.approx(without[k.kind].time + handback, rel=1e-9), k.kind
    scalar, _ = _gpt(scalar=True)
    refused = choose_plan(scalar, two_groups(), inputs, num_micro=4)
    piped = next(k for k in refused.kinds if k.plan_kind == "pipeline")
    assert refused.kind == "spmd" and piped.status == "not applicable", refused.describe()
    assert "['mean']" in piped.reason and "outputs='loss'" in piped.reason
    assert choose_plan(scalar, two_groups(), inputs, num_micro=4, outputs="loss").kind == "pipeline"


def test_the_spmd_and_segmented_kinds_price_their_gather_of_the_outputs():
    """The SPMD program makes the model's other returned tensors whole on every rank after its step
    (``output_whole``), and the planner prices it: under data parallelism (the ``dp-cp`` baseline,
    its rows split at the plan's ratios) the logits and the hidden state are held sharded by rows,
    so each costs one padded all-gather of the largest share over the cluster (two devices across
    the 100 us, 100 MB/s link) -- exactly the difference from ``outputs="loss"``. The per-segment
    kind adds its segments' gathers too."""
    from hapc.planner import gather_seconds

    model, inputs = _gpt()
    cluster = two_groups()
    opts = {"synth_options": {"baseline": "dp-cp"}, "kinds": ("spmd",)}
    whole = choose_plan(model, cluster, inputs, **opts)
    loss = choose_plan(model, cluster, inputs, outputs="loss", **opts)
    share = max(whole.plan.device_ratios)
    assert 0.5 < share < 1
    nbytes = 8 * (8 * 16 * 97 + 8 * 16 * 32)  # logits [8, 16, 97] and hidden [8, 16, 32], float64
    gather = 2 * 100e-6 + share * nbytes / 100e6
    assert whole.time == pytest.approx(loss.time + gather, rel=1e-6), whole.describe()
    assert "outputs gathered" in whole.chosen.summary and "outputs gathered" not in loss.chosen.summary
    # the loss itself is held partial by this program: made whole, it would be an all-reduce of 8 bytes
    graph = trace(model, inputs)
    reduce = gather_seconds(whole.plan, graph, [graph.outputs[graph.loss_leaf]], cluster)
    assert reduce == pytest.approx(cluster.alpha_beta("all_reduce").time(8), rel=1e-12)
    kinds = ("spmd", "segmented")
    seg_whole = choose_plan(model, cluster, inputs, kinds=kinds, prune=False)
    seg_loss = choose_plan(model, cluster, inputs, kinds=kinds, prune=False, outputs="loss")
    priced = {k.kind: k.time for k in seg_loss.kinds if k.status in ("feasible", "chosen")}
    segmented = [k for k in seg_whole.kinds if k.plan_kind == "segmented" and k.status in ("feasible", "chosen")]
    assert segmented, seg_whole.describe()
    for k in segmented:
        assert k.time > priced[k.kind] + 100e-6 and "outputs gathered" in k.summary, k
