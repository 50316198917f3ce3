"""Baseline programs under the same cost model, for comparisons (HAP §7.1).

``dp-ev``  data parallelism, even ratios;
``dp-cp``  data parallelism, ratios proportional to device speed;
``ep``     expert parallelism (GShard): data parallelism, with each MoE layer's expert weights
           sharded over the devices by expert and tokens exchanged by all-to-all, even ratios;
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

BASELINES = ("dp-ev", "dp-cp", "ep", "tp")


def restrict(theory: Theory, baseline: str, m: int) -> set[int]:
    """Indices of the triples a baseline may use."""
    g = theory.graph
    if baseline in ("dp-ev", "dp-cp", "ep"):
        wanted = _dp_sources(g, m)
        if baseline == "ep":
            experts = expert_parameters(g)
            if not experts:
                raise InfeasibleError("expert parallelism needs a mixture-of-experts layer (hapc.ops.moe_dispatch)")
            for ref in experts:
                if g[ref].shape[0] < m:
                    raise InfeasibleError(
                        f"expert parallelism over {m} devices is impossible: {g[ref].name} has only "
                        f"{g[ref].shape[0]} experts; use at most that many devices"
                    )
                wanted[ref] = shard(0)
        # only scalars (loss pieces) move, plus the all-reduces a batch-sharded op itself needs
        # (MoE token dispatch into replicated experts, batch sums) and free local slices (a
        # replicated tensor expanded to the batch, e.g. ViT's class token, cut to the local batch)
        allow_comm = lambda ins: g[ins.ref].meta.rank == 0 or ins.op in ("all_reduce", "slice")  # noqa: E731
    elif baseline == "tp":
        wanted = megatron_layouts(g)
        for ref, lay in wanted.items():
            if lay.is_sharded and theory.atoms(ref, lay.dim) < m:
                raise InfeasibleError(
                    f"tensor parallelism over {m} devices is impossible: {g[ref].name} dim {lay.dim} splits into "
                    f"only {theory.atoms(ref, lay.dim)} whole units (attention heads, experts); "
                    "use at most that many devices"
                )
        allow_comm = lambda ins: True  # noqa: E731
    else:
        raise ValueError(f"unknown baseline {baseline!r}; one of {BASELINES}")
    out = set()
    for k, t in enumerate(theory.triples):
        ok = True
        for ins in t.instrs:
            if isinstance(ins, Source) and wanted.get(ins.ref, REPLICATED) != ins.layout:
                ok = False
            if isinstance(ins, Collective) and not allow_comm(ins):
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


def expert_parameters(g: RefGraph) -> set[int]:
    """Parameters indexed by expert: read between a ``moe_dispatch`` and its ``moe_combine``,
    leading dim equal to the number of experts."""
    out: set[int] = set()
    for n in g:
        if n.op != "hapc.ops.moe_dispatch":
            continue
        experts = n.shape[0]
        inside, frontier = {n.index}, [n.index]
        while frontier:
            ref = frontier.pop()
            for user in g[ref].users:
                u = g[user]
                if u.op == "hapc.ops.moe_combine" or user in inside:
                    continue
                inside.add(user)
                frontier.append(user)
                out.update(o for o in u.operands if g[o].kind == PARAM and g[o].shape[:1] == (experts,))
    return out


def megatron_layouts(g: RefGraph) -> dict[int, Layout]:
    """Parameter layouts of Megatron's tensor parallelism, found structurally: a linear reading a
    replicated activation is column-parallel (weight rows sharded, output features sharded); one
    reading feature-sharded activations is row-parallel (weight columns sharded, output Partial).
    ``addmm(bias, x, w)`` (GPT-2's Conv1D, weight stored ``[in, out]``) likewise, transposed.
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
        if n.op == "addmm" and len(ops) == 3 and g[ops[2]].kind == PARAM:  # GPT-2's Conv1D: weight [in, out]
            b, x, w = ops
            if x in flagged:
                wanted[w] = shard(0)  # row-parallel; the bias is added once (the addmm rule's Partial)
            else:
                wanted[w] = shard(1)
                if g[b].kind == PARAM and g[b].meta.rank == 1:
                    wanted[b] = shard(0)
                flagged.add(n.index)
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
