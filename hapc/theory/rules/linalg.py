"""Contractions, attention, convolution and pooling.

Contractions are annotations: every index shards, a summed index gives ``Partial`` (HAP Fig. 9's
"reduction parallelism"), and they are linear in each operand. An *added* operand (a bias passed
straight to ``F.linear`` / ``F.conv2d``) cannot stand next to a Partial product, so those
strategies are dropped when a bias is present (``nn.Linear`` is normalised to ``linear + add``
precisely so that row-parallel linears stay expressible).
"""

from __future__ import annotations

import torch

from ..props import PARTIAL, shard
from ..registry import OpView
from ..strategy import LocalCall, Operand, ShardEnd, ShardStart, Strategy
from . import op, rule


def _without_partial(strategies):
    return [s for s in strategies if not s.output.is_partial]


@rule("linear", doc="batch dims, out-features (weight dim 0) shard; in-features -> Partial")
def _linear(view: OpView):
    """``F.linear(x, w[, b])``: ``... k, n k -> ... n``."""
    if view.num_operands == 3:
        return _without_partial(view.annotate("... k, n k, n -> ... n"))
    return view.annotate("... k, n k -> ... n", linear="each")


@rule("matmul", doc="broadcast batch dims, m, n shard; k -> Partial")
def _matmul(view: OpView):
    """``a @ b`` with torch.matmul's 1-D and broadcasting cases."""
    ra, rb = (m.rank for m in view.operands)
    if ra == 1 and rb == 1:
        spec = "k, k -> "
    elif ra == 1:
        spec = "k, ... k n -> ... n"
    elif rb == 1:
        spec = "... m k, k -> ... m"
    else:
        spec = "... m k, ... k n -> ... m n"
    return view.annotate(spec, linear="each")


# matrix product: rows, columns shard; the contraction gives Partial
op("mm", "m k, k n -> m n", linear="each")
# batched matrix product: batch, rows, columns shard; the contraction gives Partial
op("bmm", "b m k, b k n -> b m n", linear="each")


@rule("einsum", doc="any index shards; summed indices -> Partial")
def _einsum(view: OpView):
    """``torch.einsum("bij,bjk->bik", a, b)``: the equation is the annotation."""
    eq = view.node.args[0]
    if not isinstance(eq, str):
        raise view.fail("einsum needs the equation string as first argument")
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    if not _:
        # implicit output: indices that appear once, in alphabetical order
        counts = {c: lhs.count(c) for c in lhs if c.isalpha()}
        rhs = ("..." if "..." in lhs else "") + "".join(sorted(c for c, k in counts.items() if k == 1))
    return view.annotate(f"{_spaced(lhs)} -> {_spaced(rhs)}", linear="each")


def _spaced(part: str) -> str:
    out = []
    for operand in part.split(","):
        toks, i = [], 0
        while i < len(operand):
            if operand.startswith("...", i):
                toks.append("...")
                i += 3
            else:
                toks.append(operand[i])
                i += 1
        out.append(" ".join(toks))
    return ", ".join(out)


