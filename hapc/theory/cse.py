"""Common subexpressions: one reference node for a pure op applied twice to the same operands.

Library code recomputes. Hugging Face T5's attention builds ``where(mask, position_bias, -inf)``
inside every layer from the same two tensors, so a 6-layer encoder traces six equal
``(batch, heads, seq, seq)`` tensors. To the synthesizer each copy is a tensor of its own: its own
layouts in every dynamic-programming state (HAP §5.2), so the segment that makes them has exits
for every combination of the copies' layouts (exponential in the number of copies), and its own
memory. One node instead of six is the same program, priced once.

**Why merging is exact.** For a pure op ``f`` (deterministic, no side effect), ``y1 = f(x)`` and
``y2 = f(x)`` are the same value, so every reader of ``y2`` may read ``y1``. In the backward the
gradient reaching ``x`` is ``J^T g1 + J^T g2`` unmerged and ``J^T (g1 + g2)`` merged: equal, as
``J^T`` is linear; only the order of floating-point additions differs, the same freedom autograd
takes when it accumulates a tensor's gradient from several readers.

**What is merged.** Only ops named in :data:`PURE`: arithmetic, comparisons, shape and view ops,
creation of constant tensors, contractions and normalisations without state. Never random ops
(dropout draws per op, so two dropouts are two masks), ops that update state (``batch_norm``'s
running statistics), a user's registered ops or leaf modules (hapc cannot know they are pure), or
ops inside different ``torch.utils.checkpoint`` regions (recomputation is per region) or under
different ``torch.autocast`` contexts (one computes in bfloat16, the other not). Nor *static
data* (buffers and what they alone compute: Llama's ``cos.unsqueeze(1)`` in every layer): the
synthesizer keeps it replicated in one layout and recomputes it next to each reader, so a copy per
layer costs nothing, while one shared copy would be carried in the state across every layer
(merged, tiny-to-published Llama synthesis took 5x longer). Two nodes
merge when their op, target, constant arguments (compared with their types: ``1``, ``1.0`` and
``True`` differ, as do ``0.0`` and ``-0.0``), operands (after merging), checkpoint region, autocast
contexts and result shape and dtype are all equal.

>>> # x = mask_of(ids); a = torch.where(x, bias, -inf); b = torch.where(x, bias, -inf)
>>> # merge_common(nodes) == {b.index: a.index}: every reader of b reads a
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .graph import BUFFER, OP, Ref, RefNode, map_refs

#: canonical op names (:mod:`hapc.theory.opnames`) whose result depends on their arguments alone
PURE: frozenset[str] = frozenset(
    {
        # elementwise arithmetic and comparisons
        "abs", "add", "sub", "rsub", "mul", "div", "rdiv", "neg", "pow", "sqrt", "rsqrt", "exp",
        "log", "sin", "cos", "tanh", "sigmoid", "relu", "gelu", "silu", "clamp", "minimum",
        "maximum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
        "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "where", "masked_fill",
        "to", "float", "half", "bfloat16", "long", "int", "bool", "type_as", "detach", "clone",
        # shapes and views
        "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose",
        "contiguous", "flatten", "unflatten", "getitem", "select", "narrow", "triu", "tril",
        "cat", "stack", "repeat", "repeat_interleave", "pad",
        # tensors made from sizes alone
        "arange", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros",
        "new_ones", "new_full",
        # reductions, contractions and stateless normalisations
        "sum", "mean", "amax", "amin", "max", "min", "cumsum", "softmax", "log_softmax",
        "linear", "matmul", "bmm", "addmm", "baddbmm", "embedding", "layer_norm", "gather",
        "index_select", "topk",
    }
)  # fmt: skip


class _Unhashable(Exception):
    """An argument that cannot be compared by value (a tensor constant, an object)."""


def _frozen(value: Any) -> Any:
    """A hashable image of a constant argument that is equal only for equal values of equal type."""
    if isinstance(value, Ref):
        return ("ref", value.index)
    if isinstance(value, bool | int | str | type(None) | torch.dtype | torch.device | torch.memory_format):
        return (type(value).__name__, value)
    if isinstance(value, float):
        if math.isnan(value):
            raise _Unhashable
        return ("float", repr(value))  # repr tells 0.0 from -0.0
    if isinstance(value, slice):
        return ("slice", _frozen(value.start), _frozen(value.stop), _frozen(value.step))
    if isinstance(value, tuple | list):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if value is Ellipsis:
        return ("...",)
    from .trace import CurrentDevice  # "the device this runs on": one value

    if isinstance(value, CurrentDevice):
        return ("current device",)
    raise _Unhashable


def merge_common(nodes: Sequence[RefNode]) -> dict[int, int]:
    """Duplicate op nodes -> the first node computing the same value (nodes in topological order).

    A node counts as a duplicate after its operands' duplicates are replaced, so chains of equal
    computations (``b = x + 1; c = b * 2`` written twice) merge whole.
    """
    canon: dict[int, int] = {}
    seen: dict[tuple, int] = {}
    static: set[int] = set()  # buffers and what they alone compute: left as written (see above)
    for n in nodes:
        if n.kind == BUFFER or (n.kind == OP and all(o in static for o in n.operands)):
            static.add(n.index)
        if n.kind != OP or n.op not in PURE or n.index in static:
            continue
        args, kwargs = map_refs((n.args, n.kwargs), lambda r: Ref(canon.get(r.index, r.index)))
        try:
            where = (n.region, n.autocast)  # the checkpoint region and the autocast contexts
            key = (n.op, n.target, n.is_method, n.out_index, where, n.meta, _frozen(args), _frozen(kwargs))
            hash(key)
        except (_Unhashable, TypeError):
            continue
        first = seen.setdefault(key, n.index)
        if first != n.index:
            canon[n.index] = first
    return canon
