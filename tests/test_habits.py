"""DDP / FSDP habits: each trains exactly as on one device or is refused with a ``HapcError``
naming the cause and the fix -- never a silent difference (issue 13, DESIGN §9).

Every case runs on 2 and 3 gloo processes in float64, under the default plan (uneven ratios) and
a forced parameter-sharding plan (Megatron TP at fixed uneven ratios)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import assert_close

import hapc
from hapc import models
from hapc.codegen.dcp_shards import ShardEntry
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTERS = {2: cluster_of([3e9, 1e9]), 3: cluster_of([5e9, 3e9, 2e9])}
UNEVEN = {2: [0.6, 0.4], 3: [0.5, 0.3, 0.2]}
PLANS = [(world, kind) for world in (2, 3) for kind in ("default", "tp")]


def _plan(alias: str, world: int, kind: str):
    model, inputs = models.load(alias, dtype=F64)
    options = {"baseline": "tp", "ratios": UNEVEN[world]} if kind == "tp" else {}
    plan = hapc.synthesize(model, CLUSTERS[world], inputs, **options)
    if kind == "tp":
        assert any(
            i.layout.is_sharded
            for i in plan.instructions
            if type(i).__name__ == "Source" and "weight" in plan.node_names[i.ref]
        ), "the forced plan shards parameters"
    return plan


def _train(module, inputs, steps: int, opt=None) -> None:
    opt = opt or torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        module(*inputs).backward()
        opt.step()


def _one_device(alias: str, steps: int) -> dict[str, torch.Tensor]:
    model, inputs = models.load(alias, dtype=F64)
    _train(model, inputs, steps)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- item 6: state_dict() that tools understand -----------------------------------------------------


def _save_dcp_and_torch(rank, world, alias, plan, other, directory):
    model, inputs = models.load(alias, dtype=F64)
    keys = list(model.state_dict())
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan)
    _train(m, inputs, 2)
    sd = m.state_dict()
    assert list(sd) == keys, "module.state_dict() keys are the model's own, in its order"
    if rank == 0:  # the DDP habit: save on rank 0, load into the plain model later
        torch.save(sd, f"{directory}/model.pt")
    dcp.save(sd, checkpoint_id=f"{directory}/dcp")
    # load the DCP checkpoint into a module of other initial weights, under the other plan
    fresh, _ = models.load(alias, dtype=F64, seed=77)
    m2 = hapc.compile(fresh, CLUSTERS[world], inputs, plan=other)
    target = m2.state_dict()
    dcp.load(target, checkpoint_id=f"{directory}/dcp")
    m2.load_state_dict(target)
    return m2.full_state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load on one process
@pytest.mark.parametrize("world, kind", PLANS)
@pytest.mark.parametrize("alias", ["mlp", "gpt"])
def test_state_dict_round_trips_through_dcp_and_torch_save(alias, world, kind, tmp_path):
    plan = _plan(alias, world, kind)
    other = _plan(alias, world, "default" if kind == "tp" else "tp")
    results = run_distributed(_save_dcp_and_torch, world, alias, plan, other, str(tmp_path))
    want = _one_device(alias, 2)
    for rank, state in enumerate(results):
        assert_close(state, want, F64, f"rank {rank}: DCP checkpoint loaded under another plan")
    # torch.save(module.state_dict()) on rank 0 -> the plain model: single-device training
    plain, _ = models.load(alias, dtype=F64, seed=5)
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert_close(dict(plain.state_dict()), want, F64, "torch.save on rank 0, loaded into the plain model")
    # the DCP checkpoint loads on one process too (another world size: DCP reads whole tensors)
    single, _ = models.load(alias, dtype=F64, seed=6)
    sd = single.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    single.load_state_dict(sd)
    assert_close(dict(single.state_dict()), want, F64, "DCP checkpoint loaded on one process")
    if kind == "tp":  # whole tensors into another world size's chunks (sharded_state_dict)
        other_world = 5 - world
        loaded = run_distributed(
            _load_sharded, other_world, alias, _plan(alias, other_world, "tp"), str(tmp_path / "dcp")
        )
        for rank, state in enumerate(loaded):
            assert_close(state, want, F64, f"rank {rank} of {other_world}: whole tensors into sharded_state_dict()")


def _save_sharded(rank, world, alias, plan, directory):
    model, inputs = models.load(alias, dtype=F64)
    keys = list(model.state_dict())
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan)
    _train(m, inputs, 2)
    sd = m.sharded_state_dict()
    assert list(sd) == keys
    assert any(isinstance(v, ShardEntry) for v in sd.values()), "the plan shards parameters"
    with pytest.raises(hapc.HapcError, match="only this rank's chunk"):
        torch.save(sd, io.BytesIO())  # not whole tensors: refused, never half a checkpoint
    dcp.save(sd, checkpoint_id=directory)  # one chunk per rank, no gather


def _load_sharded(rank, world, alias, plan, directory):
    _, inputs = models.load(alias, dtype=F64)
    fresh, _ = models.load(alias, dtype=F64, seed=77)
    m = hapc.compile(fresh, CLUSTERS[world], inputs, plan=plan)
    sd = m.sharded_state_dict()
    dcp.load(sd, checkpoint_id=directory)  # in place, resharded by chunks
    m.load_state_dict(sd)  # nothing left to copy, but the habit works
    return m.full_state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load on one process
@pytest.mark.parametrize("saved, loaded", [((3, "tp"), (2, "default")), ((2, "tp"), (3, "tp"))])
def test_sharded_state_dict_reshards_through_dcp(saved, loaded, tmp_path):
    alias = "gpt"
    run_distributed(_save_sharded, saved[0], alias, _plan(alias, *saved), str(tmp_path))
    want = _one_device(alias, 2)
    for rank, state in enumerate(
        run_distributed(_load_sharded, loaded[0], alias, _plan(alias, *loaded), str(tmp_path))
    ):
        assert_close(state, want, F64, f"rank {rank} of {loaded[0]}: uneven chunks of {saved[0]} ranks, resharded")
    single, _ = models.load(alias, dtype=F64, seed=6)
    sd = single.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))  # whole tensors on one process, from the chunks
    single.load_state_dict(sd)
    assert_close(dict(single.state_dict()), want, F64, "the chunks loaded on one process")


def _strict_load(rank, world, plan):
    model, inputs = models.load("mlp", dtype=F64)
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan)
    with pytest.raises(RuntimeError, match="missing key"):
        m.load_state_dict({k: v for k, v in model.state_dict().items() if k != "head.bias"})
    with pytest.raises(RuntimeError, match="has shape"):
        m.load_state_dict({**model.state_dict(), "head.bias": torch.zeros(3, dtype=F64)})
    result = m.load_state_dict({"head.bias": torch.ones(10, dtype=F64)}, strict=False)
    return sorted(result.missing_keys), m.full_state_dict()["head.bias"]


def test_state_dict_load_is_strict_by_default():
    for missing, bias in run_distributed(_strict_load, 2, _plan("mlp", 2, "tp")):
        assert "head.bias" not in missing and "head.weight" in missing
        assert torch.equal(bias, torch.ones(10, dtype=F64))


# -- item 7: the original model object -----------------------------------------------------------------


def _original_model(rank, world, alias, plan):
    model, inputs = models.load(alias, dtype=F64)
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan)
    initial = model(*inputs).item()  # right after compile the model holds the module's weights
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    _train(m, inputs, 1, opt)
    errors = []
    for use in (lambda: model(*inputs), model.state_dict, lambda: hapc.compile(model, CLUSTERS[world], inputs)):
        with pytest.raises(hapc.HapcError, match=r"module\.unwrap\(\)") as err:
            use()
        errors.append(str(err.value))
    assert m.unwrap() is model
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model(*inputs)  # in sync again
    _train(m, inputs, 1, opt)  # the module trains on: stale again
    with pytest.raises(hapc.HapcError, match="the compiled module has trained its own copy"):
        model(*inputs)
    m.unwrap()
    return initial, errors, after, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world, kind", PLANS)
def test_original_model_raises_until_unwrapped(world, kind):
    alias = "gpt"
    model, inputs = models.load(alias, dtype=F64)
    want_initial = model(*inputs).item()
    one, two = _one_device(alias, 1), _one_device(alias, 2)
    for rank, (initial, errors, after, later) in enumerate(
        run_distributed(_original_model, world, alias, _plan(alias, world, kind))
    ):
        assert initial == pytest.approx(want_initial, rel=1e-12)
        assert all("a forward" in e or "state_dict" in e or "hapc.compile" in e for e in errors)
        assert_close(after, one, F64, f"rank {rank}: unwrap() after one step")
        assert_close(later, two, F64, f"rank {rank}: unwrap() after two steps")


def _meta_original(rank, world, plan):
    _, inputs = models.load("gpt", dtype=F64)
    model, _ = models.load("gpt", dtype=F64, device="meta")
    hapc.compile(model, CLUSTERS[world], inputs, plan=plan, seed=5)
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan, seed=5)  # again: nothing trained yet
    _train(m, inputs, 1)
    with pytest.raises(hapc.HapcError, match="built on the meta device and holds no weights") as err:
        model.state_dict()
    assert m.unwrap() is model
    return str(err.value), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_meta_model_raises_until_unwrapped():
    from hapc.materialize import materialize

    want, _ = models.load("gpt", dtype=F64, device="meta")
    want = materialize(want, seed=5)
    _train(want, models.load("gpt", dtype=F64)[1], 1)
    want = want.state_dict()
    for rank, (error, state) in enumerate(run_distributed(_meta_original, 3, _plan("gpt", 3, "tp"))):
        assert "module.unwrap()" in error
        assert_close(state, dict(want), F64, f"rank {rank}: the meta model after unwrap()")


def _optimizer_over_the_model(rank, world, plan):
    model, inputs = models.load("mlp", dtype=F64)
    early = torch.optim.SGD(model.parameters(), lr=0.05)  # built before compile, as DDP scripts do
    m = hapc.compile(model, CLUSTERS[world], inputs, plan=plan)
    m(*inputs).backward()
    with pytest.raises(hapc.HapcError, match=r"module\.parameters\(\)") as err:
        early.step()  # would step parameters that never get a gradient: nothing would train
    good = torch.optim.SGD(m.parameters(), lr=0.05)
    good.step()
    good.step()  # checked once
    return str(err.value)


@pytest.mark.parametrize("world, kind", [(2, "default"), (3, "tp")])
def test_an_optimizer_over_the_original_parameters_is_refused(world, kind):
    errors = run_distributed(_optimizer_over_the_model, world, _plan("mlp", world, kind))
    assert all("never receive gradients" in e for e in errors)


# -- item 2: ranks given different targets the plan takes whole ---------------------------------------


def _masked_targets(rank, world, alias, plan, same, sync):
    model, (x, y) = models.load(alias, dtype=F64)
    m = hapc.compile(model, CLUSTERS[world], (x, y), plan=plan, loss_sync=sync)
    g = torch.Generator().manual_seed(0 if same else 1 + rank)  # per-rank random -100 masking
    masked = y.masked_fill(torch.rand(y.shape, generator=g) < 0.3, -100)
    if same:
        loss = m(x, masked)
        loss.backward()
        return loss.item(), m.full_gradients()
    try:  # eager: the first call compares; lazy: backward() and every read of the loss raise
        loss = m(x, masked)
        loss.backward()
    except hapc.HapcError as e:
        first = str(e)
    else:
        raise AssertionError("ranks given different targets trained without an error")
    if sync == "lazy":
        with pytest.raises(hapc.HapcError) as again:
            loss.item()
        assert str(again.value) == first, "every read says the same"
    return first


@pytest.mark.parametrize("sync", ["lazy", "eager"])
@pytest.mark.parametrize("world, kind", PLANS)
@pytest.mark.parametrize("alias", ["mlp", "gpt"])
def test_ranks_given_different_whole_targets_are_refused(alias, world, kind, sync):
    plan = _plan(alias, world, kind)
    model, (x, y) = models.load(alias, dtype=F64)
    name = [n.name for n in hapc.trace(model, (x, y)).inputs][1]
    errors = run_distributed(_masked_targets, world, alias, plan, False, sync)
    assert len(set(errors)) == 1, "the same text on every rank"
    assert f"input {name!r} differs between the ranks" in errors[0]
    assert "the plan takes it whole" in errors[0] and "seeded alike on every rank" in errors[0]


@pytest.mark.parametrize("world, kind", PLANS)
def test_ranks_given_the_same_masked_targets_train_exactly(world, kind):
    alias = "gpt"
    model, (x, y) = models.load(alias, dtype=F64)
    masked = y.masked_fill(torch.rand(y.shape, generator=torch.Generator().manual_seed(0)) < 0.3, -100)
    loss = model(x, masked)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for value, grads in run_distributed(_masked_targets, world, alias, _plan(alias, world, kind), True, "lazy"):
        assert value == pytest.approx(loss.item(), rel=1e-12)
        assert_close(grads, want, F64, "grads")


def _two_groups():
    """Two one-device groups joined by a slow link: hapc.compile pipelines over them."""
    from hapc.cluster import Cluster

    link = {"bandwidth": "10 GB/s", "latency": "20 us"}
    return Cluster.from_dict(
        {
            "name": "two-groups",
            "group": [
                {"name": g, "devices": 1, "devices_per_host": 1, "flops": f, "memory": "8 GiB"}
                for g, f in (("fast", "20 TFLOPS"), ("slow", "10 TFLOPS"))
            ],
            "links": {
                "intra_host": link,
                "inter_host": link,
                "between": [{"groups": ["fast", "slow"], "bandwidth": "100 MB/s", "latency": "100 us"}],
            },
        }
    )


def _pipeline_original(rank, world):
    torch.set_num_threads(1)
    model, inputs = models.load("gpt", batch=8, dtype=F64)
    pm = hapc.compile(model, _two_groups(), inputs, num_micro=4)
    assert type(pm).__name__ == "PipelineModule"
    opt = torch.optim.SGD(pm.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        pm.train_step(*inputs)
        opt.step()
    with pytest.raises(hapc.HapcError, match=r"module\.unwrap\(\)"):
        model(*inputs)
    whole = pm.state_dict()
    assert pm.unwrap() is model
    return whole, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_pipelined_original_model_raises_until_unwrapped():
    model, inputs = models.load("gpt", batch=8, dtype=F64)
    _train(model, inputs, 2)
    want = dict(model.state_dict())
    for rank, (whole, unwrapped) in enumerate(run_distributed(_pipeline_original, 2, timeout=240)):
        assert_close(whole, want, F64, f"rank {rank}: pipeline state_dict()")
        assert_close(unwrapped, want, F64, f"rank {rank}: pipeline unwrap()")


def _pipeline_masked_targets(rank, world, same):
    torch.set_num_threads(1)
    model, (idx, targets) = models.load("gpt", batch=8, dtype=F64)
    pm = hapc.compile(model, _two_groups(), (idx, targets), num_micro=4)
    g = torch.Generator().manual_seed(0 if same else 1 + rank)
    masked = targets.masked_fill(torch.rand(targets.shape, generator=g) < 0.3, -100)
    if same:
        return pm.train_step(idx, masked).item(), pm.full_gradients()
    with pytest.raises(hapc.HapcError) as err:
        pm.train_step(idx, masked)
    return str(err.value)


def test_pipeline_ranks_given_different_targets_are_refused():
    errors = run_distributed(_pipeline_masked_targets, 2, False, timeout=240)
    assert len(set(errors)) == 1 and "input 'targets' differs between the ranks" in errors[0]
    model, (idx, targets) = models.load("gpt", batch=8, dtype=F64)
    masked = targets.masked_fill(torch.rand(targets.shape, generator=torch.Generator().manual_seed(0)) < 0.3, -100)
    loss = model(idx, masked)
    loss.backward()
    for value, grads in run_distributed(_pipeline_masked_targets, 2, True, timeout=240):
        assert value == pytest.approx(loss.item(), rel=1e-12)
        assert_close(grads, {k: p.grad for k, p in model.named_parameters()}, F64, "pipeline grads")
