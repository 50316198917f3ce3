"""``trace(model, example_inputs)``: a model becomes a :class:`RefGraph` (DESIGN §3, HAP §4.1).

Three steps:

1. **Symbolic trace** with ``torch.fx``. Standard ``torch.nn`` modules stay leaves and are then
   rewritten to functional form (:mod:`hapc.theory.normalize`); data-dependent Python control
   flow is an error naming the offending source line.
2. **Shape propagation on the meta device.** Every parameter, buffer and input is replaced by a
   ``meta`` tensor of the same shape and dtype, so a model with billions of parameters -- even one
   built under ``torch.device("meta")`` -- is traced without allocating it. Flops per node come
   from :mod:`hapc.theory.flops` on the same run (``torch.utils.flop_counter`` for a user's leaf
   module).
3. **Specialisation.** Every non-tensor value (sizes, shapes, dtypes, Python arithmetic on them)
   is folded to a constant; tuple-returning ops are split per output (``split``/``chunk`` become
   ``narrow``); nodes that do not reach the loss are dropped.
"""

from __future__ import annotations

import contextlib
import linecache
import operator
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .._util import without_gc
from ..errors import TraceError
from .cse import merge_common
from .draws import CaptureDraws, leaf_evaluation
from .flops import contraction_flops
from .graph import BUFFER, INPUT, OP, PARAM, Ref, RefGraph, RefNode, TensorMeta, iter_refs
from .normalize import NORMALISERS, cumulative_average, normalise_modules, normaliser
from .opnames import canonical_name, qualified_name
from .plain_meta import MetaMemo, without_sympy
from .registry import Registry, default_registry
from .static_forms import Guard, ItemWrites, ctc_loss_call, drop_unused_masked_selects, guard_at, numpy_draws_refused


class CurrentDevice:
    """Stands for "the device this runs on" where the model passed ``x.device`` along."""

    def __repr__(self) -> str:
        return "<device>"


CURRENT_DEVICE = CurrentDevice()

_HAPC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


_MISSING = object()
_SHAPE_ATTRS = {"shape", "dtype", "ndim", "device", "is_cuda", "layout", "is_sparse", "is_quantized"}
_SHAPE_METHODS = {
    "size",
    "dim",
    "numel",
    "ndimension",
    "nelement",
    "element_size",
    "is_floating_point",
    "is_complex",
    "get_device",
}


class _Proxy(fx.Proxy):
    """A proxy that knows its value's shape and dtype (computed on meta tensors while tracing).

    ``B, T, C = x.size()``, ``x.shape[-1] ** 0.5``, ``q, k, v = x.chunk(3, -1)`` and ``if x.dim() == 3``
    then run as ordinary Python: hapc specialises shapes anyway. Control flow on tensor *values*
    still fails, with the offending line.
    """

    def __getattr__(self, name: str) -> Any:
        val = self.node.meta.get("hapc_val", _MISSING)
        if isinstance(val, torch.Tensor):
            if name == "device":  # where the model really lives, not the meta device of tracing
                return self.tracer.device  # type: ignore[attr-defined]
            if name in _SHAPE_ATTRS or name in _SHAPE_METHODS:
                return getattr(val, name)
        if isinstance(val, tuple) and name in ("values", "indices"):  # x.max(dim).values
            return self[0 if name == "values" else 1]
        if name == "bincount":  # x.bincount(minlength=m): as torch.bincount (captured over m bins)
            return lambda weights=None, minlength=0: torch.bincount(self, weights, minlength)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data":  # `p.data = ...` in forward: fx would keep it on this proxy, unrecorded
            raise TraceError(
                f"in-place assignment to .data of {self.node.name} in forward: hapc does not replay updates of "
                "parameters or buffers made in forward yet; move the update out of forward (e.g. after "
                "optimizer.step(), under torch.no_grad())"
            )
        super().__setattr__(name, value)

    def __setitem__(self, index: Any, value: Any) -> None:
        """``x[index] = value``: the proxy stands for the written tensor from here on
        (:class:`~hapc.theory.static_forms.ItemWrites`; forms it does not cover are refused)."""
        self.tracer.writes.proxy_write(self, index, value)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        val = self.node.meta.get("hapc_val", _MISSING)
        if isinstance(val, (torch.Tensor, tuple, list)):
            return len(val)
        return super().__len__()

    def __iter__(self) -> Any:
        val = self.node.meta.get("hapc_val", _MISSING)
        if isinstance(val, (torch.Tensor, tuple, list)):
            return iter([self[i] for i in range(len(val))])
        return super().__iter__()


def _library_leaves() -> tuple[Any, ...]:
    """Library functions kept whole because a rule draws them rank-consistently
    (:mod:`hapc.theory.rules.random`): timm's ``drop_path`` (traced inline it would be a
    ``bernoulli_``, refused on several ranks), only when the model's code already loaded timm."""
    fn = getattr(sys.modules.get("timm.layers.drop"), "drop_path", None)
    return (fn,) if callable(fn) else ()


def _named_root(root_fn: Any, extra: dict[str, Any] | None = None) -> Any:
    """A function with exactly the named parameters of a forward taking ``**kwargs`` (maybe behind
    a wrapper), calling ``root_fn`` with them by keyword (None when the forward takes no
    ``**kwargs``, or takes ``*args``): fx would give ``**kwargs`` a placeholder of its own, with no
    example value. Its code is generated so that fx, which reads ``__code__``, sees the names::

        def forward(self, pixel_values=None, labels=None):
            return _wrapped(self, pixel_values=pixel_values, labels=labels)

    Defaults are kept (fx's ``concrete_args`` and hapc's binding of the example inputs use them).
    ``extra``: keywords the example inputs give to ``**kwargs`` (Python values: flags such as
    ``output_hidden_states=True``), passed on as constants, as the call passes them."""
    import inspect

    inner = inspect.unwrap(root_fn)
    if not hasattr(inner, "__code__"):
        return None
    sig = inspect.signature(inner)
    params = list(sig.parameters.values())
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in params
    ):
        return None  # no **kwargs, or *args too (a variadic forward is refused by name: _bind_inputs)
    named = [p for p in params if p.kind not in variadic]
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in named[1:]) or not all(
        p.name.isidentifier() for p in named
    ):
        return None
    first, rest = named[0].name, named[1:]
    defaults = {p.name: p.default for p in rest if p.default is not inspect.Parameter.empty}
    head = ", ".join([first, *(f"{p.name}=_d[{p.name!r}]" if p.name in defaults else p.name for p in rest)])
    call = ", ".join([*(f"{p.name}={p.name}" for p in rest), *(["**_x"] if extra else [])])
    src = f"def {inner.__name__}({head}):\n    return _wrapped({first}, {call})\n"
    scope: dict[str, Any] = {"_wrapped": root_fn, "_d": defaults, "_x": dict(extra or {})}
    exec(compile(src, f"<hapc root of {inner.__qualname__}>", "exec"), scope)
    return scope[inner.__name__]


def _dict_types(a: Any) -> Any:
    """The types of the dicts in a nested value, in its shape: ``(type, {key: ...})`` for a dict,
    a list of the elements' for a tuple or list, None elsewhere."""
    if isinstance(a, dict):
        return (type(a), {k: _dict_types(v) for k, v in a.items()})
    if isinstance(a, (tuple, list)):
        return [_dict_types(v) for v in a]
    return None


def _index_tensor(v: Any) -> bool:
    """A concrete one-element integer tensor, which Python's slicing reads through ``__index__``."""
    return isinstance(v, torch.Tensor) and v.numel() == 1 and not (v.is_floating_point() or v.is_complex())


def _indexed_slice(a: slice) -> slice:
    """``x[lo:hi]`` with bounds that are concrete integer tensors (DeBERTa's ``rel_embeddings[m -
    att_span : m + att_span]``, ``att_span`` a ``torch.tensor`` of static sizes) slices by their
    ``__index__``, as eager does: the integers, not tensor constants of the graph (which become meta
    tensors when shapes are computed, and a meta tensor has no value to index with)."""
    return slice(*(operator.index(v) if _index_tensor(v) else v for v in (a.start, a.stop, a.step)))


