"""One small model per built-in op (and per spelling where the rule differs), for soundness tests.

Each :class:`Case` builds ``(model, inputs)`` from three sizes ``a, b, c`` (1..7, odd and prime
included), in float64. The model's forward applies the op and reduces the result to a scalar
loss; the test checks every triple of every node of the traced graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hapc
import hapc.ops as hops
from hapc.theory.opnames import qualified_name
from hapc.theory.registry import default_registry
from hapc.theory.rules.moe import GROUPED_MM

D = torch.float64


class OpModel(nn.Module):
    def __init__(self, fn: Callable, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None):
        super().__init__()
        for k, v in params.items():
            if isinstance(v, nn.Module):
                self.add_module(k, v)
            else:
                self.register_parameter(k, nn.Parameter(v))
        for k, v in (buffers or {}).items():
            self.register_buffer(k, v)
        self.fn = fn

    def forward(self, x, y=None, z=None):
        return self.fn(self, x, y, z).to(torch.float64).sum()


@dataclass
class Case:
    name: str
    fn: Callable
    make: Callable  # (a, b, c, gen) -> (params, inputs[, buffers])

    def build(self, a: int, b: int, c: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        made = self.make(a, b, c, gen)
        params, inputs = made[0], made[1]
        buffers = made[2] if len(made) > 2 else None
        return OpModel(self.fn, params, buffers), inputs


def r(gen, *shape, positive=False):
    t = torch.randn(*shape, generator=gen, dtype=D)
    return t.abs() + 0.5 if positive else t


def ints(gen, hi, *shape):
    return torch.randint(0, hi, shape, generator=gen)


def w(gen, *shape):
    return {"w": r(gen, *shape)}


CASES: list[Case] = []


def case(name: str, make: Callable) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        CASES.append(Case(name, fn, make))
        return fn

    return deco


def unary(name: str, fn: Callable, positive: bool = False) -> None:
    CASES.append(Case(name, lambda m, x, y, z: fn(x), lambda a, b, c, g: ({}, (r(g, a, b + 1, positive=positive),))))


# -- element-wise -------------------------------------------------------------------------------
for _n in ["relu", "tanh", "sigmoid", "exp", "abs", "erf", "sin", "cos", "square", "sign", "floor", "ceil", "round"]:
    unary(_n, getattr(torch, _n))
for _n in ["log", "log1p", "sqrt", "rsqrt", "reciprocal"]:
    unary(_n, getattr(torch, _n), positive=True)
for _n in [
    "gelu",
    "silu",
    "mish",
    "softplus",
    "leaky_relu",
    "elu",
    "hardtanh",
    "hardswish",
    "relu6",
    "selu",
    "celu",
    "logsigmoid",
    "softsign",
    "tanhshrink",
]:
    unary(_n, getattr(F, _n))
for _n in ["erfinv", "erfc", "lgamma", "digamma", "logit", "sinc", "asinh", "atanh", "deg2rad", "rad2deg"]:
    unary(_n, (lambda f: lambda x: f(x.tanh() * 0.9))(getattr(torch, _n)))
unary("acosh", lambda x: torch.acosh(x.abs() + 1.5))
unary("glu", lambda x: F.glu(x.repeat(1, 2)) + F.glu(x.repeat(2, 1), dim=0).sum())
unary("unfold", lambda x: x.unfold(1, 2, 1).sum() + x.unfold(0, 1, 1).sum())
unary("unfold-im2col", lambda x: F.unfold(x.reshape(1, 1, *x.shape).expand(2, 3, -1, -1), 1).sum())
unary("clamp", lambda x: x.clamp(-0.5, 0.5))
unary("clamp_min", lambda x: torch.clamp_min(x, 0.1))
unary("clamp_max", lambda x: torch.clamp_max(x, 0.1))
unary("dropout-eval", lambda x: F.dropout(x, 0.3, training=False))


def _library_drops(a, b, c, gen):
    """torchvision's StochasticDepth and timm's DropPath (fx leaves with rank-consistent rules:
    hapc.theory.rules.random), in eval mode as dropout's case is: the identity."""
    from realworld import import_torchvision

    tv = import_torchvision()
    import timm.layers.drop  # loaded before the trace: hapc keeps its drop_path whole then

    mods = {"sd": tv.ops.StochasticDepth(0.3, "row").eval(), "dp": timm.layers.drop.DropPath(0.3).eval()}
    return mods, (r(gen, a, b, c),)


