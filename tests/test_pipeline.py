"""The pipeline runtime gives single-device training (issue 6, acceptance 1).

Real gloo processes run a GPT-like and a BERT-like model cut into 2 and 3 stages, with an SPMD
program (uneven ratios) inside at least one stage, 4-8 micro-batches and each schedule policy;
the batch loss, every parameter gradient and the parameters after three optimizer steps equal
single-device training of the whole batch (float64).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
from harness import assert_close, make_optimizer, one_device_steps, pipeline_steps, two_groups

import hapc
from hapc import models
from hapc.cluster import Cluster
from hapc.errors import HapcError, ModelAttributeError
from hapc.pipeline import compile_pipeline
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.schedule import KINDS, eager_1f1b_warmup, one_f_one_b_warmup
from hapc.pipeline.stages import balanced_cuts, split_graph
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

STEPS = 3


def _model(alias: str, batch: int):
    model, inputs = models.load(alias, batch=batch, dtype=torch.float64)
    return model, inputs


def _job(rank, world, alias, batch, weights, ranks, flops, warmups, num_micro, opt):
    torch.set_num_threads(1)
    model, inputs = _model(alias, batch)
    graph = trace(model, micro_batches(inputs, num_micro, batch)[0])
    spec = PipelineSpec(
        cuts=balanced_cuts(graph, weights),
        ranks=ranks,
        clusters=[cluster_of([flops[r] for r in rs]) for rs in ranks],
        warmups=warmups,
        num_micro=num_micro,
    )
    pm = PipelineModule(model, inputs, spec)
    return pipeline_steps(pm, inputs, STEPS, opt)


def _single(alias, batch, opt):
    return one_device_steps(*_model(alias, batch), STEPS, opt)


CASES = [
    # alias, batch, stage weights, ranks per stage, flops per rank, warm-ups, micro-batches, optimizer
    ("gpt", 8, [1, 1], [[0, 1, 2], [3]], [1e10, 6e9, 3e9, 8e9], [2, 1], 4, "sgd"),
    ("gpt", 8, [2, 1, 1], [[0, 1], [2], [3, 4]], [1e10, 5e9, 8e9, 6e9, 2e9], [4, 2, 1], 8, "adam"),
    ("bert", 8, [1, 1], [[0, 1], [2, 3]], [1e10, 4e9, 9e9, 3e9], [3, 1], 4, "adam"),
    ("bert", 12, [1, 1, 1], [[0, 1], [2, 3], [4, 5]], [1e10, 5e9, 8e9, 8e9, 3e9, 6e9], [5, 2, 1], 6, "sgd"),
]


@pytest.mark.parametrize("alias,batch,weights,ranks,flops,warmups,num_micro,opt", CASES)
def test_pipeline_equals_single_device(alias, batch, weights, ranks, flops, warmups, num_micro, opt):
    world = sum(map(len, ranks))
    results = run_distributed(_job, world, alias, batch, weights, ranks, flops, warmups, num_micro, opt, timeout=240)
    ref = _single(alias, batch, opt)
    for rank, res in enumerate(results):
        assert_close(res["losses"], ref["losses"], torch.float64, f"rank {rank} losses")
        assert_close(res["grads"], ref["grads"], torch.float64, f"rank {rank} grads")
        assert_close(res["state"], ref["state"], torch.float64, f"rank {rank} state")


@pytest.mark.parametrize("policy", ["1f1b", "eager"])
def test_other_schedules_give_the_same_training(policy):
    warm = one_f_one_b_warmup(3) if policy == "1f1b" else eager_1f1b_warmup(3)
    case = ("gpt", 8, [1, 1, 1], [[0], [1, 2], [3]], [1e10, 6e9, 4e9, 8e9], warm, 4, "sgd")
    results = run_distributed(_job, 4, *case, timeout=240)
    ref = _single("gpt", 8, "sgd")
    assert_close(results[0]["losses"], ref["losses"], torch.float64, "losses")
    assert_close(results[0]["grads"], ref["grads"], torch.float64, "grads")


def test_split_graph_keeps_the_loss_and_passes_skips_through():
    model, inputs = _model("gpt", 4)
    g = trace(model, inputs)
    want = g.run(dict(zip(g.input_names, inputs)))
    stages = split_graph(g, balanced_cuts(g, [1, 1, 1, 1]))
    values = dict(zip(g.input_names, inputs))
    flat = None
    for st in stages:
        feed = {n: values[n] for n in st.model_inputs}
        if st.receives:
            names = [n.name for n in st.graph.inputs][len(st.model_inputs) :]
            feed.update(dict(zip(names, st.unpack(flat))))
        flat = st.graph.run(feed)
        if st.index < len(stages) - 1:
            assert flat.numel() == st.send_numel and st.sends == stages[st.index + 1].receives
            assert flat.shape[0] == 4  # packed as [batch rows, features]: a batch-sharded stage sends its rows
    assert torch.equal(flat, want)


def test_bad_pipeline_inputs_are_clear_errors():
    model, inputs = _model("gpt", 8)
    g = trace(model, inputs)
    with pytest.raises(HapcError, match="increase strictly"):
        split_graph(g, [60, 40])
    with pytest.raises(HapcError, match="equal micro-batches"):
        micro_batches(inputs, 3, 8)
    spec = PipelineSpec([60], [[0], [0]], [cluster_of([1e10])] * 2, [2, 1], 2)
    with pytest.raises(HapcError, match="exactly one stage"):
        spec.check(2)


def _other_batch_job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = _model("gpt", 8)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 4)
    pm = PipelineModule(model, inputs, spec)
    refused = []
    for rows in (2, 6):  # 2: one micro-batch's rows, which used to run as every micro-batch
        with pytest.raises(HapcError, match=rf"compiled for batches of 8 rows .*got {rows}.*drop_last=True"):
            pm.train_step(*(x[:rows] for x in inputs))
        refused.append(rows)
    with torch.no_grad(), pytest.raises(HapcError, match="got 4"):
        pm(*(x[:4] for x in inputs))  # evaluation batches too
    return {"refused": refused, "loss": pm.train_step(*inputs).item(), "grads": pm.full_gradients()}


def test_a_batch_of_another_size_is_refused_and_the_pipeline_goes_on():
    """A pipeline's programs and cut routes are planned for its batch size; another size is refused on
    every rank alike (the global batch is every rank's), naming the fix, and the module still trains."""
    model, inputs = _model("gpt", 8)
    loss = model(*inputs)
    loss.backward()
    for got in run_distributed(_other_batch_job, 2, timeout=180):
        assert got["refused"] == [2, 6]
        assert got["loss"] == pytest.approx(loss.item(), rel=1e-12)
        for k, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][k], p.grad, rtol=1e-9, atol=1e-12, msg=k)


