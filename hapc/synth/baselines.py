"""Baseline programs under the same cost model, for comparisons (HAP §7.1).

``dp-ev``  data parallelism, even ratios;
``dp-cp``  data parallelism, ratios proportional to device speed;
``ep``     expert parallelism (GShard): data parallelism, with each MoE layer's expert weights
           sharded over the devices by expert and tokens exchanged by all-to-all, even ratios;
``tp``     Megatron-style tensor parallelism with even shards (column-parallel linears feeding
           row-parallel ones, everything else replicated; Shoeybi et al. 2019);
``fsdp``   fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020; PyTorch FSDP): data
           parallelism, even ratios, with every parameter held sharded -- its weights, gradients
           and optimizer state -- and all-gathered (replicated) before use, its gradient
           reduce-scattered back to the shard (the all-gather's dual). Needs a theory derived with
           ``param_comm=True`` (:func:`needs_param_comm`; hapc's entry points do so for it).

Each is a *restriction* of the theory (which triples may be used) plus fixed ratios; the same
search then finds the cheapest program inside the restriction, so baselines and hapc are priced
by one cost model.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable

from ..errors import HapcError, InfeasibleError
from ..theory.graph import BUFFER, INPUT, PARAM, RefGraph
from ..theory.instructions import Collective, Compute, Source
from ..theory.props import DONE, REPLICATED, Layout, Prop, shard
from ..theory.triples import Theory

BASELINES = ("dp-ev", "dp-cp", "ep", "tp", "fsdp")
#: baselines whose theory must be derived with ``param_comm=True`` (parameters communicated)
PARAM_COMM_BASELINES = frozenset({"fsdp"})
_REPLICATED_ONLY = frozenset({REPLICATED})


def needs_param_comm(baseline: str | None) -> bool:
    """Whether ``baseline`` needs a theory derived with ``param_comm=True``."""
    return baseline in PARAM_COMM_BASELINES


def restrict(theory: Theory, baseline: str, m: int) -> set[int]:
    """Indices of the triples a baseline may use.

    Data parallelism keeps every activation on its batch shard. Where hapc's layouts cannot say
    that -- a reshape that folds the batch into another dimension (torchvision's
    ``MultiheadAttention``: ``permute(2, 0, 1, 3).view(tgt_len * bsz, embed)``, the batch the
    inner factor), an op without a sharding rule reading batch data -- no program is left, and
    the baseline is priced with activations moved (all-to-all / all-gather) where needed, with a
    warning naming the node: real DDP runs those ops locally, so the price is an upper bound. Model
    inputs have no collectives: one such op reading an input directly (the CTC heads' check
    ``labels.max() >= vocab_size``) has the input also sourced whole on every rank, named in the
    warning (a source costs nothing in either layout; the op computes on the whole input, not the
    shard, so the price stays an upper bound); activations are moved only where that is not enough.

    ``fsdp`` keeps data parallelism's layouts, except that each parameter is sourced in one
    sharded layout (:func:`_fsdp_params`), may only be all-gathered (to replicated), and every
    computation reads parameters replicated -- never a tensor-parallel strategy on the shard. The
    gathered weight is held until the backward (as hapc's runtime does: autograd saves it), so the
    memory model charges each device its shard x 4 (weight, gradient, two Adam moments) plus the
    whole weight as an activation; the gradient is reduce-scattered (the all-gather's backward),
    not all-reduced. Real FSDP frees the gathered weight after the forward and gathers it again
    for the backward (less memory, one more all-gather), and bundles a layer's parameters into one
    collective where hapc pays one collective's latency per parameter.
    """
    g = theory.graph
    if baseline in ("dp-ev", "dp-cp", "ep", "fsdp"):
        wanted = _dp_sources(g, m)
        gathered: dict[int, Layout] = {}
        if baseline == "fsdp":
            gathered = _fsdp_params(theory, m)
            if not gathered:
                raise _no_fsdp(theory, m)
            wanted.update({ref: frozenset({lay}) for ref, lay in gathered.items()})
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
        # (FSDP: plus the all-gather of each sharded parameter; its backward is the reduce-scatter)
        def allow_comm(ins: Collective) -> bool:
            if ins.ref in gathered:
                return ins.op == "all_gather" and ins.dst.is_replicated
            return g[ins.ref].meta.rank == 0 or ins.op in ("all_reduce", "slice")

        def strict(wanted: dict[int, frozenset[Layout]]) -> set[int]:
            return _select(theory, wanted, allow_comm, whole_params=baseline == "fsdp")

        def relax(wanted: dict[int, frozenset[Layout]]) -> set[int]:
            return _select(
                theory,
                wanted,
                lambda ins: ins.ref not in gathered or (ins.op == "all_gather" and ins.dst.is_replicated),
                whole_params=baseline == "fsdp",
            )

        out = strict(wanted)
        if _reaches_loss(theory, out, m):
            return out
        stuck = _first_stuck(theory, out, m)
        # a model input read by an op with no layout for it split by batch (the CTC heads' check
        # labels.max() >= vocab_size): inputs have no collectives, so each rank also reads it whole
        # (a source costs nothing either way; the op then runs on the whole input, not the shard);
        # only if that is not enough are activations moved
        whole: list[int] = []
        out = _read_whole(theory, out, m, wanted, whole, strict)
        moved = not _reaches_loss(theory, out, m)
        if moved:
            out = _read_whole(theory, relax(wanted), m, wanted, whole, relax)
        if not _reaches_loss(theory, out, m):
            raise InfeasibleError(
                f"{baseline} cannot be priced: with parameters "
                f"{'gathered whole' if gathered else 'replicated'} and inputs split by batch, no program "
                f"computes the loss (the first node left without one: {_where(g, stuck)}); "
                "compare with another baseline (tp) or hapc's own plan"
            )
        why = (
            "it has no sharding rule"
            if stuck is not None and g[stuck].op in theory.unsupported
            else "its rule has no layout for its operands split by batch (e.g. a reshape that folds the batch "
            "into another dimension)"
        )
        how = [
            *(["activations moved (all-to-all / all-gather) there"] if moved else []),
            *(
                [f"model input {', '.join(g[o].name for o in whole)} also read whole on every rank (data "
                 "parallelism reads its shard)"]
                if whole
                else []
            ),
        ]  # fmt: skip
        warnings.warn(
            f"{baseline}: no purely data-parallel program exists in hapc's layouts: {_where(g, stuck)} cannot "
            f"compute on the local batch shard: {why}. The baseline is priced with {' and '.join(how)}; real data "
            "parallelism runs it locally, so this price is an upper bound",
            stacklevel=2,
        )
        return out
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


def _read_whole(
    theory: Theory,
    allowed: set[int],
    m: int,
    wanted: dict[int, frozenset[Layout]],
    whole: list[int],
    select: Callable[[dict[int, frozenset[Layout]]], set[int]],
) -> set[int]:
    """While no ``allowed`` program reaches the loss: let each model input that the first node no
    allowed triple computes reads also be sourced replicated (updating ``wanted``, appending to
    ``whole``) and select again; the last selection."""
    g = theory.graph
    while not _reaches_loss(theory, allowed, m):
        at = _first_stuck(theory, allowed, m)
        read = [] if at is None else [o for o in g[at].operands if g[o].kind == INPUT and o not in whole]
        if not read:
            break
        for o in read:
            wanted[o] = wanted.get(o, _REPLICATED_ONLY) | _REPLICATED_ONLY
            whole.append(o)
        allowed = select(wanted)
    return allowed


def _select(
    theory: Theory,
    wanted: dict[int, frozenset[Layout]],
    allow_comm: Callable[[Collective], bool],
    *,
    whole_params: bool = False,
) -> set[int]:
    """The triples whose sources take a wanted layout (replicated if unnamed) and whose
    collectives ``allow_comm`` accepts; ``whole_params``: and whose computations read every
    parameter replicated (FSDP computes on gathered weights, never on their shards)."""
    g = theory.graph
    out = set()
    for k, t in enumerate(theory.triples):
        ok = True
        for ins in t.instrs:
            if isinstance(ins, Source) and ins.layout not in wanted.get(ins.ref, _REPLICATED_ONLY):
                ok = False
            elif isinstance(ins, Collective) and not allow_comm(ins):
                ok = False
            elif whole_params and isinstance(ins, Compute):
                operands = g[ins.ref].operands
                if any(g[o].kind == PARAM and not lay.is_replicated for o, lay in zip(operands, ins.inputs)):
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


def _fsdp_params(theory: Theory, m: int) -> dict[int, Layout]:
    """The layout FSDP holds each parameter in: sharded on dim 0 where the theory can source it so
    and all-gather it to replicated and dim 0 has at least ``m`` whole units (attention heads,
    experts); else on the dim with the most units that can; else (left out of the result)
    replicated, its gradient all-reduced as in DDP. The theory offers a sharded source only for
    layouts some consumer's rule reads (LayerNorm weights have none: they stay replicated, a few
    KB; real FSDP flattens them into its shards), and parameter collectives only with
    ``param_comm=True``."""
    g = theory.graph
    gatherable: dict[int, set[int]] = defaultdict(set)  # param -> dims it can be gathered from
    sourced: dict[int, set[int]] = defaultdict(set)  # param -> dims it can be sourced sharded on
    for t in theory.triples:
        for ins in t.instrs:
            if isinstance(ins, Source) and ins.layout.is_sharded and g[ins.ref].kind == PARAM:
                sourced[ins.ref].add(ins.layout.dim)
            elif (
                isinstance(ins, Collective)
                and ins.op == "all_gather"
                and ins.dst.is_replicated
                and g[ins.ref].kind == PARAM
            ):
                gatherable[ins.ref].add(ins.src.dim)
    out: dict[int, Layout] = {}
    for ref, dims in gatherable.items():
        ok = [d for d in sorted(dims & sourced[ref]) if theory.atoms(ref, d) >= m]
        if not ok:
            continue
        out[ref] = shard(0) if 0 in ok else shard(max(ok, key=lambda d: (theory.atoms(ref, d), -d)))
    return out


def _no_fsdp(theory: Theory, m: int) -> HapcError:
    """Why no parameter can be sharded and gathered: a theory without parameter collectives, or
    parameters too small for ``m`` devices."""
    g = theory.graph
    moved = any(isinstance(ins, Collective) and g[ins.ref].kind == PARAM for t in theory.triples for ins in t.instrs)
    if not moved:
        return HapcError(
            "the fsdp baseline gathers sharded parameters, but this theory has no parameter collectives: "
            "derive it with hapc.derive(graph, param_comm=True) (hapc.synthesize / hapc.compile / "
            "hapc synth --baseline fsdp do so themselves)"
        )
    return InfeasibleError(
        f"fsdp over {m} devices is impossible: no parameter has a dimension of at least {m} whole units "
        "to shard; use fewer devices or another baseline (dp-ev)"
    )


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
