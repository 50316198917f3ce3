"""Sub-mesh kinds synthesized ahead of need by a second process (:class:`hapc.pipeline.stagecost.Ahead`,
what the planner starts for each micro-batch count where ``stagecost.WORKERS > 1``, as the ``hapc``
command sets): every kind's layer costs are bit for bit those of one process, whichever process
synthesized it, and each result reaches the kind it was synthesized for."""

from __future__ import annotations

import time

import numpy as np

from hapc.cluster import Cluster
from hapc.pipeline.layers import build_layers
from hapc.pipeline.planner import stage_kinds
from hapc.pipeline.stagecost import Ahead, StageCoster, model_key
from hapc.theory import derive, trace
from models import load

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep")


def test_kinds_synthesized_ahead_equal_one_process():
    model, inputs = load("gpt", batch=4)
    theory = derive(trace(model, inputs))
    layers = build_layers(theory.graph)
    cluster = Cluster.load("hap-testbed:24")  # two groups
    # the kinds of three candidates, as the planner lists them (one replica's cluster each)
    kinds = stage_kinds(cluster) + stage_kinds(cluster, 2, "strided") + stage_kinds(cluster, 2, "blocked")
    alone: dict = {}
    one = [StageCoster(theory, layers, sub, cache=alone).layer_costs(g, n) for sub, g, n in kinds]

    cache: dict = {}
    ahead = Ahead(theory, layers, kinds, cache)
    cache["ahead"] = ahead
    try:
        assert len(ahead.items) >= 6  # kinds of more than one device, each model key once
        deadline = time.monotonic() + 300
        while ahead.flags[1] != 1:  # the other process has claimed (and begun) its first two kinds
            assert time.monotonic() < deadline, "the look-ahead process did not start"
            time.sleep(0.01)
        # back to front, as StageCoster.prefetch asks: this process synthesizes what is left unclaimed
        got = {}
        for k in reversed(range(len(kinds))):
            sub, g, n = kinds[k]
            got[k] = StageCoster(theory, layers, sub, cache=cache).layer_costs(g, n)
        theirs = [i for i in range(len(ahead.items)) if ahead.flags[i] == 1]
        assert len(theirs) >= 2  # the results of the other process were used (and are checked below)
    finally:
        ahead.close()
    for k, (sub, g, n) in enumerate(kinds):
        for f in FIELDS:
            assert np.array_equal(getattr(one[k], f), getattr(got[k], f)), (k, sub.name, g, n, f)
        assert one[k].program_time == got[k].program_time, (k, g, n)
    # the kinds differ (a result stored under another kind's key would show above)
    times = {model_key(StageCoster(theory, layers, s)._model(g, n)): one[k].program_time
             for k, (s, g, n) in enumerate(kinds)}  # fmt: skip
    assert len(set(times.values())) >= len(ahead.items) // 2


def test_a_look_ahead_process_that_dies_leaves_its_kinds_to_this_one():
    model, inputs = load("mlp", batch=8)
    theory = derive(trace(model, inputs))
    layers = build_layers(theory.graph)
    cluster = Cluster.load("hap-testbed:16")
    kinds = stage_kinds(cluster)
    one = [StageCoster(theory, layers, sub, cache={}).layer_costs(g, n) for sub, g, n in kinds]
    cache: dict = {}
    ahead = Ahead(theory, layers, kinds, cache)
    cache["ahead"] = ahead
    deadline = time.monotonic() + 300
    while ahead.flags[0] != 1:
        assert time.monotonic() < deadline, "the look-ahead process did not start"
        time.sleep(0.01)
    # killed mid-way: what it claimed and did not send is synthesized here
    import os

    os.kill(ahead.pid, 9)
    try:
        got = [StageCoster(theory, layers, sub, cache=cache).layer_costs(g, n) for sub, g, n in kinds]
    finally:
        ahead.close()
    for a, b in zip(one, got):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
        assert a.program_time == b.program_time
