"""Tracing's meta evaluations, cheaper (issue 15, cold start): no sympy, and each repeated call once.

A cold ``hapc synth`` of ViT-24 spent ~1 s computing the shapes of its nodes with torch's meta
kernels: 0.5 s importing sympy for them, 0.6 s running them. Both are cut here, exactly.

**No sympy.**

hapc traces with static shapes: every size a meta kernel sees is a Python ``int``, every condition a
``bool``. Torch's Python meta kernels and references still import ``torch.fx.experimental.
symbolic_shapes`` on their first call -- ``torch._check`` does, for ``expect_true``; ``meta_conv``,
``cat``, ``expand``... do, for ``guard_or_false``, ``sym_and``... -- and ``elementwise_dtypes``
imports ``sympy`` itself to ask ``isinstance(x, sympy.Basic)``. That module imports sympy: about
0.5 s and 480 modules of a cold ``hapc synth``, for answers that on plain values are the values
themselves.

:func:`without_sympy` stands in for both modules, where neither has been imported yet, while torch's
meta kernels run for hapc's tracer -- each evaluation, never the model's own code around it:

* ``torch.fx.experimental.symbolic_shapes``: the functions the meta kernels call, each answering a
  plain argument exactly as torch's does (``guard_or_false(b) = b`` for a ``bool`` b, ``sym_eq``
  of int lists, ...) and handing anything else (a ``SymInt``, a wrong type: torch's own error) to
  the real module; any other name imports the real module and is its value.
* ``sympy``: ``Basic`` only, whose ``isinstance`` is False while sympy is not imported -- no
  instance of a sympy class can exist before sympy is -- and sympy's own answer after; any other
  name imports the real sympy.

Once a real module is imported (a user's leaf module whose flop count needs it, a symbolic value),
it replaces the stand-in in ``sys.modules`` and the stand-in's namespace becomes the real one's, so
code that imported the stand-in meanwhile sees the real module from then on. The stand-ins leave
``sys.modules`` when the block ends: a later import anywhere gets the real modules, as in a process
that never traced.

**A memo** (:class:`MetaMemo`). A transformer's layers make the same calls on the same shapes
(ViT-24: 24 x ``scaled_dot_product_attention`` at 5 ms, ``gelu``, ``layer_norm`` at 2 ms each...). A
meta kernel reads only its arguments' metadata, plain values and a little global state, so the
memo keys on exactly those and answers a repeated call with a fresh tensor of the recorded result's
metadata (ViT-24's trace: 0.9 -> 0.3 s at load 3).

``tests/test_cold_start.py`` checks the stand-ins' answers against torch's own, every memo hit
against the real evaluation, and the zoo's graphs with and without both.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

SHAPES = "torch.fx.experimental.symbolic_shapes"
SYMPY = "sympy"
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PACKAGES = frozenset({SYMPY})  # importing one of their submodules asks for __path__: the real package's


class _StandIn(types.ModuleType):
    """A module standing in for ``name`` until the real one is needed; then an alias of it."""

    def __init__(self, name: str, doc: str):
        super().__init__(name, doc)
        self._hapc_standin = True

    def __getattr__(self, attr: str) -> Any:  # a name the stand-in does not answer: the real module's
        if attr == "__all__" or (attr == "__path__" and self.__name__ in _PACKAGES):  # import *, a submodule
            return getattr(_real(self.__name__), attr)
        if attr.startswith("__"):  # the import system's other probes (__file__, a module's __path__...)
            raise AttributeError(attr)
        return getattr(_real(self.__name__), attr)


def _real(name: str) -> types.ModuleType:
    """Import the real module ``name`` (in place of its stand-in) and make the stand-in its alias."""
    standin = _STANDINS[name]
    if sys.modules.get(name) is standin:
        del sys.modules[name]
        _set_parent_attr(name, None, standin)
    module = importlib.import_module(name)
    if standin.__dict__.get("_hapc_standin"):  # once: the stand-in's namespace becomes the real one's
        standin.__dict__.clear()
        standin.__dict__.update(module.__dict__)
    return module


def _set_parent_attr(name: str, value: Any, expect: Any = None) -> None:
    """``parent.child = value`` for a dotted ``name`` (what an import does), or remove it when
    ``value`` is None and the attribute is ``expect``."""
    parent, _, child = name.rpartition(".")
    if not parent or parent not in sys.modules:
        return
    pkg = sys.modules[parent]
    if value is not None:
        setattr(pkg, child, value)
    elif getattr(pkg, child, None) is expect:
        with contextlib.suppress(AttributeError):
            delattr(pkg, child)


# -- torch.fx.experimental.symbolic_shapes, on plain values -----------------------------------------


def _identity_on(kind: type, name: str) -> Callable[..., Any]:
    """``name(a)`` of the real module, which returns ``a`` itself when ``type(a) is kind``."""

    def plain(a: Any, *rest: Any, **kwargs: Any) -> Any:
        if type(a) is kind and not rest and not kwargs:
            return a
        return getattr(_real(SHAPES), name)(a, *rest, **kwargs)

    plain.__name__ = plain.__qualname__ = name
    return plain


def _fold(name: str, op: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """``sym_and`` / ``sym_or``: ``op`` folded over the arguments (torch's definition)."""

    def plain(x: Any, *others: Any) -> Any:
        if type(x) is bool and all(type(y) is bool for y in others):
            for y in others:
                x = op(x, y)
            return x
        return getattr(_real(SHAPES), name)(x, *others)

    plain.__name__ = plain.__qualname__ = name
    return plain


def _plain_pair(x: Any, y: Any) -> bool:
    """Whether torch's ``sym_eq(x, y)`` compares plain ints only (or returns False on lengths)."""
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) != len(y) or all(_plain_pair(a, b) for a, b in zip(x, y))
    return type(x) in (int, bool) and type(y) in (int, bool)


