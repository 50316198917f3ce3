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

import warnings
from collections import defaultdict
from collections.abc import Callable

from ..errors import InfeasibleError
from ..theory.graph import BUFFER, INPUT, PARAM, RefGraph
from ..theory.instructions import Collective, Compute, Source
from ..theory.props import DONE, REPLICATED, Layout, Prop, shard
from ..theory.triples import Theory

BASELINES = ("dp-ev", "dp-cp", "ep", "tp")
_REPLICATED_ONLY = frozenset({REPLICATED})


def restrict(theory: Theory, baseline: str, m: int) -> set[int]:
    """Indices of the triples a baseline may use.

    Data parallelism keeps every activation on its batch shard. Where hapc's layouts cannot say
    that -- a reshape that folds the batch into another dimension (torchvision's
    ``MultiheadAttention``: ``permute(2, 0, 1, 3).view(tgt_len * bsz, embed)``, the batch the
    inner factor), an op without a sharding rule reading batch data -- no program is left, and
    the baseline is priced with activations moved (all-to-all / all-gather) where needed, with a
    warning naming the node: real DDP runs those ops locally, so the price is an upper bound.
    """
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
                wanted[ref] = frozenset({shard(0)})
        # only scalars (loss pieces) move, plus the all-reduces a batch-sharded op itself needs
        # (MoE token dispatch into replicated experts, batch sums) and free local slices (a
        # replicated tensor expanded to the batch, e.g. ViT's class token, cut to the local batch)
        allow_comm = lambda ins: g[ins.ref].meta.rank == 0 or ins.op in ("all_reduce", "slice")  # noqa: E731
        out = _select(theory, wanted, allow_comm)
        if _reaches_loss(theory, out, m):
            return out
        stuck = _first_stuck(theory, out, m)
        relaxed = _select(theory, wanted, lambda ins: True)
        if not _reaches_loss(theory, relaxed, m):
            raise InfeasibleError(
                f"{baseline} cannot be priced: with parameters replicated and inputs split by batch, no program "
                f"computes the loss (the first node left without one: {_where(g, stuck)}); "
                "compare with another baseline (tp) or hapc's own plan"
            )
        why = (
            "it has no sharding rule"
            if stuck is not None and g[stuck].op in theory.unsupported
            else "its rule has no layout for its operands split by batch (e.g. a reshape that folds the batch "
            "into another dimension)"
        )
        warnings.warn(
            f"{baseline}: no purely data-parallel program exists in hapc's layouts: {_where(g, stuck)} cannot "
            f"compute on the local batch shard: {why}. The baseline is priced with activations moved "
            "(all-to-all / all-gather) there; real data parallelism runs it locally, so this price is an upper "
            "bound",
            stacklevel=2,
        )
        return relaxed
    if baseline == "tp":
        layouts = megatron_layouts(g)
        for ref, lay in layouts.items():
            if lay.is_sharded and theory.atoms(ref, lay.dim) < m:
                raise InfeasibleError(
                    f"tensor parallelism over {m} devices is impossible: {g[ref].name} dim {lay.dim} splits into "
                    f"only {theory.atoms(ref, lay.dim)} whole units (attention heads, experts); "
                    "use at most that many devices"
                )
        return _select(theory, {r: frozenset({lay}) for r, lay in layouts.items()}, lambda ins: True)
    raise ValueError(f"unknown baseline {baseline!r}; one of {BASELINES}")


def _select(theory: Theory, wanted: dict[int, frozenset[Layout]], allow_comm: Callable[[Collective], bool]) -> set[int]:
    """The triples whose sources take a wanted layout (replicated if unnamed) and whose
    collectives ``allow_comm`` accepts."""
    out = set()
    for k, t in enumerate(theory.triples):
        ok = True
        for ins in t.instrs:
            if isinstance(ins, Source) and ins.layout not in wanted.get(ins.ref, _REPLICATED_ONLY):
                ok = False
            if isinstance(ins, Collective) and not allow_comm(ins):
                ok = False
        if ok:
            out.add(k)
    return out


def _fired(theory: Theory, allowed: set[int], m: int) -> tuple[set[Prop], set[int]]:
    """Forward reachability over the allowed (and shardable) triples from the empty program: the
    properties that can hold and the nodes some fired triple computes. An over-approximation of
    what the search finds (it ignores that a node is computed once), exact for a missing layout."""
    from .synthesizer import shardable_triples

    usable = sorted(allowed & shardable_triples(theory, m))
    waiting: dict[Prop, list[int]] = defaultdict(list)
    missing = {k: len(theory.triples[k].pre) for k in usable}
    for k in usable:
        for p in theory.triples[k].pre:
            waiting[p].append(k)
    queue = [k for k in usable if not missing[k]]
    produced: set[Prop] = set()
    computed: set[int] = set()
    while queue:
        t = theory.triples[queue.pop()]
        computed.update(ins.ref for ins in t.instrs if isinstance(ins, Compute))
        for p in t.post - produced:
            produced.add(p)
            for u in waiting[p]:
                missing[u] -= 1
                if not missing[u]:
                    queue.append(u)
    return produced, computed


def _reaches_loss(theory: Theory, allowed: set[int], m: int) -> bool:
    return DONE in _fired(theory, allowed, m)[0]


def _first_stuck(theory: Theory, allowed: set[int], m: int) -> int | None:
    """The first node (in program order) that some triple computes but no allowed one can."""
    _, computed = _fired(theory, allowed, m)
    every = {ins.ref for t in theory.triples for ins in t.instrs if isinstance(ins, Compute)}
    return min(every - computed, default=None)


def _where(g: RefGraph, ref: int | None) -> str:
    if ref is None:
        return "none found"
    n = g[ref]
    return f"node {n.name} (op {n.op!r}, shape {tuple(n.shape)}, {n.source})"


def _dp_sources(g: RefGraph, m: int) -> dict[int, frozenset[Layout]]:
    """Each source's layouts under data parallelism: inputs split by batch, parameters whole;
    a buffer or constant as long as the batch (``arange(b).expand``-style tensors made in the
    forward) may also be split with it, as each replica would make it for its own shard."""
    wanted: dict[int, frozenset[Layout]] = {}
    batches = set()
    for n in g:
        if n.kind == INPUT and n.meta.rank > 0:
            if n.shape[0] < m:
                raise InfeasibleError(
                    f"data parallelism needs a batch of at least {m} (input {n.name} has {n.shape[0]})"
                )
            wanted[n.index] = frozenset({shard(0)})
            batches.add(n.shape[0])
    for n in g:
        if n.kind == BUFFER and n.meta.rank > 0 and n.shape[0] in batches:
            wanted[n.index] = frozenset({REPLICATED, shard(0)})
        elif n.kind in (PARAM, BUFFER, INPUT) and n.index not in wanted:
            wanted[n.index] = _REPLICATED_ONLY
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
