"""The distributed instruction set (HAP Fig. 8): what a synthesized program is made of.

Every device executes the same instruction on its own instance of the operands:

``Source(e, L)``
    Produce input / parameter / buffer / created tensor ``e`` directly in layout ``L``
    (HAP's Placeholder-Shard and Parameter-Shard when ``L`` is ``S(d)``).
``Compute(e, strategy)``
    Run node ``e``'s op locally as the strategy says (the reference op, or its local form).
``Collective(e, op, src, dst, variant)``
    Move ``e`` from layout ``src`` to ``dst``: ``all_gather`` S->R, ``reduce_scatter`` P->S,
    ``all_reduce`` P->R, ``all_to_all`` S(d1)->S(d2), ``slice`` R->S (local, free). ``variant`` is
    ``padded`` (one collective, shards padded to the largest) or ``grouped`` (one broadcast or
    reduce per device, HAP §2.5.1).
``Loss(e, L)``
    The loss is available in layout ``L`` (``P``: every device seeds its backward with 1;
    ``R``: seeds are split so they sum to 1).

Instructions are plain data (JSON round-trip), so a saved plan regenerates the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .props import Layout

# Collective -> (forward primitive per variant, backward primitive per variant): the adjoint
# pairs of the partial-gradient convention (DESIGN §3).
COLLECTIVES: dict[str, dict[str, tuple[str, str]]] = {
    "all_gather": {"padded": ("all_gather", "reduce_scatter"), "grouped": ("broadcast", "reduce")},
    "reduce_scatter": {"padded": ("reduce_scatter", "all_gather"), "grouped": ("reduce", "broadcast")},
    "all_reduce": {"": ("all_reduce", "all_reduce")},
    "all_to_all": {"": ("all_to_all", "all_to_all")},
    "slice": {"": ("", "")},
}


@dataclass(frozen=True, slots=True)
class Source:
    ref: int
    layout: Layout

    def describe(self, name: str) -> str:
        return f"{name} = source{'' if self.layout.is_replicated else f'_shard(dim={self.layout.dim})'}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "source", "ref": self.ref, "layout": self.layout.to_json()}


@dataclass(frozen=True, slots=True)
class Compute:
    ref: int
    strategy_key: str
    inputs: tuple[Layout, ...]
    output: Layout

    def describe(self, name: str) -> str:
        label = self.strategy_key.split(":", 1)[0]
        return f"{name} = compute[{label}]"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "compute",
            "ref": self.ref,
            "strategy": self.strategy_key,
            "inputs": [lay.to_json() for lay in self.inputs],
            "output": self.output.to_json(),
        }


@dataclass(frozen=True, slots=True)
class Collective:
    ref: int
    op: str
    src: Layout
    dst: Layout
    variant: str = ""

    def describe(self, name: str) -> str:
        dims = f"dim={self.dst.dim}" if self.dst.is_sharded else (f"dim={self.src.dim}" if self.src.is_sharded else "")
        if self.op == "all_to_all":
            dims = f"{self.src.dim}->{self.dst.dim}"
        v = f", {self.variant}" if self.variant else ""
        return f"{name} = {self.op}({name}{', ' + dims if dims else ''}{v})"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "collective",
            "ref": self.ref,
            "op": self.op,
            "src": self.src.to_json(),
            "dst": self.dst.to_json(),
            "variant": self.variant,
        }


@dataclass(frozen=True, slots=True)
class Loss:
    ref: int
    layout: Layout

    def describe(self, name: str) -> str:
        return f"loss({name}: {self.layout!r})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": "loss", "ref": self.ref, "layout": self.layout.to_json()}


Instruction = Source | Compute | Collective | Loss


def instruction_from_json(data: dict[str, Any]) -> Instruction:
    kind = data.get("kind")
    if kind == "source":
        return Source(int(data["ref"]), Layout.from_json(data["layout"]))
    if kind == "compute":
        ins = tuple(Layout.from_json(x) for x in data["inputs"])
        return Compute(int(data["ref"]), str(data["strategy"]), ins, Layout.from_json(data["output"]))
    if kind == "collective":
        return Collective(
            int(data["ref"]),
            str(data["op"]),
            Layout.from_json(data["src"]),
            Layout.from_json(data["dst"]),
            str(data.get("variant", "")),
        )
    if kind == "loss":
        return Loss(int(data["ref"]), Layout.from_json(data["layout"]))
    raise ValueError(f"unknown instruction kind {kind!r}")