class _Tracer(fx.Tracer):
    def __init__(self, leaves: tuple[type, ...], registry: Registry, example_inputs: Any):
        autowrap = (*registry.custom_functions.values(), *_library_leaves())
        super().__init__(autowrap_functions=autowrap)
        self.leaves = leaves
        # fx's record_stack_traces symbolizes the whole stack of every node (and imports torch._inductor
        # on the first): ~1 s of a cold `hapc synth`. create_proxy records the one frame hapc reports.
        self.record_stack_traces = False
        # buffers are graph inputs like parameters: computed on eagerly, `self.buf.clone()` would be a
        # constant of the moment of tracing, and a later update of the buffer (load_state_dict, a
        # queue) would never reach the program
        self.proxy_buffer_attributes = True
        self.region: int | None = None  # the torch.utils.checkpoint call being traced (see _regions)
        self.autocast: list[tuple] = []  # the torch.autocast contexts entered meanwhile (autocast_regions)
        self.example_inputs = example_inputs
        self._placeholders = 0
        self.device = _example_device(example_inputs)
        self.memo = MetaMemo()  # the layers' repeated meta evaluations, computed once (plain_meta)
        self._arg_depth = 0
        self.output_types: Any = None
        self.guards: list[Guard] = []  # the model's `if <tensor>: raise` checks (static_forms)
        self.control_flow: str | None = None  # where a truth value was refused (to_bool)
        self.writes = ItemWrites(self, _where)  # `x[i] = v` with traced parts (static_forms)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """The truth of a traced value: only in a check that raises (``if c: raise``, ``assert c``),
        recorded as a :class:`~hapc.theory.static_forms.Guard` and answered with the branch that does
        not raise; any other control flow on a value is refused (fx's error)."""
        frame = sys._getframe(1)
        caller = frame.f_back if frame.f_code.co_name == "__bool__" else None
        val = obj.node.meta.get("hapc_val", _MISSING)
        found = guard_at(caller) if caller is not None else None
        if found is None or not isinstance(val, torch.Tensor) or val.numel() != 1:
            # fx's error is a ValueError: a model that catches it would be captured on the branch
            # one device may not take; _trace_fx refuses a trace that completes after this
            at = caller or frame
            line = linecache.getline(at.f_code.co_filename, at.f_lineno).strip()
            self.control_flow = self.control_flow or f"{os.path.basename(at.f_code.co_filename)}:{at.f_lineno}: {line}"
            return super().to_bool(obj)
        raise_when, error, where = found
        self.guards.append(Guard(obj.node, raise_when, f"{where} (the model raises here on one device)", error))
        return not raise_when

    def create_arg(self, a: Any) -> Any:
        """fx's conversion of a node's (or the output's) arguments, which turns every dict into a
        plain ``dict``: the types of the dicts (Hugging Face's ``ModelOutput`` subclasses) of the
        last top-level call -- the output's, when the trace ends -- are kept in ``output_types``
        (:func:`_dict_types`) so the compiled module returns what the model does."""
        top = self._arg_depth == 0
        if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, nn.Parameter):
            # a tensor with a gradient computed eagerly while tracing: from parameters the trace
            # never saw as graph values (iterated from self.parameters(), not read as self.fc.weight)
            raise TraceError(
                f"{_where()}: the forward computes on the model's parameters outside the trace (a tensor "
                "with a gradient, made from parameters taken from self.parameters() / named_parameters() "
                "or held in a plain attribute): captured, it would be a constant of the moment of tracing "
                "whose gradient is lost -- silently unlike one device. Read each parameter as a module "
                "attribute (self.fc.weight), or leave the term out of the model: an L2 penalty "
                "c * sum(p.pow(2).sum()) is the optimizer's weight_decay=2*c (SGD)"
            )
        if isinstance(a, slice) and any(map(_index_tensor, (a.start, a.stop, a.step))):
            a = _indexed_slice(a)
        if isinstance(a, torch.Tensor) and self.writes.current:  # a real tensor a traced write reached
            a = self.writes.current.get(a, a)
        self._arg_depth += 1
        try:
            out = super().create_arg(a)
        finally:
            self._arg_depth -= 1
        if top:
            self.output_types = _dict_types(a)
        return out

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> Any:
        """A root whose forward takes ``**kwargs`` (Hugging Face's ``forward(self, pixel_values,
        labels, **kwargs)``) is traced through :func:`_named_root`, which takes the named
        parameters only and passes them on by name: fx would make ``**kwargs`` a placeholder
        without an example value, and where the forward is decorated (``@can_return_tuple``: BEiT,
        Wav2Vec2, ...) it reads the parameters from the unwrapped forward but calls the wrapper,
        binding a proxy or ``None`` to the wrapper's own ``**kwargs``."""
        shim = _named_root(root_fn, getattr(self, "var_keywords", {}))
        return super().create_args_for_root(shim or root_fn, is_module, concrete_args)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        """A module made during the forward and called at once (Hugging Face's
        ``ACT2FN[config.hidden_act](x)`` builds a fresh activation module: DeBERTa's pooler) is no
        submodule of the model, so it has no name to call it by: its forward is traced inline. One
        holding parameters or buffers is refused (they would be constants of the capture)."""
        try:
            self.path_of_module(m)
        except NameError:
            if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
                raise TraceError(
                    f"forward calls a {type(m).__name__} that is not a submodule of the model but holds parameters "
                    "or buffers (made during the forward?): create it in __init__ so that it is trained and saved"
                ) from None
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # the user's leaves and the modules with a functional form stay whole; every other module,
        # torch.nn's included (MultiheadAttention, Hardsigmoid), is traced into the functions it
        # calls. One with forward hooks is traced through too, its hooks with it (fx calls the
        # module, which runs them): kept whole, the module would become its function, hooks dropped
        return isinstance(m, self.leaves) or (normaliser(m) is not None and not _forward_hooked(m))

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        if kind == "call_function" and target is F.ctc_loss:
            rewritten = ctc_loss_call(self, args, kwargs)  # masked_select targets: padded (static_forms)
            if rewritten is not None:
                return rewritten
        if kind == "call_method" and target in _GRADIENT_HOOKS:
            raise TraceError(f"forward calls {target}() on a tensor ({_where()}): {_GRADIENT_CODE_FIX}")
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        p.node.meta["stack_trace"] = _model_frame()
        if self.region is not None:
            p.node.meta["hapc_region"] = self.region
        if self.autocast:
            p.node.meta["hapc_autocast"] = tuple(self.autocast)
        try:
            p.node.meta["hapc_val"] = self._meta_value(p.node)
        except Exception:  # the authoritative propagation after tracing reports real problems
            p.node.meta["hapc_val"] = _MISSING
        if not torch.is_grad_enabled() and kind in ("call_function", "call_method", "call_module"):
            # under torch.no_grad() / inference_mode in forward: its result carries no gradient
            # (fx records the op alike; the builder detaches it), unless the op returned an operand
            # itself (x.float() of a float, dropout in eval), which keeps its gradient as on one device
            val = p.node.meta["hapc_val"]
            p.node.meta["hapc_no_grad"] = not any(
                val is a.meta.get("hapc_val") for a in p.node.all_input_nodes if val is not _MISSING
            )
        return p

    def _meta_value(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            k = self._placeholders
            self._placeholders += 1
            ex = self.example_inputs
            if isinstance(ex, dict):
                val = ex.get(node.target, node.args[0] if node.args else _MISSING)
            else:
                ex = (ex,) if isinstance(ex, torch.Tensor) else tuple(ex)
                val = ex[k] if k < len(ex) else (node.args[0] if node.args else _MISSING)
            return _to_meta(val)
        if node.op == "get_attr":
            return _to_meta(_raw_attr(self.root, node.target))

        def val(n: fx.Node) -> Any:
            v = n.meta.get("hapc_val", _MISSING)
            if v is _MISSING and n.op == "get_attr":  # constants fx registered without a proxy
                v = n.meta["hapc_val"] = _to_meta(_raw_attr(self.root, n.target))
            if v is _MISSING:
                raise LookupError(n.name)
            return v

        # devices to meta, as :func:`_propagate` does: ``torch.rand(shape, device=x.device)`` (a draw
        # recorded as a node, :mod:`hapc.theory.draws`) names the example's device
        args, kwargs = _on_meta(fx.node.map_arg((node.args, node.kwargs), val))
        with torch.device("meta"):
            if node.op == "call_function":
                return self.memo.call(node.target, args, kwargs)
            if node.op == "call_method":
                return self.memo.call(None, args, kwargs, method=node.target)
            mod = _raw_attr(self.root, node.target)
            fast = _fast_leaf_value(mod, args, kwargs)
            if fast is not None:
                return fast
            with _unpatched_modules(), _torch_kernels(mod):
                return _call_leaf(mod, args, kwargs)


_MODULE_CALL, _MODULE_GETATTR = nn.Module.__call__, nn.Module.__getattr__


@contextlib.contextmanager
def _unpatched_modules() -> Any:
    """fx patches ``Module.__call__``/``__getattr__`` while tracing; computing a leaf module's
    meta value must run the real ones, or it would record nodes of its own (and so must the
    capture's random draws: :func:`hapc.theory.draws.leaf_evaluation`)."""
    call, getattr_ = nn.Module.__call__, nn.Module.__getattr__
    nn.Module.__call__, nn.Module.__getattr__ = _MODULE_CALL, _MODULE_GETATTR  # type: ignore[method-assign]
    try:
        with leaf_evaluation():
            yield
    finally:
        nn.Module.__call__, nn.Module.__getattr__ = call, getattr_  # type: ignore[method-assign]


def _example_device(example_inputs: Any) -> torch.device:
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    values = (values,) if isinstance(values, torch.Tensor) else values
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


CAPTURES = ("auto", "fx", "export")


@without_gc
def trace(
    model: nn.Module,
    example_inputs: Sequence[Any] | dict[str, Any],
    *,
    leaf_modules: Sequence[type] = (),
    registry: Registry | None = None,
    capture: str = "auto",
    loss: str | int | None = None,
) -> RefGraph:
    """Trace ``model`` into a reference graph with static shapes, dtypes and flops.

    Args:
        model: an ``nn.Module`` whose ``forward`` returns the training loss: a scalar tensor, or
            inside whatever it returns (a Hugging Face ``ModelOutput``, a dict, a tuple). It may
            live on any device, including ``meta``.
        example_inputs: positional inputs (tuple/list) or keyword inputs (dict), as the model is
            called: ``dict(input_ids=ids, labels=ids)``. Only shapes and dtypes are read; meta
            tensors are fine. An input left out or given as ``None`` is the constant ``None``.
        leaf_modules: module classes to keep as single ops (give them a rule with
            ``hapc.register_op(MyModule, "...")``).
        capture: ``"fx"`` (hapc's tracer: fast; keeps leaf modules and ``@hapc.custom_op``
            functions whole), ``"export"`` (``torch.export``, non-strict: any Python the model
            runs, as library models need; :mod:`hapc.theory.capture`) or ``"auto"`` (default: fx,
            and export where fx cannot follow the model's Python).
        loss: which output is the loss: a key of a returned dict / ``ModelOutput`` or an index
            into the returned tensors in order; default the ``"loss"`` key if there is one, else the
            first scalar floating-point tensor returned. The other returned tensors are outputs
            of the graph too (:attr:`RefGraph.output_spec`).

    Raises:
        TraceError: the model cannot be traced statically; the message names the source line.
    """
    registry = registry or default_registry
    if not isinstance(model, nn.Module):
        raise TraceError(f"hapc traces nn.Module instances, got {type(model).__name__}")
    if capture not in CAPTURES:
        raise TraceError(f"capture must be one of {CAPTURES}, got {capture!r}")
    _refuse_setups(model)
    if capture == "export":
        try:
            with (
                _no_state_assignment(),
                _backward_code_refused(),
                _bincount_with_minlength_as_one_hot(),
                numpy_draws_refused(_where),
            ):
                return _keep_constants(model, _trace_export(model, example_inputs, loss))
        except TraceError as export_error:
            if hint := _library_hint(model, export_error):
                raise TraceError(f"{export_error}\n  {hint}") from export_error
            raise
    buffers = {k: b.detach().clone() for k, b in model.named_buffers() if b.device.type != "meta"}
    try:
        with (
            torch.enable_grad(),  # the caller's grad mode (an evaluation under no_grad) is not the forward's
            _no_state_assignment(),
            _backward_code_refused(),
            _restoring(model, buffers),
            _state_unchanged(model),
            _bincount_with_minlength_as_one_hot(),
            numpy_draws_refused(_where),
        ):
            return _keep_constants(model, _trace_fx(model, example_inputs, leaf_modules, registry, loss))
    except TraceError as fx_error:
        if capture == "fx" or leaf_modules or _mutation_error(fx_error):
            raise
        try:
            with (
                _no_state_assignment(),
                _backward_code_refused(),
                _bincount_with_minlength_as_one_hot(),
                numpy_draws_refused(_where),
            ):
                return _keep_constants(model, _trace_export(model, example_inputs, loss))
        except TraceError as export_error:
            hint = _library_hint(model, export_error)
            raise TraceError(
                f"{fx_error}\n  (torch.export could not capture it either: {export_error})"
                + (f"\n  {hint}" if hint else "")
            ) from fx_error


@contextlib.contextmanager
def constants_kept(model: nn.Module) -> Iterator[None]:
    """Leave the tensors a capture attaches to ``model`` (its ``_tensor_constant*`` attributes, as
    fx does) as they were before the block: a capture inside it (the other train/eval mode, one
    micro-batch, a replay) may replace them, and the program built from the earlier capture reads
    them. Those the block made are removed, those it replaced restored."""
    before = {k: v for k, v in vars(model).items() if k.startswith("_tensor_constant")}
    try:
        yield
    finally:
        for name in [k for k in vars(model) if k.startswith("_tensor_constant")]:
            delattr(model, name)
        vars(model).update(before)


def _keep_constants(model: nn.Module, graph: RefGraph) -> RefGraph:
    """``graph`` with the tensors its capture made in forward (the ``_tensor_constant*`` attributes
    it left on ``model``) kept in :attr:`RefGraph.constants`: a later capture replaces them."""
    graph.constants = {
        n.target: vars(model)[n.target]
        for n in graph
        if n.kind == BUFFER and isinstance(n.target, str) and isinstance(vars(model).get(n.target), torch.Tensor)
    }
    return graph


def _refuse_embedding_options(n: fx.Node, args: tuple, kwargs: dict) -> None:
    """``F.embedding`` (``nn.Embedding``) options the program does not replay, refused with the line:

    * ``max_norm``: renormalises the looked-up rows of the weight *in place* during forward (an
      update of a parameter made in forward, which hapc does not replay);
    * ``sparse=True``: sparse gradients (hapc's gradients are dense tensors, summed or sharded).

    ``scale_grad_by_freq`` is exact (each row's gradient divided by its count in the whole batch:
    the rule keeps the token dims whole, :func:`hapc.theory.rules.loss._embedding`)."""
    import inspect

    bound = inspect.signature(F.embedding).bind(*args, **kwargs)
    if bound.arguments.get("max_norm") is not None:
        raise TraceError(
            f"embedding with max_norm at {_source(n)}: it renormalises rows of the weight in place during "
            "forward, and hapc does not replay updates of parameters made in forward; drop max_norm (or "
            "renormalise the weight outside forward, e.g. after optimizer.step())"
        )
    if bound.arguments.get("sparse"):
        raise TraceError(
            f"embedding with sparse=True at {_source(n)}: hapc's gradients are dense (summed or sharded across "
            "ranks); use sparse=False (the same gradient, dense: an optimizer for dense gradients such as Adam "
            "instead of SparseAdam)"
        )


def _forward_hooked(m: nn.Module) -> bool:
    """Does calling ``m`` run forward hooks (its own or global ones) besides its ``forward``?"""
    from torch.nn.modules import module as mm

    return bool(m._forward_hooks or m._forward_pre_hooks or mm._global_forward_hooks or mm._global_forward_pre_hooks)


#: why a module backward hook cannot run, and what to do instead (_refuse_setups)
_BACKWARD_HOOK_FIX = (
    "hapc's program computes the backward of the traced forward and would not run it. Remove it and "
    "transform the parameters' gradients after loss.backward() returns (to change gradients flowing "
    "through the module, call a torch.autograd.Function in its forward: capture='fx' records it whole)"
)
_WRAPPER_FIX = (
    "hapc replaces DistributedDataParallel / FSDP -- pass the plain model (DDP's model.module, or the model "
    "before fully_shard)"
)


def _refuse_setups(model: nn.Module) -> None:
    """What a model can carry that the capture would silently drop or misread, refused before it
    runs, in one walk over the modules:

    * a wrapper of another data-parallel runtime (DDP, DataParallel, ``fully_shard``'s FSDP<Class>
      modules): hapc replaces it and needs the model itself (tracing the wrapper failed with fx's
      iteration error);
    * a ``SyncBatchNorm`` over a subgroup: its statistics are not the global batch's (one over every
      rank is batch norm over the global batch, :func:`hapc.theory.normalize._batch_norm`);
    * a module backward hook (``register_full_backward_hook``, ``register_backward_hook``,
      ``register_full_backward_pre_hook``, or a global one): it acts on gradients the program
      computes itself from the traced forward, so it would never run."""
    from torch.nn.modules import module as mm

    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise TraceError(f"hapc.compile takes the model itself, not a {type(model).__name__}: {_WRAPPER_FIX}")
    if mm._global_backward_hooks or mm._global_backward_pre_hooks:
        raise TraceError(f"a global module backward hook is registered (torch.nn.modules.module): {_BACKWARD_HOOK_FIX}")
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing was fully_shard-ed
    sharded = getattr(fsdp, "FSDPModule", ())

    def where(name: str, m: nn.Module) -> str:
        return f"module {name!r} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"

    for name, m in model.named_modules():
        if isinstance(m, sharded):
            raise TraceError(
                f"hapc.compile takes the model itself, not one prepared by fully_shard ({where(name, m)}): "
                + _WRAPPER_FIX
            )
        if isinstance(m, nn.SyncBatchNorm) and m.process_group is not None:
            raise TraceError(
                f"{where(name, m)}: SyncBatchNorm with a process_group takes its statistics over that group's "
                "share of the batch; hapc computes them over the whole global batch (as SyncBatchNorm over all "
                "ranks does, and batch norm on one device). Leave process_group unset, or use nn.BatchNorm*d"
            )
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and cumulative_average(m):
            raise TraceError(
                f"{where(name, m)}: batch norm with momentum=None keeps a cumulative average of the running "
                "statistics, weighted by 1 / num_batches_tracked, a Python number read from a buffer each call "
                "(hapc's program has static numbers); give it a momentum (torch's default is 0.1)"
            )
        if m._backward_hooks or m._backward_pre_hooks:
            raise TraceError(
                f"{where(name, m)} has a backward hook (register_full_backward_hook, register_backward_hook or "
                f"register_full_backward_pre_hook): {_BACKWARD_HOOK_FIX}"
            )


@contextlib.contextmanager
def _bincount_with_minlength_as_one_hot() -> Any:
    """While capturing, ``torch.bincount(x, minlength=m)`` (no weights; fx's ``x.bincount(...)`` too,
    :class:`_Proxy`) is captured as
    ``F.one_hot(x, m).sum(0)``: the same counts, of static length ``m``, wherever every value of ``x``
    is in ``[0, m)`` -- a count over known classes, as transformers' MoE load-balancing loss counts
    tokens per expert (``minlength=num_experts`` over top-k expert indices). Where a value is ``>= m``
    (one device would return ``max(x) + 1`` bins) the program's ``one_hot`` raises at run time instead
    of returning other counts. Without ``minlength`` the length depends on the values: refused, as
    before (:func:`_value_sized_hint`)."""
    import torch.nn.functional as F

    original = torch.bincount

    def bincount(input: Any, weights: Any = None, minlength: int = 0) -> Any:
        if weights is None and type(minlength) is int and minlength > 0:
            return F.one_hot(input, minlength).sum(0)
        return original(input, weights=weights, minlength=minlength)

    torch.bincount = bincount  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.bincount = original


def _experts_loop_hint(model: nn.Module, exc: TraceError) -> str | None:
    """The fix, where a Hugging Face mixture of experts cannot be captured because it runs its
    experts in a Python loop over the experts the batch routes to (``experts_implementation=
    "eager"``: ``for expert_idx in expert_hit``, a loop whose length is a tensor's value)."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "eager" or "data-dependent" not in str(exc):
        return None
    experts = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if not any(getattr(config, k, None) for k in experts):  # every config names an implementation
        return None
    return (
        f"{type(model).__name__} runs its experts in a Python loop over the experts each batch routes to "
        '(experts_implementation="eager"): build it with experts_implementation="grouped_mm" '
        '(transformers\' default; float32 / bfloat16 only on CPU) or "batched_mm", which hapc captures '
        "as one static graph"
    )


def _library_hint(model: nn.Module, exc: TraceError) -> str | None:
    """The fix, where a library model fails to capture in a mode its config chose and another
    mode of the same model captures: :func:`_experts_loop_hint`, and BigBird's block-sparse
    attention (``attention_type="block_sparse"``: blocks gathered by random indices drawn in
    NumPy and assembled in place), whose ``"original_full"`` attention trains as one device."""
    hint = _experts_loop_hint(model, exc)
    config = getattr(model, "config", None)
    why = str(exc)
    if (
        hint is None
        and getattr(config, "attention_type", None) == "block_sparse"
        and ("in-place" in why or "NumPy" in why)
    ):
        hint = (
            f'{type(model).__name__} uses block-sparse attention (attention_type="block_sparse": random '
            'blocks, assembled in place): build it with attention_type="original_full", which hapc captures'
        )
    return hint


def _mutation_error(exc: TraceError) -> bool:
    """A refusal torch.export would repeat (state updated in forward, code changing the backward)."""
    text = str(exc)
    return (
        ("in-place" in text and "replay" in text)
        or "assigns" in text
        or "the hook would never run" in text
        or "a backward inside" in text
    )


#: what to do instead of gradient code in forward (_backward_code_refused)
_GRADIENT_CODE_FIX = (
    "hapc's program computes the backward of the traced forward, so the hook would never run. Write the "
    "gradient change as a torch.autograd.Function (capture='fx' records its apply whole and the program runs "
    "its backward), or change the gradients after loss.backward() returns"
)


def _captured(values: Any) -> bool:
    """Whether ``values`` hold a tensor of a capture (an fx proxy, torch.export's fake or functional
    tensors), not a meta stand-in of hapc's own evaluation (a custom op's body runs on those)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    flat = values.values() if isinstance(values, dict) else values
    for v in flat:
        if isinstance(v, (fx.Proxy, FakeTensor, FunctionalTensor)):
            return True
        if isinstance(v, (tuple, list, dict)) and _captured(v):
            return True
    return False


