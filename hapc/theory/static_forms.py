"""Value-dependent Python the fx capture turns into static graph nodes, exactly (DESIGN §9 "exact or refused").

Two forms, each recognised precisely; anything else stays refused by the capture with its cause:

1. **A check that raises**: ``if <tensor>: raise E(...)`` (or ``if not <tensor>: raise``, an
   ``assert``). One device evaluates the condition and raises or goes on; a trace cannot branch on a
   value. When the bytecode after the truth test is a straight block ending in ``raise`` (no jump in
   it), the capture follows the branch that does not raise and records the check as
   :func:`hapc.ops.checked` on the loss: the program raises the same exception type where one device
   would have, and otherwise returns the loss unchanged. Hugging Face's CTC heads check
   ``labels.max() >= vocab_size`` this way.
2. **CTC targets selected by a mask**: ``F.ctc_loss(log_probs, x.masked_select(m), input_lengths,
   m.sum(-1), ...)`` with ``x`` and ``m`` of shape ``(N, S)`` -- the concatenated targets, whose length
   depends on values -- becomes :func:`hapc.ops.ctc_loss_masked`, which builds the padded targets
   ``(N, S)`` ``ctc_loss`` also accepts: the same targets per sample, so the same loss per sample.
   ``reduction="mean"`` (``mean_i loss_i / max(len_i, 1)``) becomes the ``"length_sum"`` reduction
   divided by the static batch size ``N``: a sum over samples, which a batch shard computes as a
   ``Partial`` (:mod:`hapc.theory.rules.loss`). A ``masked_select`` feeding ``ctc_loss`` in any other
   way is refused, naming this form.
"""

from __future__ import annotations

import builtins
import dis
import inspect
import linecache
import operator
import os
from bisect import bisect_left
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import TraceError

_MISSING = object()


@dataclass(frozen=True)
class Guard:
    """A recorded ``if <condition>: raise``: the program raises ``error(message)`` when
    ``bool(condition) == raise_when``."""

    condition: fx.Node
    raise_when: bool
    message: str
    error: str


def _jumps() -> set[int]:
    return set(dis.hasjrel) | set(dis.hasjabs)


def guard_at(frame: FrameType) -> tuple[bool, str, str] | None:
    """``(raise_when, error, where)`` when ``frame`` is testing the truth of a value in ``if c: raise``
    (``raise_when=True``) or ``if not c: raise`` / ``assert c`` (``False``): the jump taken on one
    truth value skips a block without jumps that ends in ``raise``. None for any other use of a
    truth value (a branch that computes, a loop, ``x if c else y``)."""
    code = frame.f_code
    insts = list(dis.get_instructions(code))
    cur = bisect_left(insts, frame.f_lasti, key=lambda i: i.offset)
    if cur >= len(insts) or insts[cur].offset != frame.f_lasti:
        return None
    inst = insts[cur]
    if not inst.opname.startswith("POP_JUMP") or inst.opname.endswith(("IF_NONE", "IF_NOT_NONE")):
        return None
    if "IF_FALSE" not in inst.opname and "IF_TRUE" not in inst.opname:
        return None
    target = inst.argval
    if not isinstance(target, int) or target <= inst.offset:
        return None
    body = [i for i in insts[cur + 1 :] if i.offset < target]
    jumps = _jumps()
    if not body or body[-1].opname != "RAISE_VARARGS" or any(i.opcode in jumps for i in body[:-1]):
        return None
    if _caught(frame, body[-1].offset):
        return None
    error = "RuntimeError"
    for i in body:
        if i.opname == "LOAD_ASSERTION_ERROR":
            error = "AssertionError"
            break
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(getattr(builtins, str(i.argval), None), type):
            if issubclass(getattr(builtins, str(i.argval)), Exception):
                error = str(i.argval)
                break
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return "IF_FALSE" in inst.opname, error, f"{code.co_filename}:{frame.f_lineno}: {line}"


_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_HAPC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_try(code: Any, offset: int) -> bool:
    """Whether ``offset`` of ``code`` lies in a ``try`` block (its handler could catch the raise;
    a ``with`` block's handler, ``WITH_EXCEPT_START``, does not count)."""
    insts = {i.offset: i for i in dis.get_instructions(code)}
    for entry in dis.Bytecode(code).exception_entries:
        if entry.start <= offset < entry.end:
            after = [insts[o].opname for o in sorted(insts) if o >= entry.target][:2]
            if after != ["PUSH_EXC_INFO", "WITH_EXCEPT_START"]:
                return True
    return False


def _caught(frame: FrameType, raise_offset: int) -> bool:
    """Whether a ``try`` in the check's own function, or in a function of the model calling it
    (up to the capture's entry; torch's and hapc's frames aside), surrounds it: one device might
    catch the exception and go on, so the check is no check and stays refused."""
    if _in_try(frame.f_code, raise_offset):
        return True
    f = frame.f_back
    while f is not None and not (f.f_code.co_name == "trace" and f.f_code.co_filename.startswith(_TORCH)):
        name = os.path.abspath(f.f_code.co_filename)
        if not name.startswith((_TORCH, _HAPC)) and _in_try(f.f_code, f.f_lasti):
            return True
        f = f.f_back
    return False


def _node(a: Any) -> fx.Node | None:
    return a.node if isinstance(a, fx.Proxy) else None


def _is_masked_select(n: fx.Node | None) -> bool:
    return n is not None and (
        (n.op == "call_method" and n.target == "masked_select")
        or (n.op == "call_function" and n.target is torch.masked_select)
    )


