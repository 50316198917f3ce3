"""Value-dependent Python the fx capture turns into static graph nodes, exactly (DESIGN §9 "exact or refused").

Three forms, each recognised precisely; anything else stays refused by the capture with its cause:

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
3. **Item writes** ``x[index] = value`` whose index or value is traced, or whose ``x`` is (Hugging
   Face's padded audio: ``hidden_states[~mask] = 0``, ``mask[(torch.arange(N), lengths - 1)] = 1`` into
   a fresh ``torch.zeros``). One device writes in place; the capture records the out-of-place op that
   computes the same tensor and makes every later read of ``x`` read that node (:class:`ItemWrites`):

   * one boolean mask ``m`` over the leading dims of ``x`` and a number ``v``:
     ``x.masked_fill(m[..., None, ...], v)`` -- the same fill of the same elements, so bit for bit
     (inf and nan included), and element-wise, so any dim shards;
   * ``(torch.arange(N), j)`` into a 2-D ``x`` of ``N`` rows and a number: row ``i`` gets ``v`` at
     column ``j_i`` (``j_i + T`` when negative, as indexing wraps), ``x.scatter(1, j', v)``, which
     shards by the rows. The first index is known to be ``0 .. N-1`` by its values, or on the meta
     device (no values) by how the forward made it: ``torch.arange(N)`` and not written since;
   * any other tuple of index tensors: ``torch.index_put(x, index, value)``, the op ``x[index] = value``
     runs (its rule keeps the indexed dims whole).

   Exactness needs every later read of ``x`` to see the write: a write into a traced ``x`` that
   another node may alias (a view, ``detach``, a no-op ``to`` or dropout) and that is read after
   the write, into a model input, parameter or buffer, or into a real tensor that a view or another
   tensor shares, or that was not made in the forward, is refused (:class:`TraceError`, naming the
   line; ``capture="auto"`` then tries ``torch.export``, which functionalises writes). Slices and
   integers in the index stay with ``torch.export`` too.

Refused, where the capture would otherwise freeze a value one device computes anew at every call:
random numbers a forward draws with NumPy's global generator (:func:`numpy_draws_refused`;
transformers' SpecAugment masks in training, ``mask_time_prob > 0``).
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import inspect
import linecache
import operator
import os
import sys
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

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


# --------------------------------------------------------------------------------------------
# 3. item writes


@dataclass(frozen=True)
class Write:
    """``x[index] = value`` on a traced ``x``: ``old`` was ``x``'s node, ``new`` computes the written
    tensor (every later read of the proxy reads it)."""

    old: fx.Node
    new: fx.Node
    where: str


def _value(a: Any) -> Any:
    """The tensor (meta for a traced value, real for a constant) or Python value of an argument."""
    return _val(a.node) if isinstance(a, fx.Proxy) else a


def _is_traced(tree: Any) -> bool:
    return any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves(tree))


def _number_fits(value: Any, dtype: torch.dtype) -> bool:
    """Whether ``value`` is a Python number that ``masked_fill`` / ``scatter`` store in ``dtype`` as
    ``x[i] = value`` does (a float into an integer tensor goes to ``index_put``)."""
    if type(value) is bool:
        return True
    if type(value) is int:
        return dtype != torch.bool or value in (0, 1)
    return type(value) is float and (dtype.is_floating_point or dtype.is_complex)


def _is_arange(t: Any, n: int, aranges: WeakIdKeyDictionary | None = None) -> bool:
    """A real integer tensor equal to ``torch.arange(n)`` (a constant of the capture): compared by
    value, or, on meta (no values to compare), one of ``aranges`` (the forward made it by
    ``torch.arange(n)``) whose version counter has not moved since (nothing wrote into it)."""
    if not (
        isinstance(t, torch.Tensor)
        and not isinstance(t, fx.Proxy)
        and t.dtype in (torch.int64, torch.int32)
        and tuple(t.shape) == (n,)
    ):
        return False
    if t.device.type == "meta":
        return aranges is not None and aranges.get(t, _MISSING) == t._version
    return bool(torch.equal(t.cpu(), torch.arange(n, dtype=t.dtype)))


def _counts_from_zero(args: tuple, kwargs: dict) -> bool:
    """Whether ``torch.arange(*args, **kwargs)`` counts 0, 1, 2, ...: ``arange(end)``,
    ``arange(0, end)`` or ``arange(0, end, 1)``, with Python ints."""
    start = kwargs.get("start", args[0] if len(args) >= 2 else 0)
    step = kwargs.get("step", args[2] if len(args) >= 3 else 1)
    return type(start) is int and type(step) is int and start == 0 and step == 1


def item_write(
    tracer: Any, x: Any, index: Any, value: Any, where: str, aranges: WeakIdKeyDictionary | None = None
) -> fx.Proxy:
    """The proxy of the tensor ``x[index] = value`` leaves in ``x`` (form 3 of the module
    docstring): ``x`` a proxy or a real tensor (a constant of the graph), ``index`` and ``value``
    proxies, real tensors or Python values; ``aranges``: the meta tensors the forward made by
    ``torch.arange`` (:class:`ItemWrites`). A :class:`TraceError` naming ``where`` for an index the
    forms do not cover."""
    xv = _value(x)
    if not isinstance(xv, torch.Tensor):
        raise TraceError(f"item assignment at {where}: the shape of the written tensor is unknown to the capture")
    idx = index if isinstance(index, tuple) else (index,)
    vals = [_value(i) for i in idx]
    if not idx or not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in vals):
        raise TraceError(
            f"item assignment at {where} indexes with slices, integers, None or a 0-dim tensor, which the fx "
            "capture does not follow (it captures x[mask] = v and x[index tensors] = v); write it out of place "
            "(torch.where, masked_fill, index_put, torch.cat), or trace with capture='export'"
        )
    func = lambda f, *args: tracer.create_proxy("call_function", f, args, {})  # noqa: E731
    mask = vals[0]
    if len(idx) == 1 and mask.dtype == torch.bool and tuple(mask.shape) == tuple(xv.shape[: mask.dim()]):
        if _number_fits(value, xv.dtype):
            m = idx[0]
            if mask.dim() < xv.dim():
                m = func(torch.reshape, m, (*mask.shape, *(1,) * (xv.dim() - mask.dim())))
            return func(torch.masked_fill, x, m, value)
    if (
        len(idx) == 2
        and xv.dim() == 2
        and _is_arange(idx[0], xv.shape[0], aranges)
        and vals[1].dtype == torch.int64
        and tuple(vals[1].shape) == (xv.shape[0],)
        and _number_fits(value, xv.dtype)
    ):
        j = idx[1]
        wrapped = func(torch.where, func(torch.lt, j, 0), func(torch.add, j, xv.shape[1]), j)
        return func(torch.scatter, x, 1, func(torch.unsqueeze, wrapped, 1), value)
    vv = _value(value)
    if isinstance(vv, torch.Tensor):
        if vv.dtype != xv.dtype:
            value = func(torch.Tensor.to, value, xv.dtype) if isinstance(value, fx.Proxy) else value.to(xv.dtype)
    elif isinstance(vv, (bool, int, float)):
        value = torch.tensor(vv, dtype=xv.dtype)
    else:
        raise TraceError(
            f"item assignment at {where} assigns a {type(vv).__name__}, which the fx capture does not follow"
        )
    return func(torch.index_put, x, tuple(idx), value)


def _concrete(t: Any) -> bool:
    """A tensor, not a traced value (real, or meta where the model is captured on meta)."""
    return isinstance(t, torch.Tensor) and not isinstance(t, fx.Proxy)


#: ops whose result may share an operand's storage (views, no-op conversions), by name
_MAY_ALIAS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "detach", "expand", "expand_as", "as_strided", "narrow", "select",
    "squeeze", "unsqueeze", "transpose", "permute", "t", "T", "mT", "H", "mH", "flatten", "unflatten", "movedim",
    "moveaxis", "swapaxes", "swapdims", "diagonal", "unfold", "split", "chunk", "unbind", "tensor_split", "getitem",
    "contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "bool", "real",
    "imag", "data", "alias", "ravel", "view_as_real", "view_as_complex", "align_to", "requires_grad_",
})  # fmt: skip


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


#: what a write leaves unchanged: read on the real tensor (``len(x)``, ``x.shape``, ``x.dtype``, ...)
_SHAPE_ONLY = frozenset({
    "__len__", "size", "dim", "numel", "ndimension", "nelement", "element_size", "is_floating_point", "is_complex",
    "get_device", "shape", "dtype", "device", "ndim", "is_cuda", "is_meta", "layout", "is_sparse", "is_quantized",
    "requires_grad", "is_leaf", "names", "itemsize", "nbytes", "stride", "storage_offset", "is_contiguous",
})  # fmt: skip


def _reads_values(func: Any) -> bool:
    """Whether ``func`` may read a tensor's values (not only what :data:`_SHAPE_ONLY` names)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name not in _SHAPE_ONLY


