"""Sufficient-factor broadcasting as a triple (HAP §2.5.2, §4.4; DESIGN §3 "SFB").

For ``y = F.linear(x, w)`` with ``x`` sharded on a batch dim and ``w`` a replicated parameter used
nowhere else, plain data parallelism all-reduces ``dw`` (``n * k`` values). SFB instead
all-gathers the two *sufficient factors* -- the input ``x`` and the output gradient ``dy`` -- and
every device computes the complete ``dw = dy^T x`` itself. It pays off when the global batch is
small next to ``n * k``, and costs the full-batch ``dw`` product on every device (which is why
on a heterogeneous cluster it is a trade-off the search must weigh, not a fixed rule).

The strategy marks the weight ``grad_complete``: its gradient is whole on every device, so the
theory drops that parameter's gradient all-reduce when it fuses the source into this triple.
"""

from __future__ import annotations

import torch

from .cost import Comm, Linear
from .graph import PARAM
from .registry import OpView
from .strategy import Strategy


def sfb_strategies(view: OpView, found: list[Strategy]) -> list[Strategy]:
    """SFB variants of the batch-sharded, weight-replicated strategies of a single-use linear."""
    node = view.node
    if node.op != "linear" or view.num_operands != 2:
        return []
    w = view.graph[node.operands[1]]
    if w.kind != PARAM or len(w.users) != 1 or node.operands[0] == node.operands[1]:
        return []
    x = view.operands[0]
    flops = node.flops
    dx = flops if view.graph[node.operands[0]].requires_grad else 0.0
    out = []
    for s in found:
        xl, wl = s.inputs
        if wl.is_replicated and xl.is_sharded and xl.dim < x.rank - 1 and s.output == xl:
            out.append(
                Strategy(
                    s.inputs,
                    s.output,
                    bwd_comm=(Comm("all_gather", x.nbytes, "max"), Comm("all_gather", view.out.nbytes, "max")),
                    flops=(Linear(0.0, flops), Linear(flops, dx)),  # dW over the whole batch on every device
                    grad_complete=(1,),
                    simulate=simulate_sfb,
                    name="sfb",
                )
            )
    return out


class _SFBLinear(torch.autograd.Function):
    """All devices at once: forward is local; backward gathers x and dy and builds dW whole."""

    @staticmethod
    def forward(ctx, n: int, *tensors: torch.Tensor):  # tensors = x_1..x_n, w_1..w_n
        xs, ws = tensors[:n], tensors[n:]
        ctx.n = n
        ctx.save_for_backward(*xs, *ws)
        return tuple(torch.nn.functional.linear(x, w) for x, w in zip(xs, ws))

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        n = ctx.n
        xs, ws = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        x_all = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])  # all-gather of the inputs
        dy_all = torch.cat([d.reshape(-1, d.shape[-1]) for d in dys])  # all-gather of dy
        dw = dy_all.t() @ x_all  # complete on every device
        dxs = [d @ w for d, w in zip(dys, ws)]
        return (None, *dxs, *[dw.clone() for _ in range(n)])


def simulate_sfb(inputs, call, ctx):
    """Semantics over all devices (forward local, weight gradient complete everywhere)."""
    n = len(inputs)
    return list(_SFBLinear.apply(n, *[i[0] for i in inputs], *[i[1] for i in inputs]))
