"""Reductions and normalisations.

A sum over a sharded dim is ``Partial``; a mean is a local sum divided by the global count
(``hapc.ops.sum_div``). Max-like reductions, softmax and the normalised dims of a layer norm
never shard. Batch norm shards its channels freely; sharding its batch dim in training needs the
statistics of the whole batch, so that strategy all-reduces them (forward and backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import ops as hops
from ..cost import Comm
from ..props import REPLICATED, shard
from ..registry import OpView
from ..strategy import LocalCall, Operand, Strategy
from . import labels, rule


def _dims(view: OpView, position: int = 1, name: str = "dim") -> list[int] | None:
    d = view.arg(position, name)
    if d is None or (isinstance(d, Sequence) and not isinstance(d, str) and len(d) == 0):
        return None
    d = [d] if isinstance(d, int) else list(d)
    return sorted(view.dim(x) for x in d)


def _reduce_spec(view: OpView, dims: list[int] | None, keepdim: bool, fixed: bool) -> str:
    rank = view.operands[0].rank
    dims = list(range(rank)) if dims is None else dims
    names = labels(rank)
    ins = [n + ("^" if fixed and k in dims else "") for k, n in enumerate(names)]
    outs = [("1" if keepdim else None) if k in dims else n for k, n in enumerate(names)]
    return f"{' '.join(ins)} -> {' '.join(o for o in outs if o is not None)}"


def _keepdim(view: OpView, position: int = 2) -> bool:
    return bool(view.arg(position, "keepdim", False))


@rule(["sum", "nansum"], doc="kept dims shard; a summed dim -> Partial; linear")
def _sum(view: OpView):
    """``x.sum(dim, keepdim)`` -- the annotation is ``"d0 d1 d2 -> d0 d2"`` for ``dim=1``."""
    dims = _dims(view)
    return view.annotate(_reduce_spec(view, dims, _keepdim(view), fixed=False), linear="each")


@rule("mean", doc="kept dims shard; a reduced dim -> Partial (local sum / global count); linear")
def _mean(view: OpView):
    """``x.mean(dim)``: on a sharded reduced dim each device sums and divides by the full count."""
    dims = _dims(view)
    keepdim = _keepdim(view)
    shape = view.operands[0].shape
    count = 1
    for d in range(len(shape)) if dims is None else dims:
        count *= shape[d]
    out = []
    for s in view.annotate(_reduce_spec(view, dims, keepdim, fixed=False), linear="each"):
        if s.output.is_partial and s.is_scaled:
            local = LocalCall(hops.sum_div, (Operand(0), dims, keepdim, float(count)))
            s = Strategy(s.inputs, s.output, local=local, name=s.name)
        out.append(s)
    return out


@rule(
    ["amax", "amin", "prod", "logsumexp", "std", "var", "norm", "all", "any", "argmax", "argmin", "count_nonzero"],
    doc="kept dims shard; reduced dims never do",
)
def _reduce_fixed(view: OpView):
    """Max-like and nonlinear reductions: only the kept dims shard."""
    return view.annotate(_reduce_spec(view, _dims(view), _keepdim(view), fixed=True))


@rule("vector_norm", doc="kept dims shard; reduced dims never do")
def _vector_norm(view: OpView):
    """``torch.linalg.vector_norm(x, ord, dim, keepdim)``: ``dim`` is its third argument."""
    return view.annotate(_reduce_spec(view, _dims(view, 2), _keepdim(view, 3), fixed=True))


@rule(["max", "min"], doc="element-wise with two tensors; otherwise kept dims shard")
def _max(view: OpView):
    """``torch.max(x)``, ``x.max(dim)`` (values and indices) or ``torch.max(a, b)``."""
    if view.num_operands == 2:
        return view.annotate("..., ... -> ...")
    dims = _dims(view)
    return view.annotate(_reduce_spec(view, dims, _keepdim(view), fixed=True))


@rule(
    ["softmax", "log_softmax", "cumprod", "logcumsumexp", "sort", "argsort", "normalize", "cummax", "cummin", "glu"],
    doc="every dim but `dim` shards",
)
def _along_dim(view: OpView):
    """Ops coupling one dim (softmax over ``dim``): that dim is fixed, the rest shard."""
    pos = 2 if view.node.op == "normalize" else 1
    default = -1 if view.node.op in ("softmax", "log_softmax", "sort", "argsort", "glu") else 1
    d = view.dim(view.arg(pos, "dim", default))
    rank = view.operands[0].rank
    names = [n + ("^" if k == d else "") for k, n in enumerate(labels(rank))]
    return view.annotate(f"{' '.join(names)} -> {' '.join(names)}")


@rule("cumsum", doc="every dim but `dim` shards; linear")
def _cumsum(view: OpView):
    """``x.cumsum(dim)`` is linear, so Partial passes through."""
    d = view.dim(view.arg(1, "dim"))
    names = [n + ("^" if k == d else "") for k, n in enumerate(labels(view.operands[0].rank))]
    return view.annotate(f"{' '.join(names)} -> {' '.join(names)}", linear="each")


@rule("topk", doc="every dim but `dim` shards")
def _topk(view: OpView):
    """``x.topk(k, dim)``: values and indices shard alike."""
    d = view.dim(view.arg(2, "dim", -1))
    names = [n + ("^" if k == d else "") for k, n in enumerate(labels(view.operands[0].rank))]
    return view.annotate(f"{' '.join(names)} -> {' '.join(names)}")


@rule("histc", doc="every dim shards, counts -> Partial (fixed range); a range from the data never")
def _histc(view: OpView):
    """``torch.histc(x, bins, min, max)``: counts of the slices add up, so a sharded ``x`` gives
    ``Partial`` counts -- unless ``min == max``, when the range is the data's own min and max."""
    low, high = view.arg(2, "min", 0), view.arg(3, "max", 0)
    if low == high:
        return []
    return view.annotate(f"{' '.join(labels(view.operands[0].rank))} -> b^")


