"""Properties: how a distributed tensor relates to a reference tensor (HAP §4.2, DESIGN §3).

A *distributed tensor* is the set of per-device instances of one value. A property ties it to a
reference tensor ``e`` of the single-device graph:

=================  ====================  ==========================================================
hapc               HAP paper             meaning (``x_j`` is device ``j``'s instance, ``m`` devices)
=================  ====================  ==========================================================
``Replicated(e)``  ``e | Identity``      ``x_j = e`` for every ``j``
``Sharded(e, d)``  ``e | All-Gather(d)`` ``cat(x_1..x_m, dim=d) = e``; shard sizes follow the ratios
``Partial(e)``     ``e | All-Reduce``    ``x_1 + ... + x_m = e``
=================  ====================  ==========================================================

Gradient duality (the *partial-gradient* convention, DESIGN §3): if a tensor has layout ``L``,
its gradient has layout ``L.grad()``: Replicated <-> Partial, Sharded(d) <-> Sharded(d). Every
backward cost in the theory follows from this one rule.
"""

from __future__ import annotations

from typing import NamedTuple


class Layout(NamedTuple):
    """Placement of one distributed tensor: ``R``, ``S(d)`` or ``P`` (plus the internal goal ``done``).

    (A named tuple: properties are hashed millions of times during synthesis.)
    """

    kind: str
    dim: int = -1

    def __repr__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @property
    def is_replicated(self) -> bool:
        return self.kind == "R"

    @property
    def is_sharded(self) -> bool:
        return self.kind == "S"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def grad(self) -> Layout:
        """Layout of this tensor's gradient under the partial-gradient convention."""
        if self.kind == "R":
            return PARTIAL
        if self.kind == "P":
            return REPLICATED
        return self

    def to_json(self) -> str:
        return repr(self)

    @staticmethod
    def from_json(text: str) -> Layout:
        if text == "R":
            return REPLICATED
        if text == "P":
            return PARTIAL
        if text.startswith("S(") and text.endswith(")"):
            return Layout("S", int(text[2:-1]))
        raise ValueError(f"not a layout: {text!r} (expected 'R', 'P' or 'S(<dim>)')")


REPLICATED = Layout("R")
PARTIAL = Layout("P")
_SHARDS = tuple(Layout("S", d) for d in range(16))


def shard(dim: int) -> Layout:
    """``S(dim)``; cached for small dims so layouts compare by identity cheaply."""
    return _SHARDS[dim] if 0 <= dim < len(_SHARDS) else Layout("S", dim)


class Prop(NamedTuple):
    """``ref | layout``: some distributed tensor in the program relates to reference node ``ref``."""

    ref: int
    layout: Layout

    def __repr__(self) -> str:
        if self.ref == DONE_REF:
            return "Done"
        kind = self.layout.kind
        if kind == "R":
            return f"Replicated(%{self.ref})"
        if kind == "P":
            return f"Partial(%{self.ref})"
        return f"Sharded(%{self.ref}, {self.layout.dim})"


DONE_REF = -1
#: The goal property: the loss has been produced in a layout the backward can seed.
DONE = Prop(DONE_REF, Layout("done"))


def _ref(e: object) -> int:
    return int(getattr(e, "index", e))  # a RefNode or a node index


def Replicated(e: object) -> Prop:
    """Every device holds all of ``e``."""
    return Prop(_ref(e), REPLICATED)


def Sharded(e: object, dim: int) -> Prop:
    """Devices hold consecutive slices of ``e`` along ``dim``, sized by the sharding ratios."""
    return Prop(_ref(e), shard(dim))


def Partial(e: object) -> Prop:
    """The element-wise sum of the devices' instances is ``e``."""
    return Prop(_ref(e), PARTIAL)
