"""Built-in sharding rules, one line of comment each (DESIGN §8).

Importing this package registers every rule in :data:`hapc.theory.registry.default_registry`.
Rules are annotations wherever the op allows it (see :mod:`hapc.theory.annotation`); the rest are
small rule functions. ``hapc rules`` prints the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..registry import RuleFn, default_registry


def op(names: str | list[str], annotation: str, linear: Any = None, doc: str | None = None) -> None:
    """Register one annotation for one or several canonical op names."""
    names = [names] if isinstance(names, str) else names
    default_registry.register_op(names[0], annotation, linear=linear, doc=doc, _builtin=True)
    if len(names) > 1:
        default_registry.alias(names[0], *names[1:])


def rule(names: str | list[str], doc: str) -> Callable[[RuleFn], RuleFn]:
    """Register a rule function for one or several canonical op names."""
    names = [names] if isinstance(names, str) else names

    def deco(fn: RuleFn) -> RuleFn:
        default_registry.register_rule(names[0], fn, doc=doc, _builtin=True)
        if len(names) > 1:
            default_registry.alias(names[0], *names[1:])
        return fn

    return deco


def labels(rank: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{k}" for k in range(rank)]


from . import elementwise, linalg, loss, moe, random, reduce, shape  # noqa: E402, F401  (registration)
