"""What a captured program computes, as a value two captures can be compared by (DESIGN §9).

Two captures of one model -- in the other train/eval mode (``hapc.compile``'s ``self.training``
check), or with a constant input given another value (:mod:`hapc.codegen.constants`) -- compute the
same function of the inputs and weights when their keys are equal. The key is the graph's op
sequence, each op with its result's shape and dtype and its arguments, tensor operands named by
position (an input or weight by name, an op by its place in the sequence), not by node name; a
traced constant (``_tensor_constant*``, named afresh by every capture) by its shape and dtype.
Dropout and stochastic depth are transparent (the runtime switches them by mode) and SDPA's
``dropout_p`` is left out. With ``outputs=True`` the key also holds what the program returns: the
output structure (container types, keys, positions) with each computed tensor named as its
operands are; a returned value the program leaves out (``None``: a cache object, a tensor the loss
does not read) is dropped from a dict, as ``ModelOutput`` drops ``None`` fields.

With ``fold=True`` an op that reads no input, parameter or registered buffer and draws nothing (a
causal mask built from ``arange``, position ids) is keyed by its value at these shapes, not by how
it is computed: such a node computes the same tensor at every step, so two captures that build one
mask by different ops (transformers checks for packed sequences only when ``use_cache=False``)
compute the same program. The values are evaluated on the graph's module (its ``_tensor_constant*``
attributes must be those of this capture); a graph on the meta device is keyed by structure.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .graph import BUFFER, OP, map_refs

__all__ = ["follows_mode", "program_key"]


def follows_mode(n: Any) -> bool:
    """A random op whose draw the runtime turns off in eval mode (``RandomStream.drops``)."""
    from .rules.random import SAMPLE_DROPS

    return ("dropout" in n.op or n.op in SAMPLE_DROPS) and bool(n.operands)


#: ops whose value is not a function of their operands: never folded
_DRAWS = ("rand", "dropout", "bernoulli", "multinomial", "normal", "uniform", "exponential", "poisson", "empty")


def program_key(graph: Any, outputs: bool = False, fold: bool = False) -> list[tuple]:
    """The comparable key of ``graph`` (see the module docstring); ``outputs``: with the returned
    structure; ``fold``: data-free ops by value."""
    ident: dict[int, Any] = dict(_folded(graph)) if fold else {}
    key: list[tuple] = []
    for n in graph:
        if n.index in ident:
            continue
        if n.kind != OP:  # a traced constant's attribute name differs between two traces
            const = str(n.target or "").startswith("_tensor_constant")
            ident[n.index] = ("constant", n.meta) if const else (n.target or n.name)
            continue
        if follows_mode(n):
            ident[n.index] = ident[n.operands[0]]
            continue
        ident[n.index] = len(key)
        if n.op == "batch_norm":
            key.append(("batch_norm", n.meta))
            continue
        args, kwargs = n.args, n.kwargs
        if n.op == "scaled_dot_product_attention":  # dropout_p follows the mode at run time (hapc.ops)
            args, kwargs = args[:3], {k: v for k, v in kwargs.items() if k != "dropout_p"}
        key.append((n.op, n.meta, repr(map_refs((args, kwargs), lambda r: ("ref", ident[r.index])))))
    if outputs:
        refs = [None if r is None else ident.get(r) for r in graph.outputs]
        spec = graph.output_spec
        shape = ("tensor", refs[0] if refs else None) if spec is None else _skeleton(spec, refs)  # the loss alone
        key.append(("returns", shape, refs[graph.loss_leaf] if refs else None))
    return key


def _folded(graph: Any) -> dict[int, tuple]:
    """``{node: ("value", meta, digest)}`` for every op computed from constants alone (see the
    module docstring); empty where they cannot be evaluated (meta tensors)."""
    from .rules.random import SAMPLE_DROPS

    free: list[int] = []
    fixed: set[int] = set()
    for n in graph:
        if n.kind == BUFFER and str(n.target or "").startswith("_tensor_constant"):
            fixed.add(n.index)  # a tensor the capture made: a constant of the program
        elif n.kind == OP and n.op not in SAMPLE_DROPS and not any(d in n.op for d in _DRAWS):
            if all(o in fixed for o in n.operands):
                fixed.add(n.index)
                free.append(n.index)
    if not free:
        return {}
    device = next((t.device for t in graph.module.parameters()), torch.device("cpu"))
    try:  # (an unused entry tells evaluate the device of the ops' `device=` arguments)
        values = graph.evaluate({"\0device": torch.empty(0, device=device)}, upto=free)
    except Exception:  # meta tensors, an op that needs a device: keyed by structure
        return {}
    out: dict[int, tuple] = {}
    for i in free:
        v = values[i]
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta":
                return {}
            data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out[i] = ("value", graph[i].meta, str(v.dtype), hashlib.sha1(data).hexdigest())
        else:
            out[i] = ("value", graph[i].meta, repr(v))
    return out


def _skeleton(spec: Any, refs: list[Any]) -> Any:
    """An output structure (:func:`hapc.theory.capture.output_structure`) with each tensor leaf
    replaced by what computes it (None where the program leaves it out)."""
    from .capture import Leaf

    if isinstance(spec, Leaf):
        return ("tensor", refs[int(spec)]) if refs[int(spec)] is not None else None
    if isinstance(spec, dict) and "__type__" in spec:
        items = ((k, _skeleton(v, refs)) for k, v in spec["items"].items())
        return (_name(spec["__type__"]), tuple((k, v) for k, v in items if v is not None))
    if isinstance(spec, (tuple, list)):
        return (_name(type(spec)), tuple(_skeleton(v, refs) for v in spec))
    return None if spec is None else ("value", repr(spec))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
