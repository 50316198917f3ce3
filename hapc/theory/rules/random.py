"""Random ops with rank-consistent draws (DESIGN §9 "Randomness"): dropout, SDPA's ``dropout_p``
and stochastic depth (torchvision's ``stochastic_depth``, timm's ``drop_path``).

Every device runs :func:`hapc.ops.dropout` (or :func:`hapc.ops.scaled_dot_product_attention`),
whose mask is a pure function of (seed, step, op, *global* element index): the local call passes
the node's name as the op, the whole tensor's shape, and where this device's slice starts
(``ShardStart(OUT, d)`` on the sharded dim, 0 elsewhere). So a sharded result is exactly the slice
of the replicated one, whatever the ratios. Dropout is elementwise, so every dim shards; and for
a fixed mask ``m`` it is linear (``m * x / (1 - p)``): every device draws the same ``m`` for the
same global element, so ``sum_j m * x_j / (1 - p) = m * (sum_j x_j) / (1 - p)`` and Partial passes
through too (a Partial summand is whole-shaped: its starts are 0).

Stochastic depth keeps or drops whole samples: sample ``i``'s decision is element ``i`` of the same
counter-based draw over the batch (:func:`hapc.ops.stochastic_depth`), so only the start on dim 0
matters, and a slice along any other dim draws the same decision as every other rank. It is
elementwise with a fixed per-sample mask too: every dim shards and Partial passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ... import ops as hops
from ..graph import RefNode
from ..props import REPLICATED
from ..registry import OpView
from ..strategy import OUT, RNG, LocalCall, Operand, ShardStart, Strategy
from . import rule


def _replicated(view: OpView) -> Strategy:
    """Replicate-everything, named as the theory's own so this rule's local call replaces its
    reference call (which would draw from each device's own generator)."""
    return Strategy(tuple(REPLICATED for _ in range(view.num_operands)), REPLICATED, scaled=False, name="replicate")


def _starts(s: Strategy, rank: int) -> tuple[Any, ...]:
    """Where this device's slice of a ``rank``-dim result starts: a marker on the sharded dim."""
    d = s.output.dim if s.output.is_sharded else None
    return tuple(ShardStart(OUT, k) if k == d else 0 for k in range(rank))


def _dropout_args(view: OpView) -> tuple[float, bool]:
    p = float(view.arg(1, "p", 0.5))
    training = view.arg(2, "training", view.node.kwargs.get("train", True))
    return p, bool(training)


@rule("dropout", doc="every dim shards; Partial -> Partial (a fixed mask is linear); masks by global index")
def _dropout(view: OpView):
    """``F.dropout(x, p, training)`` / ``torch.dropout(x, p, train)``: the rank-consistent draw of
    :func:`hapc.ops.dropout` on every strategy (p = 0 or training=False: the identity)."""
    return _elementwise_draws(view, hops.dropout, _dropout_args(view))


def _elementwise_draws(view: OpView, fn: Any, args: tuple[Any, ...]) -> list[Strategy]:
    """The replicated strategy and every sharding of ``... -> ...`` (Partial passing), each
    calling ``fn(x, *args)`` with the module's stream, this node's name as the op, the whole
    result's shape and where this device's slice starts."""
    shape = tuple(view.out.shape)
    out = []
    for s in [_replicated(view), *view.annotate("... -> ...", linear="each")]:
        kwargs = (("stream", RNG), ("op", view.node.name), ("starts", _starts(s, len(shape))), ("full_shape", shape))
        out.append(dataclasses.replace(s, local=LocalCall(fn, (Operand(0), *args), kwargs)))
    return out


def with_attention_dropout(view: OpView, strategies: list[Strategy]) -> list[Strategy]:
    """SDPA strategies whose local call is :func:`hapc.ops.scaled_dot_product_attention`: the
    dropout on the probabilities ``[..., Tq, Tk]`` draws by global index (those lead and query
    dims are the result's, the key dim never shards)."""
    args = [Operand(i) for i in range(3)]
    mask = view.arg(3, "attn_mask")
    args.append(Operand(3) if view.num_operands == 4 and mask is not None else None)
    lead = tuple(view.out.shape[:-1])
    shape = (*lead, view.operands[1].shape[-2])
    fixed = {
        "dropout_p": float(view.arg(4, "dropout_p", 0.0)),
        "is_causal": bool(view.arg(5, "is_causal", False)),
        "scale": view.arg(6, "scale"),
        "enable_gqa": bool(view.arg(7, "enable_gqa", False)),
    }
    out = []
    for s in [_replicated(view), *strategies]:
        extra = {"stream": RNG, "op": view.node.name, "starts": (*_starts(s, len(lead)), 0), "full_shape": shape}
        call = LocalCall(hops.scaled_dot_product_attention, tuple(args), tuple({**fixed, **extra}.items()))
        out.append(dataclasses.replace(s, local=call))
    return out


#: leaf functions that drop whole samples (fx leaves: torchvision's ``torch.fx.wrap``, timm's by
#: :mod:`hapc.theory.trace` when timm is loaded): op name -> the position and keyword of p
SAMPLE_DROPS: dict[str, tuple[int, str]] = {
    "torchvision.ops.stochastic_depth.stochastic_depth": (1, "p"),
    "timm.layers.drop.drop_path": (1, "drop_prob"),
    "hapc.ops.drop_path": (1, "drop_prob"),  # Hugging Face's *DropPath modules (hapc.theory.normalize)
}


def sample_drop_p(n: RefNode) -> float:
    """The drop probability of a stochastic-depth node (whatever its training flag), else 0."""
    spec = SAMPLE_DROPS.get(n.op)
    if spec is None:
        return 0.0
    pos, name = spec[0], spec[1]
    return float(n.kwargs.get(name, n.args[pos] if len(n.args) > pos else 0.0))


@rule(
    "torchvision.ops.stochastic_depth.stochastic_depth",
    doc="every dim shards; Partial -> Partial (a fixed mask is linear); one draw per global sample",
)
def _stochastic_depth(view: OpView):
    """``torchvision.ops.stochastic_depth(x, p, mode, training)``: :func:`hapc.ops.stochastic_depth`
    on every strategy (p = 0 or training=False: the identity)."""
    args = (float(view.arg(1, "p")), view.arg(2, "mode"), bool(view.arg(3, "training", True)))
    return _elementwise_draws(view, hops.stochastic_depth, args)


@rule(
    ["timm.layers.drop.drop_path", "hapc.ops.drop_path"],  # the second: Hugging Face's *DropPath modules
    doc="every dim shards; Partial -> Partial; one draw per global sample",
)
def _drop_path(view: OpView):
    """timm's ``drop_path(x, drop_prob, training, scale_by_keep)``: :func:`hapc.ops.drop_path`;
    Hugging Face's ``*DropPath`` modules are normalised to the same call."""
    args = (
        float(view.arg(1, "drop_prob", 0.0)),
        bool(view.arg(2, "training", False)),
        bool(view.arg(3, "scale_by_keep", True)),
    )
    return _elementwise_draws(view, hops.drop_path, args)
