"""Capture with ``torch.export``: library models as their documentation calls them (DESIGN §9).

hapc's own tracer (:mod:`hapc.theory.trace`) runs ``torch.fx`` symbolic tracing with shapes
flowing beside the proxies. It is fast and keeps user leaf modules and ``@hapc.custom_op``
functions whole, but Python in library code defeats it: ``torch.Size`` built from traced sizes,
loss modules created inside ``forward``, item assignment, optional arguments left at ``None``.
``torch.export`` (non-strict, the training IR) runs the model's Python for real on fake tensors
and records the ATen ops that reach the dispatcher -- whatever Python the model uses.

This module maps that ATen graph back onto the torch-level vocabulary the rules are written in,
so the theory, the rules and codegen see the same graph either way:

* ``aten.linear(x, w, b)`` becomes ``F.linear(x, w)`` + ``b`` (``hapc.ops.add_bias``, as :mod:`.normalize` does for
  ``nn.Linear``: the row-parallel linear needs the bias add apart), ``aten.conv2d`` likewise;
  ``aten.embedding(w, i)`` becomes ``F.embedding(i, w)``, ``aten.cross_entropy_loss(.., 1, ..)``
  becomes ``F.cross_entropy(.., reduction="mean")`` (then decomposed into ``sum / count``);
* ops whose ATen schema is the torch function's (``add``, ``transpose``, ``addmm``, ...) call that
  function; tensor-method-only ops (``view``, ``expand``, ``to``) become method calls;
  ``aten.slice`` becomes Python indexing;
* an in-place op on a fresh tensor (``relu_``, ``x += y`` on an activation) becomes its
  out-of-place form and later readers of the tensor read the result (functionalisation); an
  in-place update of a parameter, buffer, input or a view is refused with its source line, except
  batch norm's ``num_batches_tracked`` counter, which the runtime keeps itself;
* parameters, buffers and lifted constants become ``get_attr`` nodes named as in the model
  (tied weights are one parameter); higher-order ``set_grad_enabled`` regions are inlined, their
  results detached when grad was off.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..errors import HapcError, TraceError

aten = torch.ops.aten

#: reduction enum of ATen losses
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}

#: ATen ops that only check or alias and vanish from the graph
_DROP = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}
_IDENTITY = {"alias", "lift_fresh_copy", "lift_fresh", "clone_preserve"}

#: ops that return a view of their first operand (in-place updates through them are refused)
_VIEWS = {
    "view", "reshape", "_unsafe_view", "slice", "select", "transpose", "permute", "expand", "t", "numpy_T",
    "unsqueeze", "squeeze", "as_strided", "narrow", "unflatten", "flatten", "diagonal", "alias",
    "split", "chunk", "unbind", "view_as", "unfold", "detach",
}  # fmt: skip

#: ATen names that have no torch.* function but are tensor methods
_METHODS = {"view", "expand", "contiguous", "new_zeros", "new_ones", "new_full", "new_empty", "repeat", "type_as",
            "expand_as", "view_as", "reshape_as", "float", "double", "half", "bfloat16", "long", "int", "bool",
            "masked_fill", "index_put", "unfold", "fill"}  # fmt: skip


@dataclass
class Captured:
    """What :func:`export_capture` hands to the tracer."""

    gm: fx.GraphModule  # torch-level graph, ``get_attr`` named as in the model
    inputs: dict[str, Any]  # placeholder name -> example value
    outputs: Any  # the model's output structure with tensor leaves replaced by their index


class _Flatten(nn.Module):
    """Calls the model with keyword inputs and returns its output's tensors as a flat tuple."""

    def __init__(self, model: nn.Module, positional: list[str], spec: list[Any]):
        super().__init__()
        self.m = model
        self.positional = positional
        self.spec = spec

    def forward(self, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        args = [kwargs.pop(n) for n in self.positional]
        out = self.m(*args, **kwargs)
        leaves: list[torch.Tensor] = []
        self.spec.clear()
        self.spec.append(output_structure(out, leaves))
        return tuple(leaves)


class Leaf(int):
    """An output position in :attr:`Captured.outputs`: the i-th tensor of the flat output."""

    def __repr__(self) -> str:
        return f"<tensor {int(self)}>"


def output_structure(out: Any, leaves: list[torch.Tensor]) -> Any:
    """``out`` with every tensor replaced by its :class:`Leaf` index in ``leaves``; dicts (and
    ``ModelOutput``, a dict), tuples and lists kept, other objects (caches) become ``None``."""
    if isinstance(out, torch.Tensor):
        leaves.append(out)
        return Leaf(len(leaves) - 1)
    if isinstance(out, dict):
        return {"__type__": type(out), "items": {k: output_structure(v, leaves) for k, v in out.items()}}
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(output_structure(v, leaves) for v in out)
    if isinstance(out, tuple):  # a namedtuple
        return type(out)(*(output_structure(v, leaves) for v in out))
    if out is None or isinstance(out, (int, float, bool, str)):
        return out
    return None


def rebuild_output(spec: Any, leaves: list[Any]) -> Any:
    """The inverse of :func:`output_structure` over new tensor values."""
    if isinstance(spec, Leaf):
        return leaves[int(spec)]
    if isinstance(spec, dict) and "__type__" in spec:
        items = {k: rebuild_output(v, leaves) for k, v in spec["items"].items()}
        cls = spec["__type__"]
        try:
            return cls(**items) if cls is not dict else items
        except TypeError:
            return items
    if isinstance(spec, tuple) and hasattr(spec, "_fields"):
        return type(spec)(*(rebuild_output(v, leaves) for v in spec))
    if isinstance(spec, (tuple, list)):
        return type(spec)(rebuild_output(v, leaves) for v in spec)
    return spec


def leaf_paths(spec: Any, at: str = "") -> dict[int, str]:
    """Where each :class:`Leaf` of an output structure sits, as Python would index it
    (``["logits_per_image"]``, ``[1]``), by leaf index."""
    if isinstance(spec, Leaf):
        return {int(spec): at or "the output"}
    out: dict[int, str] = {}
    if isinstance(spec, dict) and "__type__" in spec:
        for k, v in spec["items"].items():
            out.update(leaf_paths(v, f"{at}[{k!r}]"))
    elif isinstance(spec, (tuple, list)):
        for i, v in enumerate(spec):
            out.update(leaf_paths(v, f"{at}[{i}]"))
    return out


def bind_keywords(model: nn.Module, example_inputs: Any) -> tuple[dict[str, Any], list[str]]:
    """Example inputs as ``{forward parameter name: value}`` and the names given positionally."""
    if isinstance(example_inputs, dict):
        return dict(example_inputs), []
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    values = tuple(example_inputs)
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        names.append(p.name)
    if len(values) > len(names):
        raise TraceError(
            f"{type(model).__name__}.forward takes {len(names)} named inputs {names}, got {len(values)} example "
            "inputs; give forward named parameters or pass example_inputs as a dict"
        )
    return dict(zip(names, values)), names[: len(values)]


def export_capture(model: nn.Module, example_inputs: Any) -> Captured:
    """``torch.export`` the model (non-strict) and map the graph onto torch-level ops."""
    kwargs, positional = bind_keywords(model, example_inputs)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}  # an optional input left at None stays None
    seen: set[int] = set()
    for k, v in kwargs.items():  # `labels=input_ids`: one tensor passed twice must stay two inputs
        if isinstance(v, torch.Tensor):
            if id(v) in seen:
                kwargs[k] = v.clone()
            seen.add(id(v))
    spec: list[Any] = []
    wrapper = _Flatten(model, positional, spec)
    from torch.fx.traceback import annotate, preserve_node_meta

    from .draws import CaptureDraws
    from .trace import _where, checkpoint_regions

    regions = checkpoint_regions(lambda k: annotate({"hapc_region": k}))
    try:
        with preserve_node_meta(), regions, CaptureDraws(None, _where):
            ep = torch.export.export(wrapper, (), kwargs, strict=False)
    except TraceError as exc:
        raise TraceError(f"cannot trace {type(model).__name__}: {exc}") from exc
    except Exception as exc:
        from .trace import _untraceable_message

        if "fake tensor in the exported program constant" in str(exc):  # torch's words for a .data write
            raise TraceError(
                f"cannot trace {type(model).__name__}: its forward updates a parameter or buffer in place through "
                "`.data` (e.g. `self.w.data.clamp_(...)`), which torch.export cannot capture and hapc does not replay; "
                "move the update out of forward (after optimizer.step(), under torch.no_grad()), or capture='fx' to "
                "be told the line"
            ) from exc
        raise TraceError(_untraceable_message(model, exc)) from exc
    finally:
        wrapper.m = None  # type: ignore[assignment]  # drop the reference; the model is the user's
    return Captured(*_Translator(ep, model).run(), outputs=spec[0] if spec else None)