_FUNCTION_OPS: dict[type, Any] = {}

#: library autograd Functions whose backward is the derivative of their forward (to rounding), so
#: tracing their forward differentiates them as their backward does: either capture traces them
DIFFERENTIABLE_FUNCTIONS = {
    # BLOOM's tanh GeLU in training: bloom_gelu_back is d/dx of bloom_gelu_forward (0.1070322243 =
    # 3 x 0.044715 x 0.79788456), written out to save memory
    "transformers.models.bloom.modeling_bloom.GeLUFunction",
}


def function_op(cls: type) -> Any:
    """The op a ``torch.autograd.Function`` subclass's ``cls.apply(...)`` is recorded as by the fx
    capture: one node, which the program calls as the model does, so ``cls.backward`` computes its
    gradient there as on one device. Its rule-registry name is the class's qualified name
    (``hapc.register_op(MyFunction, "... -> ...")`` lets it shard; without a rule it is replicated,
    which is exact for any function). One function per class, so equal calls stay equal."""
    op = _FUNCTION_OPS.get(cls)
    if op is None:

        def op(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        op.__name__ = f"{cls.__name__}_apply"
        op.__qualname__ = f"{cls.__qualname__}.apply"
        op.__module__ = cls.__module__
        op.__hapc_op__ = qualified_name(cls)  # type: ignore[attr-defined]
        _FUNCTION_OPS[cls] = op
    return op


@contextlib.contextmanager
def _backward_code_refused() -> Any:
    """While capturing, code in forward that changes the backward:

    * a ``torch.autograd.Function`` of the model's own (``cls.apply``, its ``backward``): recorded
      whole by the fx capture (:func:`function_op`); torch.export would trace its forward and drop
      the backward, so there it raises (the program would differentiate the forward ops instead,
      silently another gradient: a gradient reversal layer would not reverse). torch's own functions
      (reentrant ``torch.utils.checkpoint``) pass as before;
    * a gradient hook on an intermediate tensor (``h.register_hook(fn)``): raises (the fx capture's
      proxies meet it in ``_Tracer.create_proxy``);
    * ``torch.autograd.grad`` (a gradient penalty): raises, naming ``@hapc.custom_op``."""
    from torch.autograd.function import Function

    from .registry import _find_proxy

    apply = Function.__dict__["apply"]
    hooks = {name: getattr(torch.Tensor, name) for name in _GRADIENT_HOOKS}

    def guarded_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        traced = cls.__module__.startswith(("torch.", "hapc.")) or qualified_name(cls) in DIFFERENTIABLE_FUNCTIONS
        if not traced and _captured((args, kwargs)):
            proxy = _find_proxy((args, kwargs))
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", function_op(cls), args, kwargs)
            raise TraceError(
                f"forward calls {cls.__qualname__}.apply, a torch.autograd.Function ({_where()}), which "
                "torch.export captures by its forward alone (the program would differentiate that instead of "
                "running its backward); compile with capture='fx', which records the call whole so that the "
                "program makes it and its backward runs"
            )
        return apply.__func__(cls, *args, **kwargs)

    def guarded_hook(name: str) -> Any:
        def hook(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _captured((self,)):
                raise TraceError(f"forward calls {name}() on a tensor ({_where()}): {_GRADIENT_CODE_FIX}")
            return hooks[name](self, *args, **kwargs)

        return hook

    grad = torch.autograd.grad

    def guarded_grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if _captured((outputs, inputs)):
            raise TraceError(
                f"forward calls torch.autograd.grad ({_where()}), a backward inside the forward (a gradient "
                "penalty): the capture records forward ops only. Move that computation into a function decorated "
                "with @hapc.custom_op (capture='fx' records its call whole and the program makes it: replicated, "
                "so exact, unless you annotate it)"
            )
        return grad(outputs, inputs, *args, **kwargs)

    Function.apply = classmethod(guarded_apply)  # type: ignore[method-assign, assignment]
    torch.autograd.grad = guarded_grad
    for name in hooks:
        setattr(torch.Tensor, name, guarded_hook(name))
    try:
        yield
    finally:
        Function.apply = apply  # type: ignore[method-assign]
        torch.autograd.grad = grad
        for name, fn in hooks.items():
            setattr(torch.Tensor, name, fn)


#: tensor methods registering a hook on a tensor's gradient
_GRADIENT_HOOKS = ("register_hook", "register_post_accumulate_grad_hook")


@contextlib.contextmanager
def _no_state_assignment() -> Any:
    """While capturing, assigning a tensor to a module's parameter or buffer (``self.avg = ...``,
    ``self.steps += 1``) or a traced value to any attribute raises: hapc does not replay state
    updates made in forward yet, and the model must not keep a traced value."""
    setattr_ = nn.Module.__setattr__

    def guarded(self: nn.Module, name: str, value: Any) -> None:
        state = self.__dict__.get("_buffers", {}), self.__dict__.get("_parameters", {})
        old = self.__dict__.get(name)
        counter = (  # a Python number the forward changes (a step counter): read as a constant by the graph
            type(value) in (int, float) and type(old) in (int, float) and value != old
        )
        if (
            counter
            or isinstance(value, fx.Proxy)
            or (isinstance(value, torch.Tensor) and any(name in t for t in state))
        ):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if _user_file(f.filename)), None)
            where = f"{os.path.basename(frame.filename)}:{frame.lineno}: {(frame.line or '').strip()}" if frame else ""
            raise TraceError(
                f"{type(self).__name__}.forward assigns self.{name} ({where}): hapc does not replay updates of "
                "buffers or parameters made in forward yet; move the update out of forward (e.g. after "
                "optimizer.step()), or compute the value and return it"
            )
        setattr_(self, name, value)

    nn.Module.__setattr__ = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]