def _sym_eq(x: Any, y: Any) -> Any:
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        if len(x) != len(y):
            return False
        return functools.reduce(operator.and_, map(_sym_eq, x, y), True)
    return x == y


def sym_eq(x: Any, y: Any) -> Any:
    """``==``, element by element on (nested) sequences of ints, joined by ``and`` (torch's definition)."""
    if _plain_pair(x, y):
        return _sym_eq(x, y)
    return _real(SHAPES).sym_eq(x, y)


def is_nested_int(s: Any) -> Any:
    """False for anything but a ``SymInt``."""
    return isinstance(s, torch.SymInt) and _real(SHAPES).is_nested_int(s)


def has_guarding_hint(a: Any) -> bool:
    """True for anything but a symbolic value."""
    return not isinstance(a, _SYMBOLIC) or _real(SHAPES).has_guarding_hint(a)


def guarding_hint_or_throw(a: Any) -> Any:
    """A ``bool`` or ``int`` is its own hint."""
    if type(a) in (bool, int):
        return a
    return _real(SHAPES).guarding_hint_or_throw(a)


_BOOL_IDENTITIES = ("expect_true", "guard_bool", "guard_or_false", "guard_or_true", "guard_size_oblivious",
                    "statically_known_true")  # fmt: skip
_INT_IDENTITIES = ("guard_int", "optimization_hint")


def _shapes_standin() -> _StandIn:
    m = _StandIn(SHAPES, f"hapc's stand-in for {SHAPES} on plain values (hapc.theory.plain_meta)")
    for name in _BOOL_IDENTITIES:
        setattr(m, name, _identity_on(bool, name))
    for name in _INT_IDENTITIES:
        setattr(m, name, _identity_on(int, name))
    m.sym_and = _fold("sym_and", operator.and_)
    m.sym_or = _fold("sym_or", operator.or_)
    for fn in (sym_eq, is_nested_int, has_guarding_hint, guarding_hint_or_throw):
        setattr(m, fn.__name__, fn)
    return m


# -- sympy.Basic, before sympy exists ------------------------------------------------------------------


def _sympy_if_imported() -> Any:
    module = sys.modules.get(SYMPY)
    return None if module is None or module.__dict__.get("_hapc_standin") else module


