"""The runtime around the generated programs: checkpoints across plans, emitted code, local
batches, gradient accumulation, and the errors a user meets when something does not match."""

from __future__ import annotations

import json
import re

import pytest
import torch
from harness import assert_close, make_optimizer, one_device_grads, small_buckets

import hapc
import hapc.collectives
from hapc import models
from hapc.codegen.emit import emit_code, load_rank_module, rank_source
from hapc.errors import HapcError
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
SLOW3 = cluster_of([5e9, 3e9, 2e9], bandwidth="10 MB/s")
TWO = cluster_of([3e9, 1e9])


def _plan(alias, cluster, **kw):
    model, inputs = models.load(alias, dtype=F64)
    return hapc.synthesize(model, cluster, inputs, **kw)


# -- checkpoints --------------------------------------------------------------------------------


def _train_and_save(rank, world, cluster, plan, path):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-6)
    for _ in range(2):
        opt.zero_grad()
        m(*inputs).backward()
        opt.step()
    state = m.full_state_dict(opt)
    if rank == 0:
        hapc.checkpoint.save(state, path)
    return state


def _load_and_continue(rank, world, cluster, plan, path):
    _, inputs = models.load("gpt", dtype=F64)
    model, _ = models.load("gpt", dtype=F64, seed=123)  # other initial weights: all must come from the file
    m = hapc.compile(model, cluster, inputs, plan=plan)
    opt = torch.optim.Adam(m.parameters(), lr=0.5, eps=1e-6)  # hyper-parameters come from the file too
    m.load_full_state_dict(hapc.checkpoint.load(path), opt)
    reloaded = m.full_state_dict(opt)
    opt.zero_grad()
    m(*inputs).backward()
    opt.step()
    return reloaded, m.full_state_dict(opt)