@contextlib.contextmanager
def _state_unchanged(model: nn.Module) -> Any:
    """Refuse a capture during which a parameter or buffer changed: fx runs a forward's Python, and an
    update it cannot record (``buf.add_(1)`` on constants, ``buf[i] = h``, ``torch.add(..., out=buf)``,
    ``p.data = ...``) happens once, at capture -- the graph would hold that moment's value and training
    would never replay it. (``_restoring`` then puts the buffers back.)"""
    state = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]

    def where(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype

    before = [(k, t, t._version, where(t), t.data) for k, t in state]
    yield
    changed = [k for k, t, version, at, _ in before if t._version != version or where(t) != at]
    if not changed:
        return
    for _, t, _, at, data in before:  # `.data = ...` swaps: the old storage back
        if where(t) != at:
            t.data = data
    raise TraceError(
        f"{type(model).__name__}.forward updates {changed[0]!r} in place (an in-place op, an item assignment, "
        "out=, or .data = ...); hapc does not replay updates of parameters or buffers made in forward yet: "
        "move the update out of forward (e.g. after optimizer.step()), or compute the value and return it"
    )


@contextlib.contextmanager
def _restoring(model: nn.Module, buffers: dict[str, torch.Tensor]) -> Any:
    """fx runs a forward's Python on the model's real buffers: a failed capture (one that updated a
    buffer in place) leaves them as they were."""
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in buffers and b.shape == buffers[k].shape:
                    b.copy_(buffers[k])
        raise


def _user_file(filename: str) -> bool:
    f = os.path.abspath(filename)
    return not f.startswith((_TORCH_DIR, _HAPC_DIR)) and "<" not in filename


@contextlib.contextmanager
def autocast_regions(stack: list[tuple]) -> Any:
    """While capturing, every ``torch.autocast`` the model enters in its forward (a ``with`` block or
    the decorator; ``torch.cpu.amp`` / ``torch.cuda.amp`` too; ``enabled=False`` ones included) is
    pushed on ``stack`` as ``(device_type, dtype, enabled, cache_enabled)`` until it exits; the tracer
    marks each node made meanwhile with the stack (``meta["hapc_autocast"]``) and the per-rank program
    runs those nodes under the same contexts (:func:`hapc.codegen.regions.autocast_regions`). Without
    this, fx would trace through the ``with`` block as if it were not there: the distributed program
    would compute in float32 what one device computes in bfloat16 (or the reverse, under the training
    loop's autocast). Patched: ``torch.autocast``'s ``__enter__`` / ``__exit__``."""
    cls = torch.amp.autocast_mode.autocast
    enter, leave = cls.__enter__, cls.__exit__

    def entered(self: Any) -> Any:
        out = enter(self)
        stack.append((str(self.device), self.fast_dtype, bool(self._enabled), bool(self._cache_enabled)))
        return out

    def left(self: Any, *exc: Any) -> Any:
        if stack:
            stack.pop()
        return leave(self, *exc)

    cls.__enter__, cls.__exit__ = entered, left
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave


@contextlib.contextmanager
def checkpoint_regions(enter: Any) -> Any:
    """While capturing, ``torch.utils.checkpoint.checkpoint(fn, *args)`` (either variant, and so
    ``checkpoint_sequential`` and Hugging Face's gradient checkpointing) runs ``fn(*args)`` directly
    inside ``enter(k)``, a context manager marking what is captured meanwhile as region ``k`` (nested
    calls belong to the outermost). The per-rank program recomputes each region in backward
    (:mod:`hapc.codegen.regions`). Patched: the two names ``checkpoint`` looks up at call time."""
    import torch.utils.checkpoint as ckpt

    saved = ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator
    count = iter(range(1 << 30))
    depth = [0]

    @contextlib.contextmanager
    def region() -> Any:
        depth[0] += 1
        try:
            if depth[0] == 1:
                with enter(next(count)):
                    yield
            else:
                yield
        finally:
            depth[0] -= 1

    class Reentrant:
        @staticmethod
        def apply(function: Any, preserve: Any, *args: Any) -> Any:
            with region():
                out = function(*args)
            if any(_needs_grad(a) for a in args):
                return out
            # torch's reentrant variant: no input requires grad, so no gradient flows into the region
            # (its parameters get none -- torch warns, and so does the single-device run)
            warnings.warn(
                "torch.utils.checkpoint (use_reentrant=True): none of the inputs requires grad, so the "
                "parameters inside get no gradient (as torch does on one device); use_reentrant=False avoids this",
                stacklevel=3,
            )
            return torch.utils._pytree.tree_map(
                lambda t: t.detach() if isinstance(t, (torch.Tensor, fx.Proxy)) else t, out
            )

    def non_reentrant(function: Any, *rest: Any, **kwargs: Any) -> Any:
        with region():
            yield  # `checkpoint` calls the function here, between its two next()

    ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = Reentrant, non_reentrant
    try:
        yield
    finally:
        ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator = saved


def _needs_grad(a: Any) -> bool:
    """Whether a traced value requires grad: it depends on a trainable parameter (the capture's meta
    values carry no autograd state; model inputs never require grad here)."""
    if not isinstance(a, fx.Proxy):
        return isinstance(a, torch.Tensor) and a.requires_grad
    root = a.tracer.root
    seen, todo = set(), [a.node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            t = _raw_attr(root, n.target)
            if isinstance(t, nn.Parameter) and t.requires_grad:
                return True
        if n.op == "call_module" and any(p.requires_grad for p in root.get_submodule(n.target).parameters()):
            return True
        todo.extend(n.all_input_nodes)
    return False


@contextlib.contextmanager
def _scripted_functions_as_python(model: nn.Module) -> Any:
    """While fx traces, the ``@torch.jit.script`` functions the model's modules call by global name
    (DeBERTa-v2's ``scaled_size_sqrt``, ``build_rpos``, ...) are their Python originals: a
    ``ScriptFunction`` takes no proxies (``Expected a value of type 'Tensor' ... found '_Proxy'``).
    The original is the one TorchScript compiled (``_torchdynamo_inline``, which dynamo inlines the
    same way), so the graph computes what the scripted call does. The modules' globals are restored
    afterwards."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    seen: set[int] = set()
    for m in model.modules():
        space = getattr(type(m).forward, "__globals__", None)
        if space is None or id(space) in seen:
            continue
        seen.add(id(space))
        for name, value in list(space.items()):
            python = getattr(value, "_torchdynamo_inline", None)
            if isinstance(value, torch.jit.ScriptFunction) and callable(python):
                swapped.append((space, name, value))
                space[name] = python
    try:
        yield
    finally:
        for space, name, value in swapped:
            space[name] = value


def _trace_fx(model: nn.Module, example_inputs: Any, leaf_modules: Sequence[type], registry: Registry,
              loss: str | int | None) -> RefGraph:  # fmt: skip
    extra = _var_keyword_inputs(model, example_inputs)
    tensors = [k for k, v in extra.items() if not isinstance(v, (bool, int, float, str))]
    if tensors:
        raise TraceError(
            f"{type(model).__name__}.forward takes {tensors} through its **kwargs, which hapc's fx capture "
            "passes on as constants only (not tensors); capture='export' takes them (capture='auto' does so "
            "by itself)"
        )
    tracer = _Tracer(tuple(leaf_modules), registry, example_inputs)
    tracer.var_keywords = extra

    @contextlib.contextmanager
    def enter(k: int) -> Any:
        tracer.region = k
        try:
            yield
        finally:
            tracer.region = None

    with _meta_kernels_without_dynamo():
        try:
            with (
                checkpoint_regions(enter),
                autocast_regions(tracer.autocast),
                CaptureDraws(tracer, _where),
                _scripted_functions_as_python(model),
                tracer.writes,
            ):
                graph = tracer.trace(model, concrete_args=_none_inputs(model, example_inputs))
            tracer.writes.check(graph, _may_alias)
        except TraceError as exc:
            raise TraceError(f"cannot trace {type(model).__name__}: {exc}") from exc
        except Exception as exc:
            raise TraceError(_untraceable_message(model, exc)) from exc
        if tracer.control_flow is not None:
            raise TraceError(
                f"cannot trace {type(model).__name__}: the truth of a traced value is tested at "
                f"{tracer.control_flow} and the model caught the capture's error (a try/except around it), "
                "so the capture would follow a branch one device may not take; hapc needs a static graph: "
                "replace the test by tensor ops such as torch.where"
            )
        drop_unused_masked_selects(graph)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        normalise_modules(gm)
        values, flops = _propagate(gm, model, example_inputs, tracer.memo)
    builder = _Builder(gm, model, values, flops, loss=loss, output_types=tracer.output_types)
    builder.guards = tracer.guards
    return builder.run(capture="fx")


def _trace_export(model: nn.Module, example_inputs: Any, loss: str | int | None) -> RefGraph:
    from .capture import export_capture

    cap = export_capture(model, example_inputs)
    values, flops = _propagate(cap.gm, model, cap.inputs)
    return _Builder(cap.gm, model, values, flops, loss=loss, output_spec=cap.outputs).run(capture="export")


def _var_keyword_inputs(model: nn.Module, example_inputs: Any) -> dict[str, Any]:
    """Example keyword inputs (not None) that only a ``**kwargs`` of the forward takes: Hugging Face
    passes ``output_hidden_states`` / ``output_attentions`` / ``return_dict`` so in transformers 5.
    fx traces the named parameters (:func:`_named_root`) and passes these on as constants."""
    import inspect

    if not isinstance(example_inputs, dict):
        return {}
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return {}  # an unknown keyword: binding the inputs names it
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return {k: v for k, v in example_inputs.items() if k not in named and v is not None}


def _none_inputs(model: nn.Module, example_inputs: Any) -> dict[str, Any] | None:
    """Forward parameters that are ``None`` (given so, or left at a ``None`` default), or a
    ``bool`` at its default: constants, so that ``if labels is not None:`` and ``if
    interpolate_pos_encoding:`` take the branch the call takes. A call giving one another value is
    refused at run time (``codegen.module._check_constant_inputs``)."""
    import inspect

    from .capture import bind_keywords

    try:
        params = inspect.signature(model.forward).parameters
        given = bind_keywords(model, example_inputs)[0]
    except (TypeError, ValueError, TraceError):  # variadic forwards: _bind_inputs says what is wrong
        return None
    out = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = given[name] if name in given else p.default
        # a bool at its default (fx checks a specialised value against the placeholder's default,
        # so another value stays an input: fx stops at its `if`, and torch.export captures it)
        if value is None or (type(value) is bool and value is p.default):
            out[name] = value
    return out or None


# --------------------------------------------------------------------------------------------
# 1. errors at trace time


def _user_frame(tb: Any) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        f = os.path.abspath(fr.filename)
        if not f.startswith((_TORCH_DIR, _HAPC_DIR)) and "<" not in fr.filename:
            return fr
    return None


def _untraceable_message(model: nn.Module, exc: Exception) -> str:
    fr = _user_frame(exc.__traceback__)
    where = f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}" if fr else "(unknown line)"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    hint = (
        "hapc needs a static graph: replace data-dependent Python control flow (if/while on tensor "
        "values, .item(), len() of tensors) by tensor ops such as torch.where, or move that logic "
        "into a function decorated with @hapc.custom_op and give it a rule"
    )
    return f"cannot trace {type(model).__name__}: {reason}\n  at {where}\n  {hint}"


def _where() -> str:
    """The model's line being run, as errors name it ("file.py:12: code")."""
    frame = _model_frame()
    if not frame:
        return "forward"
    head, code = frame.strip().splitlines()
    path, line = head.split('"')[1], head.split("line ")[1].split(",")[0]
    return f"{os.path.basename(path)}:{line}: {code.strip()}"


def _model_frame() -> str | None:
    """The innermost frame of the model's own code (not torch's, not hapc's), in the form of fx's
    ``stack_trace`` (what :func:`_source` reads), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith("<frozen") and not os.path.abspath(filename).startswith((_TORCH_DIR, _HAPC_DIR)):
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f'  File "{filename}", line {frame.f_lineno}, in {frame.f_code.co_name}\n    {code}\n'
        frame = frame.f_back
    return None


def _source(node: fx.Node) -> str:
    st = node.meta.get("stack_trace") or ""
    lines = [ln for ln in st.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i].strip()
        if ln.startswith("File "):
            try:
                fname = ln.split('"')[1]
                lineno = ln.split("line ")[1].split(",")[0]
            except IndexError:
                continue
            if os.path.abspath(fname).startswith((_TORCH_DIR, _HAPC_DIR)):
                continue
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{os.path.basename(fname)}:{lineno}: {code}"
    return node.format_node() or node.name


# --------------------------------------------------------------------------------------------
# 2. shape propagation on meta tensors


_DYNAMO_WRAPPED: list[Any] | None = None  # see _meta_kernels_without_dynamo


def _dynamo_wrapped() -> list[Any]:
    """The functions torch wraps with ``torch._disable_dynamo`` among its Python meta kernels and
    references (``elementwise_type_promotion_wrapper``: ``cat``, ``where``, ``clamp``, ...), found
    once by following ``__wrapped__`` from the decomposition/meta tables and the ``torch._refs`` /
    ``torch._decomp`` / ``torch._prims`` / ``torch._meta_registrations`` modules (a few ms)."""
    global _DYNAMO_WRAPPED
    if _DYNAMO_WRAPPED is not None:
        return _DYNAMO_WRAPPED
    found: dict[int, Any] = {}
    try:
        import torch._compile
        import torch._decomp

        inner = torch._compile._disable_dynamo(lambda: None).__code__
        slot = inner.co_freevars.index("fn")
        roots: list[Any] = [f for table in torch._decomp.global_decomposition_table.values() for f in table.values()]
        prefixes = ("torch._refs", "torch._decomp", "torch._prims", "torch._meta_registrations")
        for name, mod in list(sys.modules.items()):
            if name.startswith(prefixes) and mod is not None:
                roots.extend(v for v in vars(mod).values() if callable(v))
        # the wrappers' chain (out_wrapper -> _disable_dynamo's inner -> the promotion wrapper -> the
        # reference): through __wrapped__ and closures, as functools.wraps may point __wrapped__ past it
        seen: set[int] = set()
        todo = [(f, 0) for f in roots]
        while todo:
            f, depth = todo.pop()
            if id(f) in seen or depth > 6:
                continue
            seen.add(id(f))
            code = getattr(f, "__code__", None)
            if code is None:
                continue
            cells = [c.cell_contents for c in (f.__closure__ or ()) if _filled(c)]
            if code is inner and f.__closure__ and _filled(f.__closure__[slot]):
                fn = f.__closure__[slot].cell_contents
                found[id(fn)] = fn
            wrapped = getattr(f, "__wrapped__", None)
            todo.extend((g, depth + 1) for g in [wrapped, *cells] if callable(g))
    except (AttributeError, ImportError, TypeError, ValueError):  # another torch: do without
        found = {}
    _DYNAMO_WRAPPED = list(found.values())
    return _DYNAMO_WRAPPED


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


@contextlib.contextmanager
def _meta_kernels_without_dynamo() -> Any:
    """Run torch's Python meta kernels without importing ``torch._dynamo`` (1-2.5 s of a cold
    ``hapc synth``, with part of ``torch._inductor``).

    Many of them are wrapped by ``torch._disable_dynamo``, which imports ``torch._dynamo`` on a
    function's first call to build ``torch._dynamo.disable(fn)`` and caches it on the function as
    ``fn.__dynamo_disable``. While ``torch._dynamo`` has not been imported, no frame can be under
    dynamo's evaluation, so that wrapper would only call ``fn``: this pre-empts the cache with ``fn``
    itself for the block and removes it afterwards (a later call, e.g. under ``torch.compile``,
    builds the real one as before). Where ``torch._dynamo`` is already imported this does nothing."""
    if "torch._dynamo" in sys.modules:
        yield
        return
    placed = []
    for fn in _dynamo_wrapped():
        if getattr(fn, "__dynamo_disable", None) is None:
            try:
                fn.__dynamo_disable = fn
            except (AttributeError, TypeError):
                continue
            placed.append(fn)
    try:
        yield
    finally:
        for fn in placed:
            if getattr(fn, "__dynamo_disable", None) is fn:
                with contextlib.suppress(AttributeError):
                    del fn.__dynamo_disable


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        t = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return t.requires_grad_(value.requires_grad) if value.is_floating_point() else t
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _raw_attr(obj: Any, qualname: str) -> Any:
    """Attribute lookup that bypasses fx's patched ``Module.__getattr__`` (which makes proxies)."""
    for part in qualname.split("."):
        if isinstance(obj, nn.Module):
            for table in (obj._parameters, obj._buffers, obj._modules, obj.__dict__):
                if part in table:
                    obj = table[part]
                    break
            else:
                obj = getattr(obj, part)
        else:
            obj = getattr(obj, part)
    return obj


def _attr(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _bind_inputs(gm: fx.GraphModule, example_inputs: Any) -> dict[str, Any]:
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    star = [n for n in names if n.startswith("*")]
    if star and not isinstance(example_inputs, dict):
        # fx gives ``forward(self, *xs)`` one placeholder for the whole tuple: binding example
        # tensors to it positionally would trace another computation
        raise TraceError(
            f"the model's forward takes variadic inputs ({', '.join(star)}): hapc traces one tensor per named "
            "input; give forward named parameters (def forward(self, x, y)) or wrap the model in one that does"
        )
    if isinstance(example_inputs, dict):
        defaults = {n.target: n.args[0] for n in gm.graph.nodes if n.op == "placeholder" and n.args}
        missing = [n for n in names if n not in example_inputs and n not in defaults and not n.startswith("*")]
        if missing:
            raise TraceError(f"example_inputs has no value for model input(s) {missing}")
        return {n: example_inputs[n] if n in example_inputs else defaults[n] for n in names if not n.startswith("*")}
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if len(example_inputs) > len(names):
        raise TraceError(f"model forward takes {len(names)} inputs {names}, got {len(example_inputs)} example inputs")
    bound = dict(zip(names, example_inputs))
    for n in gm.graph.nodes:  # defaults of forward(...) for inputs not given
        if n.op == "placeholder" and n.target not in bound:
            if not n.args:
                raise TraceError(f"no example input for model input {n.target!r}")
            bound[n.target] = n.args[0]
    return bound


def _on_meta(a: Any) -> Any:
    """``a`` with every ``torch.device`` replaced by ``meta`` (see :func:`_propagate`)."""
    return fx.node.map_aggregate(a, lambda v: _META if isinstance(v, torch.device) else v)


_META = torch.device("meta")


def _propagate(
    gm: fx.GraphModule, model: nn.Module, example_inputs: Any, memo: MetaMemo | None = None
) -> tuple[dict, dict]:
    """Run the normalised graph on meta tensors: every node's value, and flops of tensor ops."""
    memo = memo or MetaMemo()
    inputs = _bind_inputs(gm, example_inputs)
    env: dict[fx.Node, Any] = {}
    flops: dict[fx.Node, float] = {}

    def load(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: env[n])

    with torch.device("meta"):
        for node in gm.graph.nodes:
            try:
                if node.op == "placeholder":
                    env[node] = _to_meta(inputs[node.target])
                elif node.op == "get_attr":
                    env[node] = _to_meta(_attr(gm, node.target))
                elif node.op == "output":
                    env[node] = load(node.args[0])
                else:
                    # every value is on meta here: a device the model read from a tensor
                    # (``labels.to(logits.device)``, folded to the example's device) means meta too
                    args, kwargs = _on_meta(load(node.args)), _on_meta(load(node.kwargs))
                    if node.meta.get("hapc_val", _MISSING) is not _MISSING:
                        out = node.meta["hapc_val"]  # computed while tracing
                    elif node.op == "call_function":
                        out = memo.call(node.target, args, kwargs)
                    elif node.op == "call_method":
                        out = memo.call(None, args, kwargs, method=node.target)
                    else:
                        mod = gm.get_submodule(node.target)
                        with _torch_kernels(mod):
                            out = _call_leaf(mod, args, kwargs)
                    env[node] = out
                    flops[node] = _flops(node, args, kwargs, out)
            except TraceError:
                raise
            except Exception as exc:
                raise TraceError(
                    f"cannot compute shapes at node {node.name} ({_source(node)}): "
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
                    "  hapc needs every shape and Python value to be static (no .item(), .tolist(), "
                    "or ops whose output size depends on tensor values)" + _value_sized_hint(node)
                ) from exc
    return env, flops


#: ops whose output length is a function of the input's values, not its shape
_VALUE_SIZED = ("bincount", "nonzero", "unique", "masked_select", "argwhere")


def _value_sized_hint(node: fx.Node) -> str:
    """The fix for an op whose output length depends on values (``torch.bincount``: ``max(x) + 1``
    bins): a count over a known number of classes gives ``minlength`` (captured as
    ``F.one_hot(x, n).sum(0)``, a static shape: :func:`_bincount_with_minlength_as_one_hot`), as
    transformers' MoE models (Mixtral, Qwen2-MoE, ...) do in the router's load-balancing loss."""
    name = str(getattr(node.target, "__name__", node.target)).split(".")[-1]
    name = next((op for op in _VALUE_SIZED if op in (name, node.name.rstrip("_0123456789"))), None)
    if name is None:
        return ""
    hint = f"\n  torch.{name}'s output length depends on the values in its input, not on its shape"
    if name == "bincount":
        hint += (
            ": count over a known number of classes, torch.bincount(x, minlength=num_classes) (captured as "
            "F.one_hot(x, num_classes).sum(0): a static length; a value >= num_classes then raises at run time)"
        )
    return hint


_SAME_SHAPE = (
    nn.LayerNorm, nn.Dropout, nn.Identity, nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU,
    nn.ELU, nn.Softplus, nn.Hardswish, nn.Mish, nn.ReLU6, nn.Softmax, nn.LogSoftmax,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
)  # fmt: skip


def _fast_leaf_value(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The output (shape and dtype) of the commonest leaf modules without calling them: tracing
    only needs it for Python-level shape queries, and calling modules under fx is slow."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, torch.Tensor) or len(args) > 1:
        return None
    if isinstance(mod, _SAME_SHAPE) and not getattr(mod, "inplace", False):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    if type(mod) is nn.Linear and x.dim() >= 1 and x.shape[-1] == mod.in_features:
        return torch.empty((*x.shape[:-1], mod.out_features), dtype=x.dtype, device="meta")
    return None


def _flops(node: fx.Node, args: tuple, kwargs: dict, out: Any) -> float:
    if node.op == "call_module":
        # imported here: torch.utils.flop_counter imports triton (~0.6 s of a cold `hapc synth`)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:  # a user's leaf module: count it for real
            _call_leaf(node.graph.owning_module.get_submodule(node.target), args, kwargs)
        return float(counter.get_total_flops())
    return contraction_flops(canonical_name(node.target, node.op == "call_method"), args, kwargs, out)


def _torch_kernels(mod: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Around a leaf module's meta evaluation: torch's own modules (``NORMALISERS``) run only torch's
    kernels, which need no sympy (``plain_meta.without_sympy``); a user's leaf runs its own code as is."""
    return without_sympy() if type(mod) in NORMALISERS else contextlib.nullcontext()


def _call_leaf(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
    state = {**dict(mod.named_parameters()), **dict(mod.named_buffers())}
    if all(v.device.type == "meta" for v in state.values()):
        return _MODULE_CALL(mod, *args, **kwargs)  # already shapes only: no swapping needed
    return torch.func.functional_call(mod, {k: _to_meta(v) for k, v in state.items()}, args, kwargs)


# --------------------------------------------------------------------------------------------
# 3. specialisation into a RefGraph

_SPLITTERS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
#: tensor attributes that are a permutation of its dims (``T``: all reversed; ``mT``: the last two)
_TRANSPOSED = {"T", "mT", "H", "mH"}
_MEAN_LOSSES = {"cross_entropy", "nll_loss", "mse_loss"}


class _Builder:
    def __init__(
        self, gm: fx.GraphModule, model: nn.Module, values: dict, flops: dict, *, loss: Any = None,
        output_spec: Any = None, output_types: Any = None,
    ):  # fmt: skip
        self.gm, self.model, self.values, self.flops = gm, model, values, flops
        self.loss_choice, self.output_spec = loss, output_spec
        self.output_types = output_types  # fx: the returned dicts' types (_Tracer.create_arg)
        self.nodes: list[RefNode] = []
        self.env: dict[fx.Node, Any] = {}  # fx node -> Ref / tuple of Refs / constant
        self.elements: dict[tuple[fx.Node, int], Ref] = {}
        self.params = dict(model.named_parameters())
        # tied weights (an LM head sharing the embedding): one tensor, one node, under the name
        # named_parameters() gives it first; the other names are aliases (full_state_dict has them)
        self.canonical: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            self.canonical[name] = first.setdefault(id(t), name)
        self.attr_refs: dict[str, Ref] = {}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.region: int | None = None  # of the fx node being built (torch.utils.checkpoint)
        self.autocast: tuple = ()  # of the fx node being built (its torch.autocast contexts)
        self.guards: list[Guard] = []  # checks the loss passes through (:func:`hapc.ops.checked`)
        self.carries_grad: list[bool] = []  # per node so far: depends on a trainable parameter (_carries_grad)

    def add(self, **fields: Any) -> Ref:
        if fields.get("kind") == OP:
            fields.setdefault("region", self.region)
            fields.setdefault("autocast", self.autocast)
        node = RefNode(index=len(self.nodes), **fields)
        self.nodes.append(node)
        return Ref(node.index)

    def arg(self, a: Any) -> Any:
        def sub(n: fx.Node) -> Any:
            v = self.env[n]
            if isinstance(v, _Tuple):
                return tuple(self.element(n, i) for i in range(len(self.values[n])))
            return v

        return _fold_devices(fx.node.map_arg(a, sub))

    def _no_grad(self, n: fx.Node, ref: Ref) -> Ref:
        """``ref`` detached where fx node ``n`` ran under ``torch.no_grad()`` in forward (the fx
        capture; torch.export's marks its grad-mode regions itself, :mod:`hapc.theory.capture`) and
        its result could carry a gradient: one device's result of an op run without grad mode has
        none, so the program stops the gradient there too."""
        if not n.meta.get("hapc_no_grad"):
            return ref
        node = self.nodes[ref.index]
        if not (node.meta.is_float and self._carries_grad(ref.index)):
            return ref
        return self.add(
            name=f"{node.name}_no_grad",
            kind=OP,
            op=canonical_name("detach", True),
            target="detach",
            args=(ref,),
            meta=node.meta,
            is_method=True,
            source=node.source,
        )

    def _carries_grad(self, index: int) -> bool:
        """Whether node ``index`` depends on a trainable parameter (the graph's own ``requires_grad``
        is filled in only when it is finished). Nodes are added in order, operands first: the flags
        are extended up to ``index`` in one pass, never recursively (graphs are thousands deep)."""
        known = self.carries_grad
        detach = canonical_name("detach", True)
        for node in self.nodes[len(known) : index + 1]:
            if node.kind == PARAM:
                known.append(node.requires_grad)
            elif node.kind != OP or node.op == detach:
                known.append(False)
            else:
                known.append(any(known[i] for i in node.operands))
        return known[index]

    def element(self, fxnode: fx.Node, i: int) -> Ref:
        """Reference to output ``i`` of a tuple-returning op (created on first use)."""
        key = (fxnode, i)
        if key not in self.elements:
            value = self.values[fxnode][i]
            if not isinstance(value, torch.Tensor):
                raise TraceError(f"node {fxnode.name} ({_source(fxnode)}): output {i} is not a tensor")
            spec = self.env[fxnode]
            self.elements[key] = self.add(
                name=f"{fxnode.name}_{i}",
                kind=OP,
                **_element_op(spec, i, self.values[fxnode]),
                meta=_meta(value),
                flops=self.flops.get(fxnode, 0.0) / len(self.values[fxnode]),
                source=_source(fxnode),
            )
            self.elements[key] = self._no_grad(fxnode, self.elements[key])
        return self.elements[key]

    def run(self, capture: str = "fx") -> RefGraph:
        input_names = []
        for n in self.gm.graph.nodes:
            v = self.values.get(n)
            self.region = n.meta.get("hapc_region")
            self.autocast = n.meta.get("hapc_autocast", ())
            if capture == "fx" and n.op in ("call_function", "call_method"):
                self._refuse_writes(n)
            if n.op == "placeholder":
                if not isinstance(v, torch.Tensor):
                    self.env[n] = _fold_devices(v)
                    continue
                input_names.append(n.target)
                self.env[n] = self.add(name=n.target, kind=INPUT, op="input", target=n.target, meta=_meta(v))
            elif n.op == "get_attr":
                if not isinstance(v, torch.Tensor):
                    self.env[n] = v
                    continue
                target = self.canonical.get(n.target, n.target)
                if target in self.attr_refs:
                    self.env[n] = self.attr_refs[target]
                    continue
                kind = PARAM if target in self.params and self.params[target].requires_grad else BUFFER
                self.env[n] = self.attr_refs[target] = self.add(
                    name=target.replace(".", "_"),
                    kind=kind,
                    op=kind,
                    target=target,
                    meta=_meta(v),
                    requires_grad=kind == PARAM,
                    source=target,
                )
            elif n.op == "output":
                self.env[n] = self.arg(n.args[0])
            elif isinstance(v, torch.Tensor):
                self.env[n] = self._no_grad(n, self.add_op(n, v))
            elif isinstance(v, (tuple, list)) and any(isinstance(t, torch.Tensor) for t in v):
                self.env[n] = _Tuple(n, self.arg(n.args), self.arg(n.kwargs))
            else:
                self.env[n] = _fold_devices(v)  # sizes, shapes, dtypes, Python numbers
        out = self.env[next(n for n in self.gm.graph.nodes if n.op == "output")]
        graph = self.finish(out, input_names)
        graph.capture = capture
        return graph

    def add_op(self, n: fx.Node, value: torch.Tensor) -> Ref:
        is_method = n.op == "call_method"
        target = n.target if n.op != "call_module" else self.gm.get_submodule(n.target)
        if n.target is operator.getitem and isinstance(self.env.get(n.args[0]), _Tuple):
            i = self.arg(n.args[1])
            return self.element(n.args[0], i if i >= 0 else i + len(self.values[n.args[0]]))
        args, kwargs = self.arg(n.args), self.arg(n.kwargs)
        if target is getattr and len(args) == 2 and args[1] in _TRANSPOSED and not value.is_complex():
            # x.T / x.mT (x.H / x.mH on real tensors): the permutation they are, so that it shards
            rank = value.dim()
            dims = tuple(range(rank))[::-1] if args[1] in ("T", "H") else (*range(rank - 2), rank - 1, rank - 2)
            target, is_method, args = "permute", True, (args[0], dims)
        if is_method and target == "add_" and _counter_of_batch_norm(n.args[0], self.model):
            # a batch norm written out (timm's BatchNormAct2d): num_batches_tracked += 1, which the
            # runtime counts itself for every _BatchNorm (as for torch's own, and under torch.export)
            return self.env[n.args[0]]
        if is_method and target.endswith("_") and not target.endswith("__"):
            target = self._out_of_place(n)
        if kwargs.get("inplace"):
            kwargs["inplace"] = False
        op = canonical_name(type(target) if n.op == "call_module" else target, is_method)
        if op in ("cat", "concat") and args and isinstance(args[0], (list, tuple)) and value.dim() > 1:
            # torch.cat skips 1-D empty tensors (an empty cache's keys): so does the graph
            kept = [a for a in args[0] if not (isinstance(a, Ref) and self.nodes[a.index].meta.shape == (0,))]
            if len(kept) == 1 and isinstance(kept[0], Ref):
                return kept[0]
            args = (type(args[0])(kept), *args[1:])
        if op == "embedding" and not is_method:
            _refuse_embedding_options(n, args, kwargs)
        if op in _MEAN_LOSSES and not is_method:
            ref = self._decompose_mean_loss(n, op, value, args, kwargs)
            if ref is not None:
                return ref
        return self.add(
            name=n.name,
            kind=OP,
            op=op,
            target=target,
            args=args,
            kwargs=kwargs,
            meta=_meta(value),
            is_method=is_method,
            flops=self.flops.get(n, 0.0),
            source=_source(n),
        )

    def _decompose_mean_loss(self, n: fx.Node, op: str, value: torch.Tensor, args: tuple, kwargs: dict) -> Ref | None:
        """``loss(reduction='mean')`` -> ``loss(reduction='sum') / denominator``.

        A mean over a batch-sharded loss is a local *sum* divided by the global denominator;
        written this way the theory shards it with ordinary rules. For class-index targets the
        denominator counts (or weighs) the targets that are not ``ignore_index`` -- data dependent,
        so it is a node of its own that the program all-reduces (a few bytes), never a guess.
        """
        import inspect

        from .. import ops as hops

        bound = inspect.signature(n.target).bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        if a.get("reduction") != "mean" or a.get("size_average") is not None or a.get("reduce") is not None:
            return None
        x, t = a["input"], a["target"]
        tmeta, xmeta = self.nodes[t.index].meta, self.nodes[x.index].meta
        if op == "mse_loss":
            denom: Any = float(xmeta.numel)
        elif tmeta.is_float:  # class probabilities: mean over every position but the class dim
            denom = float(xmeta.numel // (xmeta.shape[1] if xmeta.rank > 1 else xmeta.shape[0]))
        elif a.get("weight") is not None and a.get("label_smoothing", 0.0):
            return None  # weighted label smoothing has its own normaliser: keep the op whole
        else:
            denom = None
        src = _source(n)
        sum_kwargs = {k: v for k, v in a.items() if k not in ("input", "target", "size_average", "reduce")}
        sum_kwargs["reduction"] = "sum"
        total = self.add(
            name=f"{n.name}_sum",
            kind=OP,
            op=op,
            target=n.target,
            args=(x, t),
            kwargs=sum_kwargs,
            meta=_meta(value),
            flops=self.flops.get(n, 0.0),
            source=src,
        )
        if denom is None:
            if a.get("weight") is not None:
                denom = self.add(
                    name=f"{n.name}_weight",
                    kind=OP,
                    op=canonical_name(hops.target_weight_sum),
                    target=hops.target_weight_sum,
                    args=(t, a["weight"], a["ignore_index"]),
                    meta=_meta(value),
                    source=src,
                )
            else:
                denom = self.add(
                    name=f"{n.name}_count",
                    kind=OP,
                    op=canonical_name(hops.target_count),
                    target=hops.target_count,
                    args=(t, a["ignore_index"]),
                    kwargs={"dtype": value.dtype},
                    meta=_meta(value),
                    source=src,
                )
        return self.add(
            name=n.name,
            kind=OP,
            op="div",
            target=operator.truediv,
            args=(total, denom),
            meta=_meta(value),
            source=src,
        )

    def _refuse_writes(self, n: fx.Node) -> None:
        """fx records ``x[i] = y`` and ``torch.add(a, b, out=x)`` as nodes whose results nobody reads:
        later readers of ``x`` would read it unwritten. Into a parameter, buffer or input: refused (not
        replayed); into a fresh tensor: a capture error, so that capture="auto" retries with
        torch.export, which functionalises it."""
        setitem = (n.op == "call_function" and n.target is operator.setitem) or (
            n.op == "call_method" and n.target == "__setitem__"
        )
        if setitem and isinstance(n.args[0], fx.Node):
            written, how = n.args[0], "item assignment"
        elif isinstance(n.kwargs.get("out"), fx.Node):
            written, how = n.kwargs["out"], "out="
        else:
            return
        root = _mutated_root(written)
        if root is not None:
            raise TraceError(
                f"in-place {how} at {_source(n)} updates {root}: hapc does not replay in-place updates of "
                "parameters, buffers or inputs in forward yet; write it out of place, or move the update out "
                "of forward (e.g. after optimizer.step())"
            )
        raise TraceError(
            f"{how} at {_source(n)} writes into {written.name}, which the fx capture cannot follow; write it "
            "out of place (torch.cat, torch.where, index_put), or trace with capture='export'"
        )

    def _out_of_place(self, n: fx.Node) -> str:
        mutated = n.args[0]
        root = _mutated_root(mutated)
        if root is not None:
            raise TraceError(
                f"in-place {n.target}() at {_source(n)} updates {root}: hapc does not replay in-place "
                "updates of parameters, buffers or inputs in forward yet; write it out of place, or move "
                "the update out of forward (e.g. after optimizer.step())"
            )
        here = self.order[n]
        later = [u for a in _aliases(mutated) for u in a.users if u is not n and self.order[u] > here]
        if later:  # x, or a view sharing its storage, is read after the update (the capture error lets
            # capture="auto" retry with torch.export, whose functionalisation re-derives such views)
            raise TraceError(
                f"in-place {n.target}() at {_source(n)} mutates {mutated.name}, which (or a view of which) is "
                f"used again later ({later[0].name}); write it out of place (y = x.{n.target[:-1]}(...))"
            )
        name = n.target[:-1]
        if not hasattr(torch.Tensor, name):
            raise TraceError(f"in-place {n.target}() at {_source(n)} has no out-of-place form")
        return name

    def finish(self, out: Any, input_names: list[str]) -> RefGraph:
        leaves: list[Ref] = []
        if self.output_spec is not None:  # export: a flat tuple of tensors and their structure
            spec = self.output_spec
            leaves = [r if isinstance(r, Ref) else None for r in out]
        else:
            spec = _ref_structure(out, leaves, self.output_types)
        index = self._loss_leaf(spec, leaves)
        out = leaves[index]
        loss = self.nodes[out.index]
        if loss.meta.rank != 0 or not loss.meta.is_float:
            raise TraceError(
                f"the model's loss must be a scalar floating-point tensor, got {loss.meta!r} "
                f"from {loss.source}; reduce it (e.g. .mean() or .sum())"
            )
        for g in self.guards:  # the model's checks, on the loss: they run wherever the loss does
            from .. import ops as hops

            out = leaves[index] = self.add(
                name=f"{loss.name}_checked", kind=OP, op=canonical_name(hops.checked), target=hops.checked,
                args=(out, self.env[g.condition], g.raise_when, g.message, g.error), meta=loss.meta,
                source=g.message, region=None, autocast=(),
            )  # fmt: skip
        same = merge_common(self.nodes)  # equal pure computations become one node (theory/cse.py)
        if same:
            for nd in self.nodes:
                nd.args, nd.kwargs = _remap((nd.args, nd.kwargs), same, keep_others=True)
            leaves = [Ref(same.get(r.index, r.index)) if isinstance(r, Ref) else r for r in leaves]
            out = leaves[index]
        keep = _reachable(self.nodes, out.index)
        remap = {old: new for new, old in enumerate(sorted(keep))}
        nodes = []
        for old in sorted(keep):
            nd = self.nodes[old]
            nd.index = remap[old]
            nd.args, nd.kwargs = _remap((nd.args, nd.kwargs), remap)
            nodes.append(nd)
        _fill_grad_and_cost(nodes)
        graph = RefGraph(nodes, self.model, [n for n in input_names if any(x.name == n for x in nodes)])
        # outputs besides the loss: the tensors the loss is computed from (logits, hidden states)
        graph.output_spec = spec
        graph.loss_leaf = index
        graph.aliases = {a: c for a, c in self.canonical.items() if a != c}
        graph.outputs = [remap.get(r.index) if isinstance(r, Ref) else None for r in leaves]
        return graph

    def _loss_leaf(self, spec: Any, leaves: list[Ref | None]) -> int:
        from .capture import Leaf

        choice = self.loss_choice
        if isinstance(choice, int) and not isinstance(choice, bool):
            if not 0 <= choice < len(leaves) or leaves[choice] is None:
                raise TraceError(f"loss={choice}: the model returns {len(leaves)} tensors")
            return choice
        keyed = spec["items"] if isinstance(spec, dict) and "items" in spec else {}
        key = choice if choice is not None else "loss"
        if isinstance(keyed.get(key), Leaf):
            return int(keyed[key])
        if choice is not None:
            raise TraceError(f"loss={choice!r}: the model's output has no tensor under that key ({list(keyed)})")
        for i, r in enumerate(leaves):
            if r is not None and self.nodes[r.index].meta.rank == 0 and self.nodes[r.index].meta.is_float:
                return i
        shapes = [repr(self.nodes[r.index].meta) for r in leaves if r is not None]
        raise TraceError(
            f"the model's forward must return the training loss: a scalar floating-point tensor, alone or "
            f"inside what it returns (a 'loss' key, or the first scalar); it returned tensors {shapes} -- "
            f"compute the loss in forward (e.g. `return F.cross_entropy(logits, y)`, or pass labels= to a "
            f"Hugging Face model), or name it with hapc.trace(..., loss=...)"
        )


def _ref_structure(out: Any, leaves: list[Ref | None], types: Any = None) -> Any:
    """The fx output value with every Ref replaced by its Leaf index (see ``capture.output_structure``);
    ``types``: the dicts' types as the model returned them (:func:`_dict_types`; fx made them plain)."""
    from .capture import Leaf

    if isinstance(out, Ref):
        leaves.append(out)
        return Leaf(len(leaves) - 1)
    if isinstance(out, dict):
        kind, sub = types if isinstance(types, tuple) and len(types) == 2 else (type(out), {})
        kind = kind if isinstance(kind, type) and issubclass(kind, dict) else type(out)
        items = {k: _ref_structure(v, leaves, sub.get(k)) for k, v in out.items()}
        return {"__type__": kind, "items": items}
    if not isinstance(out, (tuple, list)):
        return out if out is None or isinstance(out, (int, float, bool, str)) else None
    sub = types if isinstance(types, list) and len(types) == len(out) else [None] * len(out)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_ref_structure(v, leaves, t) for v, t in zip(out, sub)))
    return type(out)(_ref_structure(v, leaves, t) for v, t in zip(out, sub))


_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze", "flatten", "narrow",
                 "select", "expand", "as_strided", "view_as", "unflatten", "detach", "diagonal", "unfold"}  # fmt: skip


#: ops whose result may share its operand's storage (a view, or a no-op conversion)
_MAY_ALIAS = _VIEW_METHODS | {"split", "chunk", "unbind", "movedim", "moveaxis", "swapaxes", "swapdims", "contiguous",
                              "to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "bool",
                              "expand_as", "reshape_as", "ravel", "getitem"}  # fmt: skip


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s result may share its first operand's storage (``x.data``, ``x.T`` too)."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in ("data", "T", "mT", "H", "mH", "real", "imag")
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _MAY_ALIAS and bool(node.args) and isinstance(node.args[0], fx.Node)


def _aliases(node: fx.Node) -> list[fx.Node]:
    """Every node that may share ``node``'s storage: its base through views, and every view of that
    base (transitively). An in-place update of one is seen by all of them in eager PyTorch."""
    root = node
    for _ in range(64):
        if not _may_alias(root):
            break
        root = root.args[0]
    found, frontier = [root], [root]
    while frontier:
        b = frontier.pop()
        for u in b.users:
            if _may_alias(u) and u.args[0] is b and u not in found:
                found.append(u)
                frontier.append(u)
    return found


def _counter_of_batch_norm(node: Any, model: nn.Module) -> bool:
    """Whether ``node`` reads a batch norm module's ``num_batches_tracked`` buffer."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or not node.target.endswith("num_batches_tracked"):
        return False
    owner = node.target.rpartition(".")[0]
    try:
        return isinstance(model.get_submodule(owner), nn.modules.batchnorm._BatchNorm)
    except AttributeError:
        return False


def _mutated_root(node: fx.Node) -> str | None:
    """The parameter, buffer or input an in-place op on ``node`` writes into (through views and
    ``.data``), or None when it writes into a fresh intermediate tensor."""
    seen = 0
    while seen < 64:
        seen += 1
        if node.op == "get_attr":
            return f"the parameter or buffer {node.target}"
        if node.op == "placeholder":
            return f"the model input {node.target}"
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] == "data":
            node = node.args[0]
            continue
        if name in _VIEW_METHODS or (node.op == "call_function" and node.target is operator.getitem):
            src = node.args[0]
            if not isinstance(src, fx.Node):
                return None
            node = src
            continue
        return None
    return None


class _Tuple:
    """Placeholder for a tuple-returning op until its elements are used."""

    def __init__(self, node: fx.Node, args: Any, kwargs: Any):
        self.node, self.args, self.kwargs = node, args, kwargs


def _element_op(spec: _Tuple, i: int, values: Sequence[torch.Tensor]) -> dict[str, Any]:
    n = spec.node
    is_method = n.op == "call_method"
    name = (
        canonical_name(n.target, is_method)
        if n.op != "call_module"
        else qualified_name(type(n.graph.owning_module.get_submodule(n.target)))
    )
    if name in _SPLITTERS:
        x = spec.args[0]
        pos = 1 if name == "unbind" else 2
        dim = spec.kwargs.get("dim", spec.args[pos] if len(spec.args) > pos else 0)
        rank = values[i].dim() + (1 if name == "unbind" else 0)
        dim = dim + rank if dim < 0 else dim
        if name == "unbind":
            return {"op": "select", "target": torch.select, "args": (x, dim, i), "kwargs": {}}
        start = sum(int(v.shape[dim]) for v in values[:i])
        return {
            "op": "narrow",
            "target": torch.narrow,
            "args": (x, dim, start, int(values[i].shape[dim])),
            "kwargs": {},
        }
    target = n.target if n.op != "call_module" else n.graph.owning_module.get_submodule(n.target)
    return {
        "op": name,
        "target": target,
        "args": spec.args,
        "kwargs": spec.kwargs,
        "is_method": is_method,
        "out_index": i,
    }


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in t.shape), t.dtype)


def _fold_devices(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return CURRENT_DEVICE
    if isinstance(value, torch.Size):
        return tuple(int(s) for s in value)
    if isinstance(value, (tuple, list)):
        return type(value)(_fold_devices(v) for v in value)
    if isinstance(value, dict):
        return {k: _fold_devices(v) for k, v in value.items()}
    return value


def _reachable(nodes: list[RefNode], out: int) -> set[int]:
    keep, stack = set(), [out]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        stack.extend(r.index for r in iter_refs((nodes[i].args, nodes[i].kwargs)))
    return keep


def _remap(value: Any, remap: dict[int, int], keep_others: bool = False) -> Any:
    from .graph import map_refs

    if keep_others:
        return map_refs(value, lambda r: Ref(remap.get(r.index, r.index)))
    return map_refs(value, lambda r: Ref(remap[r.index]))


def _fill_grad_and_cost(nodes: list[RefNode]) -> None:
    """requires_grad, memory traffic and backward work of every op node."""
    for n in nodes:
        if n.kind != OP:
            continue
        ops = [nodes[i] for i in n.operands]
        n.requires_grad = n.meta.is_float and any(o.requires_grad for o in ops)
        set_traffic(n, [o.meta.nbytes for o in ops])


#: ops that read only the rows they gather: a table operand costs the result's bytes, not its own
GATHERS = frozenset({"embedding", "index_select", "gather", "take_along_dim"})


def set_traffic(node: RefNode, operand_bytes: Sequence[int]) -> None:
    """Set ``node.mem_parts`` (bytes each operand is read with, then the result's) and their sum
    ``node.mem_bytes``. A gather reads at most as many bytes of an operand as it writes."""
    out = node.meta.nbytes
    reads = [min(b, out) if node.op in GATHERS else b for b in operand_bytes]
    node.mem_parts = (*map(float, reads), float(out))
    node.mem_bytes = float(sum(node.mem_parts))


def backward_work(node: RefNode, nodes: Sequence[RefNode]) -> tuple[float, float]:
    """``(flops, bytes)`` of a node's backward: each differentiable operand of a contraction
    costs one more product of the forward's size (capped at two: dX and dW), which moves the
    forward's bytes again (``dX = dY W^T`` reads W and dY and writes dX, ``dW = X^T dY`` reads X
    and dY and writes dW); memory-bound ops move about as many bytes backward as forward."""
    if not node.requires_grad:
        return 0.0, 0.0
    grads = sum(1 for i in dict.fromkeys(node.operands) if nodes[i].requires_grad)
    products = min(grads, 2) if node.flops else 1
    return node.flops * min(grads, 2), node.mem_bytes * products
