"""Standard modules -> their functional form, so every rule is written once (DESIGN §3).

``nn.Linear`` becomes ``F.linear(x, weight)`` followed by ``hapc.ops.add_bias(y, bias)`` (an ``add``
to the rules; in ``y``'s dtype, as ``F.linear`` casts its bias under autocast): keeping the bias add
separate is what lets the theory express Megatron's row-parallel linear (the product is
``Partial``; the bias is added after the all-reduce). ``nn.Conv2d`` likewise. Dropout with ``p == 0`` or in eval
mode disappears. A module not in the table stays a leaf call and gets only the replicate
triple unless a rule is registered for its class. A table module whose functional form does not
cover its settings (``when=`` of :func:`normalises`: a ``padding_mode="reflect"`` convolution, an
embedding with ``max_norm``, batch norm's cumulative average) is traced through like any other
module: fx records what its own ``forward`` calls (``F.pad`` then the convolution), and the tracer
refuses what it cannot replay (``max_norm``'s in-place renormalisation of the weight).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

Normaliser = Callable[[fx.Graph, nn.Module, str, dict], fx.Node]
NORMALISERS: dict[type, Normaliser] = {}
#: module type -> whether its normaliser covers a given instance (absent: always)
APPLIES: dict[type, Callable[[nn.Module], bool]] = {}


def normalises(*types: type, when: Callable[[nn.Module], bool] | None = None) -> Callable[[Normaliser], Normaliser]:
    """Register the functional form of ``types``; ``when(m)``: whether it covers instance ``m``
    (otherwise ``m`` is traced through, its ``forward`` recorded op by op)."""

    def deco(fn: Normaliser) -> Normaliser:
        for t in types:
            NORMALISERS[t] = fn
            if when is not None:
                APPLIES[t] = when
        return fn

    return deco


def _attr(g: fx.Graph, qual: str, name: str) -> fx.Node:
    return g.get_attr(f"{qual}.{name}" if qual else name)


def _call(g: fx.Graph, fn: Callable, *args: object, **kwargs: object) -> fx.Node:
    return g.call_function(fn, args, kwargs)


def _add_bias(g: fx.Graph, y: fx.Node, m: nn.Module, qual: str, channel_dims: int = 0) -> fx.Node:
    if getattr(m, "bias", None) is None:
        return y
    b = _attr(g, qual, "bias")
    if channel_dims:
        b = g.call_method("view", (b, -1, *([1] * channel_dims)))
    from ..ops import add_bias  # in y's dtype, as F.linear's own bias under autocast

    return _call(g, add_bias, y, b)


@normalises(nn.Linear)
def _linear(g, m, qual, a):
    return _add_bias(g, _call(g, F.linear, a["input"], _attr(g, qual, "weight")), m, qual)


@normalises(nn.Conv1d, nn.Conv2d, nn.Conv3d, when=lambda m: m.padding_mode == "zeros")  # else F.pad first
def _conv(g, m, qual, a):
    fn = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[type(m)]
    y = _call(g, fn, a["input"], _attr(g, qual, "weight"), None, m.stride, m.padding, m.dilation, m.groups)
    return _add_bias(g, y, m, qual, channel_dims=len(m.kernel_size))


@normalises(nn.LayerNorm)
def _layer_norm(g, m, qual, a):
    w = _attr(g, qual, "weight") if m.weight is not None else None
    b = _attr(g, qual, "bias") if m.bias is not None else None
    return _call(g, F.layer_norm, a["input"], tuple(m.normalized_shape), w, b, m.eps)


if hasattr(nn, "RMSNorm"):

    @normalises(nn.RMSNorm)
    def _rms_norm(g, m, qual, a):
        w = _attr(g, qual, "weight") if m.weight is not None else None
        return _call(g, F.rms_norm, a["x"], tuple(m.normalized_shape), w, m.eps)


@normalises(nn.Embedding, when=lambda m: m.max_norm is None and not m.sparse)  # else refused (trace.py)
def _embedding(g, m, qual, a):
    w = _attr(g, qual, "weight")
    if m.scale_grad_by_freq:  # the gradient of each row divided by its count in the batch
        return _call(g, F.embedding, a["input"], w, m.padding_idx, scale_grad_by_freq=True)
    return _call(g, F.embedding, a["input"], w, m.padding_idx)


@normalises(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
def _dropout(g, m, qual, a):
    if m.p == 0 or not m.training:
        return a["input"]
    fn = {nn.Dropout1d: F.dropout1d, nn.Dropout2d: F.dropout2d, nn.Dropout3d: F.dropout3d}.get(type(m), F.dropout)
    return _call(g, fn, a["input"], m.p, True)  # whole channels for DropoutNd: not element-wise


@normalises(nn.Identity)
def _identity(g, m, qual, a):
    return a["input"]


def hf_drop_path(m: nn.Module) -> bool:
    """Whether ``m`` is one of Hugging Face's stochastic-depth modules (``BeitDropPath``,
    ``SwinDropPath``, ``ConvNextDropPath``, ... : one per vision model, all alike)::

        keep = 1 - self.drop_prob
        mask = torch.floor(torch.rand((x.shape[0], 1, ...)) + keep)  # 1 with probability keep
        return x.div(keep) * mask                                      # (x itself in eval or at 0)

    timm's ``drop_path`` with ``scale_by_keep=True``. Traced inline, its ``torch.rand`` is a draw each
    rank would make on its own (refused on several ranks): :func:`_hf_drop_path` calls
    :func:`hapc.ops.drop_path` instead, which draws rank-consistently."""
    t = type(m)
    return (
        t.__name__.endswith("DropPath")
        and t.__module__.startswith("transformers.")
        and isinstance(getattr(m, "drop_prob", None), float)
    )


def _hf_drop_path(g, m, qual, a):
    x = next(iter(a.values()))  # forward(self, hidden_states)
    if m.drop_prob == 0 or not m.training:
        return x
    from ..ops import drop_path

    return _call(g, drop_path, x, m.drop_prob, True, True)


def normaliser(m: nn.Module) -> Normaliser | None:
    """The functional form of module ``m`` (None: it is no table module, or its form does not cover
    its settings: it is traced through)."""
    norm = NORMALISERS.get(type(m))
    if norm is not None and not APPLIES.get(type(m), bool)(m):
        return None
    return _hf_drop_path if norm is None and hf_drop_path(m) else norm


def _simple(fn: Callable, *attrs: str, **fixed: object) -> Normaliser:
    def norm(g, m, qual, a):
        kwargs = {k: getattr(m, k) for k in attrs}
        kwargs.update(fixed)
        return g.call_function(fn, (a["input"],), kwargs)

    return norm


NORMALISERS.update(
    {
        nn.ReLU: _simple(F.relu),
        nn.GELU: _simple(F.gelu, "approximate"),
        nn.SiLU: _simple(F.silu),
        nn.Mish: _simple(F.mish),
        nn.Tanh: _simple(torch.tanh),
        nn.Sigmoid: _simple(torch.sigmoid),
        nn.LeakyReLU: _simple(F.leaky_relu, "negative_slope"),
        nn.ELU: _simple(F.elu, "alpha"),
        nn.Softplus: _simple(F.softplus, "beta", "threshold"),
        nn.Hardswish: _simple(F.hardswish),
        nn.ReLU6: _simple(F.hardtanh, min_val=0.0, max_val=6.0),
        nn.Softmax: _simple(F.softmax, "dim"),
        nn.LogSoftmax: _simple(F.log_softmax, "dim"),
        nn.Flatten: _simple(torch.flatten, "start_dim", "end_dim"),
        nn.AdaptiveAvgPool1d: _simple(F.adaptive_avg_pool1d, "output_size"),
        nn.AdaptiveAvgPool2d: _simple(F.adaptive_avg_pool2d, "output_size"),
    }
)


@normalises(nn.MaxPool1d, nn.MaxPool2d, when=lambda m: not m.return_indices)
def _max_pool(g, m, qual, a):
    fn = F.max_pool1d if isinstance(m, nn.MaxPool1d) else F.max_pool2d
    return _call(g, fn, a["input"], m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)


@normalises(nn.AvgPool1d, nn.AvgPool2d)
def _avg_pool(g, m, qual, a):
    fn = F.avg_pool1d if isinstance(m, nn.AvgPool1d) else F.avg_pool2d
    extra = () if isinstance(m, nn.AvgPool1d) else (m.divisor_override,)
    return _call(g, fn, a["input"], m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad, *extra)


def cumulative_average(m: nn.Module) -> bool:
    """Whether batch norm ``m`` updates its running statistics by a cumulative moving average
    (``momentum=None`` in training: weighted by ``1 / num_batches_tracked``, a Python number read
    from a buffer each call); refused by :func:`hapc.theory.trace._refuse_setups`."""
    return bool(m.training and getattr(m, "track_running_stats", False) and m.momentum is None)


def _fixed_momentum(m: nn.Module) -> bool:
    return not cumulative_average(m)


@normalises(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, when=_fixed_momentum)
def _batch_norm(g, m, qual, a):
    # SyncBatchNorm over every rank (its default group) is batch norm over the global batch: what
    # the program computes for a batch-sharded batch norm (two all-reduces, hapc.collectives.fused);
    # one over a subgroup is refused before capture (trace._refuse_setups)
    training = m.training or not m.track_running_stats
    mean = _attr(g, qual, "running_mean") if m.running_mean is not None else None
    var = _attr(g, qual, "running_var") if m.running_var is not None else None
    w = _attr(g, qual, "weight") if m.affine else None
    b = _attr(g, qual, "bias") if m.affine else None
    return _call(g, F.batch_norm, a["input"], mean, var, w, b, training, m.momentum or 0.0, m.eps)


@normalises(nn.CrossEntropyLoss)
def _cross_entropy(g, m, qual, a):
    w = _attr(g, qual, "weight") if m.weight is not None else None
    return g.call_function(
        F.cross_entropy,
        (a["input"], a["target"]),
        {"weight": w, "ignore_index": m.ignore_index, "reduction": m.reduction, "label_smoothing": m.label_smoothing},
    )


@normalises(nn.NLLLoss)
def _nll(g, m, qual, a):
    w = _attr(g, qual, "weight") if m.weight is not None else None
    return g.call_function(
        F.nll_loss, (a["input"], a["target"]), {"weight": w, "ignore_index": m.ignore_index, "reduction": m.reduction}
    )


@normalises(nn.MSELoss)
def _mse(g, m, qual, a):
    return g.call_function(F.mse_loss, (a["input"], a["target"]), {"reduction": m.reduction})


def normalise_modules(gm: fx.GraphModule) -> None:
    """Rewrite every ``call_module`` of a table module into functional nodes, in place."""
    g = gm.graph
    for node in list(g.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        norm = normaliser(mod)
        if norm is None:
            continue
        bound = inspect.signature(mod.forward).bind(*node.args, **node.kwargs)
        bound.apply_defaults()
        prev = node.prev
        with g.inserting_before(node):
            new = norm(g, mod, node.target, dict(bound.arguments))
        if node.prev is not prev and new is node.prev and node.meta.get("hapc_no_grad"):  # under torch.no_grad()
            new.meta["hapc_no_grad"] = True
        n = node.prev
        while n is not prev:  # the new nodes (inserted just before it) point at the module call's source line
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            if "hapc_region" in node.meta:  # and stay in its torch.utils.checkpoint region
                n.meta["hapc_region"] = node.meta["hapc_region"]
            if "hapc_autocast" in node.meta:  # and under its torch.autocast contexts
                n.meta["hapc_autocast"] = node.meta["hapc_autocast"]
            n = n.prev
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.lint()