def test_checkpoint_moves_between_plans_and_to_one_device(tmp_path):
    """Acceptance 2: 3 ranks under plan A -> 2 ranks under plan B -> one device, nothing lost."""
    path = tmp_path / "ckpt.pt"
    plan_a = _plan("gpt", SLOW3)  # tensor-parallel pieces, uneven
    plan_b = _plan("gpt", TWO, baseline="dp-cp")  # data parallel, 0.75 / 0.25
    assert plan_a.device_ratios != plan_b.device_ratios and len(plan_b.device_ratios) == 2
    saved = run_distributed(_train_and_save, 3, SLOW3, plan_a, str(path))[0]
    assert any(k.endswith("exp_avg_sq") for st in saved["optimizer"]["state"].values() for k in st)

    on_b = run_distributed(_load_and_continue, 2, TWO, plan_b, str(path))
    for reloaded, _ in on_b:
        assert_close(reloaded, saved, F64, "plan B reload")  # identical: slicing and gathering are exact
        for key, t in saved["model"].items():
            assert torch.equal(reloaded["model"][key], t), key

    _, inputs = models.load("gpt", dtype=F64)
    model, _ = models.load("gpt", dtype=F64, seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=0.5, eps=1e-6)
    hapc.checkpoint.load_full_state(model, hapc.checkpoint.load(path), opt)
    single = hapc.checkpoint.full_state(model, opt)
    assert_close(single, saved, F64, "single-device reload")
    opt.zero_grad()
    model(*inputs).backward()
    opt.step()
    after = hapc.checkpoint.full_state(model, opt)
    for _, stepped in on_b:  # one more step under plan B == one more step on one device
        assert_close(stepped, after, F64, "step after reload")


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    hapc.checkpoint.save({"model": {"w": torch.ones(2)}}, path)

    def crash(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        hapc.checkpoint.save({"model": {"w": torch.zeros(2)}}, path)
    monkeypatch.undo()
    assert torch.equal(hapc.checkpoint.load(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temporary left behind
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(HapcError, match="not a readable hapc checkpoint"):
        hapc.checkpoint.load(tmp_path / "bad.pt")


# -- emitted code ---------------------------------------------------------------------------------


def _emitted_matches(rank, world, cluster, plan, directory):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    cls = load_rank_module(f"{directory}/rank{rank}.py", rank)
    mine = cls(group=None, device="cpu", dtype=F64)
    mine.load_state_dict(m.program.state_dict(), strict=True)
    loss_a = m(*inputs)
    loss_a.backward()
    loss_b = mine(*inputs)
    loss_b.backward()
    assert torch.equal(loss_a.detach(), loss_b.detach())
    for name, p in mine.named_parameters():
        grad = p.grad
        if m._layouts[name][1].is_replicated and m._layouts[name][0] not in m.grad_complete:
            grad = hapc.collectives.all_reduce(grad)  # the emitted class leaves gradient sync to its user
        torch.testing.assert_close(grad, getattr(m.program, name).grad, rtol=1e-12, atol=1e-15, msg=name)
    return m.code


def test_emitted_files_run_and_equal_the_compiled_program(tmp_path):
    plan = _plan("gpt", SLOW3)
    paths = emit_code(plan, plan._theory, tmp_path)
    assert [p.name for p in paths] == ["rank0.py", "rank1.py", "rank2.py", "plan.json"]
    assert hapc.Plan.from_json(json.loads(paths[-1].read_text())).to_json() == plan.to_json()
    src = paths[1].read_text()
    assert "class Rank1(torch.nn.Module)" in src and "C.all_gather(" in src and "F.linear(" in src
    assert not re.search(r";\s+\w+ = None", src)  # no fx bookkeeping in what people read
    assert "is_causal=True" in src
    # rank 1 holds 11 of the 32 hidden features in this plan: its literal shapes say so
    assert "[10, 11, 11]" in src
    run_distributed(_emitted_matches, 3, SLOW3, plan, str(tmp_path))


def test_rank_source_is_deterministic():
    plan = _plan("mlp", SLOW3)
    assert rank_source(plan._theory, plan, 2) == rank_source(plan._theory, plan, 2)


# -- batches --------------------------------------------------------------------------------------


def _local_batch(rank, world, cluster, plan):
    from hapc.balance.rounding import bounds

    model, (x, y) = models.load("mlp", dtype=F64)
    m = hapc.compile(model, cluster, (x, y), plan=plan)
    whole = m(x, y).item()  # every rank the whole batch: the mean's token count needs no all-reduce
    ref = next(n.index for n in plan._theory.graph.inputs if n.name == "x")
    lo, hi = bounds(plan._theory.local_sizes(ref, 0, plan.device_ratios))[rank]
    with pytest.raises(HapcError, match="earlier calls gave every rank the same global batch"):
        m(x[lo:hi], y[lo:hi])  # the kind of batch is settled by the calls before
    shares = hapc.compile(model, cluster, (x, y), plan=plan)
    mine = shares(x[lo:hi], y[lo:hi]).item()  # this rank's share only (the count is all-reduced)
    again = shares(x, y).item()  # a module fed shares may still be given the whole batch
    # neither the global batch (16) nor any rank's share (8, 5, 3): another batch size, run exactly
    six = shares(x[:6], y[:6]).item() - model(x[:6], y[:6]).item() + whole
    return whole, mine, again, six


def test_forward_takes_the_global_batch_or_the_local_share():
    plan = _plan("mlp", cluster_of([5e9, 3e9, 2e9]), baseline="dp-cp")
    assert plan.device_ratios == pytest.approx([0.5, 0.3, 0.2])
    model, inputs = models.load("mlp", dtype=F64)
    ref = model(*inputs).item()
    for results in run_distributed(_local_batch, 3, cluster_of([5e9, 3e9, 2e9]), plan):
        assert results == pytest.approx([ref] * 4, rel=1e-12)


def _zero(opt, how):
    if how != "keep":  # "keep": the second step accumulates onto the first step's gradients
        opt.zero_grad(set_to_none=how == "set_to_none")
    if how == "mixed":  # zeroed in place, but one gradient replaced by a new tensor: the bucket
        for p in opt.param_groups[0]["params"]:  # then holds views and one gradient of its own
            if p.grad is not None:
                p.grad = torch.zeros_like(p)
                break


def _accumulate(rank, world, cluster, plan, micro, how, no_sync):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    opt = make_optimizer("sgd", m.parameters())
    out = []
    for _ in range(2):  # two optimizer steps, each over `micro` backward passes of the same batch
        _zero(opt, how)
        for i in range(micro):
            if no_sync and i < micro - 1:
                with m.no_sync():  # sum once, at the last backward
                    m(*inputs).backward()
            else:
                m(*inputs).backward()
        out.append(m.full_gradients())
        opt.step()
    out.append(m.full_state_dict())
    return out


def _single_accumulate(micro, how):
    model, inputs = models.load("gpt", dtype=F64)
    opt = make_optimizer("sgd", model.parameters())
    out = []
    for _ in range(2):
        _zero(opt, how)
        for _ in range(micro):
            model(*inputs).backward()
        out.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    out.append({k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("buckets", ["one", "many"])
@pytest.mark.parametrize(
    "how,no_sync",
    [
        ("set_to_none", False),
        ("zeroed_in_place", False),
        ("mixed", False),
        ("set_to_none", True),
        ("keep", True),
        ("keep", False),
    ],
)
def test_gradient_accumulation_over_backward_passes(how, no_sync, buckets, monkeypatch):
    """Replicated parameters' gradients are synced per backward (or once, after backwards under
    ``no_sync``); accumulating must still sum each contribution once, whether gradients were
    dropped, zeroed in place (then they live in the sync buckets) or kept from the last step --
    with one bucket (synced when the backward ends) or many (each sent as soon as it is full)."""
    if buckets == "many":  # 2 KiB buckets: ~20 for this model
        small_buckets(monkeypatch)
    cluster = cluster_of([5e9, 3e9, 2e9])
    plan = _plan("gpt", cluster, baseline="dp-cp")
    got = run_distributed(_accumulate, 3, cluster, plan, 3, how, no_sync)
    want = _single_accumulate(3, how)
    for res in got:
        assert_close(res, want, F64, "accumulated")


def _some_inputs(model, how, shared):
    """Two AdamW steps (weight decay), each backward into only some parameters: the first into the
    even-numbered ones, the second into the odd-numbered ones (``loss.backward(inputs=...)``)."""
    names = sorted(k for k, _ in shared.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    params = dict(shared.named_parameters())
    out = []
    for step in range(2):
        _zero(opt, how)
        model(*model._hapc_inputs).backward(inputs=[params[k] for k in names[step::2]])
        out.append(sorted(k for k, p in params.items() if p.grad is None))
        opt.step()
    return out


def _some_inputs_job(rank, world, cluster, plan, how):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    m._hapc_inputs = inputs
    nones = _some_inputs(m, how, m)
    return nones, m.full_gradients(), m.full_state_dict()


@pytest.mark.parametrize("buckets", ["one", "many"])
@pytest.mark.parametrize("how", ["set_to_none", "zeroed_in_place", "keep"])
def test_backward_into_some_parameters_leaves_the_others_as_on_one_device(how, buckets, monkeypatch):
    """``loss.backward(inputs=[...])`` accumulates into the listed parameters only: the others keep
    their gradient -- None after ``zero_grad()`` (AdamW then skips them: a zero gradient would decay
    them), or the sum of an earlier step, which must not be summed across ranks again."""
    if buckets == "many":
        small_buckets(monkeypatch)
    cluster = cluster_of([5e9, 3e9, 2e9])
    plan = _plan("gpt", cluster, baseline="dp-cp")
    model, inputs = models.load("gpt", dtype=F64)
    model._hapc_inputs = inputs
    want_nones = _some_inputs(model, how, model)
    want_grads = {k: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for k, p in model.named_parameters()}
    assert want_nones[0] or how == "keep", "the test leaves some gradients None"
    for nones, grads, state in run_distributed(_some_inputs_job, 3, cluster, plan, how):
        assert len(nones[0]) == len(want_nones[0]) and len(nones[1]) == len(want_nones[1]), "None where one device"
        assert_close(grads, want_grads, F64, "gradients")
        assert_close(state, model.state_dict(), F64, "parameters after AdamW")


def _bucketed_grads(rank, world, cluster, plan):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    m(*inputs).backward()
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in m._buckets]
    return sizes, max(p.numel() * p.element_size() for b in m._buckets for p in b), m.full_gradients()


def test_gradient_buckets_hold_a_share_of_the_synced_bytes(monkeypatch):
    """Only the last bucket's all-reduce waits after the backward, so where the gradients fit one
    big bucket they are split: after the first, no bucket holds more than 1 / BUCKETS_PER_SYNC of
    the synced bytes beyond the parameter that closed it. Three uneven ranks still sum every
    gradient exactly as one device computes it (float64, a GPT's odd-sized parameters)."""
    import hapc.codegen.module as module

    monkeypatch.setattr(module, "FIRST_BUCKET_BYTES", 64)  # the share, not the first cap, sets the sizes
    cluster = cluster_of([5e9, 3e9, 2e9])
    plan = _plan("gpt", cluster, baseline="dp-cp")
    _, want = one_device_grads("gpt", dtype=F64)
    for sizes, largest, grads in run_distributed(_bucketed_grads, 3, cluster, plan):
        share = sum(sizes) // module.BUCKETS_PER_SYNC
        assert len(sizes) >= module.BUCKETS_PER_SYNC, sizes
        assert all(size < share + largest for size in sizes[1:]), (sizes, share)
        assert_close(grads, want, F64, "gradients")


# -- errors ---------------------------------------------------------------------------------------


def test_compile_outside_a_distributed_job_says_how_to_start_one():
    model, inputs = models.load("mlp")
    with pytest.raises(HapcError, match="torchrun"):
        hapc.compile(model, "local-cpu:2", inputs)


def _compile_job(rank, world, cluster, plan, kwargs):
    model, inputs = models.load("mlp", **kwargs.pop("model", {}))
    hapc.compile(model, cluster, inputs, plan=plan, **kwargs)


@pytest.mark.parametrize(
    "world, cluster, plan_for, kwargs, message",
    [
        (2, "local-cpu:3", None, {}, "has 3 devices but the job has 2 processes"),
        (2, "local-cpu:3", "local-cpu:3", {}, "3 devices .* 2"),
        (2, "local-cpu:2", "local-cpu:2", {"model": {"widths": (24, 32, 48)}}, "another model|different model"),
        (2, "local-cpu:2", None, {"bogus": 1}, "unknown option"),
    ],
    ids=["cluster-vs-world", "plan-vs-world", "plan-vs-model", "unknown-option"],
)
def test_mismatches_are_refused_with_the_fix(world, cluster, plan_for, kwargs, message):
    plan = None
    if plan_for is not None:
        model, inputs = models.load("mlp")
        plan = hapc.synthesize(model, plan_for, inputs)
    with pytest.raises(HapcError, match=message):
        run_distributed(_compile_job, world, cluster, plan, kwargs, timeout=30)


def _eval_job(rank, world):
    model, inputs = models.load("cnn", batch_norm=True)
    m = hapc.compile(model, "local-cpu:2", inputs)
    m.eval()


def test_switching_train_eval_on_a_batch_norm_model_is_refused():
    with pytest.raises(HapcError, match=r"compile the model again after model\.eval"):
        run_distributed(_eval_job, 2, timeout=30)


# -- models built on the meta device -------------------------------------------------------------


def _meta_job(rank, world, cluster, plan):
    _, inputs = models.load("gpt", dtype=F64)
    model, _ = models.load("gpt", dtype=F64, device="meta")
    m = hapc.compile(model, cluster, inputs, plan=plan, seed=5)
    loss = m(*inputs)
    loss.backward()
    local_bytes = sum(p.numel() for p in m.parameters())
    return m.full_state_dict(), loss.item(), m.full_gradients(), local_bytes


def test_meta_models_are_initialised_per_shard():
    """No rank ever holds the whole model: it draws one module at a time and keeps its slices;
    the result is exactly a slicing of the single-device model materialize() gives."""
    from hapc.materialize import materialize

    cluster = SLOW3
    plan = _plan("gpt", cluster)
    got = run_distributed(_meta_job, 3, cluster, plan)
    model, _ = models.load("gpt", dtype=F64, device="meta")
    materialize(model, seed=5)
    _, inputs = models.load("gpt", dtype=F64)
    loss = model(*inputs)
    loss.backward()
    total = sum(p.numel() for p in model.parameters())
    for state, value, grads, local in got:
        for k, v in model.state_dict().items():
            assert torch.equal(state[k], v), k
        assert value == pytest.approx(loss.item(), rel=1e-12)
        assert_close(grads, {k: p.grad for k, p in model.named_parameters()}, F64, "grad")
        assert local < total  # tensor-parallel pieces: each rank holds less than the model
    model2, _ = models.load("gpt", dtype=F64, device="meta")
    assert torch.equal(materialize(model2, seed=5).state_dict()["wte.weight"], model.state_dict()["wte.weight"])
    assert not torch.equal(
        materialize(models.load("gpt", dtype=F64, device="meta")[0], seed=6).state_dict()["wte.weight"],
        model.state_dict()["wte.weight"],
    )
