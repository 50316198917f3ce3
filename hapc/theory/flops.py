"""Arithmetic of the ops that dominate training: counted from shapes, as multiply-adds x 2.

Contractions (linear, matmul, einsum, convolution, attention) are counted exactly; every op is
also charged the bytes it moves (``RefNode.mem_bytes``: operands and result, by layout in
:func:`hapc.theory.triples.traffic`), which the cost model turns into time with the device's
memory bandwidth -- all there is to a memory-bound op, and a contraction's fixed cost of reading a
replicated weight however few rows it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else ()


def contraction_flops(op: str, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> float:
    """Flops of one call, from the shapes of its tensor arguments and result."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out_shape = _shape(out)
    if op in ("linear", "matmul", "mm", "bmm", "addmm", "baddbmm") and len(tensors) >= 2:
        a = tensors[1] if op in ("addmm", "baddbmm") else tensors[0]
        k = a.shape[-1] if a.dim() else 1
        return 2.0 * math.prod(out_shape) * k
    if op == "einsum" and isinstance(args[0], str):
        eq = args[0].replace(" ", "")
        lhs, arrow, rhs = eq.partition("->")
        ops = [t for t in args[1:] if isinstance(t, torch.Tensor)]
        if not ops and len(args) > 1 and isinstance(args[1], (list, tuple)):
            ops = [t for t in args[1] if isinstance(t, torch.Tensor)]
        sizes: dict[str, int] = {}
        for spec, t in zip(lhs.split(","), ops):
            spec = spec.replace("...", "")
            for ch, n in zip(spec, t.shape[t.dim() - len(spec) :]):
                sizes[ch] = max(sizes.get(ch, 1), int(n))
        if not arrow:
            rhs = "".join(sorted(c for c in sizes if lhs.count(c) == 1))
        explicit_out = math.prod(sizes.get(c, 1) for c in rhs.replace("...", ""))
        broadcast = math.prod(out_shape) / max(explicit_out, 1)  # the '...' dims
        return 2.0 * math.prod(sizes.values()) * max(broadcast, 1.0)
    if op in ("conv1d", "conv2d", "conv3d") and len(tensors) >= 2:
        w = tensors[1]
        return 2.0 * math.prod(out_shape) * math.prod(w.shape[1:])
    if op == "scaled_dot_product_attention" and len(tensors) >= 3:
        q, k = tensors[:2]
        return 2.0 * math.prod(q.shape) * k.shape[-2] + 2.0 * math.prod(out_shape) * k.shape[-2]
    return 0.0
