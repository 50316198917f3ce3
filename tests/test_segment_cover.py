"""A segment's exit is a state that proves every node of the segment computed.

A parameter chain (:func:`hapc.synth.segments.source_like` nodes that are not static data) is
searched in the segment where it can first be made, beside that segment's own node. T5's relative
position bias is one: the bucket table (static data, the segment's node) feeds an embedding of the
bias weight, a permute, an unsqueeze and a ``where`` (the chain). Once the chain has consumed the
bucket table, the table is dead and only the chain's last value is held; that value descends from
the table, so it proves the table computed. Before the cover followed the chain's nodes, such a
state was never an exit: every program had to keep the table alive for some other consumer (a
collective slicing it, in the full space). Over the all-replicated triples there is none, so
:func:`~hapc.synth.synthesizer.fallback_program` found no program, the one-device stage costs fell
through to an exact search, and pricing T5's pipeline took minutes (now seconds).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import hapc
from hapc.cluster import Cluster
from hapc.synth.cost import CostModel
from hapc.synth.exhaustive import exhaustive_min_cost
from hapc.synth.synthesizer import SynthSpace, fallback_program, replicated_triples, synthesize_program


class RelativeBias(nn.Module):
    """Self-attention scores plus a learned relative-position bias computed from a buffer."""

    def __init__(self, seq: int = 6, heads: int = 2, d: int = 8):
        super().__init__()
        self.seq, self.heads = seq, heads
        self.rel = nn.Embedding(2 * seq - 1, heads)
        self.q = nn.Linear(d, d)
        self.register_buffer("pos", torch.arange(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.pos[None, :] - self.pos[:, None] + (self.seq - 1)  # static data: its own segments
        bias = self.rel(bucket).permute(2, 0, 1).unsqueeze(0) * 2.0  # the parameter chain
        q = self.q(x).view(x.shape[0], self.seq, self.heads, -1).transpose(1, 2)
        return (q @ q.transpose(-1, -2) + bias).softmax(-1).sum()


@pytest.fixture(scope="module")
def theory():
    torch.manual_seed(0)
    model = RelativeBias().double()
    return hapc.derive(hapc.trace(model, (torch.randn(4, 6, 8, dtype=torch.float64),)))


@pytest.mark.parametrize("devices", [1, 2])
def test_the_all_replicated_program_is_found_through_a_parameter_chain(theory, devices):
    cm = CostModel(Cluster.load(f"local-cpu:{devices}"))
    ratios = cm.even_ratios()
    space = SynthSpace(theory, cm.m)
    found = fallback_program(space, cm, ratios)
    assert found is not None, "the all-replicated program was not found"
    # it is the least-cost program over those triples (one per node, one stage each: additive)
    allowed = space.allowed & replicated_triples(theory)
    best = exhaustive_min_cost(theory, cm, ratios, allowed, additive=True)
    assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (found.cost, best)


class BiasOnly(nn.Module):
    """The relative-position bias alone, added to the input: small enough to enumerate."""

    def __init__(self, seq: int = 4, heads: int = 2):
        super().__init__()
        self.seq = seq
        self.rel = nn.Embedding(2 * seq - 1, heads)
        self.register_buffer("pos", torch.arange(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bucket = self.pos[None, :] - self.pos[:, None] + (self.seq - 1)
        return (x + self.rel(bucket).permute(2, 0, 1).unsqueeze(0) * 2.0).sum()


def test_the_segment_dp_over_a_parameter_chain_is_exact():
    """The whole space on two devices: the DP (with the widest and the poorest first pass) finds
    the least cost of every program, enumerated (states that exit through the chain are exits)."""
    model = BiasOnly().double()
    theory = hapc.derive(hapc.trace(model, (torch.randn(3, 2, 4, 4, dtype=torch.float64),)))
    cm = CostModel(Cluster.load("local-cpu:2"))
    ratios = cm.even_ratios()
    space = SynthSpace(theory, cm.m)
    best = exhaustive_min_cost(theory, cm, ratios, space.allowed, additive=True)
    for beam in (0, 1):
        found = synthesize_program(space, cm, ratios, beam=beam)
        assert math.isclose(found.cost, best, rel_tol=1e-9, abs_tol=1e-15), (beam, found.cost, best)
