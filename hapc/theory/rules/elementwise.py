"""Element-wise ops: every dimension of the result may shard; broadcasting operands follow.

``"..., ... -> ..."`` aligns operands from the right like broadcasting; an operand whose dim is 1
(or absent) stays ``Replicated`` while the others shard. Partial passes through ops linear in an
operand: sums and differences (jointly), products (one factor at a time), casts and copies.
"""

from __future__ import annotations

import numbers

from ..props import PARTIAL, REPLICATED
from ..registry import OpView
from ..strategy import Strategy
from . import labels, op, rule

# unary, not linear: the result's dims shard like the input's
op(
    [
        "relu",
        "gelu",
        "silu",
        "mish",
        "tanh",
        "sigmoid",
        "exp",
        "log",
        "log1p",
        "sqrt",
        "rsqrt",
        "abs",
        "erf",
        "sin",
        "cos",
        "softplus",
        "leaky_relu",
        "elu",
        "hardtanh",
        "hardswish",
        "square",
        "reciprocal",
        "sign",
        "floor",
        "ceil",
        "round",
        "logical_not",
        "isnan",
        "isinf",
        "clamp",
        "clamp_min",
        "clamp_max",
        "relu6",
        "selu",
        "celu",
        "logsigmoid",
        "softsign",
        "tanhshrink",
        "bitwise_not",
        "long",
        "int",
        "bool",
        "short",
        "byte",
        "char",
        "trunc",
        "frac",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "atan",
        "tan",
        "expm1",
        "exp2",
        "log2",
        "log10",
        "sgn",
        "nan_to_num",
        "hardsigmoid",
        "hardshrink",
        "softshrink",
        "threshold",
        "erfinv",
        "erfc",
        "lgamma",
        "digamma",
        "logit",
        "sinc",
        "asinh",
        "acosh",
        "atanh",
        "deg2rad",
        "rad2deg",
    ],
    "... -> ...",
    doc="every dim shards; Partial does not pass (not linear)",
)
# unary and linear: copies, casts and negation also pass Partial through
op(
    [
        "neg",
        "contiguous",
        "clone",
        "detach",
        "to",
        "float",
        "double",
        "half",
        "bfloat16",
        "type",
        "zeros_like",
        "positive",
        "conj",
        "alias",
    ],
    "... -> ...",
    linear="each",
    doc="every dim shards; linear: Partial -> Partial",
)


@rule("type_as", doc="x's dims shard (the other operand gives only a dtype); linear in x")
def _type_as(view: OpView):
    """``x.type_as(y)``: ``x`` cast to ``y``'s dtype; ``y``'s values are never read. Same shapes (the
    usual ``out.type_as(x)``): both in one layout; otherwise ``y`` whole. Gemma's RMSNorm and
    RoBERTa's position ids call it: without a rule they ran replicated, and data parallelism
    could not be priced."""
    x, y = view.operands[0], view.operands[1]
    xs = " ".join(labels(x.rank))
    ys = xs if y.shape == x.shape else " ".join(f"y{k}^" for k in range(y.rank))
    return view.annotate(f"{xs}, {ys} -> {xs}", linear=[(0,)])


def broadcast_spec(view: OpView) -> str:
    """``"..., ... -> ..."`` with one ``...`` per tensor operand (scalars are not operands)."""
    return ", ".join(["..."] * view.num_operands) + " -> ..."


@rule(
    [
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_and",
        "logical_or",
        "logical_xor",
        "maximum",
        "minimum",
        "fmax",
        "fmin",
        "floor_divide",
        "remainder",
        "atan2",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "hypot",
        "xlogy",
        "copysign",
        "logaddexp",
        "logaddexp2",
        "fmod",
    ],
    doc="broadcast element-wise; not linear",
)
def _compare(view: OpView):
    """Comparisons and logic: ``x > 0``, ``torch.maximum(a, b)``."""
    return view.annotate(broadcast_spec(view))


