"""``torch.utils.checkpoint`` regions are recomputed in the per-rank program (issue 13 item 9): the
capture marks the ops a model runs inside ``checkpoint(fn, ...)`` (reentrant or not, fx or export),
the program calls each region through ``torch.utils.checkpoint`` so its activations are not kept, and
training is exact -- with dropout inside (masks recomputed at the forward's step), with torch's
reentrant variant's own rule (no gradient into a region none of whose inputs requires grad), and
under a parameter-sharding plan, whose regions communicate and are kept with a warning instead of
recomputed. float64, 2 and 3 gloo processes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close
from torch import nn
from torch.utils.checkpoint import checkpoint

import hapc
from hapc.codegen import regions
from hapc.codegen.regions import checkpointed
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTERS = {1: cluster_of([1e9]), 2: cluster_of([3e9, 1e9]), 3: cluster_of([5e9, 3e9, 2e9])}
UNEVEN = {2: [0.6, 0.4], 3: [0.5, 0.3, 0.2]}


class Block(nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.up, self.down, self.p = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), p

    def forward(self, x):
        h = F.gelu(self.up(x))
        if self.p:
            h = F.dropout(h, self.p, self.training)
        return x + self.down(h)


class Net(nn.Module):
    """Blocks 0 and 2 checkpointed, block 1 not; MSE loss."""

    def __init__(self, reentrant: bool, p: float = 0.0, width: int = 16, use_checkpoint: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(3))
        self.reentrant, self.use_checkpoint = reentrant, use_checkpoint

    def forward(self, x, y):
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=self.reentrant) if i != 1 and self.use_checkpoint else b(x)
        return F.mse_loss(x, y)


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(12, 16, generator=g, dtype=F64), torch.randn(12, 16, generator=g, dtype=F64)


def _train(module, inputs, steps: int = 2):
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _job(rank, world, reentrant, kind, capture, p, use_checkpoint=True):
    torch.manual_seed(0)
    model = Net(reentrant, p, use_checkpoint=use_checkpoint).to(F64)
    options = {"baseline": "tp", "ratios": UNEVEN[world]} if kind == "tp" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = hapc.compile(model, CLUSTERS[world], _data(), capture=capture, **options)
    warned = any("communicate under this plan and are not recomputed" in str(w.message) for w in caught)
    made = [n for n in module.program.graph.nodes if n.target is checkpointed]
    calls = []  # every run of a region's code: in forward, and again when backward recomputes it
    real = regions.checkpoint

    def counting(fn, *args, **kwargs):
        def run(*xs):
            calls.append(torch.is_grad_enabled())
            return fn(*xs)

        return real(run, *args, **kwargs)

    regions.checkpoint = counting
    try:
        losses = _train(module, _data())
    finally:
        regions.checkpoint = real
    return {"regions": len(made), "warned": warned, "calls": calls, "losses": losses, "state": module.full_state_dict()}


CASES = [(2, "default", "fx", False), (2, "tp", "fx", True), (3, "tp", "export", False), (3, "default", "auto", True)]


@pytest.mark.parametrize(("world", "kind", "capture", "reentrant"), CASES)
def test_checkpointed_regions_are_recomputed_and_exact(world, kind, capture, reentrant):
    torch.manual_seed(0)
    model = Net(reentrant).to(F64)
    want = _train(model, _data())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for rank, got in enumerate(run_distributed(_job, world, reentrant, kind, capture, 0.0)):
        where = f"{world} ranks, {kind}, {capture}, rank {rank}"
        assert_close(got["losses"], want, F64, f"{where}: losses")
        assert_close(got["state"], state, F64, f"{where}: parameters")
        if kind == "tp":  # the regions communicate (sharded weights): kept, with a warning, not recomputed
            assert got["regions"] == 0 and got["warned"], where
            continue
        assert got["regions"] == 2, where  # blocks 0 and 2
        # each region runs once in forward and once more in backward (recomputed), every step -- but
        # torch's reentrant variant sends no gradient into block 0 (its input, the data, requires none):
        # block 0's parameters get no gradient, on one device as here, and it is not recomputed
        recomputed = 1 if reentrant else 2
        assert len(got["calls"]) == 2 * (2 + recomputed), (where, got["calls"])


def _one_rank(p):
    """hapc's one-rank run of the model without checkpointing: the same masks, nothing recomputed."""
    return run_distributed(_job, 1, False, "default", "fx", p, False)[0]


@pytest.mark.parametrize("world", [2, 3])
def test_dropout_inside_a_region_is_recomputed_with_the_forwards_masks(world):
    """Masks depend on the module's step, advanced after each forward: the recomputation in
    backward must draw the forward's masks, or gradients are wrong. Compared with hapc's one-rank
    run (the masks are hapc's, not torch's)."""
    want = _one_rank(0.3)
    for got in run_distributed(_job, world, False, "default", "fx", 0.3):
        assert got["regions"] == 2
        assert_close(got["losses"], want["losses"], F64, "losses with dropout in regions")
        assert_close(got["state"], want["state"], F64, "parameters with dropout in regions")


def _saved_bytes(rank, world, use_checkpoint):
    torch.manual_seed(0)
    model = Net(False, width=64, use_checkpoint=use_checkpoint).to(F64)
    x, y = torch.randn(64, 64, dtype=F64), torch.randn(64, 64, dtype=F64)
    module = hapc.compile(model, CLUSTERS[world], (x, y))
    saved = []

    def pack(t):  # activations only: the weights are saved either way
        if not isinstance(t, nn.Parameter):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(x, y)
    loss.backward()
    return sum(saved)


def test_regions_keep_fewer_activations():
    with_ckpt = run_distributed(_saved_bytes, 2, True)[0]
    without = run_distributed(_saved_bytes, 2, False)[0]
    assert with_ckpt < 0.7 * without, (with_ckpt, without)
