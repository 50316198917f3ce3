"""Random models and clusters for the equivalence fuzzer (hypothesis strategies).

A :class:`ModelSpec` is plain data (picklable, printable, reproducible): the example inputs'
shapes and a list of ops, each valid for the shape the previous ones produce. :class:`FuzzNet`
builds the model from it with parameters drawn from a generator seeded by the spec, so every
process that builds the same spec holds the same weights. The ops cover the rule library:
linear (with and without bias), matmul with a parameter and of a tensor with itself (attention
style and a batch-contracting Gram product), element-wise ops with broadcasting, activations,
layer norm, softmax, transpose / reshape, sum and mean (keeping or dropping dims), residual
branches, a weight used twice, and several inputs (an integer target for cross-entropy too).
Sizes are small odd and prime numbers, so uneven shards and size-1 dims are the common case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

from hapc.cluster import Cluster

SIZES = (1, 2, 3, 5, 7, 11)
BATCHES = (1, 2, 3, 5, 7, 8)
ACTS = ("relu", "gelu", "tanh", "sigmoid", "silu")
OPS = (
    "linear",
    "reuse",
    "shared",
    "matmul_param",
    "gram",
    "attention",
    "scale",
    "add_input",
    "act",
    "layer_norm",
    "softmax",
    "transpose",
    "flatten",
    "split",
    "reduce",
    "residual",
)


@dataclass(frozen=True)
class ModelSpec:
    """``inputs``: ``(name, shape, kind)`` with kind ``"float"`` or ``"target:<classes>"``;
    ``ops``: tuples ``(name, *arguments)`` applied in order to the running tensor ``h``;
    ``loss``: ``"mse"``, ``"sum"`` or ``"ce"`` (cross-entropy against the target input)."""

    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    ops: tuple[tuple, ...]
    loss: str
    seed: int

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(self.seed + 1)
        out = []
        for _, shape, kind in self.inputs:
            if kind.startswith("target:"):
                out.append(torch.randint(0, int(kind.split(":")[1]), shape, generator=g))
            else:
                out.append(torch.randn(shape, generator=g, dtype=torch.float64))
        return tuple(out)

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return _ARITY[len(self.inputs)](self), self.example_inputs()


class FuzzNet(nn.Module):
    """The model a :class:`ModelSpec` describes (float64): :meth:`run` takes the inputs in spec
    order and returns a scalar loss; the subclasses' ``forward`` name them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)

        def param(*shape: int) -> nn.Parameter:
            fan_in = shape[-1] if len(shape) > 1 else 1
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in))

        for i, op in enumerate(spec.ops):
            name = op[0]
            if name == "linear":
                _, out, din, bias = op
                self.register_parameter(f"w{i}", param(out, din))
                if bias:
                    self.register_parameter(f"b{i}", param(out))
            elif name == "shared":
                self.register_parameter(f"w{i}", param(op[1], op[1]))
            elif name == "matmul_param":
                self.register_parameter(f"m{i}", param(op[2], op[1]))
            elif name == "scale":
                self.register_parameter(f"s{i}", param(*op[1]))
            elif name == "add_input":
                self.register_parameter(f"w{i}", param(op[2], op[3]))
            elif name == "layer_norm" and op[2]:
                self.register_parameter(f"g{i}", nn.Parameter(1 + 0.1 * torch.randn(op[1], generator=g).double()))
                self.register_parameter(f"b{i}", param(op[1]))

    def run(self, *inputs: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        h = inputs[0]
        saved = [h]
        for i, op in enumerate(spec.ops):
            name = op[0]
            if name == "linear":
                h = F.linear(h, getattr(self, f"w{i}"), getattr(self, f"b{i}", None))
            elif name == "reuse":  # the weight of an earlier linear: one parameter, two uses
                h = F.linear(h, getattr(self, f"w{op[1]}"))
            elif name == "shared":
                w = getattr(self, f"w{i}")
                h = F.linear(torch.tanh(F.linear(h, w)), w)
            elif name == "matmul_param":
                h = torch.matmul(h, getattr(self, f"m{i}"))
            elif name == "gram":  # contracts the batch: h (h^T h) / n
                h = h @ (h.transpose(0, 1) @ h) / h.shape[0]
            elif name == "attention":  # softmax(h h^T / sqrt(d)) h over the middle dim
                a = torch.softmax(h @ h.transpose(1, 2) / math.sqrt(h.shape[-1]), dim=-1)
                h = a @ h
            elif name == "scale":
                h = h * getattr(self, f"s{i}") if op[2] == "mul" else h + getattr(self, f"s{i}")
            elif name == "add_input":
                y = F.linear(inputs[op[1]], getattr(self, f"w{i}"))
                h = h + (y.unsqueeze(1) if h.dim() == 3 else y)
            elif name == "act":
                h = getattr(F, op[1])(h) if op[1] != "tanh" and op[1] != "sigmoid" else getattr(torch, op[1])(h)
            elif name == "layer_norm":
                h = F.layer_norm(h, (op[1],), getattr(self, f"g{i}", None), getattr(self, f"b{i}", None))
            elif name == "softmax":
                h = torch.softmax(h, dim=op[1])
            elif name == "transpose":
                h = h.transpose(1, 2)
            elif name in ("flatten", "split"):
                h = h.reshape(op[1])
            elif name == "reduce":
                _, kind, dim, keep = op
                h = h.sum(dim, keepdim=keep) if kind == "sum" else h.mean(dim, keepdim=keep)
            elif name == "residual":
                h = h + saved[op[1]]
            saved.append(h)
        if spec.loss == "ce":
            return F.cross_entropy(h, inputs[-1])
        if spec.loss == "sum":
            return h.sum() * 0.1
        return (h * h).mean()


# hapc traces named inputs (a ``forward(*inputs)`` is a known limit, see test_fuzz), so one
# subclass per number of inputs
class _Net1(FuzzNet):
    def forward(self, x):
        return self.run(x)


class _Net2(FuzzNet):
    def forward(self, x, a):
        return self.run(x, a)


class _Net3(FuzzNet):
    def forward(self, x, a, b):
        return self.run(x, a, b)


class _Net4(FuzzNet):
    def forward(self, x, a, b, c):
        return self.run(x, a, b, c)


_ARITY = {1: _Net1, 2: _Net2, 3: _Net3, 4: _Net4}


def _op(draw, shape: list[int], history: list[tuple], i: int, extras: list[int], n_extra: int) -> tuple:
    """One op valid for ``shape`` (the running tensor's), or ``("act", ...)`` as a fallback."""
    d = shape[-1]
    three = len(shape) == 3
    name = draw(st.sampled_from(OPS))
    if name == "linear":
        return ("linear", draw(st.sampled_from(SIZES)), d, draw(st.booleans()))
    if name == "reuse":
        fits = [j for j, op in enumerate(history) if op[0] == "linear" and op[2] == d]
        if fits:
            return ("reuse", draw(st.sampled_from(fits)))
        return ("shared", d)
    if name == "shared":
        return ("shared", d)
    if name == "matmul_param":
        return ("matmul_param", draw(st.sampled_from(SIZES)), d)
    if name == "gram" and not three:
        return ("gram",)
    if name == "attention" and three:
        return ("attention",)
    if name == "scale":
        shapes = [(d,), (1, d)] + ([(shape[1], 1)] if three else [])
        return ("scale", draw(st.sampled_from(shapes)), draw(st.sampled_from(["mul", "add"])))
    if name == "add_input" and n_extra:
        k = draw(st.integers(1, n_extra))
        return ("add_input", k, d, extras[k - 1])
    if name == "layer_norm":
        return ("layer_norm", d, draw(st.booleans()))
    if name == "softmax":
        return ("softmax", draw(st.sampled_from([-1, 1])))
    if name == "transpose" and three:
        return ("transpose",)
    if name == "flatten" and three:
        return ("flatten", (shape[0], shape[1] * shape[2]))
    if name == "split" and not three:
        factors = [a for a in range(2, d) if d % a == 0]
        if factors:
            a = draw(st.sampled_from(factors))
            return ("split", (shape[0], a, d // a))
    if name == "reduce" and three:
        return ("reduce", draw(st.sampled_from(["sum", "mean"])), draw(st.sampled_from([1, 2])), draw(st.booleans()))
    if name == "reduce":
        return ("reduce", draw(st.sampled_from(["sum", "mean"])), 1, True)
    if name == "residual":
        return ("residual",)  # resolved by the caller (needs the saved shapes)
    return ("act", draw(st.sampled_from(ACTS)))


def _shape_after(op: tuple, shape: list[int], history: list[tuple]) -> list[int]:
    name = op[0]
    if name in ("linear", "matmul_param"):
        return shape[:-1] + [op[1]]
    if name == "reuse":
        return shape[:-1] + [history[op[1]][1]]
    if name == "transpose":
        return [shape[0], shape[2], shape[1]]
    if name in ("flatten", "split"):
        return list(op[1])
    if name == "reduce":
        _, _, dim, keep = op
        return [1 if j == dim else s for j, s in enumerate(shape)] if keep else shape[:dim] + shape[dim + 1 :]
    return shape


@st.composite
def model_specs(draw, max_ops: int = 6) -> ModelSpec:
    batch = draw(st.sampled_from(BATCHES))
    three = draw(st.booleans())
    shape = [batch, draw(st.sampled_from(SIZES[1:])), draw(st.sampled_from(SIZES))] if three else [batch]
    if not three:
        shape.append(draw(st.sampled_from(SIZES)))
    extras = [draw(st.sampled_from(SIZES)) for _ in range(draw(st.integers(0, 2)))]
    inputs = [("x", tuple(shape), "float")] + [(f"y{k}", (batch, e), "float") for k, e in enumerate(extras)]
    ops: list[tuple] = []
    shapes = [list(shape)]
    for i in range(draw(st.integers(1, max_ops))):
        op = _op(draw, shape, ops, i, extras, len(extras))
        if op[0] == "residual":
            same = [j for j, s in enumerate(shapes[:-1]) if s == shape]
            op = ("residual", draw(st.sampled_from(same))) if same else ("act", draw(st.sampled_from(ACTS)))
        if op[0] == "softmax" and len(shape) == 2:
            op = ("softmax", -1)
        shape = _shape_after(op, shape, ops)
        ops.append(op)
        shapes.append(list(shape))
    has_params = ("linear", "shared", "matmul_param", "scale", "add_input")
    if not any(op[0] in has_params or (op[0] == "layer_norm" and op[2]) for op in ops):
        ops.append(("scale", (shape[-1],), "mul"))  # something to train
    loss = draw(st.sampled_from(["mse", "sum", "ce"]))
    if loss == "ce":
        if len(shape) == 3:
            ops.append(("flatten", (batch, shape[1] * shape[2])))
            shape = [batch, shape[1] * shape[2]]
        classes = draw(st.sampled_from((2, 3, 5)))
        ops.append(("linear", classes, shape[-1], draw(st.booleans())))
        inputs.append(("target", (batch,), f"target:{classes}"))
    return ModelSpec(tuple(inputs), tuple(ops), loss, draw(st.integers(0, 2**16)))


@st.composite
def fuzz_clusters(draw, max_devices: int = 4) -> Cluster:
    """1-``max_devices`` devices, each its own group, with skewed flops and memory (some small
    enough to bind the ratio LP) and a link from slow to fast."""
    n = draw(st.sampled_from([3, 2, 4, 1][:max_devices]))  # hypothesis favours the first
    link = {
        "bandwidth": draw(st.sampled_from(["100 GB/s", "1 GB/s", "10 MB/s"])),
        "latency": draw(st.sampled_from(["0 us", "20 us"])),
    }
    groups = [
        {
            "name": f"d{i}",
            "devices": 1,
            "flops": 10 ** draw(st.floats(6.0, 7.5)),  # slow enough that splitting compute pays
            "memory": draw(st.sampled_from(["4 GiB", "4 GiB", "4 GiB", "8 KiB", "2 KiB"])),
        }
        for i in range(n)
    ]
    return Cluster.from_dict({"name": f"fuzz-{n}", "group": groups, "links": {"intra_host": link, "inter_host": link}})


SYNTH_OPTIONS = st.fixed_dictionaries(
    {
        "variants": st.sampled_from([("padded", "grouped"), ("padded",), ("grouped",)]),
        "sfb": st.booleans(),
        "param_comm": st.booleans(),
        "baseline": st.sampled_from([None, None, None, "tp", "dp-ev"]),
    }
)
