"""``x.T``, ``x.mT`` (and ``x.H`` / ``x.mH`` of real tensors) are the permutations they are.

fx records them as ``getattr(x, "T")``, which had no sharding rule: a model writing ``x @ self.w.T``
(a hand-written linear layer, as many research models do) ran that op and everything around it
replicated, with a warning, and ``strict=True`` refused it. The tracer now writes them as
``permute``, whose rule moves a sharded dim with the permutation; the programs stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close
from torch import nn

import hapc
from hapc.testing import cluster_of, run_distributed
from hapc.theory import derive, trace
from hapc.theory.instructions import Source

F64 = torch.float64


class HandLinear(nn.Module):
    """Hand-written projections through every transposing attribute."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(32, 16, generator=g, dtype=F64) / 4)
        self.w2 = nn.Parameter(torch.randn(16, 32, generator=g, dtype=F64) / 4)
        self.w3 = nn.Parameter(torch.randn(5, 16, generator=g, dtype=F64) / 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w1.H)  # [B, 32]: H of a real matrix is its transpose
        h = (self.w2 @ h.mT).T  # [B, 16]
        scores = (h.unsqueeze(1) * h.unsqueeze(2)).mT.sum(-1)  # [B, 16], through a batched mT
        return F.cross_entropy((h + scores.tanh()) @ self.w3.mH, y)


def _inputs(batch: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 16, generator=g, dtype=F64), torch.randint(0, 5, (batch,), generator=g)


def test_transposed_attributes_trace_as_permutations_and_derive_under_strict():
    g = trace(HandLinear(), _inputs())
    ops = [n.op for n in g if n.kind == "op"]
    assert "builtins.getattr" not in ops and "permute" in ops, ops
    theory = derive(g, strict=True)  # raised: op 'builtins.getattr' has no sharding rule
    w1_t = next(n for n in g if n.kind == "op" and n.op == "permute" and g[n.operands[0]].name == "w1")  # w1.H
    assert len(theory.strategies[w1_t.index]) > 1, "the transposed weight can shard"


def _job(rank: int, world: int, link: str, ratios: list[float] | None) -> tuple[float, dict, list[str]]:
    torch.set_num_threads(1)
    x, y = _inputs()
    cluster = cluster_of([3e9, 1e9] if world == 2 else [5e9, 3e9, 2e9], bandwidth=link)
    m = hapc.compile(HandLinear(), cluster, (x, y), ratios=ratios)
    loss = m(x, y)
    loss.backward()
    plan = m.plan
    sharded = [plan.node_names[i.ref] for i in plan.instructions if isinstance(i, Source) and i.layout.is_sharded]
    return float(loss.detach()), m.full_gradients(), sharded


@pytest.mark.parametrize(
    "world, link, ratios, shards",
    [(2, "2 GB/s", None, ["x", "y"]), (3, "10 MB/s", [0.5, 0.3, 0.2], ["w1", "w2", "y"])],
    ids=["rows", "weights-uneven"],
)
def test_programs_through_transposed_attributes_match_one_device(world, link, ratios, shards):
    """2 ranks shard the batch through every permutation; 3 ranks on a slow link, at fixed uneven
    ratios, shard ``w1`` (read through ``w1.H``) and ``w2``."""
    model = HandLinear()
    x, y = _inputs()
    loss = model(x, y)
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    for rank, (got, grads, sharded) in enumerate(run_distributed(_job, world, link, ratios)):
        assert sorted(sharded) == shards, f"rank {rank}: the plan shards {sharded}"
        assert got == pytest.approx(loss.item(), rel=1e-12), f"rank {rank} loss"
        assert_close(grads, want, F64, f"rank {rank} gradients")