class ItemWrites(TorchFunctionMode):
    """Active while fx traces a forward: the item writes of form 3.

    A traced ``x`` (a proxy) is written by :meth:`proxy_write` (``_Proxy.__setitem__``), which
    points the proxy at the new node. A real tensor cannot be re-pointed, so this mode keeps, for
    each one a traced write reached, the proxy of its current value (``current``) and substitutes
    it wherever the tensor is passed to torch afterwards (and the tracer does where it becomes a
    node's argument). A real tensor may be written only if the forward made it (``made``: the
    results of torch calls during the capture) and no other tensor shares its storage (a view,
    ``detach``); writes with no traced part run as written, on the real tensor."""

    def __init__(self, tracer: Any, where: Any = None):
        super().__init__()
        self.tracer = tracer
        self.where = where or (lambda: "forward")
        self.current: WeakIdKeyDictionary = WeakIdKeyDictionary()  # real tensor -> proxy of its value
        self.made: WeakIdKeyDictionary = WeakIdKeyDictionary()  # real tensors the forward computed
        self.shared: WeakIdKeyDictionary = WeakIdKeyDictionary()  # made tensors another tensor shares
        self.owner: dict[int, Any] = {}  # storage -> weakref to the first made tensor on it
        self.writes: list[Write] = []
        # meta tensors made by torch.arange(n) -> their version then (on meta, _is_arange cannot
        # compare values: a row write through (torch.arange(N), j) is recognised by how it was made)
        self.aranges: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def substitute(self, tree: Any) -> Any:
        """``tree`` with every written real tensor replaced by the proxy of its current value."""
        if not self.current:
            return tree
        return pytree.tree_map(
            lambda a: self.current.get(a, a) if isinstance(a, torch.Tensor) and not isinstance(a, fx.Proxy) else a,
            tree,
        )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.current and _reads_values(func):
            new_args, new_kwargs = self.substitute((args, kwargs))
            proxies = [a for a in pytree.tree_leaves((new_args, new_kwargs)) if isinstance(a, fx.Proxy)]
            if proxies and func is not torch.Tensor.__setitem__:
                if getattr(func, "__name__", "") == "__get__":  # x.T, x.data: the proxy's attribute
                    return getattr(new_args[0], func.__self__.__name__)
                return type(proxies[0]).__torch_function__(func, (type(proxies[0]),), new_args, new_kwargs)
            args, kwargs = new_args, new_kwargs
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs:
            x, index, value = args
            if isinstance(x, fx.Proxy):  # a written real tensor, now the proxy of its value
                self.proxy_write(x, index, value)
                return None
            if _is_traced((index, value)):
                self._check_real(x)
                self.current[x] = item_write(self.tracer, x, index, value, self.where(), self.aranges)
                return None
        out = func(*args, **kwargs)
        if func is torch.arange and _concrete(out) and out.device.type == "meta" and _counts_from_zero(args, kwargs):
            self.aranges[out] = out._version
        self._note(func, out, (args, kwargs))
        return out

    def _note(self, func: Any, out: Any, inputs: Any) -> None:
        """Record the tensors computed in the forward (``made``) and those another tensor shares
        (``shared``): a result of a view-like op of a made operand (``_MAY_ALIAS``, by name: meta
        tensors have no storage to compare), or one on a made tensor's storage. A result on an
        operand's storage that the forward did not make is not made either."""
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if _concrete(t)]
        if not outs:
            return
        given = [t for t in pytree.tree_leaves(inputs) if _concrete(t)]
        name = str(getattr(func, "__name__", "")).strip("_")
        if name == "get":  # a property: x.T, x.data, x.real
            name = str(getattr(getattr(func, "__self__", None), "__name__", ""))
        ptrs = {_storage(t) for t in given} - {None}
        for t in outs:
            if any(t is g for g in given):
                continue
            if t._base is not None:
                if t._base in self.made:
                    self.shared[t._base] = True
                continue
            ptr = _storage(t)
            if ptr is None:  # meta: no storage to compare
                if name in _MAY_ALIAS:
                    for g in given:
                        if g in self.made:
                            self.shared[g] = True
                else:
                    self.made[t] = True
                continue
            first = self.owner.get(ptr)
            held = first() if first is not None else None
            if held is None and ptr not in ptrs:
                self.owner[ptr] = weakref.ref(t)
                self.made[t] = True
            elif held is not None and held is not t:
                self.shared[held] = True

    def _check_real(self, x: Any) -> None:
        where = self.where()
        if not isinstance(x, torch.Tensor) or x not in self.made:
            found = (
                f"{name}.{k}" if name else k
                for name, m in self.tracer.root.named_modules()
                for k, v in vars(m).items()
                if v is x
            )
            what = next(iter(found), None)
            raise TraceError(
                f"in-place item assignment at {where} updates "
                f"{f'the tensor attribute {what}' if what else 'a tensor made outside the forward (a global?)'} with "
                "traced values: one device keeps the write for later calls, and hapc does not replay in-place updates "
                "made in forward yet; make the tensor in the forward, or register it as a buffer and update it out "
                "of forward (e.g. after optimizer.step())"
            )
        if x in self.shared or x._base is not None:
            raise TraceError(
                f"item assignment at {where} writes traced values into a tensor that shares its storage with another "
                "(a view, detach()): one device would change both; write it out of place (torch.where, "
                "masked_fill, index_put), or trace with capture='export'"
            )

    def proxy_write(self, x: fx.Proxy, index: Any, value: Any) -> fx.Proxy:
        """``x[index] = value`` on a proxy: the proxy now stands for the written tensor; the write
        is kept for :meth:`check` (which refuses later reads of the old value through an alias)."""
        where = self.where()
        new = item_write(self.tracer, x, self.substitute(index), self.substitute(value), where, self.aranges)
        self.writes.append(Write(x.node, new.node, where))
        x.node = new.node
        return x

    def check(self, graph: fx.Graph, may_alias: Any) -> None:
        """Refuse a write whose old value another node may share (``may_alias(node)``: the node's
        result may share its first operand's storage) and that is read after the write, or that
        belongs to a model input, parameter or buffer: one device would see the write there."""
        if not self.writes:
            return
        order = {n: i for i, n in enumerate(graph.nodes)}
        root = self.tracer.root

        def aliasing(n: fx.Node) -> bool:
            if n.op == "call_module":  # dropout / identity return their input (p = 0, eval); a user's leaf may
                m = root.get_submodule(n.target)
                kept = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                        torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout, torch.nn.Identity, torch.nn.Flatten,
                        torch.nn.Unflatten)  # fmt: skip
                return (
                    isinstance(m, kept) or not type(m).__module__.startswith("torch.") or getattr(m, "inplace", False)
                )
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            if name in ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"):
                return bool(n.args) and isinstance(n.args[0], fx.Node)
            return may_alias(n)

        for w in self.writes:
            base = w.old
            for _ in range(64):
                if not aliasing(base) or not isinstance(base.args[0], fx.Node):
                    break
                base = base.args[0]
            group, todo = {base}, [base]
            while todo:
                b = todo.pop()
                for u in b.users:
                    if u not in group and aliasing(u) and u.args and u.args[0] is b:
                        group.add(u)
                        todo.append(u)
            state = next((g for g in group if g.op in ("placeholder", "get_attr")), None)
            if state is not None:
                what = "the model input" if state.op == "placeholder" else "the parameter or buffer"
                raise TraceError(
                    f"in-place item assignment at {w.where} updates {what} "
                    f"{state.target}: hapc does not replay in-place updates of parameters, buffers or inputs in "
                    "forward yet; write it out of place, or move the update out of forward"
                )
            here = order[w.new]
            for g in group:
                later = [u for u in g.users if order[u] > here]
                if later:
                    raise TraceError(
                        f"item assignment at {w.where} writes into {w.old.name}, whose storage {g.name} shares and "
                        f"{later[0].name} reads after the write (one device would read the written values there); "
                        "write it out of place (torch.where, masked_fill, index_put), or trace with capture='export'"
                    )