CASES.append(Case("stochastic_depth-eval", lambda m, x, y, z: m.dp(m.sd(x)) * x, _library_drops))
unary("isnan", lambda x: torch.isnan(x))
unary("isinf", lambda x: torch.isinf(x))
unary("logical_not", lambda x: torch.logical_not(x > 0))
unary("bitwise_not", lambda x: torch.bitwise_not((x > 0).long()))
unary("neg", lambda x: -x)
unary("contiguous", lambda x: x.t().contiguous() * 2)
unary("clone", lambda x: x.clone())
unary("detach", lambda x: x.detach() * x)
unary("to", lambda x: x.to(torch.float32))
unary("float", lambda x: x.float())
unary("double", lambda x: x.float().double())
unary("half", lambda x: x.half())
unary("type", lambda x: x.type(torch.float32))
unary("zeros_like", lambda x: torch.zeros_like(x) + x)
# y of x's shape (one layout for both; Gemma's RMSNorm), and of another shape (y whole)
unary("type_as", lambda x: x.float().type_as(x) * 2 + x.type_as(x[0]).sum(0))
unary("positive", lambda x: torch.positive(x))
unary("ones_like", lambda x: torch.ones_like(x) * x)
unary("full_like", lambda x: torch.full_like(x, 2.0) * x)


def _bin(a, b, c, g):
    return {}, (r(g, a, b + 1), r(g, b + 1), r(g, a, 1, positive=True))