def _groups_by_name(named) -> list[dict]:
    """AdamW groups as Hugging Face's recipe makes them: no weight decay for biases and norms."""
    named = list(named)
    plain = [p for n, p in named if n.endswith(".bias") or ".ln" in n]
    return [{"params": [p for n, p in named if not any(p is q for q in plain)], "weight_decay": 0.5},
            {"params": plain, "weight_decay": 0.0}]  # fmt: skip


def _named_groups_job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = _model("gpt", 8)
    graph = trace(model, micro_batches(inputs, 2, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 2)
    pm = PipelineModule(model, inputs, spec)
    names = [n for n, _ in pm.named_parameters()]
    optimizer = torch.optim.AdamW(_groups_by_name(pm.named_parameters()), lr=0.05, eps=1e-6)
    for _ in range(2):
        optimizer.zero_grad()
        pm.train_step(*inputs)
        optimizer.step()
    return {"names": names, "state": pm.full_state_dict()}


def test_parameters_carry_the_model_s_names_for_name_based_groups():
    """``named_parameters()`` of a stage lists its parameters under the model's names, so weight-decay
    groups written for the model (biases and norms left out) train as on one device; listed by the
    program's attribute names (``module.program.blocks_0_ln1_bias``) the rule silently decayed them."""
    model, inputs = _model("gpt", 8)
    optimizer = torch.optim.AdamW(_groups_by_name(model.named_parameters()), lr=0.05, eps=1e-6)  # eps: harness
    for _ in range(2):
        optimizer.zero_grad()
        model(*inputs).backward()
        optimizer.step()
    results = run_distributed(_named_groups_job, 2, timeout=180)
    assert sorted(n for r in results for n in r["names"]) == sorted(n for n, _ in model.named_parameters())
    for got in results:
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)