class _BasicMeta(type):
    """``isinstance``/``issubclass`` against sympy's ``Basic``: False while sympy is not imported (no
    sympy object can exist before), sympy's answer after. A class derived from it derives from the
    real ``Basic``."""

    def __instancecheck__(cls, obj: Any) -> bool:
        real = _sympy_if_imported()
        return real is not None and isinstance(obj, real.Basic)

    def __subclasscheck__(cls, sub: type) -> bool:
        real = _sympy_if_imported()
        return real is not None and issubclass(sub, real.Basic)

    def __new__(mcs, name: str, bases: tuple, ns: dict[str, Any]) -> Any:
        if not bases:  # the stand-in's Basic itself
            return super().__new__(mcs, name, bases, ns)
        real = _real(SYMPY).Basic
        bases = tuple(real if isinstance(b, _BasicMeta) else b for b in bases)
        return type(real)(name, bases, ns)

    def __getattr__(cls, attr: str) -> Any:
        return getattr(_real(SYMPY).Basic, attr)


def _sympy_standin() -> _StandIn:
    m = _StandIn(SYMPY, "hapc's stand-in for sympy before it is imported (hapc.theory.plain_meta)")
    m.Basic = _BasicMeta("Basic", (), {"__module__": SYMPY})
    return m


#: one stand-in per module for the process: an alias of the real module once that is imported
_STANDINS: dict[str, _StandIn] = {SYMPY: _sympy_standin(), SHAPES: _shapes_standin()}


class _Window:
    """While open (re-entrant), the stand-ins are in ``sys.modules`` for the modules not imported yet."""

    def __init__(self) -> None:
        self.depth = 0
        self.placed: list[str] = []

    def __enter__(self) -> None:
        self.depth += 1
        if self.depth > 1:
            return
        for name, standin in _STANDINS.items():
            if name not in sys.modules and standin.__dict__.get("_hapc_standin"):
                sys.modules[name] = standin
                _set_parent_attr(name, standin)
                self.placed.append(name)

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        if self.depth:
            return
        for name in self.placed:
            standin = _STANDINS[name]
            if sys.modules.get(name) is standin:
                del sys.modules[name]
                _set_parent_attr(name, None, standin)
        self.placed.clear()


_WINDOW = _Window()


def without_sympy() -> contextlib.AbstractContextManager[None]:
    """A block of torch's own meta kernels (no user code: a model's forward must see the real modules)
    with the stand-ins for the modules not yet imported (see the module docstring); they leave
    ``sys.modules`` when it ends. Re-entrant."""
    return _WINDOW


# -- a memo of meta evaluations --------------------------------------------------------------------

#: operator's in-place functions (``x += y`` under fx) and item assignment: never memoised
_WRITES = frozenset(
    getattr(operator, n)
    for n in ("iadd", "iand", "iconcat", "ifloordiv", "ilshift", "imatmul", "imod", "imul", "ior", "ipow", "irshift",
              "isub", "itruediv", "ixor", "setitem", "delitem")
)  # fmt: skip
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class _Unkeyable(Exception):
    """An argument whose value the memo cannot key on: the call runs as it is."""


def _sig(v: Any) -> Any:
    """What a meta kernel may read of an argument: a tensor's metadata, a plain value with its type."""
    t = type(v)
    if t in _TENSOR_TYPES:
        if v.device.type != "meta" or v.layout is not torch.strided or v.is_conj() or v.is_neg():
            raise _Unkeyable
        return (t, v.dtype, tuple(v.shape), v.stride(), v.storage_offset(), v.requires_grad)
    if t is float or t is complex:
        return t, repr(v)  # -0.0 and 0.0, nan: as written
    if t in (int, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.memory_format, torch.layout):
        return t, v
    if t in (tuple, list, torch.Size):
        return t, tuple(_sig(e) for e in v)
    if t is slice:
        return t, _sig(v.start), _sig(v.stop), _sig(v.step)
    raise _Unkeyable


def _template(out: Any, args: tuple, kwargs: dict) -> Any:
    """How to make ``out`` again from nothing, or None where that would not be the same: only fresh
    tensors (a view or an input returned keeps its aliasing, so it is not memoised), at offset 0."""
    if type(out) is torch.Tensor:
        if out._is_view() or out.storage_offset() != 0 or out.layout is not torch.strided:
            return None
        if out.is_conj() or out.is_neg():
            return None
        if any(out is a for a in (*args, *kwargs.values())):
            return None
        tmpl = (out.dtype, tuple(out.shape), out.stride(), out.requires_grad)
        return tmpl if _rebuild(tmpl).stride() == out.stride() else None
    if isinstance(out, (tuple, list)) and (type(out) in (tuple, list) or type(out).__module__ == "torch.return_types"):
        parts = [_template(o, args, kwargs) for o in out]
        return None if any(p is None for p in parts) else (type(out), parts)
    return None