for _n in ["eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "fmax", "fmin", "atan2"]:
    CASES.append(Case(_n, (lambda f: lambda m, x, y, z: f(x, y))(getattr(torch, _n)), _bin))
for _n in ["hypot", "xlogy", "copysign", "logaddexp", "logaddexp2", "fmod"]:
    CASES.append(Case(_n, (lambda f: lambda m, x, y, z: f(x, z))(getattr(torch, _n)), _bin))
case("lerp", _bin)(lambda m, x, y, z: torch.lerp(x, y, 0.3) + torch.lerp(x, z, y.sigmoid()))
case("addcmul", _bin)(lambda m, x, y, z: torch.addcmul(x, y, z, value=0.5) + torch.addcdiv(x, z, z + 2.0, value=2.0))
case("floor_divide", _bin)(lambda m, x, y, z: torch.floor_divide(x, z))
case("remainder", _bin)(lambda m, x, y, z: torch.remainder(x, z))
case("logical_and", _bin)(lambda m, x, y, z: torch.logical_and(x > 0, y > 0) | torch.logical_xor(x > 0, z > 1))
case("bitwise", _bin)(lambda m, x, y, z: ((x > 0).long() & (y > 0).long()) ^ ((z > 1).long() | (x > 1).long()))
case("add", _bin)(lambda m, x, y, z: x + y + z)
case("add-scalar", _bin)(lambda m, x, y, z: (x + 1.5) + torch.add(y, 0.0))
case("sub", _bin)(lambda m, x, y, z: x - y - 2.0)
case("rsub", _bin)(lambda m, x, y, z: torch.rsub(x, y) + (1.0 - z))
case("mul", _bin)(lambda m, x, y, z: x * y * z * 3.0)
case("div", _bin)(lambda m, x, y, z: x / z / 2.0 + 2.0 / z)
case("pow", _bin)(lambda m, x, y, z: x**2 + 2.0**y + z**z)
case("where", _bin)(lambda m, x, y, z: torch.where(x > 0, x, y) + torch.where(z > 1, z, 0.0))
case("masked_fill", _bin)(lambda m, x, y, z: x.masked_fill(z > 1, 0.0) + x.masked_fill(y > 0, -1.0))

# -- contractions ---------------------------------------------------------------------------------
case("linear", lambda a, b, c, g: ({"w": r(g, c + 1, b + 1), "b": r(g, c + 1)}, (r(g, a, 2, b + 1),)))(
    lambda m, x, y, z: F.linear(x, m.w) + F.linear(x, m.w, m.b)
)
case("matmul", lambda a, b, c, g: ({}, (r(g, a, b, c), r(g, c, b), r(g, c))))(
    lambda m, x, y, z: (
        (x @ y).sum() + (z @ z) + (x @ z).sum() + (z @ y).sum() + torch.matmul(x, y.expand(x.shape[0], -1, -1)).sum()
    )
)
case("mm", lambda a, b, c, g: ({"w": r(g, b + 1, c)}, (r(g, a, b + 1),)))(lambda m, x, y, z: torch.mm(x, m.w))
case("bmm", lambda a, b, c, g: ({}, (r(g, a, b, c), r(g, a, c, b + 1))))(lambda m, x, y, z: torch.bmm(x, y))
case("einsum", lambda a, b, c, g: ({"w": r(g, c, b)}, (r(g, a, b, c), r(g, a, b))))(
    lambda m, x, y, z: (
        torch.einsum("abc,cd->abd", x, m.w).sum()
        + torch.einsum("ab,ab->", y, y)
        + torch.einsum("...c,cb", x, m.w).sum()
    )
)

case("mv", lambda a, b, c, g: ({"w": r(g, a, b + 1)}, (r(g, b + 1), r(g, c), r(g, a))))(
    lambda m, x, y, z: torch.mv(m.w, x).sum() + torch.dot(x, x) + torch.outer(z, y).sum() + torch.ger(y, y).sum()
)


def _affine(a, b, c, g):
    n, k, o = a + 1, b + 1, c
    params = {"w": r(g, k, o), "b": r(g, o), "bb": r(g, a, n, o), "row": r(g, n, 1), "v": r(g, n)}
    return params, (r(g, n, k), r(g, a, n, k), r(g, a, k, o))


case("addmm", _affine)(
    lambda m, x, y, z: (
        torch.addmm(m.b, x, m.w).sum()  # GPT-2's Conv1D: a bias row
        + torch.addmm(m.row, x, m.w, beta=0.5, alpha=2.0).sum()  # a bias column
        + torch.addmm(m.bb[0], x, m.w).sum()  # a whole bias
        + torch.addmm(m.b[0], x, m.w).sum()  # a 0-d bias
        + torch.baddbmm(m.bb, y, z).sum()
        + torch.baddbmm(m.b, y, z, alpha=0.5).sum()
        + torch.addbmm(m.b, y, z).sum()
        + torch.addmv(m.v, x, m.w[:, 0]).sum()
        + torch.addr(m.bb[0], m.v, m.b).sum()
    )
)


def _attn(a, b, c, g):
    h, s, e = b, c + 1, 3
    return {}, (r(g, a, h, s, e), r(g, a, h, s + 1, e), r(g, a, h, s + 1, e + 1))


case("sdpa", _attn)(lambda m, x, y, z: F.scaled_dot_product_attention(x, y, z))
case("sdpa-causal", lambda a, b, c, g: ({}, (r(g, a, b, c + 1, 3), r(g, a, b, c + 1, 3), r(g, a, b, c + 1, 2))))(
    lambda m, x, y, z: F.scaled_dot_product_attention(x, y, z, is_causal=True)
)
case(
    "sdpa-mask",
    lambda a, b, c, g: ({}, (r(g, a, b, c + 1, 3), r(g, a, b, c + 2, 3), torch.rand(c + 1, c + 2, generator=g) > 0.3)),
)(lambda m, x, y, z: F.scaled_dot_product_attention(x, y, y, attn_mask=z | torch.ones(1, dtype=torch.bool)))
case("sdpa-gqa", lambda a, b, c, g: ({}, (r(g, a, 2 * b, c + 1, 3), r(g, a, b, c + 1, 3), r(g, a, b, c + 1, 2))))(
    lambda m, x, y, z: F.scaled_dot_product_attention(x, y, z, enable_gqa=True)
)
case("conv1d", lambda a, b, c, g: ({"w": r(g, c + 1, b, 3), "b": r(g, c + 1)}, (r(g, a, b, 7),)))(
    lambda m, x, y, z: F.conv1d(x, m.w, padding=1).sum() + F.conv1d(x, m.w, m.b).sum()
)
case("conv2d", lambda a, b, c, g: ({"w": r(g, 2 * c, 2 * b, 3, 3), "b": r(g, 2 * c)}, (r(g, a, 2 * b, 5, 6),)))(
    lambda m, x, y, z: (
        F.conv2d(x, m.w, stride=2).sum()
        + F.conv2d(x, m.w.narrow(1, 0, x.shape[1] // 2), groups=2).sum()
        + F.conv2d(x, m.w, m.b).sum()
    )
)
case("conv3d", lambda a, b, c, g: ({"w": r(g, c, b, 2, 2, 2)}, (r(g, a, b, 3, 4, 3),)))(
    lambda m, x, y, z: F.conv3d(x, m.w)
)
for _n, _k in [
    ("max_pool1d", 1),
    ("avg_pool1d", 1),
    ("max_pool2d", 2),
    ("avg_pool2d", 2),
    ("max_pool3d", 3),
    ("avg_pool3d", 3),
]:
    CASES.append(
        Case(
            _n,
            (lambda f: lambda m, x, y, z: f(x, 2))(getattr(F, _n)),
            (lambda k: lambda a, b, c, g: ({}, (r(g, a, b, *([5] * k)),)))(_k),
        )
    )
for _n, _k in [
    ("adaptive_avg_pool1d", 1),
    ("adaptive_avg_pool2d", 2),
    ("adaptive_avg_pool3d", 3),
    ("adaptive_max_pool1d", 1),
    ("adaptive_max_pool2d", 2),
]:
    CASES.append(
        Case(
            _n,
            (lambda f: lambda m, x, y, z: f(x, 2))(getattr(F, _n)),
            (lambda k: lambda a, b, c, g: ({}, (r(g, a, b, *([5] * k)),)))(_k),
        )
    )
case("interpolate", lambda a, b, c, g: ({}, (r(g, a, b, 3, 4),)))(
    lambda m, x, y, z: (
        (
            F.interpolate(x, scale_factor=2)
            + F.interpolate(x, size=(6, 8), mode="bilinear", align_corners=False)
            + F.interpolate(x, size=(6, 8), mode="bicubic", align_corners=True)
        ).sum()
        + F.interpolate(x.flatten(2), size=5, mode="linear").sum()
        + F.interpolate(x.unsqueeze(2), scale_factor=(2, 1, 2), mode="trilinear").sum()
        + F.interpolate(x, size=(2, 3), mode="area", antialias=False).sum()
    )
)

# -- reductions and normalisation --------------------------------------------------------------------
_3d = lambda a, b, c, g: ({}, (r(g, a, b + 1, c),))  # noqa: E731
case("sum", _3d)(
    lambda m, x, y, z: x.sum(1).sum() + x.sum((0, 2), keepdim=True).sum() + torch.sum(x) + torch.nansum(x, -1).sum()
)
case("mean", _3d)(lambda m, x, y, z: x.mean(1).sum() + x.mean((0, 2), keepdim=True).sum() + torch.mean(x))
case("amax", _3d)(
    lambda m, x, y, z: x.amax(1) + x.amin(-1, keepdim=True).sum() + x.prod(0).sum() + x.logsumexp(1).sum()
)
case("std", _3d)(lambda m, x, y, z: x.std(1) + x.var(2).sum() + x.norm(dim=1) + x.norm())
case("vector_norm", _3d)(
    lambda m, x, y, z: (
        torch.linalg.vector_norm(x, 2, 1)
        + torch.linalg.vector_norm(x, 3, (0, 2), True).sum()
        + torch.linalg.vector_norm(x, dim=-1, keepdim=True).sum()
        + torch.linalg.vector_norm(x)
    )
)
case("argmax", _3d)(
    lambda m, x, y, z: (
        x.argmax(1)
        + x.argmin(0).sum()
        + (x > 0).all(1).sum()
        + (x > 0).any(2).sum()
        + torch.count_nonzero(x > 0, dim=1)
    )
)
case("max", _3d)(
    lambda m, x, y, z: x.max(1)[0] + x.max(2)[1].sum() + x.min(0).values.sum() + x.max() + torch.max(x, x * 2).sum()
)
case("softmax", _3d)(lambda m, x, y, z: x.softmax(-1) + F.log_softmax(x, 1) + x.cumprod(1) + x.logcumsumexp(0))
case("sort", _3d)(lambda m, x, y, z: x.sort(1)[0] + x.argsort(-1) + F.normalize(x, dim=1))
case("cumsum", _3d)(lambda m, x, y, z: x.cumsum(1))
case("topk", _3d)(lambda m, x, y, z: x.topk(1, dim=1)[0].sum() + x.topk(1, dim=-1)[1].sum())
case("layer_norm", lambda a, b, c, g: ({"w": r(g, c + 1), "b": r(g, c + 1)}, (r(g, a, b + 1, c + 1),)))(
    lambda m, x, y, z: (
        F.layer_norm(x, (x.shape[-1],), m.w, m.b) + F.layer_norm(x, x.shape[1:]) + F.rms_norm(x, (x.shape[-1],), m.w)
    )
)
case("group_norm", lambda a, b, c, g: ({"w": r(g, 2 * b), "b": r(g, 2 * b)}, (r(g, a, 2 * b, c + 1),)))(
    lambda m, x, y, z: F.group_norm(x, 2, m.w, m.b)
)


def _bn(a, b, c, g):
    return (
        {"w": r(g, b + 1), "b": r(g, b + 1)},
        (r(g, a + 1, b + 1, c + 1),),
        {"rm": torch.zeros(b + 1, dtype=D), "rv": torch.ones(b + 1, dtype=D)},
    )


case("batch_norm-train", _bn)(lambda m, x, y, z: F.batch_norm(x, m.rm, m.rv, m.w, m.b, True, 0.1, 1e-5))
case("batch_norm-eval", _bn)(lambda m, x, y, z: F.batch_norm(x, m.rm, m.rv, m.w, m.b, False))
case("batch_norm-noaffine", _bn)(lambda m, x, y, z: F.batch_norm(x, None, None, training=True))

# -- shapes ---------------------------------------------------------------------------------------
_4d = lambda a, b, c, g: ({}, (r(g, a, b, c, 2),))  # noqa: E731
case("view", _4d)(lambda m, x, y, z: x.view(x.shape[0], -1).view(x.shape[0], x.shape[1], -1, 1))
case("reshape", _4d)(
    lambda m, x, y, z: x.reshape(-1, 2).reshape(x.shape[0] * x.shape[1], x.shape[2] * 2).reshape(x.shape)
)
case("flatten", _4d)(lambda m, x, y, z: x.flatten(1).unflatten(1, (x.shape[1], -1)).flatten().ravel())
case("squeeze", _4d)(lambda m, x, y, z: x.unsqueeze(1).unsqueeze(-1).squeeze(1).squeeze(-1))
case("view_as", _4d)(lambda m, x, y, z: x.view_as(x * 2).reshape_as(x))
case("transpose", _4d)(lambda m, x, y, z: x.transpose(1, 2).permute(3, 0, 2, 1).movedim(0, 2))
case("t", lambda a, b, c, g: ({}, (r(g, a, b),)))(lambda m, x, y, z: x.t() @ x)
case("getitem", _4d)(
    lambda m, x, y, z: x[:, 0].sum() + x[:, :1].sum() + x[None, ..., 0].sum() + x[..., None].sum() + x[0, :, 1:].sum()
)
case("narrow", _4d)(
    lambda m, x, y, z: (
        x.narrow(3, 0, 1).sum()
        + x.select(1, 0).sum()
        + sum(t.sum() for t in x.chunk(2, dim=3))
        + sum(t.sum() for t in x.unbind(-1))
        + x.chunk(2, 3)[1].sum()
        + x.split([1, 1], -1)[1].sum()
    )
)
case("cat", _4d)(
    lambda m, x, y, z: torch.cat([x, x * 2], 1).sum() + torch.stack([x, x], 2).sum() + torch.stack([x, x], -1).sum()
)
case("expand", lambda a, b, c, g: ({}, (r(g, a, 1, c), r(g, a, b, c))))(
    lambda m, x, y, z: x.expand(-1, y.shape[1], -1) + x.expand_as(y) + torch.broadcast_to(x, y.shape)
)
case("tril", _3d)(lambda m, x, y, z: x.tril() + x.triu(1))
case("flip", _3d)(lambda m, x, y, z: x.flip(1) + x.roll(1, 2))
case("pad", _3d)(lambda m, x, y, z: F.pad(x, (1, 1)).sum() + F.pad(x, (0, 0, 1, 0), value=1.0).sum())
case("cummax", _3d)(lambda m, x, y, z: x.cummax(1)[0] + x.cummin(2).indices + x.cummin(0).values)
case("histc", _3d)(lambda m, x, y, z: torch.histc(x, bins=4, min=-1.0, max=1.0) + torch.histc(x * 2, 3).sum())


def _perm(gen, n, *lead):
    """Distinct indices along the last dim (a scatter that writes each place once)."""
    return torch.rand(*lead, n, generator=gen).argsort(-1)


def _indexing(a, b, c, g):
    """x [a, b+1, c] with index buffers for dims 0, 1 and 2."""
    x = r(g, a, b + 1, c)
    buffers = {
        "i0": ints(g, a, 4),  # rows of x, repeats allowed
        "i1": ints(g, b + 1, a, min(3, b + 1), c),  # gather / scatter along dim 1, other dims as in x
        "i2": ints(g, c, a, 1, min(2, c)),  # along dim 2, dim 1 narrower than x's
        "p1": _perm(g, b + 1, a, c).transpose(1, 2).contiguous(),  # a permutation along dim 1
        "u0": torch.randperm(a, generator=g)[: max(1, a - 1)],  # distinct rows
        "reps": torch.arange(b + 1) % 3,  # repeats 0, 1, 2, 0...
    }
    return {}, (x, r(g, 4, b + 1, c), r(g, a, b + 1, c)), buffers


case("index_select", _indexing)(
    lambda m, x, y, z: (
        x.index_select(1, m.i0 % x.shape[1]).sum()
        + torch.index_select(x, 0, m.i0).sum()
        + x.index_select(2, m.i0[0] % x.shape[2]).sum()
    )
)
case("gather", _indexing)(lambda m, x, y, z: x.gather(1, m.i1).sum() + torch.gather(x, 2, m.i2).sum())
case("scatter", _indexing)(
    lambda m, x, y, z: (
        x.scatter(1, m.p1, z).sum()
        + x.scatter(1, m.p1, 0.0).sum()
        + x.scatter(1, m.p1[:, :1], 2.0).sum()
        + x.scatter_add(1, m.i1, z).sum()
        + x.scatter_add(1, m.i1, z[:, :3]).sum()
        + torch.scatter_add(x, 2, m.i2, z).sum()
        + x.scatter_reduce(1, m.i1, z, "sum").sum()
        + x.scatter_reduce(1, m.i1, z, "mean", include_self=False).sum()
        + x.scatter_reduce(1, m.i1, z, "amax").sum()
        + x.scatter(1, m.i1, z, reduce="add").sum()
    )
)
case("index_add", _indexing)(
    lambda m, x, y, z: (
        x.index_add(0, m.i0, y[:, :1].expand(-1, -1, x.shape[2]) * 0 + z[:1].expand(4, -1, -1)).sum()
        + x.index_add(1, m.i0 % x.shape[1], z[:, :1].expand(-1, 4, -1), alpha=0.5).sum()
        + x.index_copy(0, m.u0, z[: m.u0.shape[0]]).sum()
        + x.index_fill(1, m.i0 % x.shape[1], 0.0).sum()
        + x.index_fill(2, m.i0[:1] % x.shape[2], -1.0).sum()
    )
)
case("index_put", _indexing)(
    lambda m, x, y, z: (
        torch.index_put(x, (m.u0,), z[: m.u0.shape[0]]).sum()
        + x.index_put((m.i0,), z[:1, :, :1], accumulate=True).sum()
        + x.index_put((m.u0, m.u0 % x.shape[1]), z[0, 0]).sum()
    )
)
case("getitem-index", _indexing)(
    lambda m, x, y, z: x[m.i0].sum() + x[:, m.i1[0, :2, 0]].sum() + x[..., m.i0 % x.shape[2]].sum()
)
case("repeat_interleave", _indexing)(
    lambda m, x, y, z: (
        x.repeat_interleave(2, dim=1).sum()
        + x[0, 0].repeat_interleave(3).sum()
        + torch.repeat_interleave(x, m.reps, dim=1, output_size=sum(k % 3 for k in range(x.shape[1]))).sum()
        + x.repeat_interleave(torch.tensor(2), dim=-1, output_size=2 * x.shape[-1]).sum()
    )
)
case("repeat", _3d)(lambda m, x, y, z: x.repeat(1, 2, 1).sum() + x.repeat(2, 1, 1, 1).sum() + torch.tile(x, (2,)).sum())
case("diff", _3d)(
    lambda m, x, y, z: torch.diff(x, dim=1).sum() + torch.diff(x, n=2, dim=-1, prepend=x[..., :1], append=x[..., -1:])
)
case("one_hot", _indexing)(
    lambda m, x, y, z: F.one_hot((x > 0).long(), 2).sum() + F.one_hot((z * 3).long().clamp(0, 2), 3)
)
case("new_zeros", _3d)(
    lambda m, x, y, z: (
        (x.new_zeros(x.shape) + x).sum()
        + x.new_zeros((3, x.shape[0])).sum()
        + (x.new_ones(x.shape[1:]) * x).sum()
        + x.new_full((x.shape[0], 2), 2.0).sum()
        + (x.new_full(x.shape, 0.0, dtype=torch.float64) + x).sum()
    )
)
case("constants", _3d)(lambda m, x, y, z: x * torch.arange(x.shape[2], dtype=D) + torch.ones(x.shape, dtype=D).tril())


# -- losses, embedding, MoE ---------------------------------------------------------------------
def _cls(a, b, c, g):
    return (
        {},
        (r(g, a, c + 1), ints(g, c + 1, a), r(g, a, c + 1, b).softmax(1)),
        {"cw": r(g, c + 1, positive=True)},
    )


case("cross_entropy", _cls)(
    lambda m, x, y, z: (
        F.cross_entropy(x, y) + F.cross_entropy(x, y, reduction="sum") + F.cross_entropy(x, y, reduction="none").sum()
    )
)
case("cross_entropy-weighted", _cls)(
    lambda m, x, y, z: F.cross_entropy(x, y, weight=m.cw) + F.cross_entropy(x, y, weight=m.cw, label_smoothing=0.1)
)
case("cross_entropy-smoothing", _cls)(
    lambda m, x, y, z: F.cross_entropy(x, torch.cat([y[:1] * 0 + 1, y[1:]]), label_smoothing=0.2, ignore_index=0)
)
case("cross_entropy-probs", _cls)(lambda m, x, y, z: F.cross_entropy(x.unsqueeze(-1).expand(-1, -1, z.shape[2]), z))
case("nll_loss", _cls)(lambda m, x, y, z: F.nll_loss(x.log_softmax(1), y) + F.nll_loss(x, y, reduction="sum"))
case("mse_loss", _bin)(
    lambda m, x, y, z: (
        F.mse_loss(x, y.expand_as(x))
        + F.l1_loss(x, x * 2, reduction="sum")
        + F.smooth_l1_loss(x, x * 3)
        + F.huber_loss(x, x * 0.5, reduction="sum")
    )
)


def _ctc(a, b, c, g):
    """log-probabilities' logits (T, N=a, C=b+2), transcripts of 0..c labels padded with -100
    (S=c), input lengths in [2S+1, T] (every transcript fits: no infinite loss)."""
    classes, s = b + 2, c
    t = 2 * s + 3
    labels = ints(g, classes - 1, a, s) + 1
    keep = torch.arange(s)[None, :] < (torch.arange(a) % (s + 1))[:, None]
    labels = torch.where(keep, labels, torch.full_like(labels, -100))
    return {}, (r(g, t, a, classes), labels, torch.randint(2 * s + 1, t + 1, (a,), generator=g))


def _ctc_fn(m, x, y, z):
    if y.max() >= x.shape[-1]:  # transformers' check: a `checked` node
        raise ValueError("label out of range")
    lp, mask = x.log_softmax(-1), y >= 0
    lengths = mask.sum(-1)
    sel = y.masked_select(mask)
    return (
        F.ctc_loss(lp, sel, z, lengths, reduction="sum")
        + F.ctc_loss(lp, sel, z, lengths, blank=1, zero_infinity=True)  # mean: length_sum / N
        + F.ctc_loss(lp, sel, z, lengths, reduction="none").sum()
        + F.ctc_loss(lp, y.clamp_min(0), z, lengths, reduction="sum")  # padded targets, as torch takes them
    )


case("ctc_loss", _ctc)(_ctc_fn)
case("_weight_norm", lambda a, b, c, g: ({"g2": r(g, 1, 1, c + 1), "g0": r(g, a, 1, 1)}, (r(g, a, b + 1, c + 1),)))(
    lambda m, x, y, z: torch._weight_norm(x, m.g2, 2) + torch._weight_norm(x, m.g0, 0)
)


case("embedding", lambda a, b, c, g: ({"w": r(g, c + 2, b + 1)}, (ints(g, c + 2, a, 3),)))(
    lambda m, x, y, z: F.embedding(x, m.w) + F.embedding(x, m.w, padding_idx=1)
)


def _moe(a, b, c, g):
    experts, tokens, _k = c + 1, 2 * a + 1, 2
    params = {"w1": r(g, experts, b + 1, 3), "gate": r(g, b + 1, experts)}
    return params, (r(g, tokens, b + 1),)


def _moe_fn(m, x, y, z):
    logits = x @ m.gate
    weights, idx = logits.softmax(-1).topk(2, dim=-1)
    capacity = max(1, x.shape[0] // 2)
    buf = hops.moe_dispatch(x, idx, m.w1.shape[0], capacity)
    h = torch.einsum("ecm,emh->ech", buf, m.w1).relu()
    out = torch.einsum("ech,emh->ecm", h, m.w1)
    return hops.moe_combine(out, idx, weights, capacity)


case("moe", _moe)(_moe_fn)


@hapc.custom_op()
def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_fallback`` in plain torch: rows ``offs[g-1]:offs[g]`` times ``b[g]``,
    zeros past the last offset. The built-in rule for that op is aliased to it here, so the
    catalogue checks the rule without importing transformers (tests/test_rules_realworld.py checks
    it on the real op)."""
    if a.device.type == "meta":  # shape propagation
        return a.new_empty(a.shape[0], b.shape[2])
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    rows = [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))]
    rows.append(a.new_zeros(a.shape[0] - ends[-1], b.shape[2]))
    return torch.cat(rows)


default_registry.alias(GROUPED_MM[-1], qualified_name(grouped_mm_reference))


def _grouped(a, b, c, g):
    experts, rows = c + 1, 2 * a + 3
    cuts = torch.randint(0, rows, (experts,), generator=g).sort().values  # empty groups too
    cuts[-1] = rows - 1  # the last row, past the final offset, stays zero
    return {"w": r(g, experts, b + 1, 3)}, (r(g, rows, b + 1),), {"offs": cuts.to(torch.int32)}


case("grouped_mm", _grouped)(lambda m, x, y, z: grouped_mm_reference(x, m.w, m.offs))


def _mha(a, b, c, g):
    torch.manual_seed(a * 100 + b * 10 + c)
    return {"mha": nn.MultiheadAttention(4, 2, batch_first=True).double()}, (r(g, a + 1, c, 4),)


case("multi_head_attention", _mha)(lambda m, x, y, z: m.mha(x, x, x, need_weights=False)[0])