# --------------------------------------------------------------------------------------------
# refused: NumPy draws


#: the model functions whose NumPy draws are transformers' SpecAugment (Wav2Vec2, HuBERT, ...)
_SPEC_AUGMENT = ("_compute_mask_indices", "_sample_negative_indices")


@contextlib.contextmanager
def numpy_draws_refused(where: Callable[[], str]) -> Iterator[None]:
    """While a model is captured, a draw from NumPy's global generator (``np.random.rand``,
    ``np.random.choice``, ...) made by the model's code raises a :class:`TraceError` naming
    ``where()``: neither capture records it, so the program would reuse the capture's draw at every
    step (on every rank) where one device draws anew. Draws by torch or hapc pass."""
    try:
        import numpy as np
    except ImportError:
        yield
        return
    state = np.random.mtrand._rand
    names = [k for k, v in vars(np.random).items() if getattr(v, "__self__", None) is state and callable(v)]
    saved = {k: getattr(np.random, k) for k in names}

    def refusing(name: str, fn: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            path = os.path.abspath(caller.f_code.co_filename)
            if path.startswith((_TORCH, _HAPC)):
                return fn(*args, **kwargs)
            hint = ""
            if caller.f_code.co_name in _SPEC_AUGMENT:
                hint = (
                    " (transformers' SpecAugment, in training: set config.mask_time_prob = 0 and "
                    "config.mask_feature_prob = 0 to train without it, or apply the masks to the batch outside "
                    "the model)"
                )
            raise TraceError(
                f"{where()}: the forward draws random numbers with NumPy (np.random.{name}); the capture would "
                "freeze one draw into the program, while one device draws anew at every step: draw them with "
                f"torch, which hapc captures{hint}"
            )

        return draw

    for k, fn in saved.items():
        setattr(np.random, k, refusing(k, fn))
    try:
        yield
    finally:
        for k, fn in saved.items():
            setattr(np.random, k, fn)