def _rebuild(tmpl: Any) -> Any:
    if isinstance(tmpl[0], torch.dtype):
        dtype, shape, stride, requires_grad = tmpl
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        # an op's result that requires grad is no leaf (in-place ops on it are allowed): a clone's isn't
        return t.requires_grad_().clone() if requires_grad else t
    kind, parts = tmpl
    return kind(_rebuild(p) for p in parts) if kind in (tuple, list) else kind([_rebuild(p) for p in parts])


_TORCH_MODULES = ("_operator", "builtins", "math")


def _torch_code(fn: Any, args: tuple, method: str | None) -> bool:
    """Whether the call runs torch's code only: a plain tensor's method, a function of torch (or of
    operator / builtins / math, which dispatch to the tensor's methods) or one of hapc's own ops
    (``hapc.ops``: torch calls on their operands)."""
    if method is not None:
        return bool(args) and type(args[0]) in _TENSOR_TYPES
    module = getattr(fn, "__module__", None) or ""
    return module.split(".", 1)[0] in ("torch", "hapc") or module in _TORCH_MODULES


class MetaMemo:
    """Meta evaluations of one trace, keyed by what a meta kernel reads: the function (or method
    name), every argument's metadata and plain value, the default dtype and grad mode. A transformer's
    layers repeat the same calls on the same shapes; a kernel reads nothing else, so its result's
    metadata is the same, and a fresh tensor with that metadata (shape, strides, dtype,
    requires_grad, not a leaf where it requires grad) stands for it. Never memoised: in-place calls
    (a name ending in ``_``, ``inplace=True``, ``out=``, operator's in-place functions), results that
    are views or inputs, non-tensor results, arguments it cannot key (objects, tensor subclasses),
    and anything under autocast."""

    def __init__(self) -> None:
        self.table: dict[Any, Any] = {}
        self.hits = 0

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, method: str | None = None) -> Any:
        """``fn(*args, **kwargs)`` (or ``args[0].method(*args[1:], **kwargs)``), from the memo where it can.
        Only torch's own functions and tensor methods are memoised and see the stand-ins; a user's
        function (a ``custom_op``, an autograd Function) runs as it is, every time."""
        if not _torch_code(fn, args, method):
            return getattr(args[0], method)(*args[1:], **kwargs) if method is not None else fn(*args, **kwargs)
        key = self._key(fn, args, kwargs, method)
        if key is not None:
            tmpl = self.table.get(key)
            if tmpl is not None:
                self.hits += 1
                return _rebuild(tmpl)
        with _WINDOW:  # torch's kernels only: the stand-ins are never visible to a model's own code
            out = getattr(args[0], method)(*args[1:], **kwargs) if method is not None else fn(*args, **kwargs)
        if key is not None:
            tmpl = _template(out, args, kwargs)
            if tmpl is not None:
                self.table[key] = tmpl
        return out

    @staticmethod
    def _key(fn: Any, args: tuple, kwargs: dict, method: str | None) -> Any:
        name = method if method is not None else getattr(fn, "__name__", "")
        if not isinstance(name, str) or (name.endswith("_") and not name.endswith("__")) or name.startswith("__i"):
            return None  # in place (x.add_, x.__iadd__), or unnamed
        if kwargs.get("inplace") or "out" in kwargs or torch._C._is_any_autocast_enabled():
            return None
        schema = getattr(fn, "_schema", None)  # an aten overload (torch.ops.aten.add_.Tensor)
        if schema is not None and getattr(schema, "is_mutable", True):
            return None
        try:
            if method is None and fn in _WRITES:
                return None
            return (
                method if method is not None else fn, torch.get_default_dtype(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), _sig(args), tuple((k, _sig(v)) for k, v in kwargs.items()),
            )  # fmt: skip
        except (_Unkeyable, TypeError):  # TypeError: an unhashable function
            return None
