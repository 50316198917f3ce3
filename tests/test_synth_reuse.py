"""Repeated layers share their searches (HAP §5.2, HARP §5.1's repeated blocks).

The synthesizer names each segment's tensors canonically (its ``i``-th node, the ``j``-th operand of
it) rather than by graph index, so two layers match although export capture places every parameter
at the start of the graph and all layers read one mask made at the top. A mapping bug here would
hand one layer's program to another with the wrong tensors: the program the synthesizer returns is
therefore priced again from scratch and must cost what the search claimed.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hapc
from hapc.cluster import Cluster
from hapc.errors import HapcError
from hapc.synth import synthesizer
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, program_cost, shardable_triples, synthesize_program


class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = (self.q(x) @ self.k(x).transpose(1, 2)).masked_fill(mask, -1e4).softmax(-1)
        return x + self.o(a @ x)


class Net(nn.Module):
    def __init__(self, layers: int, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)  # made once, read by every layer
        for layer in self.layers:
            x = layer(x, mask)
        return ((x - y) ** 2).mean()


def _synth(
    layers: int,
    cluster: str = "local-cpu:3",
    beam: int = 0,
    deadline: float | None = None,
    incumbent: bool = True,
    batch: int = 6,
):
    """``beam=0``: the plain DP (branch and bound's searches depend on the bounds it meets)."""
    torch.manual_seed(0)
    x, y = torch.randn(batch, 4, 8), torch.randn(batch, 4, 8)
    graph = hapc.trace(Net(layers), (x, y), capture="export")
    theory = hapc.derive(graph)
    model = CostModel(Cluster.load(cluster))
    space = SynthSpace(theory, model.m, "node", shardable_triples(theory, model.m))
    ratios = model.proportional_ratios()
    result = synthesize_program(space, model, ratios, beam=beam, deadline=deadline, incumbent=incumbent)
    return theory, model, ratios, result


def test_params_first_in_export_graph():
    """The premise: export puts every parameter before the first op, far from the layer using it."""
    theory, *_ = _synth(2)
    kinds = [n.kind for n in theory.graph]
    assert kinds.index("op") > kinds.index("param") + 4


def test_later_layers_reuse_searches_and_the_program_prices_as_claimed():
    runs = {n: _synth(n) for n in (3, 4, 5)}
    searches = {n: r[3].searches for n, r in runs.items()}
    # the third layer onward enters in states a layer before already saw: no new searches
    assert searches[3] == searches[4] == searches[5], searches
    for theory, model, ratios, res in runs.values():
        assert abs(program_cost(theory, model, res.parts, ratios) - res.cost) <= 1e-12 * res.cost
    # a layer costs the same wherever it sits: each extra layer adds one layer's cost
    costs = [runs[n][3].cost for n in (3, 4, 5)]
    assert abs((costs[2] - costs[1]) - (costs[1] - costs[0])) <= 1e-9 * costs[2]


def test_branch_and_bound_finds_the_plain_optimum_with_fewer_searches():
    """The default synthesis (a beam pass for an upper bound, then the DP pruned by it and by the
    remaining segments' lower bounds) returns the plain DP's optimum, priced as claimed."""
    for n in (2, 4):
        theory, model, ratios, plain = _synth(n)
        *_, bounded = _synth(n, beam=synthesizer.BEAM)
        assert abs(bounded.cost - plain.cost) <= 1e-12 * plain.cost
        assert abs(program_cost(theory, model, bounded.parts, ratios) - bounded.cost) <= 1e-12 * bounded.cost
        assert bounded.searches <= plain.searches


def test_deepened_bounds_find_the_plain_optimum_where_the_beam_is_poor():
    """On 8 devices (communication dominates) with the poorest first pass (``beam=1``), the exact
    passes deepen their bound from the lower bound: every pass before the last finds nothing, the
    last finds the plain DP's optimum, and a repeated layer's cached block from a lower-bound pass
    is not reused under a higher one."""
    for n in (2, 3):
        theory, model, ratios, plain = _synth(n, "hap-testbed:8")
        *_, deep = _synth(n, "hap-testbed:8", beam=1)
        assert len(deep.bounds) >= 2 and deep.bounds == sorted(deep.bounds), deep.bounds
        assert abs(deep.cost - plain.cost) <= 1e-12 * plain.cost
        assert deep.cost <= deep.bounds[-1] * (1 + 1e-9)
        assert abs(program_cost(theory, model, deep.parts, ratios) - deep.cost) <= 1e-12 * deep.cost


def test_a_passed_deadline_returns_the_fallback_marked_unproven():
    """A deadline that has passed stops every search -- the data-parallel incumbent, the first
    pass, the exact passes -- before any completes a program: the all-replicated fallback comes
    back, unproven, priced as claimed, its floor below the true optimum (the plain DP's) and its
    cost above. Were the first pass (beam 1: cheap, never out of time on its own) to ignore the
    deadline, its program (cheaper here) would come back instead."""
    late = time.monotonic() - 1
    theory, model, ratios, plain = _synth(3, "hap-testbed:8", batch=8)
    *_, late_run = _synth(3, "hap-testbed:8", beam=1, deadline=late, batch=8)
    *_, first = _synth(3, "hap-testbed:8", beam=1, deadline=time.monotonic() + 600, batch=8)
    space = SynthSpace(theory, model.m, "node", shardable_triples(theory, model.m))
    fallback = synthesizer.fallback_program(space, model, ratios)
    assert fallback is not None and not fallback.proven
    assert late_run.parts == fallback.parts and late_run.cost == fallback.cost and not late_run.proven
    assert late_run.floor <= plain.cost * (1 + 1e-12) <= late_run.cost * (1 + 1e-12)
    assert abs(program_cost(theory, model, late_run.parts, ratios) - late_run.cost) <= 1e-12 * late_run.cost
    # every triple of the fallback keeps every tensor replicated, with no collective
    assert all(k in synthesizer.replicated_triples(theory) for k in late_run.triples)
    # the data-parallel incumbent has no fallback of its own: out of time, none
    assert synthesizer.data_parallel_program(space, model, ratios, deadline=late) is None
    with pytest.raises(synthesizer.OutOfTime):
        synthesize_program(space, model, ratios, beam=1, deadline=late, fallback=False)
    # a deadline far off changes nothing: the proven optimum
    assert first.proven and abs(first.cost - plain.cost) <= 1e-12 * plain.cost < fallback.cost - plain.cost


def test_a_deadline_in_the_exact_passes_keeps_the_best_program_found(monkeypatch):
    """The deadline passing in the exact passes returns the cheaper of the first pass's program and
    the data-parallel incumbent (priced first under a deadline), unproven; a first pass cut short
    leaves the exact passes to find the optimum."""
    theory, model, ratios, plain = _synth(3, "hap-testbed:8", batch=8)
    space = SynthSpace(theory, model.m, "node", shardable_triples(theory, model.m))
    dp = synthesizer.data_parallel_program(space, model, ratios)
    solve = synthesizer._Synth.solve
    stopped = []

    def out_of_time_in(which: str):
        def fake(self, required: bool = True):
            # the outer search only (not the data-parallel incumbent's, over fewer triples)
            if self.deadline is not None and (self.beam == 0) == (which == "exact") and self.space.allowed == whole:
                stopped.append(which)
                raise synthesizer.OutOfTime
            return solve(self, required)

        return fake

    whole = space.allowed
    run = synthesizer._Synth(space, model, ratios, None)
    run.beam = 1
    first_pass = run.solve()  # the first pass alone
    monkeypatch.setattr(synthesizer._Synth, "solve", out_of_time_in("exact"))
    *_, exact = _synth(3, "hap-testbed:8", beam=1, batch=8)  # no deadline: never stopped
    assert not stopped and exact.proven and abs(exact.cost - plain.cost) <= 1e-12 * plain.cost
    far = time.monotonic() + 600
    *_, beam_only = _synth(3, "hap-testbed:8", beam=1, deadline=far, incumbent=False, batch=8)
    assert stopped and not beam_only.proven and beam_only.cost == first_pass[0]
    *_, first = _synth(3, "hap-testbed:8", beam=1, deadline=far, batch=8)
    assert not first.proven
    assert dp is not None and dp.cost < beam_only.cost  # the beam of one is poorer here
    assert abs(first.cost - dp.cost) <= 1e-12 * dp.cost
    for res in (first, beam_only):
        assert res.floor <= plain.cost * (1 + 1e-12) <= res.cost * (1 + 1e-12)
        assert abs(program_cost(theory, model, res.parts, ratios) - res.cost) <= 1e-12 * res.cost
    monkeypatch.setattr(synthesizer._Synth, "solve", out_of_time_in("first"))
    stopped.clear()
    *_, in_first = _synth(3, "hap-testbed:8", beam=synthesizer.BEAM, deadline=far, batch=8)
    # the first pass cut short: the exact passes, bounded by the incumbent, still prove the optimum
    assert stopped == ["first"] and in_first.proven and abs(in_first.cost - plain.cost) <= 1e-12 * plain.cost


def test_time_limit_marks_the_plan_and_is_checked():
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    plan = hapc.synthesize(Net(2), "hap-testbed:8", (x, y), time_limit=1e-9)
    assert plan.predicted["proven_optimal"] is False and plan.predicted["optimality_gap"] >= 1
    assert "not proven optimal" in str(plan)
    assert plan.options["time_limit"] == 1e-9
    exact = hapc.synthesize(Net(2), "hap-testbed:8", (x, y))
    assert exact.predicted["proven_optimal"] is True and "not proven" not in str(exact)
    assert exact.time <= plan.time * (1 + 1e-9)
    with pytest.raises(HapcError, match="time_limit must be a positive number"):
        hapc.synthesize(Net(2), "hap-testbed:8", (x, y), time_limit=0)


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: ``1.0 + self.weight.float()``, a chain of the parameter alone that the
    theory keeps as triples of their own."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())


class NormNet(nn.Module):
    def __init__(self, layers: int = 4, d: int = 8):
        super().__init__()
        self.norms = nn.ModuleList(GemmaNorm(d) for _ in range(layers))
        self.fcs = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for norm, fc in zip(self.norms, self.fcs):
            x = x + fc(norm(x))
        return ((x - y) ** 2).mean()


def test_a_chain_is_searched_where_its_result_is_used():
    """Every layer's ``1 + weight`` is searched in the segments that read it, not all in the first
    segment (where one search enumerated every chain's layouts together: tiny Gemma planned for
    more than 10 minutes), and the program found is the plain DP's optimum, priced as claimed."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    theory = hapc.derive(hapc.trace(NormNet(), (x, y)))
    model = CostModel(Cluster.load("local-cpu:3"))
    space = SynthSpace(theory, model.m, "node", shardable_triples(theory, model.m))
    where = {a: s.index for s in space.segments for a in s.anchors}
    chains = {k for k in space.allowed if not isinstance(theory.triples[k].instrs[-1], synthesizer.Collective)
              and theory.triples[k].instrs[-1].ref not in where}  # fmt: skip
    assert chains, "the premise: 1 + weight is made in no segment of its own"
    readers: dict[int, set[int]] = {}
    for s in space.segments:
        for k in s.triples:
            for p in theory.triples[k].pre:
                readers.setdefault(p.ref, set()).add(s.index)
    for k in chains:
        ref = theory.triples[k].instrs[-1].ref
        homes = {s.index for s in space.segments if k in s.triples}
        assert homes == readers[ref], f"{theory.graph[ref].name}: searched in {homes}, read in {readers[ref]}"
    assert len({min(s.index for s in space.segments if k in s.triples) for k in chains}) == 4  # one per layer
    ratios = model.proportional_ratios()
    plain = synthesize_program(space, model, ratios, beam=0)
    bounded = synthesize_program(space, model, ratios)
    assert abs(bounded.cost - plain.cost) <= 1e-12 * plain.cost
    assert abs(program_cost(theory, model, bounded.parts, ratios) - bounded.cost) <= 1e-12 * bounded.cost
