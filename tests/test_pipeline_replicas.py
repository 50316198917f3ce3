"""Pipelines across the hosts of one group, and data-parallel replicas of a pipeline (issue 14).

* The HARP DP cuts a one-group cluster at its host boundary when the inter-host link is slow (the
  stages' sub-meshes are the hosts, the link between them the inter-host link), and that pipeline
  trains like one device.
* ``R`` replicas of a pipeline (:mod:`hapc.pipeline.replicas`): layouts, the price of the
  all-reduce across replicas (the SPMD gradient all-reduce's, on the peers' link), the planner
  listing every replica count it priced, and 2 replicas x 2 stages on 4 gloo processes giving the
  single-device loss, gradients and 3 optimizer steps (float64) -- also with micro-batches that
  count different numbers of targets, where each replica's share of the loss is not ``1/R``.
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import assert_close, make_optimizer

import hapc
from hapc import models
from hapc.cluster import Cluster, derived_alpha_beta
from hapc.errors import HapcError
from hapc.pipeline import PipelinePlan, compile_pipeline, micro_batches, plan_pipeline, spec_from_plan
from hapc.pipeline.replicas import layouts, peer_link, replica_cluster, replica_devices, sync_seconds_per_byte
from hapc.pipeline.runtime import PipelineModule, PipelineSpec
from hapc.pipeline.stages import balanced_cuts
from hapc.planner import choose_plan, replica_counts
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

STEPS = 3


def hosts(devices: int = 4, per_host: int = 2, inter: str = "100 MB/s") -> Cluster:
    """One group of ``devices`` on hosts of ``per_host``: fast inside a host, ``inter`` between."""
    return Cluster.from_dict(
        {
            "name": f"one-group-{devices}-on-{devices // per_host}-hosts",
            "group": [
                {
                    "name": "gpu",
                    "devices": devices,
                    "devices_per_host": per_host,
                    "flops": "10 TFLOPS",
                    "memory": "8 GiB",
                }
            ],
            "links": {
                "intra_host": {"bandwidth": "10 GB/s", "latency": "20 us"},
                "inter_host": {"bandwidth": inter, "latency": "100 us"},
            },
        }
    )


def _model(alias: str, batch: int = 8):
    return models.load(alias, batch=batch, dtype=torch.float64)


def _single(alias: str, opt: str, targets: torch.Tensor | None = None) -> dict:
    model, inputs = _model(alias)
    if targets is not None:
        inputs = (inputs[0], targets)
    optimizer = make_optimizer(opt, model.parameters())
    losses, grads, norm = [], None, None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        optimizer.step()
    return {"losses": losses, "grads": grads, "norm": norm, "state": hapc.checkpoint.full_state(model, optimizer)}


def _train(pm, inputs, opt: str) -> dict:
    optimizer = make_optimizer(opt, pm.parameters())
    losses = [pm.train_step(*inputs).item()]
    grads = pm.full_gradients()
    norm = float(pm.clip_grad_norm_(1e9))  # the whole model's norm (clipping nothing)
    for _ in range(STEPS - 1):
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.train_step(*inputs).item())
    optimizer.step()
    # the single-device checkpoint (weights and optimizer state), gathered from the first replica's stages
    return {"losses": losses, "grads": grads, "norm": norm, "state": pm.full_state_dict(optimizer)}


def _check(results: list[dict], ref: dict) -> None:
    for rank, res in enumerate(results):
        assert_close(res["losses"], ref["losses"], torch.float64, f"rank {rank} losses")
        assert_close(res["grads"], ref["grads"], torch.float64, f"rank {rank} grads")
        assert res["norm"] == pytest.approx(ref["norm"], rel=1e-9), f"rank {rank} gradient norm"
        assert_close(res["state"], ref["state"], torch.float64, f"rank {rank} state")


# -- a pipeline across the hosts of one group -------------------------------------------------------


def test_the_dp_cuts_one_group_at_its_host_boundary():
    """Slow between hosts: one stage per host, joined by the inter-host link; the stages' own
    collectives stay on the fast intra-host link. Fast between hosts: no cut pays for itself as
    much, and the link (if any cut) is priced at the fast bandwidth."""
    model, inputs = _model("gpt")
    micro = micro_batches(inputs, 4, 8)[0]
    plan = plan_pipeline(model, hosts(), micro, num_micro=4)
    assert [(s.devices, s.link) for s in plan.stages] == [([0, 1], "inter_host"), ([2, 3], "end")]
    c = plan.stages[0].comm  # latency + the boundary activation over 100 MB/s
    assert c == pytest.approx(100e-6 + 2 * 16 * 32 * 8 / 100e6, rel=0.5) and c > 1e-4
    fast = plan_pipeline(model, hosts(inter="10 GB/s"), micro, num_micro=4)
    assert all(s.comm < c / 10 for s in fast.stages)


def _hosts_job(rank, world, alias, opt):
    torch.set_num_threads(1)
    model, inputs = _model(alias)
    plan = plan_pipeline(model, hosts(), micro_batches(inputs, 4, 8)[0], num_micro=4)
    pm = compile_pipeline(model, hosts(), inputs, plan)
    out = _train(pm, inputs, opt)
    out["ranks"] = pm.spec.ranks
    return out


def test_a_pipeline_across_two_hosts_of_one_group_equals_single_device():
    results = run_distributed(_hosts_job, 4, "gpt", "adam", timeout=240)
    assert results[0]["ranks"] == [[0, 1], [2, 3]]
    _check(results, _single("gpt", "adam"))


# -- data-parallel replicas: layouts and price ------------------------------------------------------


def test_replica_layouts_and_devices():
    c = Cluster.load("hap-testbed:16")  # 16 V100, 8 per host
    assert layouts(c, 2) == ["blocked", "strided"] and layouts(c, 3) == [] and layouts(c, 16) == ["blocked"]
    assert replica_devices(c, 2, "blocked") == [list(range(8)), list(range(8, 16))]
    assert replica_devices(c, 2, "strided") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    sub = replica_cluster(c, 2, "strided")
    assert (sub.groups[0].devices, sub.groups[0].devices_per_host) == (8, 4)
    assert peer_link(c, 2, "strided", "v100") == (c.intra_host, False)
    assert peer_link(c, 2, "blocked", "v100") == (c.inter_host, True)
    assert replica_counts(c, 8) == [2, 4, 8] and replica_counts(c, 6) == [2] and replica_counts(c, 8, ()) == []
    # two groups: a replica takes its share of each, ranks in cluster-file order
    two = Cluster.load("hap-testbed:32")  # 16 V100 + 16 P100
    assert replica_devices(two, 2, "blocked")[1] == list(range(8, 16)) + list(range(24, 32))
    with pytest.raises(HapcError, match="do not tile"):
        replica_cluster(c, 3, "blocked")


def test_the_all_reduce_across_replicas_is_priced_as_the_gradient_all_reduce():
    """Per byte: the bucketed ring all-reduce of R devices over the peers' link (SPMD's gradient
    price); on the inter-host link, times the stage's devices sharing the host's link. It enters
    each stage's sync, so the plan's time includes it."""
    c = hosts(8, 4)
    for layout, link, share in (("strided", c.intra_host, 1), ("blocked", c.inter_host, 2)):
        ab = derived_alpha_beta("all_reduce", 2, link)
        assert sync_seconds_per_byte(c, 2, layout, "gpu", 2) == pytest.approx((ab.beta + ab.alpha / 25e6) * share)
    model, inputs = _model("gpt")
    micro = micro_batches(inputs, 4, 8)[0]
    plan = plan_pipeline(model, c, micro, num_micro=4, replicas=2, layout="blocked")
    assert plan.replicas == 2 and plan.num_micro == 2
    for s in plan.stages:
        per_byte = sync_seconds_per_byte(c, 2, "blocked", s.group, len(s.devices))
        assert s.replica_sync == pytest.approx(s.mem_param / plan.memory_factor * per_byte) and s.replica_sync > 0
        assert s.sync >= s.replica_sync
    assert plan.time >= sum(s.replica_sync for s in plan.stages) / plan.num_micro
    # the JSON round trip keeps the replicas; another format version is refused by name
    back = PipelinePlan.from_json(plan.to_json())
    assert (back.replicas, back.layout, back.stages[0].replica_sync) == (2, "blocked", plan.stages[0].replica_sync)
    with pytest.raises(HapcError, match=r"format version 1.*plan again"):
        PipelinePlan.from_json({**plan.to_json(), "version": 1})


def test_the_planner_prices_every_replica_count():
    model, inputs = _model("gpt")
    seen: list[str] = []
    choice = choose_plan(model, hosts(), inputs, num_micro=4, on_price=seen.append)
    labels = [k.kind for k in choice.kinds]
    # per-segment ratios last: not applicable on one device group
    pipes = ["pipeline", "pipeline x2 (blocked)", "pipeline x2 (strided)", "pipeline x4 (blocked)"]
    assert labels == ["spmd", *pipes, "segmented"]
    assert seen == ["spmd", *pipes], "each entry announced as its pricing starts (hapc synth's status line)"
    priced = [k for k in choice.kinds if math.isfinite(k.time)]
    best = min(priced, key=lambda k: k.time)
    assert best.status == "chosen" and choice.time == best.time
    # DP inside the hosts, the pipeline across them: the cheapest here
    assert best.kind == "pipeline x2 (strided)" and choice.kind == "pipeline" and choice.plan.replicas == 2
    assert "pipeline x2 (strided)" in "\n".join(str(x) for x in choice.plan.kinds)
    none = choose_plan(model, hosts(), inputs, num_micro=4, replicas=())
    assert [k.kind for k in none.kinds] == ["spmd", "pipeline", "segmented"]


# -- data-parallel replicas: training equals one device -----------------------------------------------


def _replica_job(rank, world, alias, opt, targets):
    torch.set_num_threads(1)
    model, inputs = _model(alias)
    if targets is not None:
        inputs = (inputs[0], targets)
    pm = hapc.compile(model, hosts(), inputs, num_micro=4)  # the planner's choice: 2 replicas x 2 stages
    out = _train(pm, inputs, opt)
    out["replicas"] = pm.spec.replicas
    return out


def _ignore_some(targets: torch.Tensor) -> torch.Tensor:
    out = targets.clone()
    out[0, :] = -100  # replica 0's micro-batches count fewer targets than replica 1's
    out[1, 2:] = -100
    out[6, 5:] = -100
    return out


@pytest.mark.parametrize("ignored", [False, True])
def test_two_replicas_of_a_two_stage_pipeline_equal_single_device(ignored):
    targets = _ignore_some(_model("gpt")[1][1]) if ignored else None
    results = run_distributed(_replica_job, 4, "gpt", "adam", targets, timeout=300)
    assert results[0]["replicas"] == [[[0], [2]], [[1], [3]]]  # strided: a replica on each host
    _check(results, _single("gpt", "adam", targets))


def _spec_job(rank, world):
    """bert, 2 replicas of [2 ranks (uneven SPMD), 1 rank]: an explicit spec, ranks interleaved."""
    torch.set_num_threads(1)
    model, inputs = _model("bert")
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    reps = [[[0, 2], [4]], [[1, 3], [5]]]
    spec = PipelineSpec(
        cuts=balanced_cuts(graph, [1, 1]),
        ranks=reps[0],
        clusters=[cluster_of([1e10, 4e9]), cluster_of([8e9])],
        warmups=[2, 1],
        num_micro=4,
        replicas=reps,
    )
    pm = PipelineModule(model, inputs, spec)
    return _train(pm, inputs, "sgd")


def test_replicas_with_an_uneven_stage_equal_single_device():
    results = run_distributed(_spec_job, 6, timeout=300)
    _check(results, _single("bert", "sgd"))


def test_spec_from_plan_maps_each_replica_to_its_devices():
    c = hosts(8, 4)
    model, inputs = _model("gpt")
    plan = plan_pipeline(model, c, micro_batches(inputs, 4, 8)[0], num_micro=4, replicas=2, layout="strided")
    spec = spec_from_plan(plan, c)
    flat = sorted(r for rep in spec.replicas for rs in rep for r in rs)
    assert flat == list(range(8)) and spec.num_micro == 4 and spec.ranks == spec.replicas[0]
    by_replica = [{r for rs in rep for r in rs} for rep in spec.replicas]
    assert by_replica == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    with pytest.raises(HapcError, match="made for cluster"):
        spec_from_plan(plan, hosts(4, 2))