def _no_sync_job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = _model("gpt", 8)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 4,
                        replicas=[[[0], [1]], [[2], [3]]])  # fmt: skip
    pm = PipelineModule(model, inputs, spec)
    optimizer = torch.optim.SGD(pm.parameters(), lr=0.1)
    for k, batch in enumerate([inputs, tuple(x.flip(0) for x in inputs)]):  # DDP's accumulation loop
        with pm.no_sync() if k == 0 else contextlib.nullcontext():
            (pm(*batch) / 2).backward()
    grads = pm.full_gradients()
    optimizer.step()
    return {"grads": grads, "state": pm.full_state_dict()}


def test_ddp_s_no_sync_accumulation_loop_runs_on_pipeline_replicas():
    """``with module.no_sync():`` (DDP's gradient accumulation) on two replicas of a 2-stage pipeline:
    the accumulated gradients and the step equal one device's."""
    model, inputs = _model("gpt", 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in [inputs, tuple(x.flip(0) for x in inputs)]:
        (model(*batch) / 2).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    optimizer.step()
    for got in run_distributed(_no_sync_job, 4, timeout=240):
        for k, g in grads.items():
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-9, atol=1e-12, msg=k)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=k)


def _ddp_module_job(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    out = []
    for kind in ({"pipeline": True, "num_micro": 2}, {"segmented": True}, {"pipeline": False}):
        model, inputs = _model("gpt", 8)
        model.config = {"layers": 2}  # (a Hugging Face model's config)
        module = hapc.compile(model, cluster_of([1e10, 4e9]) if kind.get("segmented") else two_groups(), inputs, **kind)
        assert not hasattr(module, "module")  # an AttributeError: hasattr / getattr(..., default) work
        with pytest.raises(ModelAttributeError, match=r"'config' belongs to the model.*module\.unwrap\(\)\.config"):
            _ = module.config
        with pytest.raises(AttributeError) as plain:
            _ = module.no_such_attribute
        assert not isinstance(plain.value, ModelAttributeError)
        with pytest.raises(ModelAttributeError, match=r"DDP's wrapped model.*module\.unwrap\(\)") as caught:
            module.module.state_dict()
        out.append(type(module).__name__)
        assert "module.unwrap()" in str(caught.value)
    return out


def test_ddp_s_module_attribute_names_unwrap_on_every_kind():
    """``ddp_model.module`` is how DDP scripts reach the model (``.module.state_dict()``,
    ``.module.save_pretrained``); a pipeline answered with its stage's program module, whose state
    is one stage's part of the model: a checkpoint saved so silently lacked the other stages. The
    model's own attributes (``config``) are refused naming ``unwrap()`` on every kind alike."""
    kinds = run_distributed(_ddp_module_job, 2, timeout=240)[0]
    assert kinds == ["PipelineModule", "SegmentedModule", "CompiledModule"]


def groups(n: int) -> Cluster:
    """``n`` groups of 2 devices (each slower than the last), fast links inside each group and slow
    ones between neighbouring groups: HARP's setting in miniature."""
    link = {"bandwidth": "10 GB/s", "latency": "20 us"}
    names = ["fast", "mid", "slow"][:n] if n <= 3 else [f"g{i}" for i in range(n)]
    return Cluster.from_dict(
        {
            "name": f"{n}-groups",
            "group": [
                {"name": g, "devices": 2, "devices_per_host": 2, "flops": f"{20 / (i + 1):g} TFLOPS", "memory": "8 GiB"}
                for i, g in enumerate(names)
            ],
            "links": {
                "intra_host": link,
                "inter_host": link,
                "between": [
                    {"groups": [a, b], "bandwidth": "100 MB/s", "latency": "100 us"}
                    for a, b in itertools.pairwise(names)
                ],
            },
        }
    )


def _planned_job(rank, world, alias, n, num_micro):
    torch.set_num_threads(1)
    model, inputs = _model(alias, 8)
    if alias == "gpt":  # hapc.compile pipelines by itself: the cluster's groups are joined by a slow link
        pm = hapc.compile(model, groups(n), inputs, num_micro=num_micro)
    else:
        pm = compile_pipeline(model, groups(n), inputs, num_micro=num_micro)
    with torch.no_grad():
        evaluation = pm(*inputs).item()  # the forwards alone
    loss = pm(*inputs)  # DDP's loop: the forwards now, the backwards in loss.backward() (GPipe's order)
    loss.backward()
    out = {"eval": evaluation, "ddp loss": loss.item(), "ddp grads": pm.full_gradients()}
    pm.zero_grad()
    loss = pm.train_step(*inputs).item()
    return {"loss": loss, "grads": pm.full_gradients(), "ranks": pm.spec.ranks, **out}


@pytest.mark.parametrize("alias,n", [("gpt", 2), ("bert", 2), ("bert", 3)])
def test_planned_pipeline_over_groups_equals_single_device(alias, n):
    """The planner places the stages (HARP DP), each stage synthesizes its SPMD program for its
    sub-mesh, the runtime trains: the whole chain gives the single-device gradients."""
    results = run_distributed(_planned_job, 2 * n, alias, n, 4, timeout=240)
    ref = _single(alias, 8, "sgd")
    assert all(len(rs) >= 1 for rs in results[0]["ranks"]) and len(results[0]["ranks"]) >= 2
    for rank, res in enumerate(results):
        assert_close(res["loss"], ref["losses"][0], torch.float64, f"rank {rank} loss")
        assert_close(res["grads"], ref["grads"], torch.float64, f"rank {rank} grads")
        # module(*batch) then loss.backward(), and a no-grad evaluation: the same numbers
        for key in ("eval", "ddp loss"):
            assert_close(res[key], ref["losses"][0], torch.float64, f"rank {rank} {key}")
        assert_close(res["ddp grads"], ref["grads"], torch.float64, f"rank {rank} grads of loss.backward()")


def _ignored_job(rank, world, num_micro):
    torch.set_num_threads(1)
    model, (idx, targets) = _model("gpt", 8)
    targets = _ignore_some(targets)
    graph = trace(model, micro_batches((idx, targets), num_micro, 8)[0])
    spec = PipelineSpec(
        balanced_cuts(graph, [1, 1]), [[0, 1], [2]], [cluster_of([1e10, 5e9]), cluster_of([8e9])], [2, 1], 4
    )
    pm = PipelineModule(model, (idx, targets), spec)
    return {"loss": pm.train_step(idx, targets).item(), "grads": pm.full_gradients()}


def _ignore_some(targets):
    out = targets.clone()
    out[0, :] = -100  # micro-batch 0 (rows 0-1) counts half the targets of the others
    out[5, 3:] = -100
    return out


def test_ignored_targets_weigh_micro_batches_by_their_counts():
    """A mean cross-entropy with ignore_index: micro-batches count different numbers of targets,
    so each weighs count_m / sum(count), not 1/M -- exactly the single-device batch loss."""
    model, (idx, targets) = _model("gpt", 8)
    loss = model(idx, _ignore_some(targets))
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for rank, res in enumerate(run_distributed(_ignored_job, 3, 4, timeout=240)):
        assert_close(res["loss"], loss.item(), torch.float64, f"rank {rank} loss")
        assert_close(res["grads"], want, torch.float64, f"rank {rank} grads")


class _Regression(torch.nn.Module):
    """Two layers and a loss the test picks: a sum (weight 1 per micro-batch) or a scaled mean (refused)."""

    def __init__(self, loss: str):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.loss = torch.nn.Linear(6, 10), torch.nn.Linear(10, 3), loss

    def forward(self, x, y):
        err = (self.b(torch.relu(self.a(x))) - y) ** 2
        return err.sum() if self.loss == "sum" else 2 * err.mean()


def _regression_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def _sum_job(rank, world):
    model, inputs = _Regression("sum").double(), _regression_data()
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 4)
    pm = PipelineModule(model, inputs, spec)
    return {"loss": pm.train_step(*inputs).item(), "grads": pm.full_gradients()}


