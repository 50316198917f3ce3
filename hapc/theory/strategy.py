"""Strategies: one way to run a reference node on every device (the computation triples' raw form).

A rule (an annotation or a rule function, see :mod:`hapc.theory.registry`) yields
:class:`Strategy` objects; the theory turns each into the Hoare triple

    { operand_i | inputs[i] ... }  compute(node, strategy)  { node | output }

A strategy says which layout each tensor operand must have, which layout the result then has,
whether the work is split by the sharding ratios, and -- when the device must run something other
than the reference op -- the local call. Local calls may contain *shard markers* that codegen
replaces with the device's own numbers (``ShardLen(OUT, 2)`` is this device's length of the
result's dim 2), which is how ``x.view(8, 12, 64)`` becomes ``x.view(8, 5, 64)`` on a device that
holds 5 of the 12 heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cost import Comm
from .props import Layout

#: ``which`` value of a marker that refers to the node's result rather than an operand.
OUT = -1


@dataclass(frozen=True, slots=True)
class ShardMarker:
    """A number known only per device: the local ``len``/``start``/``end`` of a sharded dim.

    ``which`` is the operand position (``OUT`` for the result) and ``dim`` the dimension.
    """

    kind: str  # "len" | "start" | "end"
    which: int
    dim: int

    def __repr__(self) -> str:
        who = "out" if self.which == OUT else f"arg{self.which}"
        return f"<{self.kind} {who}.{self.dim}>"


def ShardLen(which: int, dim: int) -> ShardMarker:
    return ShardMarker("len", which, dim)


def ShardStart(which: int, dim: int) -> ShardMarker:
    return ShardMarker("start", which, dim)


def ShardEnd(which: int, dim: int) -> ShardMarker:
    return ShardMarker("end", which, dim)


@dataclass(frozen=True, slots=True)
class StreamMarker:
    """The module's random stream (:class:`hapc.ops.RandomStream`: seed, step, train/eval), known
    only at run time: random ops' local calls take it, codegen reads it from ``self.rng``."""

    def __repr__(self) -> str:
        return "<rng>"


#: the marker random ops' local calls use
RNG = StreamMarker()


@dataclass(frozen=True, slots=True)
class Operand:
    """The node's tensor operand at ``position`` inside a :class:`LocalCall` template."""

    position: int

    def __repr__(self) -> str:
        return f"<arg{self.position}>"


@dataclass(frozen=True, slots=True)
class LocalCall:
    """What a device runs instead of the reference call.

    ``args``/``kwargs`` use :class:`Operand` for the node's tensor operands (by position) and
    :class:`ShardMarker` for per-device numbers. ``target`` is a callable, or a method name when
    ``is_method`` (then ``args[0]`` is the tensor).
    """

    target: Any
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    is_method: bool = False
    out_index: int | None = None  # element of a tuple-returning call

    @property
    def kwargs_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)


@dataclass(frozen=True)
class Strategy:
    """One way to compute a node on all devices at once.

    Attributes:
        inputs: layout required of each tensor operand, in the node's operand order.
        output: layout the result then has.
        scaled: the op's iteration space is split by the ratios (work ``total * B_j``); default:
            true when any operand or the result is sharded.
        local: the per-device call when it differs from the reference call.
        fwd_comm, bwd_comm: collectives embedded in the instruction (e.g. synchronised batch-norm
            statistics); most strategies have none.
        simulate: for strategies with embedded collectives, their semantics over all devices at
            once: ``simulate(device_args: list[tuple], node) -> list[result]`` (see
            :mod:`hapc.theory.simulate`); ``None`` means "run ``local`` on each device".
        links: groups of ``(which, dim)`` whose shard sizes must be identical (the same index);
            default: every sharded dim of this strategy forms one group.
        units: ``(which, dim, unit)``: shard boundaries of that dim must be multiples of ``unit``
            (whole heads after a reshape).
        grad_complete: operand positions whose gradient this instruction produces *complete* on
            every device (sufficient-factor broadcasting); those parameters skip the all-reduce.
        flops: ``(forward, backward)`` per-device flops override, as ``Linear`` values.
        name: a short label shown by ``hapc rules`` and in programs (``"col"``, ``"sfb"``).
    """

    inputs: tuple[Layout, ...]
    output: Layout
    scaled: bool | None = None
    local: LocalCall | None = None
    fwd_comm: tuple[Comm, ...] = ()
    bwd_comm: tuple[Comm, ...] = ()
    simulate: Callable[..., list[Any]] | None = None
    links: tuple[tuple[tuple[int, int], ...], ...] | None = None
    units: tuple[tuple[int, int, int], ...] = ()
    grad_complete: tuple[int, ...] = ()
    flops: tuple[Any, Any] | None = None
    name: str = ""

    @property
    def is_scaled(self) -> bool:
        if self.scaled is not None:
            return self.scaled
        return self.output.is_sharded or any(layout.is_sharded for layout in self.inputs)

    def link_groups(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        if self.links is not None:
            return self.links
        group = [(i, lay.dim) for i, lay in enumerate(self.inputs) if lay.is_sharded]
        if self.output.is_sharded:
            group.append((OUT, self.output.dim))
        return (tuple(group),) if len(group) > 1 else ()

    def key(self) -> str:
        """A stable textual identity, used to find this strategy again when a plan is loaded."""
        ins = ",".join(map(repr, self.inputs))
        return f"{self.name or 'std'}:{ins}->{self.output!r}"

    def __repr__(self) -> str:
        return f"Strategy({self.key()})"