class _Translator:
    """One pass over the exported graph, emitting a torch-level fx graph."""

    def __init__(self, ep: Any, model: nn.Module):
        self.ep, self.model = ep, model
        self.g = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.attrs: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}
        self.origin: dict[fx.Node, str] = {}  # new node -> "param"/"buffer"/"input"/view op name
        self.bn_counters = _batch_norm_counters(model)
        self.autocast: list[tuple] = []  # the wrap_with_autocast regions being inlined, outermost first

    # -- sources ------------------------------------------------------------------------------
    def run(self) -> tuple[fx.GraphModule, dict[str, Any]]:
        sig = self.ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs}
        user_values = dict(self.ep.example_inputs[1]) if self.ep.example_inputs else {}
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.source(node, specs[node.name], user_values)
            elif node.op == "call_function":
                try:
                    self.env[node] = self.call(node)
                except HapcError:
                    raise
                except Exception as exc:  # a shape or bound the model computes from values (an fx Node)
                    from .trace import _source

                    raise TraceError(
                        f"cannot translate torch.export's node {node.name} ({_source(node)}): "
                        f"{type(exc).__name__}: {exc}; hapc needs every shape, size and slice bound to be "
                        "static (not computed from tensor values)"
                    ) from exc
            elif node.op == "get_attr":  # a higher-order op's subgraph
                self.env[node] = getattr(self.ep.graph_module, node.target)
            elif node.op == "output":
                outs = node.args[0]
                user = [o for o, s in zip(outs, sig.output_specs) if s.kind.name == "USER_OUTPUT"]
                if len(user) != len(outs):
                    raise TraceError(
                        f"{type(self.model).__name__} updates parameters or buffers in its forward "
                        f"({[s.target for s in sig.output_specs if s.kind.name != 'USER_OUTPUT']}); hapc does not "
                        "replay such updates yet: move them out of forward (after optimizer.step())"
                    )
                self.g.output(tuple(self.load(o) for o in user))
        gm = fx.GraphModule(self.attrs, self.g, type(self.model).__name__)
        return gm, self.inputs

    def source(self, node: fx.Node, spec: Any, user_values: dict[str, Any]) -> fx.Node:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            name = node.name
            value = _find_input(name, user_values)
            out = self.g.placeholder(name)
            self.inputs[name] = value
            self.origin[out] = "input"
            return out
        target = spec.target
        if kind in ("PARAMETER", "BUFFER"):
            fqn = target.removeprefix("m.")
            self.attrs[fqn] = _lookup(self.model, fqn)
            out = self.g.get_attr(fqn)
            self.origin[out] = kind.lower()
            return out
        if kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            value = self.ep.constants[target]
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise TraceError(
                    f"{target.removeprefix('m.')}: a tensor that wants a gradient is held as a plain attribute, "
                    "not an nn.Parameter: captured, it would be a constant whose gradient is lost -- silently "
                    "unlike one device. Make it a parameter (nn.Parameter, or register_parameter), or a buffer "
                    "if it should not train"
                )
            # a tensor the forward creates from constants: kept on the model as fx keeps its own
            # ``_tensor_constant*`` attributes (a plain attribute: not in the model's state_dict)
            name = "_tensor_constant_" + target.removeprefix("m.").replace(".", "_")
            self.model.__dict__[name] = value
            self.attrs[name] = value
            out = self.g.get_attr(name)
            self.origin[out] = "constant"
            return out
        raise TraceError(f"torch.export gave an input of kind {kind} ({target}); hapc does not support it")

    def load(self, a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: self.env[n])

    # -- ops ----------------------------------------------------------------------------------
    def call(self, node: fx.Node) -> Any:
        target = node.target
        args, kwargs = self.load(node.args), self.load(node.kwargs)
        if target is operator.getitem:
            if isinstance(args[0], (tuple, list)):  # of an inlined higher-order op's results
                return args[0][args[1]]
            return self.emit(operator.getitem, args, {}, node)
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self.higher_order(node, args)
        if not isinstance(target, torch._ops.OpOverload):
            return self.emit(target, args, kwargs, node)
        name = target._schema.name.split("::")[-1]
        if name in _DROP:
            return None
        if name in _IDENTITY:
            return args[0]
        inplace = name.endswith("_") and not name.endswith("__") and target._schema.is_mutable
        if inplace:
            return self.inplace(node, name[:-1], args, kwargs)
        out = self.translate(name, target, args, kwargs, node)
        if name in _VIEWS and isinstance(out, fx.Node):
            self.origin[out] = "view"
        return out

    def inplace(self, node: fx.Node, base: str, args: tuple, kwargs: dict) -> Any:
        """``x.op_(...)``: the out-of-place op, and every later reader of ``x`` reads its result."""
        mutated = node.args[0]
        new_x = self.env[mutated]
        origin = self.origin.get(new_x, "op")
        if origin in ("buffer", "param") and new_x.target in self.bn_counters and base == "add":
            return new_x  # batch norm's num_batches_tracked += 1: the runtime counts itself
        if origin == "constant" and base == "detach":
            return new_x
        if origin == "view":
            done = self.inplace_on_slice(node, base, args, kwargs)
            if done is not None:
                return done
        if origin != "op":
            what = {"param": "a parameter", "buffer": "a buffer", "input": "a model input", "view": "a view"}.get(
                origin, "a tensor"
            )
            raise TraceError(
                f"in-place {base}_() on {what} ({getattr(new_x, 'target', new_x)}) at {_where(node)}: hapc "
                "does not replay in-place updates of parameters, buffers, inputs or views yet; write it out of "
                f"place (y = x.{base}(...)) or move the update out of forward"
            )
        out = self.translate(base, _out_of_place(node, base), args, kwargs, node)
        self.env[mutated] = out  # functionalise: later readers of x read the updated value
        self.refresh_views(mutated, node)  # and so do views of x taken before the update
        return out

    def refresh_views(self, mutated: fx.Node, node: fx.Node, skip: fx.Node | None = None) -> None:
        """Views of ``mutated`` taken before the in-place ``node`` and read after it see the update
        in eager PyTorch (they share storage): re-derive each from the updated value, in graph order.

        Example: ``z = y.view(-1); y.add_(1); z.sum()`` reads ``view(y + 1)``, not ``view(y)``."""
        here = self.order(node)
        root = mutated
        while _mutates(root) and isinstance(root.args[0], fx.Node):  # y.add_(1).mul_(3): the chain's storage is y
            root = root.args[0]
        bases, frontier = {root}, [root]
        while frontier:  # y and every earlier in-place result on it (each is y)
            b = frontier.pop()
            for u in b.users:
                if self.order(u) < here and _mutates(u) and u.args[0] is b and u not in bases:
                    bases.add(u)
                    frontier.append(u)
        for b in bases:
            self.env[b] = self.env[mutated]
        views: list[fx.Node] = []
        frontier = list(bases)
        while frontier:
            b = frontier.pop()
            for u in b.users:
                if u is not skip and self.order(u) < here and u not in views and _is_view_of(u, b):
                    views.append(u)
                    frontier.append(u)
        if not views:
            return
        later = {v for v in views if any(self.order(u) > here for u in v.users)}
        for v in sorted(views, key=self.order, reverse=True):  # a view is needed if it or a view of it is read
            if any(w in later for w in v.users):
                later.add(v)
        for v in sorted(later, key=self.order):
            self.env[v] = self.call(v)

    def inplace_on_slice(self, node: fx.Node, base: str, args: tuple, kwargs: dict) -> Any:
        """``x[..., a:b] = y`` / ``x[:, i].fill_(v)`` on a fresh tensor ``x`` (T5's ``_shift_right``):
        the updated ``x`` is the concatenation of its untouched parts and the new piece."""
        view_ep = node.args[0]
        if not (isinstance(view_ep, fx.Node) and view_ep.op == "call_function"):
            return None
        kind = getattr(view_ep.target, "_schema", None)
        kind = kind.name.split("::")[-1] if kind is not None else ""
        if kind not in ("slice", "select") or not isinstance(view_ep.args[0], fx.Node):
            return None
        base_ep = view_ep.args[0]
        base_new = self.env[base_ep]
        if self.origin.get(base_new, "op") != "op" or any(
            self.order(u) > self.order(node) for u in view_ep.users if u is not node
        ):
            return None  # a parameter's, an input's or a view's slice, or the slice is read again later
        shape = tuple(base_ep.meta["val"].shape)
        rank = len(shape)
        dim = view_ep.args[1] if len(view_ep.args) > 1 else 0
        dim = dim + rank if dim < 0 else dim
        n = shape[dim]
        if kind == "select":
            start = view_ep.args[2] % n
            end, step = start + 1, 1
        else:
            start = view_ep.args[2] if len(view_ep.args) > 2 and view_ep.args[2] is not None else 0
            end = view_ep.args[3] if len(view_ep.args) > 3 and view_ep.args[3] is not None else n
            step = view_ep.args[4] if len(view_ep.args) > 4 else 1
            start, end = (start + n if start < 0 else start), min(end + n if end < 0 else end, n)
        if step != 1:
            return None
        view = self.env[view_ep]
        if base == "copy" or (base == "fill" and isinstance(args[1], fx.Node)):
            piece = self.emit("expand_as", (args[1], view), {}, node, method=True)
            piece = self.emit("to", (piece, base_ep.meta["val"].dtype), {}, node, method=True)
        elif base == "fill":
            piece = self.emit(torch.full_like, (view, args[1]), {}, node)
        else:
            piece = self.translate(base, _out_of_place(node, base), (view, *args[1:]), kwargs, node)
        if kind == "select":
            piece = self.emit(torch.unsqueeze, (piece, dim), {}, node)
        parts = []
        if start > 0:
            parts.append(self.emit(torch.narrow, (base_new, dim, 0, start), {}, node))
        parts.append(piece)
        if end < n:
            parts.append(self.emit(torch.narrow, (base_new, dim, end, n - end), {}, node))
        updated = parts[0] if len(parts) == 1 else self.emit(torch.cat, (parts, dim), {}, node)
        self.env[base_ep] = updated
        self.refresh_views(base_ep, node, skip=view_ep)
        self.env[view_ep] = piece if kind == "slice" else self.emit(torch.squeeze, (piece, dim), {}, node)
        return self.env[view_ep]

    def order(self, node: fx.Node) -> int:
        if not hasattr(self, "_order"):
            self._order = {n: i for i, n in enumerate(self.ep.graph.nodes)}
        return self._order.get(node, -1)

    def higher_order(self, node: fx.Node, args: tuple) -> Any:
        name = getattr(node.target, "_name", str(node.target))
        if name == "wrap_with_set_grad_enabled":  # (enabled, subgraph, *operands)
            enabled, sub, *operands = args
            return self.inline(sub, operands, detach=not enabled)
        if name == "wrap_with_autocast":  # (device, dtype, enabled, cache, subgraph, *operands)
            device, dtype, enabled, cache = args[:4]
            cache = torch.is_autocast_cache_enabled() if cache is None else cache
            self.autocast.append((str(device), dtype, bool(enabled), bool(cache)))
            try:  # its ops run under the same context in the per-rank program (codegen.regions)
                return self.inline(args[4], list(args[5:]), detach=False)
            finally:
                self.autocast.pop()
        raise TraceError(f"{name} at {_where(node)}: hapc cannot capture this construct yet")

    def inline(self, sub: fx.GraphModule, operands: list[Any], detach: bool) -> Any:
        saved = self.env
        self.env = dict(saved)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for p, v in zip(placeholders, operands):
            self.env[p] = v
        result: Any = ()
        for n in sub.graph.nodes:
            if n.op == "call_function":
                self.env[n] = self.call(n)
            elif n.op == "get_attr":
                raise TraceError("a grad-mode region reads a module attribute: not supported")
            elif n.op == "output":
                result = self.load(n.args[0])
        self.env = {**saved, **{k: v for k, v in self.env.items() if k not in saved}}
        if detach:
            result = tuple(self.g.call_method("detach", (r,)) if isinstance(r, fx.Node) else r for r in result)
        return tuple(result)

    def emit(self, target: Any, args: tuple, kwargs: dict, node: fx.Node, method: bool = False) -> fx.Node:
        out = self.g.call_method(target, args, kwargs) if method else self.g.call_function(target, args, kwargs)
        out.meta["stack_trace"] = node.meta.get("stack_trace")
        region = node.meta.get("custom", {}).get("hapc_region")
        if region is not None:  # a torch.utils.checkpoint region (see trace.checkpoint_regions)
            out.meta["hapc_region"] = region
        if self.autocast:  # inside torch.autocast contexts (see higher_order)
            out.meta["hapc_autocast"] = tuple(self.autocast)
        return out

    def translate(self, name: str, target: Any, args: tuple, kwargs: dict, node: fx.Node) -> Any:
        special = _SPECIAL.get(name)
        if special is not None:
            return special(self, args, kwargs, node)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("layout", "pin_memory", "memory_format")}
        if "device" in kwargs:
            kwargs["device"] = self.device_arg()
        fn = getattr(torch, name, None)
        if name in _METHODS or fn is None:
            if hasattr(torch.Tensor, name):
                return self.emit(name, args, kwargs, node, method=True)
            fn = getattr(F, name, None)
            if fn is None:
                return self.emit(target, args, kwargs, node)  # an ATen-only op: its own name for the rules
        return self.emit(fn, args, kwargs, node)

    def device_arg(self) -> Any:
        return torch.device("meta")  # shape propagation runs on meta; the builder reads it as "this rank's device"


