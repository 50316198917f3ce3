"""Exact pruning in the plan-kind choice (issue 14, acceptance 2): a pipeline candidate whose Eq. 12
lower bound (:func:`hapc.pipeline.dp.step_lower_bound`) is no better than a pipeline already priced
skips its DP. The bound must never exceed what the DP returns, and pruning must change nothing
the planner reports but the pruned entries' status: the choice, every time priced, the counts the
micro-batch search visits."""

from __future__ import annotations

import math

import pytest
from test_plan_kinds import groups

from hapc.cluster import Cluster
from hapc.errors import HapcError
from hapc.pipeline.planner import PipelinePruned, plan_pipeline
from hapc.pipeline.replicas import layouts
from hapc.pipeline.runtime import micro_batches
from hapc.planner import choose_plan, micro_candidates, replica_counts
from hapc.theory import derive, trace
from models import load

CASES = [
    ("mlp", 6, lambda: groups("100 MB/s")),
    ("mlp", 24, lambda: groups("100 MB/s", per_group=4)),
    ("mlp", 8, lambda: "hap-testbed:16"),
    ("gpt", 8, lambda: groups("1 GB/s")),
]


def _entries(choice) -> list[tuple[str, str, float]]:
    return [(k.kind, k.status, k.time) for k in choice.kinds]


@pytest.mark.parametrize(("alias", "batch", "cluster"), CASES, ids=[f"{a}-{b}" for a, b, _ in CASES])
def test_pruning_changes_no_choice_and_no_time(alias, batch, cluster):
    model, inputs = load(alias, batch=batch)
    pruned = choose_plan(model, cluster(), inputs, kinds=("spmd", "pipeline"))
    full = choose_plan(model, cluster(), inputs, kinds=("spmd", "pipeline"), prune=False)
    assert pruned.chosen.kind == full.chosen.kind and pruned.time == full.time
    if pruned.kind == "pipeline":
        a, b = pruned.plan.to_json(), full.plan.to_json()
        for d in (a, b):  # (syntheses: which candidate synthesized a shared sub-mesh kind first)
            d.pop("timings"), d.pop("kinds"), d["search"].pop("syntheses")
        assert a == b
    # the same entries in the same order (the micro-batch search took the same path); each priced
    # one at the same time, each pruned one no better than the least priced before it or at its own
    # micro-batch count (a count's candidates are priced in the order of their synthesis-free bound)
    assert [k.kind for k in pruned.kinds] == [k.kind for k in full.kinds]
    priced = [k for k in pruned.kinds if k.plan_kind == "pipeline" and k.status in ("feasible", "chosen")]
    for i, (p, f) in enumerate(zip(pruned.kinds, full.kinds)):
        if p.status == "pruned":
            before = pruned.kinds[:i]
            least = min((k.time for k in priced if k.num_micro == p.num_micro or k in before), default=math.inf)
            assert f.time >= least, (p.kind, f.time, least)
        else:
            assert (p.kind, p.status, p.time) == (f.kind, f.status, f.time)
    assert "pruned" not in {k.status for k in full.kinds}


def test_some_candidates_are_pruned():
    model, inputs = load("mlp", batch=24)
    choice = choose_plan(model, groups("100 MB/s", per_group=4), inputs, kinds=("spmd", "pipeline"))
    statuses = [k.status for k in choice.kinds]
    assert statuses.count("pruned") >= 5, choice.kinds
    why = next(k.reason for k in choice.kinds if k.status == "pruned")
    assert "not priced" in why and "lower bound" in why


@pytest.mark.parametrize(
    ("alias", "batch", "cluster", "tight"), [(*CASES[1], 0.95), (*CASES[2], 0.5)], ids=["mlp-24", "mlp-8-hap"]
)
def test_the_bound_is_below_every_candidates_step_time(alias, batch, cluster, tight):
    """Every (micro-batch count, replica count, layout) the planner may price: the bound that
    pruning compares (read off PipelinePruned, forced by a tiny ``above``) is at most the DP's Eq. 12
    time, and close to it somewhere (``tight``: a bound of 0 would prune nothing; on hap-testbed the
    collectives inside stages, which the bound leaves out, keep it looser)."""
    model, inputs = load(alias, batch=batch)
    cl = cluster()
    whole = Cluster.load(cl) if isinstance(cl, str) else cl
    ratios = []
    for B in micro_candidates(batch, whole.num_devices):
        micro = micro_batches((*inputs,), B, batch)[0]
        th = derive(trace(model, micro))
        cache: dict = {}
        for R in [1] + replica_counts(whole, B):
            for layout in layouts(whole, R) if R > 1 else ["blocked"]:
                common = dict(num_micro=B, theory=th, replicas=R, layout=layout, cache=cache)
                try:
                    exact = plan_pipeline(model, whole, micro, **common).time
                except HapcError:
                    continue  # no pipeline fits: nothing to bound
                with pytest.raises(PipelinePruned) as info:
                    plan_pipeline(model, whole, micro, above=1e-12, **common)
                assert info.value.bound <= exact, (B, R, layout, info.value.bound, exact)
                ratios.append(info.value.bound / exact)
    assert ratios and max(ratios) > tight, sorted(ratios)