def test_a_sum_loss_weighs_micro_batches_by_one():
    model, inputs = _Regression("sum").double(), _regression_data()
    loss = model(*inputs)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for res in run_distributed(_sum_job, 2):
        assert_close(res["loss"], loss.item(), torch.float64, "loss")
        assert_close(res["grads"], want, torch.float64, "grads")


def test_a_loss_that_is_neither_mean_nor_sum_is_refused():
    from hapc.pipeline.stages import loss_weighting

    graph = trace(_Regression("scaled").double(), _regression_data())
    with pytest.raises(HapcError, match="mean or a sum"):
        loss_weighting(graph)


def _checkpoint_job(rank, world):
    torch.set_num_threads(1)
    model, inputs = _model("bert", 8)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = dict(cuts=balanced_cuts(graph, [1, 1]), ranks=[[0, 1], [2]], warmups=[2, 1], num_micro=4)
    clusters = [cluster_of([1e10, 4e9]), cluster_of([8e9])]
    pm = PipelineModule(model, inputs, PipelineSpec(clusters=clusters, **spec))
    opt = make_optimizer("adam", pm.parameters())
    for _ in range(2):
        opt.zero_grad()
        pm.train_step(*inputs)
        opt.step()
    saved = pm.full_state_dict(opt)
    # a fresh pipeline over other ranks per stage resumes from the single-device checkpoint
    fresh, _ = _model("bert", 8)
    clusters = [cluster_of([6e9]), cluster_of([1e10, 2e9])]
    pm2 = PipelineModule(fresh, inputs, PipelineSpec(clusters=clusters, **{**spec, "ranks": [[0], [1, 2]]}))
    opt2 = make_optimizer("adam", pm2.parameters())
    pm2.load_full_state_dict(saved, opt2)
    opt2.zero_grad()
    pm2.train_step(*inputs)
    opt2.step()
    return {"saved": saved, "resumed": pm2.full_state_dict(opt2)}