def _out_of_place(node: fx.Node, base: str) -> Any:
    """The out-of-place overload of an in-place ATen op (``add_.Tensor`` -> ``add.Tensor``)."""
    op = getattr(aten, base, None)
    return getattr(op, node.target._overloadname, None) or node.target


def _aten_name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def _mutates(node: fx.Node) -> bool:
    """An in-place ATen op (``add_``): its result is its first operand."""
    schema = getattr(node.target, "_schema", None)
    name = _aten_name(node)
    return schema is not None and schema.is_mutable and name.endswith("_") and not name.endswith("__")


def _is_view_of(node: fx.Node, base: fx.Node) -> bool:
    """Whether ``node`` shares ``base``'s storage: a view op on it, or an item of a view op's list
    (``split``/``chunk``/``unbind``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _aten_name(base) in _VIEWS
    return _aten_name(node) in _VIEWS and bool(node.args) and node.args[0] is base


def _where(node: fx.Node) -> str:
    from .trace import _source

    return _source(node)


def _find_input(name: str, values: dict[str, Any]) -> Any:
    if name in values:
        return values[name]
    for k, v in values.items():  # export may suffix a placeholder name (input_ids_1)
        if name.startswith(k) and name[len(k) :].lstrip("_").isdigit():
            return v
    raise TraceError(f"torch.export gave an input {name!r} that matches no example input ({list(values)})")


def _lookup(model: nn.Module, fqn: str) -> torch.Tensor:
    obj: Any = model
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


def _batch_norm_counters(model: nn.Module) -> set[str]:
    return {
        f"{q}.num_batches_tracked" if q else "num_batches_tracked"
        for q, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


# -- ops whose torch-level spelling differs from their ATen schema -------------------------------
Special = Callable[[_Translator, tuple, dict, fx.Node], Any]
_SPECIAL: dict[str, Special] = {}


def special(*names: str) -> Callable[[Special], Special]:
    def deco(fn: Special) -> Special:
        for n in names:
            _SPECIAL[n] = fn
        return fn

    return deco


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _with_bias(t: _Translator, y: fx.Node, bias: Any, node: fx.Node, channel_dims: int = 0) -> fx.Node:
    if bias is None:
        return y
    if channel_dims:
        bias = t.emit("view", (bias, -1, *([1] * channel_dims)), {}, node, method=True)
    from ..ops import add_bias  # in y's dtype, as the fused op's own bias under autocast

    return t.emit(add_bias, (y, bias), {}, node)


@special("linear")  # the bias add apart, as nn.Linear is normalised (row-parallel linear)
def _linear(t, args, kwargs, node):
    return _with_bias(t, t.emit(F.linear, (args[0], args[1]), {}, node), _arg(args, kwargs, 2, "bias"), node)


@special("conv1d", "conv2d", "conv3d")
def _conv(t, args, kwargs, node):
    name = node.target._schema.name.split("::")[-1] if hasattr(node.target, "_schema") else "conv2d"
    fn = getattr(F, name)
    rest = tuple(args[3:])
    y = t.emit(fn, (args[0], args[1], None, *rest), {}, node)
    return _with_bias(t, y, _arg(args, kwargs, 2, "bias"), node, channel_dims=int(name[-2]))


@special("embedding")  # aten.embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
def _embedding(t, args, kwargs, node):
    pad = _arg(args, kwargs, 2, "padding_idx", -1)
    options = {"padding_idx": None if pad == -1 else pad}
    for i, name in ((3, "scale_grad_by_freq"), (4, "sparse")):  # sparse is refused (trace._refuse_embedding_options)
        if _arg(args, kwargs, i, name, False):
            options[name] = True
    return t.emit(F.embedding, (args[1], args[0]), options, node)


@special("layer_norm")
def _layer_norm(t, args, kwargs, node):
    a = list(args[:5])
    return t.emit(F.layer_norm, tuple(a), {}, node)


@special("batch_norm")  # aten: (x, w, b, running_mean, running_var, training, momentum, eps, cudnn)
def _batch_norm(t, args, kwargs, node):
    x, w, b, rm, rv, training, momentum, eps = args[:8]
    return t.emit(F.batch_norm, (x, rm, rv, w, b, training, momentum, eps), {}, node)


@special("cross_entropy_loss")  # (input, target, weight, reduction enum, ignore_index, label_smoothing)
def _cross_entropy(t, args, kwargs, node):
    x, y = args[0], args[1]
    kw = {
        "weight": _arg(args, kwargs, 2, "weight"),
        "reduction": _REDUCTION[_arg(args, kwargs, 3, "reduction", 1)],
        "ignore_index": _arg(args, kwargs, 4, "ignore_index", -100),
        "label_smoothing": _arg(args, kwargs, 5, "label_smoothing", 0.0),
    }
    return t.emit(F.cross_entropy, (x, y), kw, node)


@special("nll_loss", "nll_loss_nd")
def _nll(t, args, kwargs, node):
    kw = {
        "weight": _arg(args, kwargs, 2, "weight"),
        "reduction": _REDUCTION[_arg(args, kwargs, 3, "reduction", 1)],
        "ignore_index": _arg(args, kwargs, 4, "ignore_index", -100),
    }
    return t.emit(F.nll_loss, (args[0], args[1]), kw, node)


@special("mse_loss")
def _mse(t, args, kwargs, node):
    return t.emit(
        F.mse_loss, (args[0], args[1]), {"reduction": _REDUCTION[_arg(args, kwargs, 2, "reduction", 1)]}, node
    )


@special("dropout")
def _dropout(t, args, kwargs, node):
    return t.emit(F.dropout, (args[0],), {"p": float(args[1]), "training": bool(args[2])}, node)


@special("gelu")
def _gelu(t, args, kwargs, node):
    return t.emit(F.gelu, (args[0],), {"approximate": _arg(args, kwargs, 1, "approximate", "none")}, node)


@special("silu", "hardsigmoid", "hardswish", "relu6", "mish", "hardtanh", "elu", "leaky_relu", "softplus")
def _activation(t, args, kwargs, node):
    name = node.target._schema.name.split("::")[-1].removesuffix("_")
    return t.emit(getattr(F, name), tuple(args), dict(kwargs), node)


@special("pad")  # aten.pad(x, pad, mode, value)
def _pad(t, args, kwargs, node):
    return t.emit(F.pad, (args[0], list(args[1])), {"mode": _arg(args, kwargs, 2, "mode", "constant"),
                                                     "value": _arg(args, kwargs, 3, "value")}, node)  # fmt: skip


@special("scaled_dot_product_attention")
def _sdpa(t, args, kwargs, node):
    names = ("attn_mask", "dropout_p", "is_causal")
    kw = {n: v for n, v in zip(names, args[3:6])}
    kw.update({k: v for k, v in kwargs.items() if k in ("scale", "enable_gqa", *names)})
    if not kw.get("enable_gqa"):
        kw.pop("enable_gqa", None)
    return t.emit(F.scaled_dot_product_attention, tuple(args[:3]), kw, node)


@special("slice")  # aten.slice(x, dim, start, end, step) -> x[:, ..., start:end:step]
def _slice(t, args, kwargs, node):
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim", 0)
    start, end = _arg(args, kwargs, 2, "start"), _arg(args, kwargs, 3, "end")
    step = _arg(args, kwargs, 4, "step", 1)
    rank = node.args[0].meta["val"].dim()
    dim = dim + rank if dim < 0 else dim
    if end is not None and end >= 2**62:
        end = None
    index = (slice(None),) * dim + (slice(start, end, None if step == 1 else step),)
    return t.emit(operator.getitem, (x, index), {}, node)


@special("index")  # aten.index(x, [i0, None, i2]) -> x[i0, :, i2]
def _index(t, args, kwargs, node):
    index = tuple(slice(None) if i is None else i for i in args[1])
    return t.emit(operator.getitem, (args[0], index), {}, node)


@special("to", "_to_copy")  # dtype conversions only: every tensor already lives on the rank's device
def _to(t, args, kwargs, node):
    dtype = kwargs.get("dtype")
    if dtype is None:
        dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
    if dtype is None:
        return args[0]
    return t.emit("to", (args[0], dtype), {}, node, method=True)


@special("detach")
def _detach(t, args, kwargs, node):
    return t.emit("detach", (args[0],), {}, node, method=True)


@special("split", "split_with_sizes")  # aten.split.Tensor(x, size, dim)
def _split(t, args, kwargs, node):
    return t.emit(torch.split, (args[0], args[1], _arg(args, kwargs, 2, "dim", 0)), {}, node)


@special("broadcast_tensors")  # aten takes a list, torch.broadcast_tensors(*tensors) (F.mse_loss calls it)
def _broadcast_tensors(t, args, kwargs, node):
    return t.emit(torch.broadcast_tensors, tuple(args[0]), {}, node)


@special("t")
def _t(t, args, kwargs, node):
    if node.args[0].meta["val"].dim() < 2:  # a 0-d or 1-d tensor's t() is itself
        return args[0]
    return t.emit(torch.transpose, (args[0], 0, 1), {}, node)


@special("numpy_T")  # x.T (CLIP's contrastive loss: logits_per_text.T): every dim reversed
def _numpy_t(t, args, kwargs, node):
    rank = node.args[0].meta["val"].dim()
    if rank < 2:
        return args[0]
    if rank == 2:
        return t.emit(torch.transpose, (args[0], 0, 1), {}, node)
    return t.emit(torch.permute, (args[0], tuple(range(rank - 1, -1, -1))), {}, node)


@special("log_sigmoid")  # F.logsigmoid (SigLIP's sigmoid loss); ATen's name is no torch function
def _log_sigmoid(t, args, kwargs, node):
    return t.emit(F.logsigmoid, (args[0],), {}, node)


@special("linalg_vector_norm")  # x.norm(p=2, dim=-1, keepdim=True) under export (SigLIP's embeddings)
def _vector_norm(t, args, kwargs, node):
    ord_, dim, keepdim = (
        _arg(args, kwargs, i, k, d) for i, k, d in ((1, "ord", 2), (2, "dim", None), (3, "keepdim", False))
    )
    kw = {"dtype": kwargs["dtype"]} if kwargs.get("dtype") is not None else {}
    return t.emit(torch.linalg.vector_norm, (args[0],), {"ord": ord_, "dim": dim, "keepdim": keepdim, **kw}, node)


@special("__and__", "__or__", "__xor__")
def _bitwise(t, args, kwargs, node):
    name = node.target._schema.name.split("::")[-1].strip("_")
    return t.emit(getattr(torch, f"bitwise_{name}"), tuple(args), {}, node)


@special("arange")
def _arange(t, args, kwargs, node):
    kw = {k: v for k, v in kwargs.items() if k == "dtype"}
    kw["device"] = t.device_arg()
    return t.emit(torch.arange, tuple(args), kw, node)


@special("zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "rand", "randn",
         "scalar_tensor", "tensor")  # fmt: skip
def _factory(t, args, kwargs, node):
    name = node.target._schema.name.split("::")[-1]
    kw = {k: v for k, v in kwargs.items() if k in ("dtype", "fill_value", "requires_grad")}
    if not name.endswith("_like"):
        kw["device"] = t.device_arg()
    return t.emit(getattr(torch, name), tuple(args), kw, node)
