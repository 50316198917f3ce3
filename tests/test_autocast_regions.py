"""``torch.autocast`` regions inside a model's forward run under the same contexts in the per-rank program.

fx traces through a ``with torch.autocast(...)`` block as if it were not there, and torch.export
wraps it in a higher-order op hapc used to inline: either way the distributed program computed in
float32 what one device computes in bfloat16 -- silently, a bf16-sized difference in every step. The
capture now records the contexts the model enters around each op (``enabled=False`` islands too, as
Llama keeps its rotary embedding in float32 under the caller's autocast), and the program runs those
ops through :func:`hapc.codegen.regions.autocasted`.

An ignored region shows in the dtypes of the values the model returns (a bf16 region's output is
bfloat16; the float32 island's stays float32 under the loop's autocast): the tests compare them with
one device's exactly. Losses and parameters after 3 SGD-momentum steps are compared at the tolerance
of bfloat16 arithmetic (2^-8 relative per rounding): the ranks round partial sums (a data-parallel
weight gradient, a tensor-parallel dot product) to bf16 at other places than one device does, so they
agree to a few bf16 ulps of the largest entry, not bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapc
from hapc.codegen.regions import autocasted
from hapc.testing import cluster_of, run_distributed

BF16 = torch.bfloat16
CLUSTERS = {2: cluster_of([3e9, 1e9]), 3: cluster_of([5e9, 3e9, 2e9])}
UNEVEN = {2: [0.6, 0.4], 3: [0.5, 0.3, 0.2]}
RTOL = 2.0**-5  # four bf16 ulps of the largest entry (see the module docstring)


class Mixed(nn.Module):
    """A bf16 region (the first layer), a float32 island that stays float32 under the training loop's
    autocast (the second), and a head that follows whatever the loop runs under."""

    def __init__(self, honour: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        self.honour = honour  # False: the same arithmetic without the regions (what hapc used to run)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=BF16, enabled=self.honour):
            h = torch.tanh(self.a(x))
        with torch.autocast("cpu", enabled=False):
            z = torch.relu(self.b(h.float()))
        out = self.c(z)
        return F.mse_loss(out.float(), y), h, z


def _data(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def _train(module, inputs, outer: bool, steps: int = 3) -> dict:
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    losses, dtypes = [], None
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16, enabled=outer):
            loss, h, z = module(*inputs)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        dtypes = (str(h.dtype), str(z.dtype))
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"losses": losses, "dtypes": dtypes, "state": state}


def _reference(outer: bool, honour: bool = True) -> dict:
    torch.manual_seed(0)
    model = Mixed()
    model.honour = honour
    return _train(model, _data(), outer)


def _job(rank, world, kind, capture, outer):
    torch.manual_seed(0)
    options = {"baseline": "tp", "ratios": UNEVEN[world]} if kind == "tp" else {}
    module = hapc.compile(Mixed(), CLUSTERS[world], _data(), capture=capture, **options)
    regions = sum(1 for n in module.program.graph.nodes if n.target is autocasted)
    return {"regions": regions, **_train(module, _data(), outer)}


def _close(got: float | torch.Tensor, want: float | torch.Tensor, what: str) -> None:
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    scale = max(float(want.abs().max()), 1e-12)
    err = float((got.float() - want.float()).abs().max()) / scale
    assert err <= RTOL, f"{what}: off by {err:.3g} of its largest entry (bf16 tolerance {RTOL:.3g})"


CASES = [(2, "default", "fx", False), (2, "tp", "export", True), (3, "default", "auto", True), (3, "tp", "fx", False)]


@pytest.mark.parametrize(("world", "kind", "capture", "outer"), CASES)
def test_autocast_regions_compute_as_on_one_device(world, kind, capture, outer):
    want = _reference(outer)
    assert want["dtypes"] == ("torch.bfloat16", "torch.float32")
    assert _reference(outer, honour=False)["dtypes"] != want["dtypes"]  # an ignored region would show
    for rank, got in enumerate(run_distributed(_job, world, kind, capture, outer)):
        where = f"{world} ranks, {kind}, {capture}, loop autocast {outer}, rank {rank}"
        assert got["regions"] >= 2, where  # the bf16 region and the float32 island
        assert got["dtypes"] == want["dtypes"], where
        _close(got["losses"], want["losses"], f"{where}: losses")
        for k, v in want["state"].items():
            _close(got["state"][k], v, f"{where}: {k}")


class CheckpointedAutocast(nn.Module):
    """An autocast region inside a ``torch.utils.checkpoint`` region: recomputed in backward under the
    same context (torch's checkpoint restores the forward's autocast state; hapc's region sits inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return torch.tanh(self.a(x))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, use_reentrant=False)
        return F.mse_loss(self.b(h.float()), y)


def _ckpt_job(rank, world):
    torch.manual_seed(0)
    module = hapc.compile(CheckpointedAutocast(), CLUSTERS[world], _data())
    nested = any(
        n.target is autocasted
        for m in module.program.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    )
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        module(*_data()).backward()
        opt.step()
    return {"nested": nested, "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def test_an_autocast_region_inside_a_checkpoint_region_is_recomputed_under_its_context():
    torch.manual_seed(0)
    model = CheckpointedAutocast()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(*_data()).backward()
        opt.step()
    for got in run_distributed(_ckpt_job, 2):
        assert got["nested"]
        for k, v in model.state_dict().items():
            _close(got["state"][k], v, f"checkpointed autocast: {k}")
            assert not torch.equal(v, ref.state_dict()[k])  # it trained


class RowParallelHead(nn.Module):
    """A column-parallel then a row-parallel linear under tensor parallelism: the second's bias is
    added after the all-reduce, apart from the product."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.b(F.gelu(self.a(x)))
        return F.mse_loss(out.float(), y), out


def _row_parallel_job(rank, world):
    torch.manual_seed(0)
    module = hapc.compile(RowParallelHead(), CLUSTERS[world], _data(), baseline="tp", ratios=UNEVEN[world])
    with torch.autocast("cpu", dtype=BF16):
        loss, out = module(*_data())
    return {"code": module.code, "loss": float(loss), "out": out.detach()}


@pytest.mark.parametrize("world", [2, 3])
def test_a_row_parallel_bias_added_after_the_reduction_keeps_autocasts_dtype(world):
    """``F.linear(x, w, b)`` under autocast casts its bias with the product: the result is bfloat16.
    The program adds a row-parallel linear's bias after the all-reduce; a plain ``+`` of the bf16
    product and the float32 bias promoted to float32, unlike one device (``hapc.ops.add_bias``)."""
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=BF16):
        loss, out = RowParallelHead()(*_data())
    assert out.dtype == BF16
    for rank, got in enumerate(run_distributed(_row_parallel_job, world)):
        assert "C.all_reduce(" in got["code"] and "hapc.ops.add_bias(" in got["code"], got["code"]
        assert got["out"].dtype == out.dtype, f"rank {rank}: {got['out'].dtype}"
        _close(got["out"], out.detach(), f"{world} ranks, rank {rank}: output")
        _close(got["loss"], float(loss), f"{world} ranks, rank {rank}: loss")
