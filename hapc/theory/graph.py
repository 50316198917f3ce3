"""The reference graph: the single-device program the distributed program must emulate (HAP §4.1).

A :class:`RefGraph` is a static, shape-specialised, functional view of a traced model:

* every node produces exactly one tensor (multi-output ops are split per output);
* every shape, size and Python scalar is a constant (``x.view(x.size(0), -1)`` becomes
  ``x.view(8, 96)``), so rules can reason about sizes and codegen can write local shapes as literals;
* standard modules are already their functional form (``nn.Linear`` is ``F.linear`` + ``add``);
* tensor operands are :class:`Ref` objects inside ``args``/``kwargs``; everything else is a constant.

Node kinds: ``input`` (a model argument), ``param`` (trainable parameter), ``buffer`` (a registered
buffer or constant tensor attribute), ``op`` (a computation; ops without operands create tensors).
The last node is the loss, a scalar.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

INPUT, PARAM, BUFFER, OP = "input", "param", "buffer", "op"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Static shape and dtype of a reference tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def __repr__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor operand inside a node's ``args``: the index of the producing node."""

    index: int

    def __repr__(self) -> str:
        return f"%{self.index}"


@dataclass(eq=False)
class RefNode:
    """One reference tensor and the op that computes it.

    ``op`` is the canonical op name used to look up rules (``"linear"``, ``"view"``, a custom op's
    qualified name); ``target`` is what actually runs it (a callable, or a method name when
    ``is_method``); for params and buffers ``target`` is the attribute's qualified name.
    """

    index: int
    name: str
    kind: str
    op: str
    target: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    meta: TensorMeta = TensorMeta((), torch.float32)
    is_method: bool = False
    out_index: int | None = None  # element of a tuple-returning op
    requires_grad: bool = False  # depends on a trainable parameter
    flops: float = 0.0  # forward arithmetic
    mem_bytes: float = 0.0  # forward memory traffic (operands + result)
    mem_parts: tuple[float, ...] = ()  # mem_bytes by operand (in ``operands`` order), then the result
    source: str = ""  # "file.py:12: <code>" for error messages
    users: list[int] = field(default_factory=list)
    region: int | None = None  # the torch.utils.checkpoint call it ran in (recomputed in backward)
    autocast: tuple = ()  # the torch.autocast contexts it ran under: ((device, dtype, enabled, cache), ...)

    @property
    def operands(self) -> list[int]:
        """Indices of the tensor operands, in order of appearance in args then kwargs."""
        cached = self.__dict__.get("_operands")
        if cached is not None:
            return cached
        return [r.index for r in iter_refs((self.args, tuple(self.kwargs.values())))]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    def __repr__(self) -> str:
        return f"%{self.index}:{self.name}={self.op}{self.meta!r}"

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Run this node's op on concrete values (``args`` with refs already substituted)."""
        if self.is_method:
            out = getattr(args[0], self.target)(*args[1:], **kwargs)
        else:
            out = self.target(*args, **kwargs)
        return out if self.out_index is None else out[self.out_index]


def iter_refs(value: Any) -> Iterator[Ref]:
    """Every :class:`Ref` inside a nested structure of tuples, lists and dicts, in order."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from iter_refs(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from iter_refs(v)


def map_refs(value: Any, fn: Callable[[Ref], Any]) -> Any:
    """Rebuild a nested structure with every :class:`Ref` replaced by ``fn(ref)``."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


