"""Sub-mesh kinds synthesized side by side (:meth:`hapc.pipeline.stagecost.StageCoster.prefetch`,
``stagecost.WORKERS = 2``, what the ``hapc`` command sets): every kind's layer costs are bit for bit
those of one process, and the planner chooses the same plan at the same times."""

from __future__ import annotations

import numpy as np
import pytest

from hapc.cluster import Cluster
from hapc.pipeline import stagecost
from hapc.pipeline.layers import build_layers
from hapc.pipeline.stagecost import StageCoster, submesh_sizes
from hapc.planner import choose_plan
from hapc.theory import derive, trace
from models import load

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep")


def _costs(workers: int, monkeypatch) -> tuple[dict, int]:
    monkeypatch.setattr(stagecost, "WORKERS", workers)
    model, inputs = load("gpt", batch=4)
    theory = derive(trace(model, inputs))
    cluster = Cluster.load("hap-testbed:16")
    coster = StageCoster(theory, build_layers(theory.graph), cluster)
    kinds = [(g.name, n) for g in cluster.groups for n in submesh_sizes(g)]
    coster.prefetch(kinds)
    return {k: coster.layer_costs(*k) for k in kinds}, coster.syntheses


def test_kinds_priced_in_two_processes_equal_one_process(monkeypatch):
    one, n1 = _costs(1, monkeypatch)
    two, n2 = _costs(2, monkeypatch)
    assert n1 == n2 and n1 > 2
    for k in one:
        for f in FIELDS:
            assert np.array_equal(getattr(one[k], f), getattr(two[k], f)), (k, f)
        assert one[k].program_time == two[k].program_time, k


@pytest.mark.parametrize("cluster", ["hap-testbed:16", "harp-setting2"])
def test_the_planner_chooses_the_same_with_two_processes(cluster, monkeypatch):
    model, inputs = load("mlp", batch=8)
    got = []
    for workers in (1, 2):
        monkeypatch.setattr(stagecost, "WORKERS", workers)
        choice = choose_plan(model, cluster, inputs, kinds=("spmd", "pipeline"))
        got.append([(k.kind, k.status, k.time) for k in choice.kinds])
    assert got[0] == got[1]
