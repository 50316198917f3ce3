"""Where a model's graph may be cut: sources and single-tensor cuts (HAP §5.2, HARP §5.1).

*Sources* are tensors any part of a program may re-create: inputs, parameters, buffers and what
parameters and buffers alone compute (a transposed weight, a mask). A *cut* is a point in the
topological order that only one computed tensor crosses -- between transformer blocks, the
residual stream. ``hapc.synth.synthesizer`` builds segments from these; ``hapc.pipeline`` builds
layers from them.
"""

from __future__ import annotations

from ..theory.graph import BUFFER, INPUT, OP, PARAM, RefGraph


def source_like(graph: RefGraph) -> set[int]:
    """Nodes every segment may re-create: inputs, parameters, buffers, and what parameters and
    buffers alone compute (a transposed weight, a mask)."""
    static: set[int] = set()
    for n in graph:
        if n.kind in (PARAM, BUFFER) or (n.kind == OP and all(o in static for o in n.operands)):
            static.add(n.index)
    return static | {n.index for n in graph if n.kind == INPUT}


def find_cuts(graph: RefGraph) -> list[tuple[int, int | None]]:
    """``(position, crossing node)`` for every cut: after node ``position`` only that tensor crosses."""
    sources = source_like(graph)
    last_use = {}
    for n in graph:
        for o in n.operands:
            last_use[o] = max(last_use.get(o, -1), n.index)
    live: set[int] = set()
    cuts = []
    for n in graph:
        if n.index not in sources and n.index in last_use:
            live.add(n.index)
        live = {x for x in live if last_use[x] > n.index}
        if len(live) == 1 and n.index < len(graph) - 1:
            cuts.append((n.index, next(iter(live))))
    return cuts