class RefGraph:
    """The traced single-device program: nodes in topological order, the last one the loss."""

    def __init__(self, nodes: list[RefNode], module: torch.nn.Module, input_names: list[str]):
        self.nodes = nodes
        self.module = module
        self.input_names = input_names
        self.capture = "fx"  # how the model was captured: "fx" or "export" (hapc.trace)
        # what the model returns: its structure with tensors as capture.Leaf positions, the flat
        # tensors as node indices (None where not computed here), and which of them is the loss
        self.output_spec: Any = None
        self.outputs: list[int | None] = [len(nodes) - 1] if nodes else []
        self.loss_leaf = 0
        self.aliases: dict[str, str] = {}  # tied weights: state_dict name -> the name the graph uses
        # the tensors this capture made in forward (``_tensor_constant*``): the next capture of the
        # module replaces its attributes of these names
        self.constants: dict[str, torch.Tensor] = {}
        for n in nodes:
            n.users = []
            n.__dict__.pop("_operands", None)
            n.__dict__["_operands"] = n.operands  # the graph is final: compute once
        for n in nodes:
            for o in dict.fromkeys(n.operands):
                nodes[o].users.append(n.index)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[RefNode]:
        return iter(self.nodes)

    def __getitem__(self, index: int) -> RefNode:
        return self.nodes[index]

    @property
    def loss(self) -> RefNode:
        return self.nodes[-1]

    def of_kind(self, kind: str) -> list[RefNode]:
        return [n for n in self.nodes if n.kind == kind]

    @property
    def params(self) -> list[RefNode]:
        return self.of_kind(PARAM)

    @property
    def inputs(self) -> list[RefNode]:
        return self.of_kind(INPUT)

    def by_name(self, name: str) -> RefNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes)

    def param_count(self) -> int:
        return sum(n.meta.numel for n in self.params)

    def fingerprint(self) -> str:
        """A hash of the graph's structure, shapes and dtypes (plans record it)."""
        import hashlib

        h = hashlib.sha256()
        for n in self.nodes:
            h.update(f"{n.kind}|{n.op}|{n.meta!r}|{n.operands}|{n.out_index}|".encode())
            h.update(repr(map_refs((n.args, n.kwargs), lambda r: r.index)).encode())
        return h.hexdigest()[:16]

    def run(self, inputs: dict[str, torch.Tensor] | None = None, **tensors: torch.Tensor) -> Any:
        """Evaluate the graph on concrete tensors (single device): the reference semantics."""
        return self.evaluate(inputs, **tensors)[-1]

    def evaluate(
        self,
        inputs: dict[str, torch.Tensor] | None = None,
        *,
        upto: int | Iterable[int] | None = None,
        **tensors: torch.Tensor,
    ) -> list[Any]:
        """Every node's value on concrete inputs, with the module's own parameters and buffers.
        With ``upto`` (a node or several), only those and what they depend on are computed (the
        rest are ``None``)."""
        given = dict(inputs or {}, **tensors)
        values: list[Any] = [None] * len(self.nodes)
        if upto is None:
            nodes = self.nodes
        else:
            need: set[int] = set()
            for i in [upto] if isinstance(upto, int) else upto:
                need |= self.ancestors(i)
            nodes = [self.nodes[i] for i in sorted(need)]
        state: dict[str, Any] | None = None
        device = next((v.device for v in given.values() if isinstance(v, torch.Tensor)), None)
        for n in nodes:
            if n.kind == INPUT:
                if n.name not in given:
                    raise KeyError(f"no value for model input {n.name!r}")
                values[n.index] = given[n.name]
            elif n.kind in (PARAM, BUFFER):
                if state is None:
                    state = dict(self.module.named_parameters())
                    state.update(self.module.named_buffers())
                value = state[n.target] if n.target in state else _getattr(self.module, n.target)
                # a buffer the graph updates in place (batch norm's running statistics): evaluating
                # the reference must never move the model's own
                values[n.index] = value.clone() if n.kind == BUFFER else value
            else:
                a, k = map_refs((n.args, n.kwargs), lambda r: values[r.index])
                a, k = _with_device((a, k), device)
                values[n.index] = n.call(*a, **k)
        return values

    def ancestors(self, index: int) -> set[int]:
        """``index`` and every node it depends on."""
        need, stack = set(), [index]
        while stack:
            i = stack.pop()
            if i not in need:
                need.add(i)
                stack.extend(self.nodes[i].operands)
        return need

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for n in self.nodes:
            kinds[n.kind] = kinds.get(n.kind, 0) + 1
        return {
            "nodes": len(self.nodes),
            **kinds,
            "parameters": self.param_count(),
            "forward_flops": self.total_flops(),
            "loss": repr(self.loss.meta),
        }


def _with_device(value: Any, device: Any) -> Any:
    from .trace import CurrentDevice

    if isinstance(value, CurrentDevice):
        return device
    if isinstance(value, tuple):
        return tuple(_with_device(v, device) for v in value)
    if isinstance(value, list):
        return [_with_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: _with_device(v, device) for k, v in value.items()}
    return value


def _getattr(module: torch.nn.Module, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
