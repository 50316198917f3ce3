"""Canonical op names: one name per mathematical op, whatever spelling the model used.

``x + y``, ``torch.add(x, y)``, ``x.add(y)`` and ``x += y`` are all ``"add"``; ``F.linear`` is
``"linear"``; a user's function is its qualified name (``"mypkg.ops.fused_gelu"``). Rules are
registered under these names, so one rule covers every spelling.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

# Synonyms -> canonical name. In-place spellings map to the out-of-place op (the tracer only
# accepts them where that is equivalent; see ``trace``).
SYNONYMS = {
    "iadd": "add",
    "__add__": "add",
    "__radd__": "add",
    "isub": "sub",
    "subtract": "sub",
    "__sub__": "sub",
    "__rsub__": "rsub",
    "imul": "mul",
    "multiply": "mul",
    "__mul__": "mul",
    "__rmul__": "mul",
    "truediv": "div",
    "itruediv": "div",
    "true_divide": "div",
    "divide": "div",
    "__truediv__": "div",
    "__rtruediv__": "rdiv",
    "neg": "neg",
    "negative": "neg",
    "__neg__": "neg",
    "__matmul__": "matmul",
    "imatmul": "matmul",
    "concat": "cat",
    "concatenate": "cat",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "__getitem__": "getitem",
    "__pow__": "pow",
    "ipow": "pow",
    "absolute": "abs",
    "clip": "clamp",
    "greater": "gt",
    "less": "lt",
    "__gt__": "gt",
    "__lt__": "lt",
    "__ge__": "ge",
    "__le__": "le",
    "__eq__": "eq",
    "__ne__": "ne",
    "__and__": "bitwise_and",
    "__or__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "and_": "bitwise_and",
    "or_": "bitwise_or",
    "xor": "bitwise_xor",
    "invert": "logical_not",
    "__invert__": "logical_not",
    "floordiv": "floor_divide",
    "mod": "remainder",
}

_NAMESPACES: tuple[Any, ...] = (operator, torch, F, torch.Tensor, torch.special, torch.linalg)
_BUILTIN: dict[int, str] = {}


def _builtin_table() -> dict[int, str]:
    """id(callable) -> canonical name, for every callable of torch / F / Tensor / operator."""
    if not _BUILTIN:
        for ns in _NAMESPACES:
            for attr in dir(ns):
                if attr.startswith("_") and attr not in SYNONYMS:
                    continue
                try:
                    obj = getattr(ns, attr)
                except Exception:  # some torch attributes raise on access
                    continue
                if callable(obj) and not isinstance(obj, type):
                    _BUILTIN.setdefault(id(obj), canonical_method(attr))
    return _BUILTIN


def canonical_method(name: str) -> str:
    """Canonical name of a method / function name (``"add_"`` -> ``"add"``, ``"__mul__"`` -> ``"mul"``)."""
    if name in SYNONYMS:
        return SYNONYMS[name]
    if name.endswith("_") and not name.endswith("__"):
        base = name[:-1]
        return SYNONYMS.get(base, base)
    return name


def qualified_name(obj: Any) -> str:
    mod = getattr(obj, "__module__", None) or type(obj).__module__
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return f"{mod}.{qual}"


def canonical_name(target: Any, is_method: bool = False) -> str:
    """The rule-registry name of an fx target."""
    if is_method:
        return canonical_method(str(target))
    if isinstance(target, str):
        return target
    alias = getattr(target, "__hapc_op__", None)  # a spelling of a built-in op (``hapc.ops.add_bias``)
    if alias is not None:
        return alias
    found = _builtin_table().get(id(target))
    if found is not None:
        return found
    return qualified_name(target)


def is_inplace(target: Any, is_method: bool) -> bool:
    """``x.add_(y)``, ``operator.iadd``... (``x += y`` rebinds ``x`` and is harmless)."""
    name = str(target) if is_method else getattr(target, "__name__", "")
    return is_method and name.endswith("_") and not name.endswith("__")
