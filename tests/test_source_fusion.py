"""HAP §4.5 (1), source fusion: the optimised theory keeps the optimum and stays small.

Fusing the empty-precondition triples into their consumers must leave the least program cost
unchanged (the search over the unoptimised theory finds the same; also for a weight-normalised
layer, whose weight is made from two parameters), and a model that computes a statistic of a
weight beside the weight itself (a logit offset ``w.mean()``) must not multiply the triples: each
round of the fixpoint used to fuse the static op into chains that had already made its result,
1.2k triples instead of 0.1k here, 35k instead of 1.3k for a tiny GPT (its search ten times
slower), 43k instead of 26k for Hugging Face's DeBERTa.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations

import hapc
from hapc.presets import preset
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, synthesize_program


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 16)
        self.out = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(torch.tanh(self.l(x))), y)


class WeightMean(Plain):
    """The output weight's mean subtracted from the logits: a static op reading a weight whose
    other user is the layer itself."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(torch.tanh(self.l(x))) - self.out.weight.mean(), y)


class WeightNormed(Plain):
    """``torch.nn.utils.parametrizations.weight_norm``: the weight is ``g * v / |v|``, made from
    two parameters at every forward."""

    def __init__(self):
        super().__init__()
        self.l = parametrizations.weight_norm(nn.Linear(8, 16))


def _theories(cls):
    torch.manual_seed(0)
    model = cls().double()
    x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(0, 6, (12,))
    graph = hapc.trace(model, (x, y))
    return hapc.derive(graph), hapc.derive(graph, optimise=False)


@pytest.mark.parametrize("cls", [Plain, WeightMean, WeightNormed])
@pytest.mark.parametrize("ratios", [None, (0.4, 0.2)])  # per device type: two fast, one slow
def test_fusion_keeps_the_least_cost(cls, ratios):
    fused, raw = _theories(cls)
    cm = CostModel(preset("local-cpu:3"))
    r = ratios or cm.even_ratios()
    best = synthesize_program(SynthSpace(fused, cm.m, "none"), cm, r).cost
    want = synthesize_program(SynthSpace(raw, cm.m, "none"), cm, r).cost
    assert math.isclose(best, want, rel_tol=1e-12), (best, want)


def test_a_weight_statistic_does_not_multiply_the_triples():
    plain, _ = _theories(Plain)
    fused, raw = _theories(WeightMean)
    assert len(fused.triples) <= 1.5 * len(plain.triples), (len(fused.triples), len(plain.triples))
    assert len(fused.triples) <= len(raw.triples) + len(plain.triples)
