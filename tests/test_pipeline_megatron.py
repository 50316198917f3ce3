"""The Megatron-3D baseline's planning pieces (issue 14): a pipeline whose stages all take ``t``
devices (``sizes=[t]``) and run the Megatron tensor-parallel program on them (``baseline="tp"``),
with data-parallel replicas -- TP inside a host x PP x DP under hapc's cost model.

hapc's own pipeline search is a superset (any sub-mesh size, any SPMD program on it), so the
baseline's predicted time can never be below hapc's for the same micro-batch and replica count."""

from __future__ import annotations

import numpy as np
import pytest

from hapc import models
from hapc.cluster import Cluster
from hapc.errors import HapcError
from hapc.pipeline import micro_batches, plan_pipeline
from hapc.pipeline.layers import build_layers
from hapc.pipeline.stagecost import StageCoster
from hapc.theory import derive, trace


def hosts(inter: str = "100 MB/s") -> Cluster:
    """8 devices, 4 to a host: fast inside a host, ``inter`` between."""
    return Cluster.from_dict(
        {
            "name": "one-group-8-on-2-hosts",
            "group": [{"name": "gpu", "devices": 8, "devices_per_host": 4, "flops": "10 TFLOPS", "memory": "8 GiB"}],
            "links": {
                "intra_host": {"bandwidth": "10 GB/s", "latency": "20 us"},
                "inter_host": {"bandwidth": inter, "latency": "100 us"},
            },
        }
    )


def _micro(num_micro: int = 4):
    model, inputs = models.load("gpt", batch=16)
    return model, micro_batches(inputs, num_micro, 16)[0]


@pytest.mark.parametrize("t", [1, 2, 4])
def test_every_stage_takes_t_devices_and_is_never_cheaper_than_hapc(t):
    model, micro = _micro()
    theory = derive(trace(model, micro))
    free = plan_pipeline(model, hosts(), micro, num_micro=4, theory=theory)
    meg = plan_pipeline(model, hosts(), micro, num_micro=4, theory=theory, sizes=[t], baseline="tp")
    assert all(len(s.devices) == t for s in meg.stages), [s.devices for s in meg.stages]
    assert meg.time >= free.time * (1 - 1e-9), (meg.time, free.time)
    for R, layout in ((2, "blocked"), (2, "strided")):
        f = plan_pipeline(model, hosts(), micro, num_micro=4, theory=theory, replicas=R, layout=layout)
        m = plan_pipeline(
            model, hosts(), micro, num_micro=4, theory=theory, replicas=R, layout=layout, sizes=[t], baseline="tp"
        )
        assert m.replicas == R and all(len(s.devices) == t for s in m.stages)
        assert m.time >= f.time * (1 - 1e-9), (R, layout, m.time, f.time)


def test_stage_programs_are_the_tensor_parallel_ones():
    """On a 4-device sub-mesh the TP-restricted program is priced at least as dear as hapc's free
    one, and differs from it (a tiny GPT at 4 rows per micro-batch is cheaper data-parallel than
    Megatron-sharded): the restriction reaches the stage costs."""
    model, micro = _micro()
    theory = derive(trace(model, micro))
    layers = build_layers(theory.graph)
    free = StageCoster(theory, layers, hosts()).layer_costs("gpu", 4)
    tp = StageCoster(theory, layers, hosts(), baseline="tp").layer_costs("gpu", 4)
    assert tp.program_time >= free.program_time * (1 - 1e-9)
    assert not np.allclose(tp.fwd + tp.bwd + tp.sync, free.fwd + free.bwd + free.sync)
    # one device: nothing to shard, the same costs
    one_free = StageCoster(theory, layers, hosts()).layer_costs("gpu", 1)
    one_tp = StageCoster(theory, layers, hosts(), baseline="tp").layer_costs("gpu", 1)
    assert one_tp.program_time == pytest.approx(one_free.program_time, rel=1e-12)


def test_a_cache_is_not_shared_across_baselines_and_sizes_must_exist():
    model, micro = _micro()
    theory = derive(trace(model, micro))
    layers = build_layers(theory.graph)
    cache: dict = {}
    StageCoster(theory, layers, hosts(), cache=cache)
    with pytest.raises(HapcError, match="baseline"):
        StageCoster(theory, layers, hosts(), cache=cache, baseline="tp")
    with pytest.raises(HapcError, match="no group has a sub-mesh of \\[3\\]"):
        plan_pipeline(model, hosts(), micro, num_micro=4, theory=theory, sizes=[3])


def test_a_group_without_the_size_is_named():
    """A 4-device TP degree on a cluster whose second group has 2 devices: no stage can use them."""
    two = Cluster.from_dict(
        {
            "name": "four-and-two",
            "group": [
                {"name": "a", "devices": 4, "devices_per_host": 4, "flops": "10 TFLOPS", "memory": "8 GiB"},
                {"name": "b", "devices": 2, "devices_per_host": 2, "flops": "10 TFLOPS", "memory": "8 GiB"},
            ],
            "links": {
                "intra_host": {"bandwidth": "10 GB/s", "latency": "20 us"},
                "inter_host": {"bandwidth": "100 MB/s", "latency": "100 us"},
            },
        }
    )
    model, micro = _micro()
    with pytest.raises(HapcError, match=r"group 'b' \(2 devices, 2 to a host\) has no sub-mesh of \[4\]"):
        plan_pipeline(model, two, micro, num_micro=4, sizes=[4], baseline="tp")
    with pytest.raises(HapcError, match=r"no group has a sub-mesh of \[8\]"):
        plan_pipeline(model, two, micro, num_micro=4, sizes=[8], baseline="tp")
