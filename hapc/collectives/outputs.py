"""The model's other outputs (logits, hidden states) handed back to the caller.

The loss drives the backward; the other tensors a model returns are for metrics (accuracy,
perplexity, logging). The program computes each in whatever layout its search chose; here it is
made whole on every rank (``Sharded(d)``: gathered; ``Partial``: summed) or left as this rank's
piece. Either way it carries no gradient path into the program: under the partial-gradient
convention every rank would seed the *same* gradient into a replicated output and the sum over
ranks would be ``world`` times too large, so a backward through it raises instead of silently
training something else. A loss term computed from the logits belongs in ``forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import HapcError
from .ops import gather_impl, reduce_impl


class _MetricsOnly(torch.autograd.Function):
    """Identity forward; a backward through it is refused."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        raise HapcError(
            f"a gradient reached the model output {ctx.name!r}, which hapc returns for metrics only: a loss term "
            "computed from it outside forward would be counted once per rank. Compute every loss term inside the "
            "model's forward (it is then part of the synthesized program), or use output.detach()"
        )


def _metrics_only(x: torch.Tensor, name: str) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _MetricsOnly.apply(x, name)
    return x.detach()


def output_whole(
    x: torch.Tensor, kind: str, dim: int, sizes: Sequence[int], group: Any, name: str
) -> torch.Tensor:  # fmt: skip
    """This rank's piece of output ``name`` made whole: ``kind`` is ``"R"`` (already whole),
    ``"S"`` (gather ``sizes`` along ``dim``) or ``"P"`` (sum over ranks)."""
    with torch.no_grad():  # (each collective starts the loss's deferred all-reduce first: flush_losses)
        if kind == "S":
            whole = gather_impl(x.detach().contiguous(), dim, list(sizes), group, "padded")
        elif kind == "P":
            whole = reduce_impl(x.detach(), group)
        else:
            whole = x.detach()
    if x.requires_grad and torch.is_grad_enabled():
        whole = _MetricsOnly.apply(whole.requires_grad_(), name)
    return whole


def output_local(x: torch.Tensor, name: str) -> torch.Tensor:
    """This rank's piece of output ``name`` as the program computed it (no communication)."""
    return _metrics_only(x, name)
