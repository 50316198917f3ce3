"""Sharding annotations: an einsum-like line from which all of an op's triples follow mechanically.

Grammar (one line)::

    annotation := operand ("," operand)* "->" result
    operand    := dim*                     -- one entry per dimension of a tensor operand
    result     := dim*                     -- empty for a scalar result
    dim        := label | label "^" | "..." | "1"

Operands are the op's *tensor* operands in call order (args then kwargs); constants such as
``dim=-1`` are not listed.

Meaning of each dimension entry:

``label``
    A named index. The same label in several places is the same index (sizes must agree, except
    that an operand dimension of size 1 under a larger label is a broadcast and does not carry it).
``label^``
    An index that may never be sharded (the softmax dimension, a convolution window). A ``^``
    anywhere marks the label everywhere.
``...``
    Any number of dimensions, aligned from the right across operands like broadcasting. Each is
    an ordinary shardable label (``batch0``, ``batch1``... counted from the right).
``1``
    A size-1 dimension, never sharded.

The triples generated for a node (besides replicate-everything, which every op gets):

* **shard a kept label** ``l`` (in the result): every operand carrying ``l`` is ``Sharded`` on
  its dimension of ``l``, the other operands ``Replicated``; the result is ``Sharded`` on its
  dimension of ``l``. Work scales with the device's ratio.
* **shard a summed label** ``l`` (not in the result): same operands, result ``Partial`` -- the
  annotation asserts the op *sums* over ``l`` (a contraction or a sum-reduction). Mark max-like
  reductions ``l^`` instead.
* **Partial pass-through** from ``linear=`` (the op is linear in those operands):

  ``"each"``   multilinear: any one operand ``Partial``, the others ``Replicated`` (matmul, mul);
  ``"all"``    jointly linear: all operands ``Partial`` (add, cat);
  ``[(0,), (1, 2)]`` explicit groups of operand positions (``where(c, a, b)`` is ``[(1, 2)]``).

  Partial pass-through does not split work (every device runs the full-size op on its summand).

Examples (tinygrad-style table; one line each)::

    "... k, n k -> ... n"             linear without bias: batch/out-features shard, k -> Partial
    "..., ... -> ..."                 broadcasting binary elementwise
    "... d^ -> ... d^"                softmax over the last dim: everything else shards
    "n i h^ w^, o i p^ q^ -> n o y^ x^"   conv2d: batch, out-channels; in-channels -> Partial
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RuleError
from .props import PARTIAL, REPLICATED, shard
from .strategy import Strategy

if TYPE_CHECKING:
    from .registry import OpView

_TOKEN = re.compile(r"^(\.\.\.|1|[A-Za-z_][A-Za-z_0-9]*\^?)$")


@dataclass(frozen=True)
class Dim:
    label: str  # "" for "1", "..." for the ellipsis
    fixed: bool = False

    @property
    def is_ellipsis(self) -> bool:
        return self.label == "..."


@dataclass(frozen=True)
class Annotation:
    operands: tuple[tuple[Dim, ...], ...]
    result: tuple[Dim, ...]
    text: str

    @property
    def fixed_labels(self) -> frozenset[str]:
        dims = [d for op in (*self.operands, self.result) for d in op]
        return frozenset(d.label for d in dims if d.fixed)


@functools.lru_cache(maxsize=4096)
def parse_annotation(text: str) -> Annotation:
    """Parse an annotation; a malformed one raises :class:`RuleError` naming the bad token."""
    if text.count("->") != 1:
        raise RuleError(f"annotation {text!r} must contain exactly one '->'")
    lhs, rhs = text.split("->")
    operands = tuple(_parse_operand(part, text) for part in lhs.split(","))
    result = _parse_operand(rhs, text)
    for op in (*operands, result):
        if sum(d.is_ellipsis for d in op) > 1:
            raise RuleError(f"annotation {text!r}: at most one '...' per operand")
    return Annotation(operands, result, text)


def _parse_operand(part: str, text: str) -> tuple[Dim, ...]:
    dims = []
    for tok in part.split():
        if not _TOKEN.match(tok):
            raise RuleError(f"annotation {text!r}: bad dimension {tok!r} (use a name, 'name^', '...' or '1')")
        if tok == "1":
            dims.append(Dim("", True))
        elif tok == "...":
            dims.append(Dim("..."))
        else:
            dims.append(Dim(tok.rstrip("^"), tok.endswith("^")))
    return tuple(dims)


def _expand(dims: tuple[Dim, ...], rank: int, where: str, ann: Annotation) -> list[Dim]:
    """Replace '...' by right-aligned labels ``batch<k>`` so the list has one entry per dim."""
    explicit = [d for d in dims if not d.is_ellipsis]
    has_ellipsis = len(explicit) != len(dims)
    extra = rank - len(explicit)
    if extra < 0 or (extra > 0 and not has_ellipsis):
        raise RuleError(f"annotation {ann.text!r}: {where} has rank {rank}, annotation gives {len(dims)} dims")
    out: list[Dim] = []
    for d in dims:
        if d.is_ellipsis:
            out.extend(Dim(f"batch{extra - 1 - k}") for k in range(extra))
        else:
            out.append(d)
    return out


def strategies_from_annotation(view: OpView, text: str, linear: Any = None) -> list[Strategy]:
    """All non-replicated strategies an annotation implies for one node."""
    ann = parse_annotation(text)
    metas = view.operands
    if len(ann.operands) != len(metas) and not (len(ann.operands) == 1 and not ann.operands[0] and not metas):
        raise view.fail(f"annotation {text!r} lists {len(ann.operands)} operands, node has {len(metas)} tensors")
    ops = [_expand(dims, m.rank, f"operand {i}", ann) for i, (dims, m) in enumerate(zip(ann.operands, metas))]
    res = _expand(ann.result, view.out.rank, "the result", ann)
    fixed = ann.fixed_labels  # never sharded, so their sizes need not agree (cat, grouped conv)

    size: dict[str, int] = {}
    for dims, shape in [*zip(ops, (m.shape for m in metas)), (res, view.out.shape)]:
        for d, n in zip(dims, shape):
            if d.label:  # an empty dim makes the label empty (never sharded)
                size[d.label] = 0 if n == 0 or size.get(d.label) == 0 else max(size.get(d.label, 1), n)
    for dims, shape in [*zip(ops, (m.shape for m in metas)), (res, view.out.shape)]:
        for d, n in zip(dims, shape):
            if d.label and d.label not in fixed and n not in (0, 1, size[d.label]):
                raise view.fail(f"annotation {text!r}: label {d.label!r} has sizes {n} and {size[d.label]}")

    strategies: list[Strategy] = []
    for label in dict.fromkeys(d.label for dims in (*ops, res) for d in dims if d.label):
        if label in fixed or size[label] <= 1:
            continue
        carriers: list[int | None] = []
        for dims, m in zip(ops, metas):
            pos = [k for k, d in enumerate(dims) if d.label == label and m.shape[k] == size[label]]
            if len(pos) > 1:  # an operand carrying the label twice (a trace): cannot shard it
                break
            carriers.append(pos[0] if pos else None)
        else:
            out_pos = [k for k, d in enumerate(res) if d.label == label and view.out.shape[k] == size[label]]
            if all(c is None for c in carriers) or len(out_pos) > 1:
                continue  # a dimension the op creates: only a rule function knows its local form
            inputs = tuple(REPLICATED if c is None else shard(c) for c in carriers)
            output = shard(out_pos[0]) if out_pos else PARTIAL
            name = label if not label.startswith("batch") else (f"d{out_pos[0]}" if out_pos else "sum")
            strategies.append(Strategy(inputs, output, name=name))
    strategies.extend(partial_strategies(len(metas), linear))
    return strategies


def partial_strategies(n: int, linear: Any) -> list[Strategy]:
    """Partial pass-through strategies for ``linear`` = ``"each"``, ``"all"`` or position groups."""
    if linear is None or n == 0:
        return []
    if linear == "each":
        groups: list[tuple[int, ...]] = [(i,) for i in range(n)]
    elif linear == "all":
        groups = [tuple(range(n))]
    else:
        groups = [tuple(g) for g in linear]
    out = []
    for g in groups:
        if any(not 0 <= i < n for i in g):
            raise RuleError(f"linear group {g} names an operand outside 0..{n - 1}")
        inputs = tuple(PARTIAL if i in g else REPLICATED for i in range(n))
        out.append(Strategy(inputs, PARTIAL, scaled=False, name="linear"))
    return out
