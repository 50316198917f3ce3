"""Acceptance 1 of synthesis: the search returns exactly the least cost of all complete programs.

Random small graphs (hypothesis) on random 2-4 device clusters with random (uneven) ratios; the
reference enumerates every program of the theory (``hapc.synth.exhaustive``). Checked for the
whole-program A* (HAP's stage model) and for the default one-node-per-segment dynamic program
(whose stages are single triples).
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from randgraph import branchy_case, random_clusters, random_models, ratios_for

import hapc
from hapc.synth.cost import CostModel
from hapc.synth.exhaustive import exhaustive_min_cost
from hapc.synth.synthesizer import BEAM, SynthSpace, program_cost, synthesize_program

SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("HAPC_EXAMPLES", 120)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _setup(data, model_and_inputs, cluster):
    model, inputs = model_and_inputs
    theory = hapc.derive(
        hapc.trace(model, inputs), variants=data.draw(st.sampled_from([("padded",), ("padded", "grouped")]))
    )
    cm = CostModel(cluster)
    ratios = ratios_for(data.draw, cluster)
    return theory, cm, ratios


@SETTINGS
@given(data=st.data(), mi=random_models(max_ops=2), cluster=random_clusters())
def test_astar_matches_exhaustive_enumeration(data, mi, cluster):
    theory, cm, ratios = _setup(data, mi, cluster)
    space = SynthSpace(theory, cm.m, "none")
    found = synthesize_program(space, cm, ratios)
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)
    assert math.isclose(program_cost(theory, cm, found.parts, ratios), found.cost, rel_tol=1e-9, abs_tol=1e-15)


@SETTINGS
@given(data=st.data(), mi=random_models(max_ops=3), cluster=random_clusters())
def test_segment_dp_matches_exhaustive_enumeration(data, mi, cluster):
    """Also with branch and bound fed a poor upper bound (``beam=1``: one state per table in the
    first pass), where its lower bounds on the remaining segments decide what is pruned."""
    theory, cm, ratios = _setup(data, mi, cluster)
    space = SynthSpace(theory, cm.m, "node")
    found = synthesize_program(space, cm, ratios, beam=data.draw(st.sampled_from([0, 1, 2, BEAM])))
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed, additive=True)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)
    assert math.isclose(program_cost(theory, cm, found.parts, ratios), found.cost, rel_tol=1e-9, abs_tol=1e-15)


# seeds of tests/randgraph.branchy_case; HAPC_BRANCHY_SEEDS=n checks the first n (the mutation
# run uses more). The first ones are cases where a doubled (inadmissible) heuristic picks a worse
# program (found by running that mutant over seeds 0-62: 15, 27, 45, 56 fail; 27 and 45 are slow).
BRANCHY_PINNED = [15, 56]
BRANCHY_SEEDS = BRANCHY_PINNED + [
    s for s in range(int(__import__("os").environ.get("HAPC_BRANCHY_SEEDS", 8))) if s not in BRANCHY_PINNED
]


@pytest.mark.parametrize("seed", BRANCHY_SEEDS)
def test_astar_matches_exhaustive_on_branchy_graphs(seed):
    """Forks and joins let the search order independent work around a collective (where an
    inadmissible heuristic or an unsound pruning picks a worse program); 2-3 device types."""
    model, inputs, cluster, ratios, variants = branchy_case(seed)
    theory = hapc.derive(hapc.trace(model, inputs), variants=variants)
    cm = CostModel(cluster)
    space = SynthSpace(theory, cm.m, "none")
    found = synthesize_program(space, cm, ratios)
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)
    assert math.isclose(program_cost(theory, cm, found.parts, ratios), found.cost, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.parametrize("seed", BRANCHY_SEEDS)
def test_segment_dp_with_branch_and_bound_matches_exhaustive(seed):
    """The node-segmented DP under branch and bound with the poorest first pass (``beam=1``): what
    its segment lower bounds and the searches' budgets prune never holds the optimum."""
    model, inputs, cluster, ratios, variants = branchy_case(seed)
    theory = hapc.derive(hapc.trace(model, inputs), variants=variants)
    cm = CostModel(cluster)
    space = SynthSpace(theory, cm.m, "node")
    found = synthesize_program(space, cm, ratios, beam=1)
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed, additive=True)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)
    assert math.isclose(program_cost(theory, cm, found.parts, ratios), found.cost, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.parametrize("seed", [6, 8, 13, 17, 34, 39])  # branchy cases whose TP program communicates
def test_astar_prices_forced_collectives_exactly(seed):
    """Restricted to Megatron's tensor-parallel triples the program must communicate, forward and
    backward, several times in a row: the search's running stage accounting must equal the cost
    model's on its program, and its cost the exhaustive least over the same triples."""
    from hapc.synth.baselines import restrict
    from hapc.synth.synthesizer import shardable_triples

    model, inputs, cluster, ratios, variants = branchy_case(seed)
    theory = hapc.derive(hapc.trace(model, inputs), variants=variants)
    cm = CostModel(cluster)
    allowed = restrict(theory, "tp", cm.m) & shardable_triples(theory, cm.m)
    space = SynthSpace(theory, cm.m, "none", allowed=allowed)
    found = synthesize_program(space, cm, ratios)
    assert math.isclose(program_cost(theory, cm, found.parts, ratios), found.cost, rel_tol=1e-9, abs_tol=1e-15)
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)
