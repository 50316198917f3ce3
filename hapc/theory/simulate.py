"""Reference semantics of the distributed instruction set, all devices in one process.

A distributed tensor is a Python list with one tensor per device. Each instruction maps lists to
lists with ordinary differentiable torch ops, so autograd through a simulated program *is* its
backward: ``cat`` back-propagates as a reduce-scatter, a sum as an all-reduce, a slice as a
zero-fill -- exactly the adjoints of the partial-gradient convention (DESIGN §3). The theory's
soundness tests run every triple this way against the single-device op, forward and backward,
and the runtime's collectives are tested against these definitions.

``instances(value, layout)`` builds per-device instances satisfying a property; ``combine`` is its
inverse (and ``holds`` checks a property); ``grad_instances`` / ``grad_holds`` do the same for the
*dual* property a gradient must satisfy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..balance.rounding import bounds
from .graph import RefNode
from .instructions import Collective
from .local import local_call, run_call, substitute
from .props import Layout
from .strategy import OUT, ShardMarker, Strategy
from .triples import Theory


@dataclass
class SimContext:
    """Per-device numbers for one node: shard sizes of its operands and result."""

    theory: Theory
    node: RefNode
    ratios: Sequence[float]

    @property
    def m(self) -> int:
        return len(self.ratios)

    def ref(self, which: int) -> int:
        return self.node.index if which == OUT else self.node.operands[which]

    def sizes(self, which: int, dim: int) -> list[int]:
        return self.theory.local_sizes(self.ref(which), dim, self.ratios)

    def marker(self, device: int):
        def value(m: ShardMarker) -> int:
            lo, hi = bounds(self.sizes(m.which, m.dim))[device]
            return {"len": hi - lo, "start": lo, "end": hi}[m.kind]

        return value


def split_sizes(theory: Theory, ref: int, layout: Layout, ratios: Sequence[float]) -> list[int] | None:
    return theory.local_sizes(ref, layout.dim, ratios) if layout.is_sharded else None


def instances(
    value: torch.Tensor, layout: Layout, sizes: Sequence[int] | None, m: int, gen: torch.Generator | None = None
) -> list[torch.Tensor]:
    """Per-device tensors satisfying ``layout`` for reference ``value``.

    Partial summands are random (integers stay exact: all on device 0).
    """
    if layout.is_replicated:
        return [value.clone() for _ in range(m)]
    if layout.is_sharded:
        return [t.clone() for t in torch.split(value, list(sizes), dim=layout.dim)]
    if not value.is_floating_point():
        return [value.clone()] + [torch.zeros_like(value) for _ in range(m - 1)]
    parts = [torch.randn(value.shape, generator=gen, dtype=value.dtype) for _ in range(m - 1)]
    return [value - sum(parts, torch.zeros_like(value)), *parts] if m > 1 else [value.clone()]


def combine(parts: Sequence[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The reference tensor the per-device tensors stand for (Replicated: device 0's)."""
    if layout.is_sharded:
        return torch.cat(list(parts), dim=layout.dim)
    if layout.is_partial:
        return sum(parts[1:], parts[0])
    return parts[0]


def holds(parts: Sequence[torch.Tensor], layout: Layout, reference: torch.Tensor, rtol: float, atol: float) -> bool:
    """Do the per-device tensors satisfy ``layout`` with respect to ``reference``?"""
    if layout.is_replicated:
        return all(_close(p, reference, rtol, atol) for p in parts)
    got = combine(parts, layout)
    return got.shape == reference.shape and _close(got, reference, rtol, atol)


def grad_instances(grad: torch.Tensor, layout: Layout, sizes, m: int, gen=None) -> list[torch.Tensor]:
    """Per-device output gradients for a tensor of ``layout`` (the dual layout)."""
    return instances(grad, layout.grad(), sizes, m, gen)


def grad_holds(
    grads: Sequence[torch.Tensor], layout: Layout, reference: torch.Tensor, rtol: float, atol: float
) -> bool:
    """Do per-device input gradients satisfy the dual of ``layout`` for the reference gradient?"""
    return holds(grads, layout.grad(), reference, rtol, atol)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def run_compute(ctx: SimContext, strategy: Strategy, operands: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Execute a computation triple on every device. ``operands[i][j]``: operand ``i`` on device ``j``."""
    per_device = [[op[j] for op in operands] for j in range(ctx.m)]
    if strategy.simulate is not None:
        ref_call = local_call(ctx.node, Strategy(strategy.inputs, strategy.output))

        def call(ops: Sequence[torch.Tensor]) -> torch.Tensor:
            return run_call(ref_call, ops, _no_markers)

        return list(strategy.simulate(per_device, call, ctx))
    call = local_call(ctx.node, strategy)
    return [run_call(call, per_device[j], ctx.marker(j)) for j in range(ctx.m)]


def _no_markers(m: ShardMarker) -> int:
    raise TypeError("the reference call of a simulated strategy has no shard markers")


def run_collective(
    theory: Theory, ins: Collective, parts: Sequence[torch.Tensor], ratios: Sequence[float]
) -> list[torch.Tensor]:
    """Execute a collective on every device (padded and grouped variants mean the same)."""
    m = len(ratios)
    ref = ins.ref
    if ins.op == "all_gather":
        full = torch.cat(list(parts), dim=ins.src.dim)
        return [full for _ in range(m)]
    if ins.op == "all_reduce":
        total = sum(parts[1:], parts[0])
        return [total for _ in range(m)]
    if ins.op == "reduce_scatter":
        total = sum(parts[1:], parts[0])
        return list(torch.split(total, theory.local_sizes(ref, ins.dst.dim, ratios), dim=ins.dst.dim))
    if ins.op == "all_to_all":
        full = torch.cat(list(parts), dim=ins.src.dim)
        return list(torch.split(full, theory.local_sizes(ref, ins.dst.dim, ratios), dim=ins.dst.dim))
    if ins.op == "slice":
        out = []
        for j, (lo, hi) in enumerate(bounds(theory.local_sizes(ref, ins.dst.dim, ratios))):
            out.append(parts[j].narrow(ins.dst.dim, lo, hi - lo))
        return out
    raise ValueError(f"unknown collective {ins.op!r}")


__all__ = [
    "SimContext",
    "combine",
    "grad_holds",
    "grad_instances",
    "holds",
    "instances",
    "run_collective",
    "run_compute",
    "split_sizes",
    "substitute",
]
