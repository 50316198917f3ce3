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

import torch

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
    """Basic indexing ``x[:, 0, 1:3, None, ...]``; one integer index tensor among whole dims
    (``x[idx]``, ``x[:, idx]``) like ``index_select``; an item of a tuple of tensors."""
    if view.num_operands != 1:
        return _getitem_tensors(view)
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


def _getitem_tensors(view: OpView):
    """``pair[i]`` on a tuple of tensors, or ``x[idx]`` with one integer index tensor."""
    src, idx = view.node.args[0], view.node.args[1]
    if isinstance(src, (tuple, list)):  # one item of a tuple of tensors: the others stay as they are
        if not isinstance(idx, int) or not all(_is_ref(v) for v in src):
            return []
        pos = idx % len(src)
        specs = [
            " ".join(labels(m.rank) if k == pos else [f"u{k}_{j}^" for j in range(m.rank)])
            for k, m in enumerate(view.operands)
        ]
        return view.annotate(f"{', '.join(specs)} -> {' '.join(labels(view.out.rank))}", linear=[(pos,)])
    idx = idx if isinstance(idx, tuple) else (idx,)
    if view.num_operands != 2 or not _is_ref(src) or sum(_is_ref(i) for i in idx) != 1:
        return []
    if not all(_is_ref(i) or i is Ellipsis or i == slice(None) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return []
    x, index = view.operands
    if index.dtype == torch.bool:
        return []  # a mask: the result's length depends on the values
    p = 0
    for i in idx:
        if _is_ref(i):
            break
        p += x.rank - (len(idx) - 1) if i is Ellipsis else 1
    names = labels(x.rank)
    xs = [n + ("^" if k == p else "") for k, n in enumerate(names)]
    ids = [f"i{j}" for j in range(index.rank)]
    outs = names[:p] + ids + names[p + 1 :]
    return view.annotate(f"{' '.join(xs)}, {' '.join(ids)} -> {' '.join(outs)}", linear=[(0,)])


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


# -- creation from a tensor's dtype and device ----------------------------------------------------
_NEW = ["new_zeros", "new_ones", "new_full", "new_empty"]


@rule(_NEW, doc="the result shards on any dim (local sizes); new_zeros is also Partial")
def _new(view: OpView):
    """``x.new_zeros(size)`` (T5's ``_shift_right``): only ``x``'s dtype and device are read, so the
    result may be created sharded on any dim (each device makes its own slice) from a replicated
    ``x``, or from ``x`` sharded alike when the shapes agree. Zeros are also a ``Partial`` zero."""
    name, x, out = view.node.op, view.operands[0], view.out
    extra = tuple(view.node.args[2:]) if name == "new_full" else ()
    if name == "new_full" and not extra:
        extra = (view.node.kwargs["fill_value"],)
    kwargs = tuple((k, v) for k, v in view.node.kwargs.items() if k not in ("size", "fill_value"))
    strategies = []
    for d, n in enumerate(out.shape):
        if n <= 1:
            continue
        size = tuple(ShardLen(OUT, d) if k == d else m for k, m in enumerate(out.shape))
        local = LocalCall(name, (Operand(0), size, *extra), kwargs, is_method=True)
        strategies.append(Strategy((REPLICATED,), shard(d), local=local, name=f"d{d}"))
        if tuple(x.shape) == tuple(out.shape):
            strategies.append(Strategy((shard(d),), shard(d), local=local, name=f"like-d{d}"))
    zero = name == "new_zeros" or (name == "new_full" and extra and extra[0] == 0)
    if zero:
        strategies.append(Strategy((REPLICATED,), PARTIAL, scaled=False, name="zeros"))
    return strategies


# -- indexing with index tensors --------------------------------------------------------------------
def _is_ref(value: object) -> bool:
    from ..graph import Ref

    return isinstance(value, Ref)


@rule("index_select", doc="dims not indexed shard; the index (and the result's dim) shard with x whole on it; linear")
def _index_select(view: OpView):
    """``x.index_select(dim, idx)``: the result's ``dim`` follows ``idx``, every other dim follows ``x``."""
    x, idx = view.operands
    d = view.dim(view.arg(1, "dim"))
    names = labels(x.rank)
    xs = [n + ("^" if k == d else "") for k, n in enumerate(names)]
    outs = [("i" if idx.rank else "1") if k == d else n for k, n in enumerate(names)]
    return view.annotate(f"{' '.join(xs)}, {'i' if idx.rank else ''} -> {' '.join(outs)}", linear=[(0,)])


@rule("gather", doc="the index's dims shard (x whole on `dim`, sharded alike where sizes agree); linear in x")
def _gather(view: OpView):
    """``x.gather(dim, idx)``: ``out[..., j, ...] = x[..., idx[..., j, ...], ...]`` along ``dim``;
    every dim of ``idx`` (and the result) shards, ``x`` alongside where it has the same size."""
    x, idx = view.operands
    d = view.dim(view.arg(1, "dim"))
    xs, ids = [], []
    for k in range(idx.rank):
        same = k != d and k < x.rank and x.shape[k] == idx.shape[k]
        xs.append(f"d{k}" if same else f"x{k}^")
        ids.append(f"d{k}")
    return view.annotate(f"{' '.join(xs)}, {' '.join(ids)} -> {' '.join(ids)}", linear=[(0,)])


def _scatter_spec(x, idx, src, d: int) -> tuple[list[str], list[str], list[str]]:
    """Labels of (x and result, idx, src): a dim other than ``d`` where all sizes agree is shared."""
    xs, ids, ss = [], [], []
    for k in range(x.rank):
        sizes = {x.shape[k], idx.shape[k]} | ({src.shape[k]} if src is not None else set())
        if k != d and len(sizes) == 1:
            xs.append(f"d{k}")
            ids.append(f"d{k}")
            ss.append(f"d{k}")
        else:
            xs.append(f"x{k}^")
            ids.append(f"i{k}^")
            ss.append(f"s{k}^")
    return xs, ids, ss


def _split_add(view: OpView, index_pos: int, index_dim: int, src_dim: int) -> list[Strategy]:
    """An additive scatter with its updates split over devices: each adds its share to its summand
    of a ``Partial`` x, so the results sum to x plus every update."""
    idx, src = view.operands[index_pos], view.operands[2]
    if idx.shape[index_dim] <= 1 or idx.shape[index_dim] != src.shape[src_dim]:
        return []
    ins = (PARTIAL, shard(index_dim), shard(src_dim))
    return [Strategy(ins, PARTIAL, links=(((1, index_dim), (2, src_dim)),), name="split-add")]


@rule(["scatter", "scatter_add", "scatter_reduce"], doc="dims other than `dim` shard where x, index, src agree; linear")
def _scatter(view: OpView):
    """``x.scatter(dim, idx, src | value, reduce=)``, ``x.scatter_add(dim, idx, src)``,
    ``x.scatter_reduce(dim, idx, src, reduce, include_self=)``. Jointly linear in (x, src) when the
    reduction is a plain write, a sum or a mean; a sum may also split the updates (``split-add``)."""
    name = view.node.op
    x, idx = view.operands[0], view.operands[1]
    src = view.operands[2] if view.num_operands == 3 else None
    d = view.dim(view.arg(1, "dim"))
    reduce = view.arg(4, "reduce") if name != "scatter_add" else "sum"
    reduce = {"add": "sum", "multiply": "prod"}.get(reduce, reduce)
    include_self = bool(view.arg(5, "include_self", True)) if name == "scatter_reduce" else True
    xs, ids, ss = _scatter_spec(x, idx, src, d)
    if src is None:  # x.scatter(dim, idx, value)
        value = view.arg(3, "value")
        linear = [(0,)] if reduce is None and value == 0 else None
        return view.annotate(f"{' '.join(xs)}, {' '.join(ids)} -> {' '.join(xs)}", linear=linear)
    linear = [(0, 2)] if reduce in (None, "sum", "mean") else None
    spec = f"{' '.join(xs)}, {' '.join(ids)}, {' '.join(ss)} -> {' '.join(xs)}"
    strategies = view.annotate(spec, linear=linear)
    if reduce == "sum" and include_self and idx.shape == src.shape:
        strategies += _split_add(view, 1, d, d)
    return strategies


@rule(["index_add", "index_copy", "index_fill"], doc="dims other than `dim` shard; linear in (x, source)")
def _index_update(view: OpView):
    """``x.index_add(dim, idx, src, alpha=)``, ``x.index_copy(dim, idx, src)``, ``x.index_fill(dim,
    idx, value)``: rows ``idx`` of ``x`` along ``dim`` are updated; every other dim shards.
    ``index_add`` may also split its updates over devices (``split-add``)."""
    name = view.node.op
    x = view.operands[0]
    d = view.dim(view.arg(1, "dim"))
    names = labels(x.rank)
    xs = [n + ("^" if k == d else "") for k, n in enumerate(names)]
    srcs = [f"s{k}^" if k == d else n for k, n in enumerate(names)]
    ops = [" ".join(xs), "i^" if view.operands[1].rank else ""]
    if view.num_operands == 3:
        value = view.operands[2]
        ops.append(" ".join(srcs) if value.rank == x.rank else " ".join(f"v{k}^" for k in range(value.rank)))
        linear = [(0, 2)]
    else:  # index_fill with a number
        linear = [(0,)] if view.arg(3, "value") == 0 else None
    strategies = view.annotate(f"{', '.join(ops)} -> {' '.join(xs)}", linear=linear)
    if name == "index_add" and view.operands[1].rank == 1:
        strategies += _split_add(view, 1, 0, d)
    return strategies


@rule("index_put", doc="dims after the indexed ones shard where the values carry them; linear in (x, values)")
def _index_put(view: OpView):
    """``x[idx] = v`` as ``x.index_put((idx,), v, accumulate)``: the indexed leading dims stay
    whole; each later dim shards in x, the result and the values (broadcast from the right)."""
    indices = view.arg(1, "indices")
    if not isinstance(indices, (tuple, list)) or not indices or not all(_is_ref(i) for i in indices):
        return []
    metas = view.operands
    x, idx, values = metas[0], metas[1:-1], metas[-1]
    lead = sum(m.rank if m.dtype == torch.bool else 1 for m in idx)  # a mask covers its rank in dims
    if lead > x.rank:
        return []
    xs = [f"x{k}^" if k < lead else f"d{k}" for k in range(x.rank)]
    vs = []
    for j in range(values.rank):
        k = x.rank - (values.rank - j)  # the x dim this value dim broadcasts against
        vs.append(f"d{k}" if k >= lead and values.shape[j] == x.shape[k] else f"v{j}^")
    spec = [" ".join(xs), *(" ".join(f"i{n}_{k}^" for k in range(m.rank)) for n, m in enumerate(idx)), " ".join(vs)]
    return view.annotate(f"{', '.join(spec)} -> {' '.join(xs)}", linear=[(0, view.num_operands - 1)])


# -- repetition and differences ---------------------------------------------------------------------
@rule("repeat_interleave", doc="every dim shards (the repeated one in whole repeats); linear")
def _repeat_interleave(view: OpView):
    """``x.repeat_interleave(r, dim)``: element ``i`` of ``dim`` becomes ``r`` consecutive
    elements, so a slice of ``x`` maps to a slice ``r`` times longer; per-element repeats (a
    tensor ``r``) leave ``dim`` whole. Without ``dim`` x is flattened first (1-D x only)."""
    if view.arg(1, "repeats") is None and view.num_operands == 1:
        return []  # torch.repeat_interleave(repeats): the result depends on the values
    x, out = view.operands[0], view.out
    d = view.arg(2, "dim")
    if d is None:
        if x.rank != 1:
            return []
        d = 0
    d = view.dim(d)
    names = labels(x.rank)
    xs = [n + ("^" if k == d else "") for k, n in enumerate(names)]
    outs = [f"r{k}^" if k == d else n for k, n in enumerate(names)]
    specs = [" ".join(xs)] + [" ".join(f"n{k}^" for k in range(m.rank)) for m in view.operands[1:]]
    strategies = view.annotate(f"{', '.join(specs)} -> {' '.join(outs)}", linear=[(0,)])
    scalar_repeats = view.num_operands == 1 or view.operands[1].numel == 1
    if scalar_repeats and x.shape[d] > 1 and out.shape[d] % x.shape[d] == 0:
        ins = (shard(d),) + (REPLICATED,) * (view.num_operands - 1)
        local = None
        if view.node.kwargs.get("output_size") is not None:  # the local result's length
            from ..local import default_call

            call = default_call(view.node)
            kwargs = {**dict(call.kwargs), "output_size": ShardLen(OUT, d)}
            local = LocalCall(call.target, call.args, tuple(kwargs.items()), call.is_method)
        strategies.append(Strategy(ins, shard(d), local=local, name=f"d{d}-repeats"))  # linked: in proportion
    return strategies


@rule(["repeat", "tile"], doc="dims repeated once shard; tiled dims never; linear")
def _repeat(view: OpView):
    """``x.repeat(2, 1, 3)`` / ``x.tile(dims)``: a tiled dim's slice is not a slice of the result."""
    x, out = view.operands[0], view.out
    lead = out.rank - x.rank
    xs, outs = [], [f"n{k}^" for k in range(lead)]
    for k, n in enumerate(x.shape):
        same = out.shape[lead + k] == n
        xs.append(f"d{k}" if same else f"d{k}^")
        outs.append(f"d{k}" if same else f"t{k}^")
    return view.annotate(f"{' '.join(xs)} -> {' '.join(outs)}", linear="each")


@rule("diff", doc="every dim but `dim` shards; jointly linear with prepend / append")
def _diff(view: OpView):
    """``torch.diff(x, n, dim, prepend, append)``: neighbours along ``dim`` are coupled."""
    d = view.dim(view.arg(2, "dim", -1))
    names = labels(view.operands[0].rank)
    specs = [" ".join(f"a{i}^" if k == d else n for k, n in enumerate(names)) for i in range(view.num_operands)]
    outs = " ".join("o^" if k == d else n for k, n in enumerate(names))
    return view.annotate(f"{', '.join(specs)} -> {outs}", linear="all")


# one-hot encoding: every index dim shards, the new class dim never does
op("one_hot", "... -> ... c^")


@rule("unfold", doc="every dim but the unfolded one shards; linear")
def _unfold(view: OpView):
    """``x.unfold(dim, size, step)``: windows along ``dim`` overlap; the window dim is new.
    ``F.unfold(x, kernel_size)`` (im2col, same name): only the batch dim shards."""
    rank = view.operands[0].rank
    if not view.node.is_method:  # F.unfold: [N, C, H, W] -> [N, C * kh * kw, L]
        return view.annotate("n c^ h^ w^ -> n k^ l^" if rank == 4 else "c^ h^ w^ -> k^ l^", linear="each")
    return view.annotate(_fixed_dim_spec(rank, view.dim(view.arg(1, "dimension"))) + " w^", linear="each")
