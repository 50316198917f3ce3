"""Shape ops: reshape dim mapping, permutations, indexing, concatenation.

(Tensors created from constants -- ``torch.arange(T)``, ``torch.ones(T, T)`` -- are evaluated while
tracing, since shapes are static, and enter the graph as buffers: sources in any layout.)

**Reshape.** Strip size-1 dims, then cut both shapes into the shortest groups with equal products
(``[8, 768] -> [8, 12, 64]`` has groups ``{8}->{8}`` and ``{768}->{12, 64}``). Within a group only the
outermost dims can shard together: a slice of input dim ``a`` with inner product ``P`` covers a
contiguous range of the group, which is a slice of output dim ``b`` (inner product ``Q``) iff the
boundaries fall on multiples of ``lcm(P, Q)`` elements of the group. That becomes a *unit*
(``hapc.theory.granularity``): whole heads. Reshapes are linear.
"""

from __future__ import annotations

import math

from ..props import PARTIAL, REPLICATED, shard
from ..registry import OpView
from ..strategy import OUT, LocalCall, Operand, ShardLen, Strategy
from . import labels, op, rule

_RESHAPES = [
    "view",
    "reshape",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "_unsafe_view",
    "view_as",
    "reshape_as",
    "ravel",
]
_SIZE_ARG_FREE = {"flatten", "squeeze", "unsqueeze", "ravel"}


def reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of dims (positions in ``a`` and ``b``, size-1 dims left out) with equal products."""
    ia = [i for i, n in enumerate(a) if n != 1]
    ib = [j for j, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(ia) and j < len(ib):
        ga, gb = [ia[i]], [ib[j]]
        pa, pb = a[ia[i]], b[ib[j]]
        while pa != pb:
            if pa < pb:
                i += 1
                ga.append(ia[i])
                pa *= a[ia[i]]
            else:
                j += 1
                gb.append(ib[j])
                pb *= b[ib[j]]
        groups.append((ga, gb))
        i, j = i + 1, j + 1
    return groups


@rule(_RESHAPES, doc="the outermost dim of each reshaped group shards, in whole units; linear")
def _reshape(view: OpView):
    """``x.view(8, 12, 64)`` and friends: only the input and output shapes matter."""
    a, b = view.operands[0].shape, view.out.shape
    out = [Strategy((PARTIAL,) + (REPLICATED,) * (view.num_operands - 1), PARTIAL, scaled=False, name="linear")]
    x = Operand(0)
    for ga, gb in reshape_groups(a, b):
        da, db = ga[0], gb[0]
        p, q = math.prod(a[k] for k in ga[1:]), math.prod(b[k] for k in gb[1:])
        lcm = math.lcm(p, q)
        local = None
        if view.node.op not in _SIZE_ARG_FREE:
            shape = tuple(ShardLen(OUT, k) if k == db else n for k, n in enumerate(b))
            local = LocalCall("reshape", (x, shape), is_method=True)
        ins = (shard(da),) + (REPLICATED,) * (view.num_operands - 1)
        units = ((0, da, lcm // p), (OUT, db, lcm // q))
        out.append(Strategy(ins, shard(db), local=local, units=units, links=(((0, da), (OUT, db)),), name=f"d{da}"))
    return out


def _permutation(view: OpView) -> list[int]:
    """``perm[k]`` = input dim that becomes output dim ``k``."""
    rank = view.operands[0].rank
    name = view.node.op
    if name in ("permute",):
        dims = view.node.args[1:] if not isinstance(view.arg(1, "dims"), (tuple, list)) else view.arg(1, "dims")
        return [view.dim(d) for d in dims]
    if name == "t":
        return [1, 0] if rank == 2 else list(range(rank))
    if name == "movedim":
        src, dst = view.arg(1, "source"), view.arg(2, "destination")
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [view.dim(d) for d in src], [view.dim(d) for d in dst]
        rest = [d for d in range(rank) if d not in src]
        perm = [-1] * rank
        for s, d in zip(src, dst):
            perm[d] = s
        it = iter(rest)
        return [p if p >= 0 else next(it) for p in perm]
    d0, d1 = view.dim(view.arg(1, "dim0")), view.dim(view.arg(2, "dim1"))
    perm = list(range(rank))
    perm[d0], perm[d1] = d1, d0
    return perm


@rule(["transpose", "permute", "t", "movedim"], doc="every dim shards, moved with the permutation; linear")
def _permute(view: OpView):
    """``x.transpose(1, 2)``: a sharded input dim stays sharded where it lands."""
    perm = _permutation(view)
    names = labels(len(perm))
    return view.annotate(f"{' '.join(names)} -> {' '.join(names[p] for p in perm)}", linear="each")


@rule("getitem", doc="dims taken whole by `:` shard; indexed and sliced dims never; linear")
def _getitem(view: OpView):
    """Basic indexing ``x[:, 0, 1:3, None, ...]``; tensor indices are left replicated."""
    if view.num_operands != 1:
        return []
    idx = view.node.args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    rank = view.operands[0].rank
    n_used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    expanded: list[object] = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (rank - n_used))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (rank - sum(1 for i in expanded if i is not None)))
    ins, outs, d = [], [], 0
    for i in expanded:
        if i is None:
            outs.append("1")
            continue
        name = f"d{d}"
        if isinstance(i, slice) and i == slice(None):
            ins.append(name)
            outs.append(name)
        elif isinstance(i, slice):
            ins.append(name + "^")
            outs.append(f"s{d}^")
        else:
            ins.append(name + "^")
        d += 1
    return view.annotate(f"{' '.join(ins)} -> {' '.join(outs)}", linear="each")


def _fixed_dim_spec(rank: int, d: int, remove: bool = False) -> str:
    names = labels(rank)
    ins = [n + ("^" if k == d else "") for k, n in enumerate(names)]
    outs = [n if k != d else f"x{k}^" for k, n in enumerate(names) if not (remove and k == d)]
    return f"{' '.join(ins)} -> {' '.join(outs)}"


@rule("narrow", doc="every dim but the narrowed one shards; linear")
def _narrow(view: OpView):
    """``x.narrow(dim, start, length)`` (also what ``split``/``chunk`` become)."""
    return view.annotate(_fixed_dim_spec(view.operands[0].rank, view.dim(view.arg(1, "dim"))), linear="each")


@rule("select", doc="every dim but the selected one shards; linear")
def _select(view: OpView):
    """``x.select(dim, i)`` / ``x[:, i]`` (also what ``unbind`` becomes)."""
    return view.annotate(
        _fixed_dim_spec(view.operands[0].rank, view.dim(view.arg(1, "dim")), remove=True), linear="each"
    )


@rule(["cat", "concat"], doc="every dim but the concatenated one shards; jointly linear")
def _cat(view: OpView):
    """``torch.cat([a, b], dim)``: the pieces shard alike on the other dims."""
    rank = view.operands[0].rank
    d = view.dim(view.arg(1, "dim", 0), rank)
    names = [n + ("^" if k == d else "") for k, n in enumerate(labels(rank))]
    spec = ", ".join([" ".join(names)] * view.num_operands)
    return view.annotate(f"{spec} -> {' '.join(names)}", linear="all")


@rule("stack", doc="every dim shards except the new one; jointly linear")
def _stack(view: OpView):
    """``torch.stack([a, b], dim)``."""
    rank = view.operands[0].rank
    d = view.dim(view.arg(1, "dim", 0), rank + 1)
    names = labels(rank)
    outs = names[:d] + ["new^"] + names[d:]
    spec = ", ".join([" ".join(names)] * view.num_operands)
    return view.annotate(f"{spec} -> {' '.join(outs)}", linear="all")


@rule(["expand", "expand_as", "broadcast_to"], doc="kept dims shard; broadcast dims never; linear")
def _expand(view: OpView):
    """``x.expand(4, -1, 8)``: dims that keep their size map through."""
    x, out = view.operands[0], view.out
    lead = out.rank - x.rank
    ins = [f"d{lead + k}" if n == out.shape[lead + k] else "1" for k, n in enumerate(x.shape)]
    outs = [f"d{k}" if k >= lead and x.shape[k - lead] == n else f"e{k}^" for k, n in enumerate(out.shape)]
    spec = " ".join(ins) + (", " + " ".join(outs) if view.num_operands == 2 else "")
    out = []
    for s in view.annotate(f"{spec} -> {' '.join(outs)}", linear=[(0,)]):
        if s.output.is_sharded:  # the size list names the sharded dim's full length
            sizes = tuple(ShardLen(OUT, k) if k == s.output.dim else n for k, n in enumerate(view.out.shape))
            s = Strategy(
                s.inputs, s.output, local=LocalCall("expand", (Operand(0), sizes), is_method=True), name=s.name
            )
        out.append(s)
    return out


@rule(["tril", "triu"], doc="leading dims shard; the matrix dims never; linear")
def _tri(view: OpView):
    """``x.tril(k)``: position-dependent on the last two dims."""
    return view.annotate("... r^ c^ -> ... r^ c^", linear="each")


@rule(["flip", "roll"], doc="untouched dims shard; flipped / rolled dims never; linear")
def _flip(view: OpView):
    """``x.flip(dims)`` / ``x.roll(shifts, dims)``."""
    rank = view.operands[0].rank
    dims = view.arg(1 if view.node.op == "flip" else 2, "dims")
    dims = list(range(rank)) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
    dims = {view.dim(d) for d in dims}
    names = [n + ("^" if k in dims else "") for k, n in enumerate(labels(rank))]
    return view.annotate(f"{' '.join(names)} -> {' '.join(names)}", linear="each")


@rule("pad", doc="unpadded dims shard; padded dims never (linear when the value is 0)")
def _pad(view: OpView):
    """``F.pad(x, (l, r, t, b), value=0)``."""
    rank = view.operands[0].rank
    pad = view.arg(1, "pad")
    padded = {rank - 1 - k // 2 for k in range(len(pad)) if pad[k]}
    ins = [n + ("^" if k in padded else "") for k, n in enumerate(labels(rank))]
    outs = [n if k not in padded else f"p{k}^" for k, n in enumerate(labels(rank))]
    value = view.arg(3, "value", 0) or 0
    return view.annotate(f"{' '.join(ins)} -> {' '.join(outs)}", linear="each" if value == 0 else None)


# creation from a template tensor: only its shape is read, so any layout maps through
op(["ones_like", "empty_like", "full_like", "rand_like", "randn_like"], "... -> ...", doc="every dim shards")
