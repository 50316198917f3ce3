"""The DP-EV baseline is priceable whenever the batch divides (issue 12).

It used to fail with "no program gets past segment N" on torchvision's ViT-B/16 (its
``MultiheadAttention`` folds the batch into the inner factor of ``view(tgt_len * bsz, embed)``),
on a batch-shaped constant made in the forward, and on an op without a rule reading batch data:
the restriction (inputs split by batch, parameters and buffers whole, no activation moved) left
no program. Now a constant as long as the batch may be split with it (as each replica makes its
own), and where no purely data-parallel program exists in hapc's layouts the baseline is priced
with activations moved there, with a warning naming the node -- never a silent wrong answer.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import hapc
from hapc.cluster import Cluster
from hapc.planner import synthesize_theory
from hapc.testing import run_distributed


@hapc.custom_op()
def no_rule(x: torch.Tensor) -> torch.Tensor:
    return torch.special.erfcx(x)


class SeqFirst(nn.Module):
    """The pattern of ``nn.MultiheadAttention(batch_first=True)``: sequence-first inside, the
    projection applied to ``[seq * batch, hidden]`` rows (batch the inner factor), back after."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # [B, S, H]
        t = h.transpose(0, 1)  # [S, B, H]
        f = self.b(t.reshape(-1, 8)).view(t.shape)
        return ((f.transpose(0, 1) + h - y) ** 2).mean()


class NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((no_rule(self.a(x)) - y) ** 2).mean()


class BatchConstant(nn.Module):
    """A tensor as long as the batch, made in the forward (positions expanded over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=x.dtype).expand(x.shape[0], -1)
        return ((self.a(x) + pos.unsqueeze(-1) - y) ** 2).mean()


class InputCheck(nn.Module):
    """A check on a whole model input (the pattern of the CTC heads' ``labels.max() >= vocab_size``):
    ``max`` over the batch has no layout for its operand split by batch, and inputs do not move."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if y.max() > 100:
            raise ValueError("targets out of range")
        return ((self.a(x) - y) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, dtype=torch.float64, generator=gen), torch.randn(
        4, 6, 8, dtype=torch.float64, generator=gen
    )


def _dp_ev(model: nn.Module) -> tuple[Any, list[str]]:
    graph = hapc.trace(model, _batch())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hapc.UnsupportedOpWarning)
        theory = hapc.derive(graph)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan = synthesize_theory(theory, Cluster.load("local-cpu:2"), baseline="dp-ev")
    return plan, [str(w.message) for w in rec if "dp-ev" in str(w.message)]


def _moved(plan: Any) -> list[str]:
    """The collectives on activations other than the batch all-reduces data parallelism makes."""
    return [c.op for c in plan.collectives() if c.op not in ("all_reduce", "slice")]


def test_batch_shaped_constant_is_split_with_the_batch() -> None:
    plan, notes = _dp_ev(BatchConstant())
    assert not notes and not _moved(plan)  # pure data parallelism: nothing but gradients moves
    assert plan.ratios == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize(
    ("model", "node", "why"),
    [(SeqFirst, "node reshape", "folds the batch"), (NoRule, "node no_rule", "no sharding rule")],
)
def test_no_data_parallel_layout_is_priced_with_moves_and_named(model: type, node: str, why: str) -> None:
    plan, notes = _dp_ev(model())
    assert len(notes) == 1, notes
    assert node in notes[0] and "test_baselines.py" in notes[0] and why in notes[0] and "upper bound" in notes[0]
    assert _moved(plan)  # the moves it is priced with are in the program
    assert plan.time > 0 and plan.ratios == pytest.approx([0.5, 0.5])


def test_input_read_by_a_whole_batch_op_is_also_sourced_whole() -> None:
    """The check's input is also read whole on every rank (inputs have no collectives), named in
    the warning; the rest stays data parallel (nothing but gradients moves: the restriction that
    allows moving activations, which the search may use elsewhere too, is not needed)."""
    plan, notes = _dp_ev(InputCheck())
    assert len(notes) == 1, notes
    assert "node max" in notes[0] and "model input y also read whole" in notes[0] and "upper bound" in notes[0]
    assert "activations moved" not in notes[0]  # no move is needed: the relaxed restriction is not used
    sources = {(plan.node_names[i.ref], repr(i.layout)) for i in plan.instructions if type(i).__name__ == "Source"}
    assert {("y", "R"), ("y", "S(0)"), ("x", "S(0)")} <= sources, sources
    assert not _moved(plan) and plan.ratios == pytest.approx([0.5, 0.5])


def _job(rank: int, world: int, cls: type = SeqFirst) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = cls().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = hapc.compile(model, f"local-cpu:{world}", _batch(), baseline="dp-ev")
    loss = module(*_batch())
    loss.backward()
    return {"loss": float(loss.detach()), "grads": module.full_gradients(), "moved": _moved(module.plan)}


@pytest.mark.parametrize("cls", [SeqFirst, InputCheck])
def test_relaxed_dp_ev_program_trains_like_one_device(cls: type) -> None:
    """The program priced with moves (or with an input also read whole) is a real program: run on 2
    gloo processes it equals one device."""
    torch.manual_seed(0)
    ref = cls().double()
    loss = ref(*_batch())
    loss.backward()
    for r in run_distributed(_job, 2, cls, timeout=180):
        assert bool(r["moved"]) == (cls is SeqFirst)
        assert r["loss"] == pytest.approx(float(loss.detach()), rel=1e-12)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-10, atol=1e-12)