@rule("scaled_dot_product_attention", doc="batch and head dims shard (queries too when not causal); linear in v")
def _sdpa(view: OpView):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask)``: rows of attention are independent,
    so batch and heads shard; a causal mask ties query positions to key positions."""
    q, k = view.operands[0], view.operands[1]
    causal = bool(view.arg(5, "is_causal", False))
    lead = q.rank - 2
    qb = [f"h{i}" for i in range(lead)]
    kb = list(qb)
    if lead and q.shape[-3] != k.shape[-3]:  # grouped-query attention: head counts differ
        qb[-1], kb[-1] = "gq^", "gk^"
    ql = "l^" if causal else "l"
    spec = [" ".join([*qb, ql, "e^"]), " ".join([*kb, "s^", "e^"]), " ".join([*kb, "s^", "v^"])]
    if view.num_operands == 4:
        m = view.operands[3]
        spec.append(" ".join([*qb[lead - (m.rank - 2) :], ql, "s^"]))
    strategies = view.annotate(f"{', '.join(spec)} -> {' '.join([*qb, ql, 'v^'])}", linear=[(2,)])
    if float(view.arg(4, "dropout_p", 0.0)) > 0:  # rank-consistent attention dropout
        from .random import with_attention_dropout

        return with_attention_dropout(view, strategies)
    return strategies


@rule(["conv1d", "conv2d", "conv3d"], doc="batch, out-channels shard; in-channels -> Partial (groups=1)")
def _conv(view: OpView):
    """``F.conv2d(x, w[, b], stride, padding, dilation, groups)``: windows never shard."""
    x, w = view.operands[0], view.operands[1]
    spatial = w.rank - 2
    sp_in = " ".join(f"i{k}^" for k in range(spatial))
    sp_w = " ".join(f"k{k}^" for k in range(spatial))
    sp_out = " ".join(f"o{k}^" for k in range(spatial))
    groups = view.arg(6, "groups", 1)
    cin, cout = ("ci", "co") if groups == 1 else ("ci^", "co^")
    batch = "n " if x.rank == spatial + 2 else ""
    spec = f"{batch}{cin} {sp_in}, {cout} {cin} {sp_w}"
    if view.num_operands == 3:
        return _without_partial(view.annotate(f"{spec}, {cout} -> {batch}{cout} {sp_out}"))
    return view.annotate(f"{spec} -> {batch}{cout} {sp_out}", linear="each")


def _pool(spatial: int, linear: bool):
    sp_in = " ".join(f"i{k}^" for k in range(spatial))
    sp_out = " ".join(f"o{k}^" for k in range(spatial))
    return f"... {sp_in} -> ... {sp_out}", ("each" if linear else None)


for _names, _k, _lin in [
    (["max_pool1d", "adaptive_max_pool1d"], 1, False),
    (["max_pool2d", "adaptive_max_pool2d"], 2, False),
    (["max_pool3d"], 3, False),
    (["avg_pool1d", "adaptive_avg_pool1d"], 1, True),
    (["avg_pool2d", "adaptive_avg_pool2d"], 2, True),
    (["avg_pool3d", "adaptive_avg_pool3d"], 3, True),
]:
    _spec, _linear_kind = _pool(_k, _lin)
    # pooling: batch and channel dims shard; the pooled window never does
    op(_names, _spec, linear=_linear_kind)


@rule("interpolate", doc="batch and channel dims shard; the resized spatial dims never do")
def _interpolate(view: OpView):
    """``F.interpolate(x, size | scale_factor, mode, ...)`` on ``(N, C, *spatial)``: every mode
    (nearest, (bi/tri)linear, bicubic, area, antialiased) computes each output pixel of channel
    ``(n, c)`` from that channel's input pixels alone, so ``n`` and ``c`` shard and each device
    resizes its own channels; a window crosses any cut of a spatial dim, so those never shard."""
    spatial = view.operands[0].rank - 2
    sp_in = " ".join(f"i{k}^" for k in range(spatial))
    sp_out = " ".join(f"o{k}^" for k in range(spatial))
    return view.annotate(f"n c {sp_in} -> n c {sp_out}")


@rule("torch.nn.modules.activation.MultiheadAttention", doc="batch dim shards (module kept whole, weights replicated)")
def _mha(view: OpView):
    """``nn.MultiheadAttention`` stays one op: sequences are independent, so the batch dim shards."""
    mod = view.node.target
    batch = 0 if getattr(mod, "batch_first", False) or view.node.out_index == 1 else 1
    ins = []
    for m in view.operands:
        if m.rank == 3:
            ins.append(shard(0 if getattr(mod, "batch_first", False) else 1))
        elif m.rank == 2 and m.shape[0] == view.out.shape[batch] and m.dtype == torch.bool:
            ins.append(shard(0))  # key_padding_mask [B, S]
        else:
            return []
    return [Strategy(tuple(ins), shard(batch), name="batch")]


# matrix-vector, dot and outer products: every index shards; a contracted one gives Partial
op("mv", "n k, k -> n", linear="each")
op("dot", "k, k -> ", linear="each")
op(["outer", "ger"], "n, m -> n m", linear="each")


def affine_product(op_name: str, bias, a, b, start: int, end: int, beta: float = 1, alpha: float = 1):
    """``torch.<op_name>(bias, a, b, beta=, alpha=)`` on one device of a contraction-sharded
    strategy: only the device holding the first non-empty slice of the contracted index adds the
    bias, so the devices' results sum to the whole result (the others run with ``beta=0``)."""
    import torch

    owner = start == 0 and end > start
    return getattr(torch, op_name)(bias, a, b, beta=beta if owner else 0, alpha=alpha)


#: ``torch.<op>(bias, a, b)``: the product's annotation; the bias broadcasts against the result
_AFFINE = {
    "addmm": "n k, k m -> n m",
    "baddbmm": "b n k, b k m -> b n m",
    "addbmm": "b n k, b k m -> n m",
    "addmv": "n k, k -> n",
    "addr": "n, m -> n m",
}


@rule(list(_AFFINE), doc="like the product (rows, columns shard); a contracted index -> Partial, bias added once")
def _affine(view: OpView):
    """``torch.addmm(bias, x, w, beta=1, alpha=1)`` = ``beta * bias + alpha * (x @ w)`` (GPT-2's
    ``Conv1D``), and ``baddbmm`` / ``addbmm`` / ``addmv`` / ``addr`` alike.

    The bias broadcasts against the result, so a result index shards the bias where the bias
    carries it. Sharding a contracted index makes the product ``Partial``; the bias must then be
    added once in the sum: either it is ``Partial`` itself, or it is ``Replicated`` and only the
    device holding the first slice of the contracted index adds it (:func:`affine_product`).
    The op is jointly linear in (bias, first factor) and in (bias, second factor).
    """
    name = view.node.op
    product = _AFFINE[name]
    lhs, res = product.split("->")
    out_labels = res.split()
    bias = view.operands[0]
    if bias.rank > len(out_labels):
        return []
    bias_labels = out_labels[len(out_labels) - bias.rank :]
    spec = f"{' '.join(bias_labels)}, {lhs.strip()} -> {res.strip()}"
    beta, alpha = view.node.kwargs.get("beta", 1), view.node.kwargs.get("alpha", 1)  # keyword-only
    out = []
    for s in view.annotate(spec, linear=[(0, 1), (0, 2)]):
        if not (s.output.is_partial and s.is_scaled):
            out.append(s)
            continue
        # a contracted index: the bias joins Partial, or one device adds it
        out.append(Strategy((PARTIAL, *s.inputs[1:]), PARTIAL, name=f"{s.name}-partial-bias"))
        a_dim = s.inputs[1].dim
        local = LocalCall(
            affine_product,
            (name, Operand(0), Operand(1), Operand(2), ShardStart(1, a_dim), ShardEnd(1, a_dim), beta, alpha),
        )
        out.append(Strategy(s.inputs, PARTIAL, local=local, name=s.name))
    return out