def _val(n: fx.Node) -> Any:
    return n.meta.get("hapc_val", _MISSING)


#: deterministic element-wise ops a mask is written with (by name: ``operator.ge``, ``torch.ge``, ``x.ge``)
_COMPARISONS = {"ge", "gt", "le", "lt", "eq", "ne", "invert", "logical_not", "logical_and", "logical_or", "and", "or"}


def _same(a: Any, b: Any) -> bool:
    """Whether two fx arguments compute the same value: one node, or nodes of one comparison on
    the same arguments (``labels >= 0`` written twice, as the mask and in its count)."""
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if a is b:
            return True
        return (
            a.op == b.op
            and a.op in ("call_function", "call_method")
            and a.target == b.target
            and str(getattr(a.target, "__name__", a.target)).strip("_") in _COMPARISONS
            and _same(a.args, b.args)
            and _same(a.kwargs, b.kwargs)
        )
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and not isinstance(a, fx.Node) and a == b


def _row_count_of(n: fx.Node | None, mask: fx.Node) -> bool:
    """Whether ``n`` is ``mask.sum(-1)`` (or over dim 1 of a 2-D mask, no keepdim, no dtype)."""
    if n is None or not (
        (n.op == "call_method" and n.target == "sum") or (n.op == "call_function" and n.target is torch.sum)
    ):
        return False
    if not n.args or not _same(n.args[0], mask) or set(n.kwargs) - {"dim"}:
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    dim = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    return len(n.args) <= 2 and dim in (-1, 1)


def ctc_loss_call(tracer: Any, args: tuple, kwargs: dict) -> Any:
    """The capture of ``F.ctc_loss(*args, **kwargs)`` while fx traces (form 2 of the module
    docstring): the proxy of :func:`hapc.ops.ctc_loss_masked` (divided by ``N`` for ``"mean"``) when
    the targets are a ``masked_select`` whose lengths are its mask's row counts; a :class:`TraceError`
    naming the form for any other ``masked_select`` targets; otherwise :func:`hapc.ops.ctc_loss`
    (torch's call, with shapes on meta and ``"mean"`` as ``length_sum / N``)."""
    from .. import ops as hops

    try:
        bound = inspect.signature(F.ctc_loss).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    sel = _node(a["targets"])
    lp = _val(a["log_probs"].node) if isinstance(a["log_probs"], fx.Proxy) else None
    batch = lp.shape[1] if isinstance(lp, torch.Tensor) and lp.dim() == 3 else None
    if not _is_masked_select(sel):
        if a["reduction"] == "mean" and batch is None:
            return None  # unbatched or unknown: torch's own call (replicated, no meta kernel: refused)
        reduction = "length_sum" if a["reduction"] == "mean" else a["reduction"]
        call = (a["log_probs"], a["targets"], a["input_lengths"], a["target_lengths"])
        kw = {"blank": a["blank"], "reduction": reduction, "zero_infinity": a["zero_infinity"]}
        loss = tracer.create_proxy("call_function", hops.ctc_loss, call, kw)
        return _mean(tracer, loss, a["reduction"], batch)
    x, mask = (sel.args[0], sel.args[1]) if len(sel.args) >= 2 else (sel.args[0], sel.kwargs.get("mask"))
    xv, mv = (_val(x), _val(mask)) if isinstance(x, fx.Node) and isinstance(mask, fx.Node) else (None, None)
    lengths = _node(a["target_lengths"])
    if not (
        isinstance(xv, torch.Tensor)
        and isinstance(mv, torch.Tensor)
        and xv.dim() == 2
        and mv.shape == xv.shape
        and mv.dtype == torch.bool
        and isinstance(a["input_lengths"], fx.Proxy)
        and _row_count_of(lengths, mask)
        and a["reduction"] in ("none", "sum", "mean")
    ):
        raise TraceError(
            "F.ctc_loss's targets are a masked_select (a length that depends on the values): hapc captures "
            "them only as ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1)) with "
            "labels and a boolean mask of one shape (N, S) and tensor input_lengths (it passes the padded "
            "targets (N, S) instead, the same loss per sample); pass padded targets (N, S) with target_lengths "
            "to F.ctc_loss yourself"
        )
    reduction = "length_sum" if a["reduction"] == "mean" else a["reduction"]
    call = (a["log_probs"], tracer.proxy(x), tracer.proxy(mask), a["input_lengths"], a["target_lengths"])
    loss = tracer.create_proxy(
        "call_function",
        hops.ctc_loss_masked,
        call,
        {"blank": a["blank"], "reduction": reduction, "zero_infinity": a["zero_infinity"]},
    )
    return _mean(tracer, loss, a["reduction"], xv.shape[0])


def _mean(tracer: Any, loss: Any, reduction: str, batch: int | None) -> Any:
    """torch's ``"mean"``: the ``"length_sum"`` over the batch divided by its (static) size."""
    if reduction != "mean":
        return loss
    return tracer.create_proxy("call_function", operator.truediv, (loss, float(batch)), {})


def drop_unused_masked_selects(graph: fx.Graph) -> None:
    """Remove the ``masked_select`` nodes :func:`ctc_loss_call` left without readers (their length
    depends on values: shape propagation could not compute them)."""
    for n in reversed(list(graph.nodes)):
        if _is_masked_select(n) and not n.users:
            graph.erase_node(n)
