"""Mixture of experts: GShard dispatch / combine with any number of experts on any devices.

``hapc.ops.moe_dispatch(x [T, M], idx [T, k], E, C) -> [E, C, M]`` and
``hapc.ops.moe_combine(y [E, C, M], idx, gates [T, k], C) -> [T, M]``. Besides replication and
feature (``M``) sharding, the rules offer expert parallelism with *uneven* expert counts (the
expert dim shards by the ratios in whole experts, HAP §7.6):

* dispatch ``x S(0), idx S(0) -> S(0)`` -- tokens to expert owners: one all-to-all, after a tiny
  all-gather of per-expert counts so slots are numbered exactly as on one device;
* dispatch ``x S(0), idx S(0) -> P`` -- each device fills the slots of its own tokens;
* dispatch ``x R, idx R -> S(0)`` -- each device builds only its experts' buffers;
* combine ``y S(0), idx S(0), gates S(0) -> S(0)`` -- the reverse all-to-all;
* combine ``y S(0), idx R, gates R -> P`` -- each device adds its experts' contributions;
* combine ``y R, idx S(0), gates S(0) -> S(0)`` -- each device gathers for its tokens.

Strategies with collectives inside carry their semantics as a ``simulate`` function over all
devices (the runtime's implementation must match it; see ``hapc.collectives``).
"""

from __future__ import annotations

import torch

from ... import ops as hops
from ..cost import Comm
from ..props import PARTIAL, REPLICATED, shard
from ..registry import OpView
from ..strategy import OUT, LocalCall, Operand, ShardEnd, ShardStart, Strategy
from . import rule

S0 = shard(0)
TOKENS = (((0, 0), (1, 0)),)  # x and idx hold the same tokens


def _full(values, layout):
    return torch.cat(values, 0) if layout.is_sharded else values[0]


def _sim_dispatch_a2a(inputs, call, ctx):
    y = call([_full([i[0] for i in inputs], S0), _full([i[1] for i in inputs], S0)])
    return list(torch.split(y, ctx.sizes(OUT, 0), 0))


def _sim_dispatch_partial(inputs, call, ctx):
    idx = _full([i[1] for i in inputs], S0)
    out = []
    for j in range(len(inputs)):
        x = torch.cat([i[0] if k == j else torch.zeros_like(i[0]) for k, i in enumerate(inputs)], 0)
        out.append(call([x, idx]))
    return out


def _sim_combine(expert_layout):
    def sim(inputs, call, ctx):
        y = _full([i[0] for i in inputs], expert_layout)
        idx, gates = (_full([i[k] for i in inputs], S0) for k in (1, 2))
        return list(torch.split(call([y, idx, gates]), ctx.sizes(1, 0), 0))

    return sim


@rule(
    "hapc.ops.moe_dispatch",
    doc="features shard; experts shard unevenly (all-to-all or local); tokens -> Partial",
)
def _dispatch(view: OpView):
    """``moe_dispatch(x, idx, E, C)``."""
    x, idx = view.operands
    num_experts, capacity = view.arg(2, "num_experts"), view.arg(3, "capacity")
    out = view.annotate("t^ m, t^ k^ -> e^ c^ m", linear=[(0,)])
    counts = Comm("all_gather", idx.shape[1] * num_experts * 8, "full")
    buf = view.out.nbytes
    local = LocalCall(
        hops.moe_dispatch_range, (Operand(0), Operand(1), num_experts, capacity, ShardStart(OUT, 0), ShardEnd(OUT, 0))
    )
    out.append(Strategy((REPLICATED, REPLICATED), S0, local=local, name="experts"))
    if x.shape[0] > 1:
        out.append(
            Strategy(
                (S0, S0),
                S0,
                fwd_comm=(counts, Comm("all_to_all", buf, "max")),
                bwd_comm=(Comm("all_to_all", buf, "max"),),
                simulate=_sim_dispatch_a2a,
                links=TOKENS,
                name="all-to-all",
            )
        )
        out.append(
            Strategy((S0, S0), PARTIAL, fwd_comm=(counts,), simulate=_sim_dispatch_partial, links=TOKENS, name="tokens")
        )
    return out


@rule("hapc.ops.moe_combine", doc="features shard; experts -> Partial or all-to-all to tokens; tokens shard")
def _combine(view: OpView):
    """``moe_combine(y, idx, gates, C)``."""
    y, idx, _ = view.operands
    num_experts, capacity = y.shape[0], view.arg(3, "capacity")
    out = view.annotate("e^ c^ m, t^ k^, t^ k^ -> t^ m", linear=[(0,), (2,)])
    counts = Comm("all_gather", idx.shape[1] * num_experts * 8, "full")
    local = LocalCall(
        hops.moe_combine_range, (Operand(0), Operand(1), Operand(2), capacity, num_experts, ShardStart(0, 0))
    )
    out.append(Strategy((S0, REPLICATED, REPLICATED), PARTIAL, local=local, name="experts"))
    if idx.shape[0] > 1:
        links = (((1, 0), (2, 0), (OUT, 0)),)
        out.append(
            Strategy(
                (REPLICATED, S0, S0),
                S0,
                fwd_comm=(counts,),
                simulate=_sim_combine(REPLICATED),
                links=links,
                name="tokens",
            )
        )
        out.append(
            Strategy(
                (S0, S0, S0),
                S0,
                fwd_comm=(counts, Comm("all_to_all", view.operands[0].nbytes, "max")),
                bwd_comm=(Comm("all_to_all", view.operands[0].nbytes, "max"),),
                simulate=_sim_combine(S0),
                links=links,
                name="all-to-all",
            )
        )
    return out


#: grouped matrix products (``out[rows of group g] = a[rows of g] @ b[g]``, groups ended by ``offs``):
#: the fallback Hugging Face transformers registers for its MoE experts (what its default experts
#: path records when captured). torch's own ``F.grouped_mm`` is left without a rule: its CPU
#: kernel takes neither float64 nor the 16-byte-misaligned slices a sharded K gives, so the rule
#: cannot be checked here.
GROUPED_MM = ["torch._ops.transformers.transformers::grouped_mm_fallback"]


@rule(GROUPED_MM, doc="2-D x 3-D with offs: out-features shard; in-features -> Partial; linear in a and b")
def _grouped_mm(view: OpView):
    """``grouped_mm(a [S, K], b [E, K, N], offs [E])`` (transformers' ``grouped_mm_experts_forward``).

    Rows belong to groups by the offsets and experts to rows, so neither shards here; within a
    group it is a matrix product, so ``N`` shards (``b`` column-sharded) and ``K`` gives ``Partial``.
    """
    offs = view.arg(2, "offs")
    if view.num_operands != 3 or offs is None or [m.rank for m in view.operands] != [2, 3, 1]:
        return []
    if view.node.kwargs.get("bias") is not None:
        return []
    return view.annotate("s^ k, e^ k n, e^ -> s^ n", linear=[(0,), (1,)])
