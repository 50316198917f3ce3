"""The synthesizer's deadline reaches inside one DP step and the dominance pruning between steps.

``time_limit=`` is checked by every segment search and at the start of every DP step; a single
step over a table of 10^5 states, or the pruning of a table whose states tie (ALBERT's shared
layers on one device left 12 096 equal-cost states in one group: 4.9 s of pairwise checks), ran
on past it for seconds. These tests need no clock: a deadline already passed must stop both
within their first few thousand states (:class:`~hapc.synth.search.OutOfTime`), and the faster
pruning (a state compared only with kept states of more properties) must drop exactly the states
the pairwise definition drops.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict

import pytest

from hapc.synth.search import OutOfTime
from hapc.synth.synthesizer import _Bits, _prune_dominated
from hapc.theory.props import REPLICATED, Prop, shard

LAYOUTS = (REPLICATED, shard(0), shard(1))


def _states(seed: int, n: int, refs: int = 4, tokens: int = 2) -> tuple[dict, _Bits]:
    """``n`` random DP states over ``refs`` tensors (each held in a non-empty set of layouts),
    with few distinct costs, so that ties and supersets are common."""
    rng, bits = random.Random(seed), _Bits()
    states: dict[tuple[int, int], tuple] = {}
    while len(states) < n:
        live = 0
        for r in rng.sample(range(refs), rng.randint(1, refs)):
            for lay in rng.sample(LAYOUTS, rng.randint(1, len(LAYOUTS))):
                live |= bits.p(Prop(r, lay))
        states[(live, rng.randrange(tokens))] = (float(rng.randint(0, 4)), None)
    return states, bits


def _pairwise(states: dict, bits: _Bits) -> set:
    """The definition: a state goes when a state of its group kept before it (cost order) holds a
    superset of its properties at no higher cost."""
    groups = defaultdict(list)
    for st, val in states.items():
        groups[(st[1], frozenset(p.ref for p in bits.props(st[0])))].append((st, val[0]))
    dropped = set()
    for members in groups.values():
        members.sort(key=lambda x: x[1])
        kept = []
        for st, c in members:
            if any((k[0] & st[0]) == st[0] and kc <= c for k, kc in kept):
                dropped.add(st)
            else:
                kept.append((st, c))
    return dropped


@pytest.mark.parametrize("seed", range(20))
def test_pruning_drops_exactly_the_dominated_states(seed):
    states, bits = _states(seed, 60)
    want = set(states) - _pairwise(states, bits)
    _prune_dominated(states, bits)
    assert set(states) == want
    assert len(want) < 60  # the draw had dominated states to drop


def test_pruning_stops_at_a_passed_deadline():
    states, bits = _states(0, 3000, refs=6, tokens=1)
    with pytest.raises(OutOfTime):
        _prune_dominated(states, bits, deadline=time.monotonic() - 1)
    states, bits = _states(0, 3000, refs=6, tokens=1)
    _prune_dominated(states, bits, deadline=time.monotonic() + 3600)  # a far one changes nothing
    assert len(states) < 3000


def test_one_dp_step_stops_at_a_passed_deadline(monkeypatch):
    """A step checks the deadline every 2048 states of its table, not only when it starts."""
    import torch
    from torch import nn

    from hapc.cluster import Cluster
    from hapc.synth import synthesizer
    from hapc.synth.cost import CostModel
    from hapc.synth.synthesizer import SynthSpace, _Synth
    from hapc.theory import derive, trace

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x, y):
            return ((self.fc(x) - y) ** 2).mean()

    theory = derive(trace(Net(), (torch.randn(8, 8), torch.randn(8, 1))))
    cluster = Cluster.load("local-cpu:2")
    cost = CostModel(cluster)
    space = SynthSpace(theory, cost.m, "node", set(range(len(theory.triples))))
    run = _Synth(space, cost, cost.even_ratios(), None)
    seg = space.segments[0]
    table = {(1 << (k + 40), 0): (0.0, None) for k in range(5000)}  # states no exit is looked up for
    calls = []
    monkeypatch.setattr(run, "segment_exits", lambda *a: calls.append(a) or [])
    monkeypatch.setattr(synthesizer.time, "monotonic", lambda: 10.0)
    run.deadline = 5.0
    with pytest.raises(OutOfTime):
        run.step(seg, {(0, 0): (0.0, None)})  # at its start
    run.deadline = 20.0
    run.step(seg, dict(table))  # before the deadline: every state stepped
    assert len(calls) == 5000
    calls.clear()
    clock = iter([10.0] + [30.0] * 10)  # the deadline passes once the step has begun
    monkeypatch.setattr(synthesizer.time, "monotonic", lambda: next(clock))
    with pytest.raises(OutOfTime):
        run.step(seg, dict(table))
    assert 0 < len(calls) <= 2048