def test_pipeline_checkpoints_are_single_device_state_and_resume_on_another_layout():
    model, inputs = _model("bert", 8)
    opt = make_optimizer("adam", model.parameters())
    states = []
    for _ in range(3):
        opt.zero_grad()
        model(*inputs).backward()
        opt.step()
        states.append(hapc.checkpoint.full_state(model, opt))
    for rank, res in enumerate(run_distributed(_checkpoint_job, 3, timeout=240)):
        assert_close(res["saved"], states[1], torch.float64, f"rank {rank} checkpoint after 2 steps")
        assert_close(res["resumed"], states[2], torch.float64, f"rank {rank} resumed third step")


def _bn_job(rank, world):
    model, inputs = models.load("cnn", dtype=torch.float64, batch_norm=True)
    graph = trace(model, micro_batches(inputs, 2, inputs[0].shape[0])[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 2)
    try:
        PipelineModule(model, inputs, spec)
    except HapcError as e:
        return str(e)
    return "accepted"


def test_batch_norm_in_training_is_refused_in_a_pipeline():
    for msg in run_distributed(_bn_job, 2):
        assert "micro-batch by its own statistics" in msg


def _stage_dies(rank, world):
    import os
    import signal

    from hapc.pipeline import runtime

    model, inputs = _model("gpt", 8)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1, 1]), [[0], [1], [2]], [cluster_of([1e10])] * 3, [3, 2, 1], 4)
    pm = PipelineModule(model, inputs, spec)
    forward = runtime._Step.F

    def dying(step, m):  # the middle stage dies after its second forward, mid-step
        forward(step, m)
        if rank == 1 and m == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    runtime._Step.F = dying
    return pm.train_step(*inputs).item()


def test_a_stage_that_dies_stops_the_pipeline():
    """Its neighbours wait on messages it will never send: they fail by themselves (the peer closed
    the connection), nobody hangs."""
    from hapc.errors import DistributedRunError

    with pytest.raises(DistributedRunError) as err:
        run_distributed(_stage_dies, 3, timeout=20)
    e = err.value
    assert e.died == {1: -9} and e.hung == []
    assert set(e.errors) == {0, 2}
    lost = ("closed", "reset", "read error", "remote worker crashing", "timed out")  # how gloo words it
    assert all(any(w in msg.lower() for w in lost) for msg in e.errors.values()), e.errors


def _stage_hangs(rank, world, flag_dir):
    import time
    from pathlib import Path

    from hapc.pipeline import runtime

    model, inputs = _model("gpt", 8)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1, 1]), [[0], [1], [2]], [cluster_of([1e10])] * 3, [3, 2, 1], 4)
    # the job's own timeout is long (60 s); the pipeline's messages give up after 3
    pm = PipelineModule(model, inputs, spec, timeout=3)
    forward = runtime._Step.F
    flags = Path(flag_dir)

    def stuck(step, m):  # the middle stage stops sending after its second forward, alive
        forward(step, m)
        if rank == 1 and m == 1:
            while len(list(flags.iterdir())) < world - 1:
                time.sleep(0.05)
            raise SystemExit("resumed after the others gave up")

    runtime._Step.F = stuck
    try:
        return pm.train_step(*inputs).item()
    finally:
        (flags / str(rank)).touch()