def _scalars(view: OpView) -> list[object]:
    return [a for a in view.node.args if isinstance(a, numbers.Number) and not isinstance(a, bool)]


@rule(["add", "sub", "rsub"], doc="broadcast element-wise; Partial + Partial -> Partial (no nonzero scalar)")
def _additive(view: OpView):
    """Sums shard like any element-wise op; they are jointly linear only without a scalar term
    (``x + 1`` on Partial x would add 1 on every device)."""
    n = view.num_operands
    strategies = view.annotate(broadcast_spec(view))
    if all(s == 0 for s in _scalars(view)):
        strategies.append(Strategy(tuple(PARTIAL for _ in range(n)), PARTIAL, scaled=False, name="linear"))
    return strategies


@rule("mul", doc="broadcast element-wise; linear in each factor")
def _mul(view: OpView):
    """``x * y`` or ``x * 2``: one tensor operand or two, multilinear either way."""
    return view.annotate(broadcast_spec(view), linear="each")


@rule("div", doc="broadcast element-wise; linear in the numerator")
def _div(view: OpView):
    """``x / y`` is linear in ``x`` only -- unless ``x`` is a scalar (``2 / y``)."""
    numerator_is_tensor = _is_tensor_arg(view, 0)
    linear = [(0,)] if numerator_is_tensor else None
    return view.annotate(broadcast_spec(view), linear=linear)


@rule(["pow", "float_power"], doc="broadcast element-wise; not linear")
def _pow(view: OpView):
    """``x ** 2``, ``2 ** x`` or ``x ** y``."""
    return view.annotate(broadcast_spec(view))


@rule("where", doc="broadcast element-wise; linear jointly in the two branches")
def _where(view: OpView):
    """``where(c, a, b)``: a sum of masked branches, so Partial a and b give Partial (a scalar
    branch must be 0)."""
    n = view.num_operands
    strategies = view.annotate(broadcast_spec(view))
    branches = [i for i in range(1, n)]
    scalar_ok = all(s == 0 for s in _scalars(view))
    if _is_tensor_arg(view, 0) and branches and scalar_ok:
        ins = tuple(PARTIAL if i in branches else REPLICATED for i in range(n))
        strategies.append(Strategy(ins, PARTIAL, scaled=False, name="linear"))
    return strategies


@rule("masked_fill", doc="broadcast element-wise; linear in the input when the fill value is 0")
def _masked_fill(view: OpView):
    """``x.masked_fill(mask, v)``: zeroing commutes with the sum over devices, other values do not."""
    n = view.num_operands
    value = view.arg(2, "value")
    return view.annotate(broadcast_spec(view), linear=[(0,)] if value == 0 and n == 2 else None)


def _is_tensor_arg(view: OpView, position: int) -> bool:
    from ..graph import Ref

    return position < len(view.node.args) and isinstance(view.node.args[position], Ref)


@rule("lerp", doc="broadcast element-wise; jointly linear in start and end")
def _lerp(view: OpView):
    """``torch.lerp(a, b, w)`` = ``a + w * (b - a)``: for a fixed weight, linear in (a, b) together."""
    strategies = view.annotate(broadcast_spec(view))
    if _is_tensor_arg(view, 0) and _is_tensor_arg(view, 1):
        n = view.num_operands
        ins = tuple(PARTIAL if i < 2 else REPLICATED for i in range(n))
        strategies.append(Strategy(ins, PARTIAL, scaled=False, name="linear"))
    return strategies


@rule(["addcmul", "addcdiv"], doc="broadcast element-wise; jointly linear in the input and the first factor")
def _addc(view: OpView):
    """``torch.addcmul(x, t1, t2, value=v)`` = ``x + v * t1 * t2`` (``addcdiv``: ``t1 / t2``): linear in
    (x, t1) together, and for ``addcmul`` in (x, t2) together."""
    linear = [(0, 1), (0, 2)] if view.node.op == "addcmul" else [(0, 1)]
    return view.annotate(broadcast_spec(view), linear=linear if view.num_operands == 3 else None)
