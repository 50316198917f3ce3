"""The two exact shortcuts of the cold ``hapc synth`` (issue 15, acceptance 3).

1. **A stage-cost lower bound without a synthesis** (:meth:`StageCoster.lower_per_micro`,
   :func:`hapc.pipeline.planner.step_bound`): per layer and sub-mesh kind, the least defining triple
   of each computed node summed over the layer is at most the synthesized ``fwd + bwd + (sync +
   extra) / B`` the DP charges, on every kind of every replica layout, so the step bound over it is
   at most every plan's Eq. 12 time; the planner skips a candidate's syntheses where it is no better
   than a pipeline already priced (checked against ``prune=False`` in test_planner_prune.py).
2. **The direct pass at U** (:func:`hapc.synth.synthesizer._direct`): synthesis with it returns the
   very program (triples and cost) it returns without it, whether the first pass was optimal (the
   deepening passes skipped) or not (the caches restored, the deepening passes as before).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_plan_kinds import groups
from test_stagecost_cache import hosts

from hapc.cluster import Cluster
from hapc.pipeline import planner as pplanner
from hapc.pipeline.layers import build_layers
from hapc.pipeline.planner import cost_table, group_order, lower_table, plan_pipeline, step_bound
from hapc.pipeline.replicas import layouts, replica_cluster, sync_seconds_per_byte
from hapc.pipeline.runtime import micro_batches
from hapc.pipeline.stagecost import StageCoster
from hapc.planner import micro_candidates, replica_counts
from hapc.synth import synthesizer
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, shardable_triples, synthesize_program
from hapc.theory import derive, trace
from models import load

CASES = [
    ("mlp", 8, lambda: Cluster.load("hap-testbed:16")),
    ("gpt", 8, lambda: groups("1 GB/s")),
    ("gpt", 8, lambda: hosts(devices=8, per_host=2)),
]


@pytest.mark.parametrize(("alias", "batch", "cluster"), CASES, ids=["mlp-hap16", "gpt-groups", "gpt-hosts"])
def test_the_lower_table_is_below_the_synthesized_one_everywhere(alias, batch, cluster):
    """Every micro-batch count, replica count, layout, sub-mesh kind and layer: the synthesis-free
    bound <= what the DP charges per micro-batch (the replicas' all-reduce included), and the step
    bound over it <= the bound over the synthesized costs <= the plan's Eq. 12 time."""
    model, inputs = load(alias, batch=batch)
    whole = cluster()
    checked = 0
    for B in micro_candidates(batch, whole.num_devices)[-3:]:
        micro = micro_batches((*inputs,), B, batch)[0]
        th = derive(trace(model, micro))
        layers = build_layers(th.graph, min_compute=2)
        cache: dict = {}
        pure: dict = {}  # never synthesized into: the bound from triples alone
        for R in [1] + replica_counts(whole, B):
            for layout in layouts(whole, R) if R > 1 else ["blocked"]:
                sub = replica_cluster(whole, R, layout)
                names = group_order(sub)
                coster = StageCoster(th, layers, sub, cache=cache)
                per = B // R
                low = lower_table(StageCoster(th, layers, sub, cache=pure), layers, names, whole, R, layout, per)
                assert not pure.get("costs")
                real = cost_table(coster, layers, names)
                extra = np.stack(
                    [
                        real.mem_param[o] / 4.0 * sync_seconds_per_byte(whole, R, layout, names[opt.group], opt.size)
                        for o, opt in enumerate(real.options)
                    ]
                )
                charged = real.fwd + real.bwd + (real.sync + extra) / per
                assert low.options == real.options
                assert np.all(low.fwd <= charged * (1 + 1e-12)), (B, R, layout, float((low.fwd / charged).max()))
                assert np.all(low.fwd >= 0)
                bound = step_bound(th, layers, whole, B, replicas=R, layout=layout, cache=cache)
                try:
                    exact = plan_pipeline(model, whole, micro, num_micro=B, theory=th, layers=layers, replicas=R,
                                          layout=layout, cache=cache).time  # fmt: skip
                except pplanner.PlanningError:
                    continue
                assert bound <= exact, (B, R, layout, bound, exact)
                checked += 1
    assert checked >= 3


def test_the_synthesis_free_bound_prunes_before_any_synthesis(monkeypatch):
    """A candidate whose synthesis-free bound is above ``above`` is pruned with no stage synthesized;
    with the shortcut off (``PRICE_BOUND = False``) the same candidate synthesizes its kinds first and
    reports a bound no lower."""
    model, inputs = load("mlp", batch=8)
    whole = Cluster.load("hap-testbed:16")
    micro = micro_batches((*inputs,), 8, 8)[0]
    th = derive(trace(model, micro))
    layers = build_layers(th.graph, min_compute=2)
    cache: dict = {}
    free = step_bound(th, layers, whole, 8, cache=cache)
    with pytest.raises(pplanner.PipelinePruned) as cheap:
        plan_pipeline(model, whole, micro, num_micro=8, theory=th, layers=layers, cache=cache, above=free)
    assert not cache.get("costs")  # nothing synthesized
    assert cheap.value.bound == free
    monkeypatch.setattr(pplanner, "PRICE_BOUND", False)
    with pytest.raises(pplanner.PipelinePruned) as dear:
        plan_pipeline(model, whole, micro, num_micro=8, theory=th, layers=layers, cache=cache, above=1e-12)
    assert cache["costs"]  # synthesized this time
    assert dear.value.bound >= free * (1 - 1e-12)


def _space(alias: str, batch: int, cluster: Cluster):
    model, inputs = load(alias, batch=batch)
    th = derive(trace(model, inputs))
    cm = CostModel(cluster)
    return SynthSpace(th, cm.m, "node", shardable_triples(th, cm.m)), cm


@pytest.mark.parametrize("beam", [synthesizer.BEAM, 1])
@pytest.mark.parametrize(
    ("alias", "cluster"),
    [("gpt", "hap-testbed:8"), ("mlp", "hap-testbed:16"), ("gpt", "hap-testbed:2")],
    ids=["gpt-hap8", "mlp-hap16", "gpt-hap2"],
)
def test_the_direct_pass_changes_no_program(monkeypatch, alias, cluster, beam):
    """The program, its cost and its per-segment costs are those of the deepening passes alone, with
    the first pass at its default beam (optimal here: the deepening skipped) and at beam 1 (poor:
    the direct pass finds a cheaper program or hits its cap, and the deepening runs as before)."""
    space, cm = _space(alias, 8, Cluster.load(cluster))
    for ratios in (cm.even_ratios(), cm.proportional_ratios()):
        monkeypatch.setattr(synthesizer, "DIRECT", True)
        fast = synthesize_program(space, cm, ratios, beam=beam, incumbent=False)
        monkeypatch.setattr(synthesizer, "DIRECT", False)
        slow = synthesize_program(space, cm, ratios, beam=beam, incumbent=False)
        assert fast.parts == slow.parts and fast.cost == slow.cost and fast.segment_costs == slow.segment_costs
        assert fast.proven and slow.proven


def test_the_direct_pass_skips_the_deepening_where_the_first_pass_is_optimal(monkeypatch):
    """On hap-testbed:8 the default first pass finds GPT's optimum: with the direct pass one exact
    pass (at U) runs instead of the deepening passes and the pass at U."""
    space, cm = _space("gpt", 8, Cluster.load("hap-testbed:8"))
    ratios = cm.even_ratios()
    monkeypatch.setattr(synthesizer, "DIRECT", False)
    slow = synthesize_program(space, cm, ratios, incumbent=False)
    monkeypatch.setattr(synthesizer, "DIRECT", True)
    fast = synthesize_program(space, cm, ratios, incumbent=False)
    assert len(slow.bounds) >= 2 and fast.bounds == [fast.cost]
    assert fast.parts == slow.parts and fast.cost == slow.cost


def test_segmented_plans_are_pruned_by_their_boundary_latencies():
    """On hap-testbed:24 (two device groups) a boundary's all-to-alls cost more latency than the best
    pipeline takes (the segments' own programs left out): the two-segment cut sets are listed
    pruned, not priced; without pruning they are priced at no less than the floor, above the chosen
    time, and every entry priced both ways and the choice are the same."""
    from hapc.planner import choose_plan, segmented_floor

    model, inputs = load("mlp", batch=8)
    cluster = Cluster.load("hap-testbed:24")
    pruned = choose_plan(model, cluster, inputs, num_micro=4)
    full = choose_plan(model, cluster, inputs, num_micro=4, prune=False)
    seg = [k for k in pruned.kinds if k.plan_kind == "segmented"]
    assert seg and all(k.status == "pruned" and "boundary" in k.reason for k in seg), seg
    assert pruned.chosen.kind == full.chosen.kind and pruned.time == full.time
    floor = segmented_floor(cluster, 1)
    assert floor >= pruned.time
    priced = [k for k in full.kinds if k.plan_kind == "segmented" and k.status == "feasible"]
    assert priced and all(k.time >= floor for k in priced)
    others = [k for k in full.kinds if k.plan_kind != "segmented"]
    for p, f in zip([k for k in pruned.kinds if k.plan_kind != "segmented"], others, strict=True):
        assert p.kind == f.kind and (p.status == "pruned" or (p.status, p.time) == (f.status, f.time))
