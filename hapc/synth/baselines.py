"""Baseline programs under the same cost model, for comparisons (HAP §7.1).

``dp-ev``  data parallelism, even ratios;
``dp-cp``  data parallelism, ratios proportional to device speed;
``tp``     Megatron-style tensor parallelism with even shards (column-parallel linears feeding
           row-parallel ones, everything else replicated; Shoeybi et al. 2019).

Each is a *restriction* of the theory (which triples may be used) plus fixed ratios; the same
search then finds the cheapest program inside the restriction, so baselines and hapc are priced
by one cost model.
"""

from __future__ import annotations

from ..errors import InfeasibleError
from ..theory.graph import BUFFER, INPUT, PARAM, RefGraph
from ..theory.instructions import Collective, Source
from ..theory.props import REPLICATED, Layout, shard
from ..theory.triples import Theory

BASELINES = ("dp-ev", "dp-cp", "tp")


def restrict(theory: Theory, baseline: str, m: int) -> set[int]:
    """Indices of the triples a baseline may use."""
    g = theory.graph
    if baseline in ("dp-ev", "dp-cp"):
        wanted = _dp_sources(g, m)
        allow_comm = lambda ref: g[ref].meta.rank == 0  # noqa: E731 - only scalars (loss pieces) move
    elif baseline == "tp":
        wanted = megatron_layouts(g)
        for ref, lay in wanted.items():
            if lay.is_sharded and theory.atoms(ref, lay.dim) < m:
                raise InfeasibleError(
                    f"tensor parallelism over {m} devices is impossible: {g[ref].name} dim {lay.dim} splits into "
                    f"only {theory.atoms(ref, lay.dim)} whole units (attention heads); use at most that many devices"
                )
        allow_comm = lambda ref: True  # noqa: E731
    else:
        raise ValueError(f"unknown baseline {baseline!r}; one of {BASELINES}")
    out = set()
    for k, t in enumerate(theory.triples):
        ok = True
        for ins in t.instrs:
            if isinstance(ins, Source) and wanted.get(ins.ref, REPLICATED) != ins.layout:
                ok = False
            if isinstance(ins, Collective) and not allow_comm(ins.ref):
                ok = False
        if ok:
            out.add(k)
    return out


def _dp_sources(g: RefGraph, m: int) -> dict[int, Layout]:
    wanted: dict[int, Layout] = {}
    for n in g:
        if n.kind == INPUT and n.meta.rank > 0:
            if n.shape[0] < m:
                raise InfeasibleError(
                    f"data parallelism needs a batch of at least {m} (input {n.name} has {n.shape[0]})"
                )
            wanted[n.index] = shard(0)
        elif n.kind in (PARAM, BUFFER, INPUT):
            wanted[n.index] = REPLICATED
    return wanted


def megatron_layouts(g: RefGraph) -> dict[int, Layout]:
    """Parameter layouts of Megatron's tensor parallelism, found structurally: a linear reading a
    replicated activation is column-parallel (weight rows sharded, output features sharded); one
    reading feature-sharded activations is row-parallel (weight columns sharded, output Partial).
    Biases follow their linear; every other parameter is replicated."""
    wanted: dict[int, Layout] = {n.index: REPLICATED for n in g if n.kind in (PARAM, BUFFER, INPUT)}
    flagged: set[int] = set()
    for n in g:
        ops = n.operands
        if n.op == "linear" and len(ops) >= 2 and g[ops[1]].kind == PARAM:
            x, w = ops[0], ops[1]
            if x in flagged:
                wanted[w] = shard(1)
            else:
                wanted[w] = shard(0)
                flagged.add(n.index)
                if len(ops) == 3:
                    wanted[ops[2]] = shard(0)
            continue
        if n.op == "add" and len(ops) == 2:
            a, b = ops
            if a in flagged and g[b].kind == PARAM and g[b].meta.rank == 1:
                wanted[b] = shard(0)
                flagged.add(n.index)
                continue
        if any(o in flagged for o in ops) and n.op not in ("layer_norm", "rms_norm", "cross_entropy"):
            flagged.add(n.index)
    return wanted
