"""The stage-cost cache changes no plan (issue 14's planning time, exactly).

Sub-meshes whose cost models price alike (:func:`hapc.pipeline.stagecost.model_key`) share one
synthesis: 4 devices over 2 hosts of 2 and over 4 hosts of 1 both ring over the inter-host link. The
tests check that every shared entry is bitwise the fresh synthesis of its own sub-mesh, that
sub-meshes on different links are not shared, and that every pipeline entry :func:`choose_plan`
prices with the shared cache (each micro-batch count, replica count and layout) has the time and
stages :func:`plan_pipeline` gives that entry alone, from a fresh trace and an empty cache -- so the
choice is the cheapest of the kinds priced without the shortcut.
"""

from __future__ import annotations

import math

import numpy as np

from hapc import models
from hapc.cluster import Cluster
from hapc.pipeline import micro_batches, plan_pipeline
from hapc.pipeline.layers import build_layers
from hapc.pipeline.replicas import replica_cluster
from hapc.pipeline.stagecost import StageCoster, submesh_sizes
from hapc.planner import choose_plan
from hapc.theory import derive, trace

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act")


def hosts(devices: int = 8, per_host: int = 2) -> Cluster:
    """One group of ``devices`` on hosts of ``per_host``: 10 GB/s inside a host, 100 MB/s between."""
    return Cluster.from_dict(
        {
            "name": f"one-group-{devices}-on-{devices // per_host}-hosts",
            "group": [
                {"name": "gpu", "devices": devices, "devices_per_host": per_host, "flops": "10 TFLOPS",
                 "memory": "8 GiB"}
            ],
            "links": {
                "intra_host": {"bandwidth": "10 GB/s", "latency": "20 us"},
                "inter_host": {"bandwidth": "100 MB/s", "latency": "100 us"},
            },
        }
    )  # fmt: skip


def _equal(a, b) -> bool:
    return a.program_time == b.program_time and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in FIELDS)


def test_submeshes_that_price_alike_share_one_synthesis_equal_to_their_own():
    model, inputs = models.load("gpt", batch=4)
    theory = derive(trace(model, inputs))
    layers = build_layers(theory.graph)
    cluster = hosts(devices=8, per_host=2)  # 4 hosts of 2, 100 MB/s between hosts
    shared: dict = {}
    whole = StageCoster(theory, layers, cluster, cache=shared)
    for n in submesh_sizes(cluster.groups[0]):  # 1, 2 (one host), 4, 6, 8 (whole hosts)
        whole.layer_costs("gpu", n)
    assert whole.syntheses == 5
    strided = replica_cluster(cluster, 2, "strided")  # 4 devices, one on each host
    coster = StageCoster(theory, layers, strided, cache=shared)
    got = {n: coster.layer_costs("gpu", n) for n in submesh_sizes(strided.groups[0])}  # 1, 2, 3, 4
    # 1 device and 4 devices over the inter-host link were priced above; 2 and 3 over it were not
    assert coster.syntheses == 2
    assert got[1] is whole.layer_costs("gpu", 1) and got[4] is whole.layer_costs("gpu", 4)
    for n, costs in got.items():  # each one bitwise the synthesis of its own sub-mesh
        assert _equal(costs, StageCoster(theory, layers, strided).layer_costs("gpu", n)), n
    # 2 devices on one host (fast link) and over two hosts (slow link) are different sub-meshes
    assert not _equal(got[2], whole.layer_costs("gpu", 2))


def test_every_pipeline_kind_priced_with_the_cache_equals_it_priced_alone():
    model, inputs = models.load("gpt", batch=8)
    cluster = hosts(devices=8, per_host=2)
    # micro-batch count searched, every replica count and layout (prune=False: each one's DP runs)
    choice = choose_plan(model, cluster, inputs, prune=False)
    pipes = [k for k in choice.kinds if k.plan_kind == "pipeline" and math.isfinite(k.time)]
    assert {k.replicas for k in pipes} >= {1, 2, 4} and len({k.num_micro for k in pipes}) >= 2
    assert any("strided" in k.kind for k in pipes)
    for k in pipes:
        layout = k.kind.split("(")[1].split(")")[0] if k.replicas > 1 else "blocked"
        micro = micro_batches(tuple(inputs), k.num_micro, inputs[0].shape[0])[0]
        alone = plan_pipeline(model, cluster, micro, num_micro=k.num_micro, replicas=k.replicas, layout=layout)
        assert k.time == alone.time, k.kind
    priced = [k for k in choice.kinds if math.isfinite(k.time)]
    best = min(priced, key=lambda k: k.time)
    assert best.status == "chosen" and choice.time == best.time