@rule(["layer_norm", "rms_norm"], doc="leading dims shard; normalised dims and affine params never")
def _layer_norm(view: OpView):
    """``F.layer_norm(x, normalized_shape, w, b)``."""
    k = len(view.arg(1, "normalized_shape"))
    x = view.operands[0]
    lead = labels(x.rank - k, "b")
    norm = [f"n{i}^" for i in range(k)]
    params = [" ".join(norm)] * (view.num_operands - 1)
    return view.annotate(", ".join([" ".join(lead + norm), *params]) + " -> " + " ".join(lead + norm))


@rule("group_norm", doc="batch dim shards")
def _group_norm(view: OpView):
    """``F.group_norm(x, groups, w, b)``: statistics are per sample."""
    x = view.operands[0]
    rest = " ".join(f"s{i}^" for i in range(x.rank - 1))
    params = ["s0^"] * (view.num_operands - 1)
    return view.annotate(", ".join([f"n {rest}", *params]) + f" -> n {rest}")


@rule("batch_norm", doc="channels shard; batch shards in eval, and in training with all-reduced statistics")
def _batch_norm(view: OpView):
    """``F.batch_norm(x, running_mean, running_var, w, b, training, momentum, eps)``.

    Channels (dim 1) are independent. In eval mode every other dim shards too. In training the
    batch statistics span the whole batch, so batch sharding all-reduces them forward and backward
    -- synchronised batch norm, never per-shard statistics: the sums (C values and the count), then
    the sums of squared deviations from the whole batch's mean (C values; two passes, as one
    device computes the variance, not ``E[x^2] - mean^2``, which cancels where ``|mean| >> std``).
    """
    x = view.operands[0]
    n_params = view.num_operands - 1
    training = bool(view.arg(5, "training", False))
    out = [Strategy((shard(1),) + (shard(0),) * n_params, shard(1), name="channels")]
    if x.shape[0] > 1:
        others = (REPLICATED,) * n_params
        if not training:
            out += [
                Strategy((shard(d),) + others, shard(d), name=f"d{d}")
                for d in range(x.rank)
                if d != 1 and x.shape[d] > 1
            ]
        else:
            # two passes, as one device computes them (hapc.collectives.sync_batch_norm): the
            # per-channel sums and the count, then the sums of squares about the whole batch's mean
            c = x.shape[1]
            comm = (Comm("all_reduce", (c + 1) * 4, "full"), Comm("all_reduce", c * 4, "full"))
            out.append(
                Strategy(
                    (shard(0),) + others,
                    shard(0),
                    fwd_comm=comm,
                    bwd_comm=comm,
                    simulate=_sim_sync_batch_norm,
                    name="sync-batch",
                )
            )
    return out


def _sim_sync_batch_norm(inputs, call, ctx):
    """Semantics of synchronised batch norm: normalise with the statistics of the whole batch."""
    import torch

    xs = [ops[0] for ops in inputs]
    y = call([torch.cat(xs, dim=0), *inputs[0][1:]])
    return list(torch.split(y, [x.shape[0] for x in xs], dim=0))


@rule([torch._weight_norm], doc="`dim` shards (g linear); the normed dims never")  # type: ignore[list-item]
def _weight_norm(view: OpView):
    """``torch._weight_norm(v, g, dim) = v * g / ||v||`` over every dim but ``dim`` (``nn.utils.
    weight_norm`` and its parametrization: Wav2Vec2's positional convolution): each slice along
    ``dim`` is normed on its own, so ``dim`` shards; linear in ``g``. ``dim=-1`` norms the whole
    tensor: replicated."""
    v = view.operands[0]
    d = view.arg(2, "dim", 0)
    if d == -1 or view.num_operands != 2 or view.operands[1].rank != v.rank:
        return []
    d = view.dim(d)
    names = [f"d{k}" + ("" if k == d else "^") for k in range(v.rank)]
    g = [names[k] if k == d else "1" for k in range(v.rank)]
    return view.annotate(f"{' '.join(names)}, {' '.join(g)} -> {' '.join(names)}", linear=[(1,)])
