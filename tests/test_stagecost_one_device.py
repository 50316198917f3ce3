"""A one-device sub-mesh's stage costs come from its all-replicated program, without a search.

:meth:`hapc.pipeline.stagecost.StageCoster.layer_costs` prices a sub-mesh of one device by the
all-replicated program (:func:`hapc.synth.synthesizer.fallback_program`): on one device no layout
saves anything (no collective, every op computed once at full size). The pipeline planner reads
only the per-layer columns, so the shortcut must give exactly (bit for bit) the columns of the
synthesized optimum -- times and memory -- on every model; the whole program's time agrees to
rounding (its sum runs in another order). Stage costs also synthesize without the data-parallel
incumbent outside a time limit (it only bounds the exact passes): the same columns, bit for bit.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import hapc.pipeline.stagecost as stagecost
from hapc import models
from hapc.cluster import Cluster
from hapc.pipeline.layers import build_layers
from hapc.pipeline.stagecost import StageCoster
from hapc.synth.synthesizer import searches_until, synthesize_program
from hapc.theory import derive, trace

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act")
#: the planner's theory options (hapc.planner.choose_plan)
OPTIONS = {"sfb": True, "variants": ("padded", "grouped"), "param_comm": False, "strict": False}


def hosts() -> Cluster:
    """Two groups of differing devices, one with a memory bandwidth and a per-op overhead."""
    return Cluster.from_dict(
        {
            "name": "two-kinds",
            "group": [
                {"name": "big", "devices": 4, "devices_per_host": 2, "flops": "20 TFLOPS", "memory": "8 GiB",
                 "mem_bandwidth": "900 GB/s", "op_overhead": "5 us"},
                {"name": "small", "devices": 4, "devices_per_host": 4, "flops": "5 TFLOPS", "memory": "4 GiB"},
            ],
            "links": {
                "intra_host": {"bandwidth": "10 GB/s", "latency": "20 us"},
                "inter_host": {"bandwidth": "100 MB/s", "latency": "100 us"},
            },
        }
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, kwargs, cluster, memory_factor",
    [
        ("gpt", {"batch": 4}, "hap-testbed:16", 4.0),
        ("bert", {"batch": 4}, "hap-testbed:16", 4.0),
        ("moe", {"batch": 4}, "hap-testbed:16", 2.0),
        ("cnn", {"batch": 4}, "two-kinds", 4.0),
        ("vit", {"batch": 8, "layers": 2}, "two-kinds", 4.0),
    ],
)
def test_one_device_costs_equal_the_synthesized_optimum(monkeypatch, name, kwargs, cluster, memory_factor):
    model, inputs = models.load(name, **kwargs)
    theory = derive(trace(model, inputs), **OPTIONS)
    layers = build_layers(theory.graph)
    cl = hosts() if cluster == "two-kinds" else Cluster.load(cluster)
    # two devices: the shortcut must not apply there (the replicated program pays the gradient
    # all-reduce and runs the whole batch on each device: not the optimum)
    for group, size in [(g, n) for g in cl.groups for n in (1, 2)]:
        got = {}
        for shortcut in (True, False):
            monkeypatch.setattr(stagecost, "ONE_DEVICE_SHORTCUT", shortcut)
            coster = StageCoster(theory, layers, cl, memory_factor=memory_factor)
            got[shortcut] = coster.layer_costs(group.name, size)
        fast, searched = got[True], got[False]
        for k in FIELDS:
            assert np.array_equal(getattr(fast, k), getattr(searched, k)), (group.name, size, k)
        assert fast.mem_act.sum() > 0 and fast.fwd.sum() > 0
        assert fast.program_time == pytest.approx(searched.program_time, rel=1e-12)


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_stage_costs_without_the_incumbent_equal_those_with_it(monkeypatch, name):
    """Stage costs synthesize without the data-parallel incumbent (outside a time limit): it only
    bounds the exact passes, so every sub-mesh's columns are those found with it, bit for bit, and
    its program time the same optimum (to rounding: where the incumbent ties the optimum, e.g. a
    free token-count all-reduce against taking the targets whole, the sum runs in another order)."""
    model, inputs = models.load(name, batch=8)
    theory = derive(trace(model, inputs), **OPTIONS)
    layers = build_layers(theory.graph)
    cl = Cluster.load("hap-testbed:16")  # 2 hosts of 8 V100: sub-meshes of 2, 4, 8 (NVLink), 16 (10.4 Gbps)
    got = {}
    for incumbent in (True, False):
        monkeypatch.setattr(stagecost, "INCUMBENT", incumbent)
        coster = StageCoster(theory, layers, cl)
        got[incumbent] = [coster.layer_costs("v100", n) for n in (2, 4, 8, 16)]
    for n, a, b in zip((2, 4, 8, 16), got[True], got[False]):
        assert a.program_time == pytest.approx(b.program_time, rel=1e-12), n
        for k in FIELDS:
            assert np.array_equal(getattr(a, k), getattr(b, k)), (n, k)


def test_stage_costs_keep_the_incumbent_under_a_time_limit(monkeypatch):
    """Under a deadline the incumbent bounds what an unfinished search returns: it stays on."""
    asked = []

    def spy(*args, incumbent=True, **kwargs):
        asked.append(incumbent)
        return synthesize_program(*args, incumbent=incumbent, **kwargs)

    monkeypatch.setattr(stagecost, "synthesize_program", spy)
    model, inputs = models.load("mlp")
    theory = derive(trace(model, inputs), **OPTIONS)
    layers = build_layers(theory.graph)
    cl = Cluster.load("hap-testbed:16")
    StageCoster(theory, layers, cl).layer_costs("v100", 2)
    with searches_until(time.monotonic() + 600):
        StageCoster(theory, layers, cl).layer_costs("v100", 2)
    assert asked == [False, True]


@pytest.mark.parametrize("alias", ["gpt", "bert", "mlp", "cnn", "moe"])
def test_a_one_device_synthesis_searches_the_replicated_program_alone(alias, monkeypatch):
    """``hapc.synthesize`` on one device searches the all-replicated triples alone (exact: the same
    predicted time as the search over every triple, which is what a pipeline stage on one device
    and ``--cluster local-cpu:1`` plan)."""
    import hapc.planner as planner

    model, inputs = models.load(alias, batch=4)
    theory = derive(trace(model, inputs), **OPTIONS)
    one = Cluster.from_dict(
        {"name": "one", "group": [{"name": "d", "devices": 1, "devices_per_host": 1, "flops": "10 TFLOPS",
                                   "memory": "8 GiB", "mem_bandwidth": "500 GB/s", "op_overhead": "4 us"}],
         "links": {"intra_host": {"bandwidth": "10 GB/s", "latency": "10 us"}}}
    )  # fmt: skip
    fast = planner.synthesize_theory(theory, one)
    monkeypatch.setattr(planner, "replicated_triples", lambda th: set(range(len(th.triples))))
    searched = planner.synthesize_theory(theory, one)
    assert fast.time == pytest.approx(searched.time, rel=1e-12)
    assert fast.predicted["memory"] == pytest.approx(searched.predicted["memory"], rel=1e-12)
    assert not any(i.layout.is_sharded for i in fast.instructions if type(i).__name__ == "Source")