def test_a_stage_that_hangs_times_out_its_neighbours(tmp_path):
    """A stage alive but silent: its neighbours give up after the pipeline's timeout, not the job's."""
    from hapc.errors import DistributedRunError

    with pytest.raises(DistributedRunError) as err:
        run_distributed(_stage_hangs, 3, str(tmp_path), timeout=60)
    e = err.value
    assert e.hung == [] and e.died == {}
    assert all("3000ms" in e.errors[r] or "timeout" in e.errors[r].lower() for r in (0, 2)), e.errors


def _released_job(rank, world, ranks, warmups, num_micro, emulate):
    """Train two steps while counting, before every action, the sent tensors still alive (a weak
    reference per message: gloo's pending send keeps its tensor alive too)."""
    import weakref

    from hapc.pipeline import runtime

    torch.set_num_threads(1)
    model, inputs = _model("gpt", 12)
    graph = trace(model, micro_batches(inputs, num_micro, 12)[0])
    flops = [1e10, 6e9, 8e9, 5e9, 7e9]
    spec = PipelineSpec(
        cuts=balanced_cuts(graph, [1] * len(ranks)),
        ranks=ranks,
        clusters=[cluster_of([flops[r] for r in rs]) for rs in ranks],
        warmups=warmups,
        num_micro=num_micro,
    )
    pm = PipelineModule(model, inputs, spec, emulate=emulate)
    sent: list = []
    peak = [0]
    isend, methods = runtime.PipelineModule._isend, {k: getattr(runtime._Step, k) for k in KINDS}

    def tracked_isend(self, x, dst, tag, emulated):
        work, msg = isend(self, x, dst, tag, emulated)
        sent.append(weakref.ref(msg))
        return work, msg

    def counted(kind):
        def action(step, m):
            peak[0] = max(peak[0], sum(r() is not None for r in sent))
            return methods[kind](step, m)

        return action

    runtime.PipelineModule._isend = tracked_isend
    for k in KINDS:
        setattr(runtime._Step, k, counted(k))
    losses = [pm.train_step(*inputs).item() for _ in range(2)]
    return {"peak": peak[0], "losses": losses, "grads": pm.full_gradients(), "pool": len(pm._pool)}


@pytest.mark.parametrize(
    "ranks,warmups,emulate",
    [
        ([[0], [1], [2]], [3, 2, 1], None),  # one rank per stage
        ([[0, 1], [2, 3], [4]], [5, 2, 1], {"bandwidth": 2e9, "latency": 1e-4}),  # relays, emulated links
    ],
)
def test_sent_activations_are_released_during_the_step(ranks, warmups, emulate):
    """Every sent tensor is dropped once a later message proves it received: the live ones stay
    within the schedule's in-flight counts (not the 2M a stage sends in a step), the activation
    receive buffers are pooled within the warm-up count, and training equals one device."""
    num_micro = 12
    world = sum(map(len, ranks))
    results = run_distributed(_released_job, world, ranks, warmups, num_micro, emulate, timeout=240)
    model, inputs = _model("gpt", 12)
    loss = model(*inputs)
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    stage_of = {r: k for k, rs in enumerate(ranks) for r in rs}
    for rank, res in enumerate(results):
        assert_close(res["losses"], [loss.item()] * 2, torch.float64, f"rank {rank} losses")
        assert_close(res["grads"], {k: 2 * g for k, g in grads.items()}, torch.float64, f"rank {rank} grads")
        k = stage_of[rank]
        # activations in flight (N_k) + gradients awaiting the previous stage's next activation
        # (N_{k-1} + 1); a relay's forwards inside its group are released with the latter
        bound = warmups[k] + (warmups[k - 1] + 1 if k else 0)
        assert res["peak"] <= bound < 2 * num_micro, (rank, res["peak"], bound)
        assert res["pool"] <= (warmups[k] if k else 0), (rank, res["pool"])
    assert all(any(results[r]["peak"] for r in rs) for rs in ranks), "every stage sends"
