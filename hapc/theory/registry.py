"""The op-rule registry: how each op may be sharded (DESIGN §3 "Rules").

Two ways in, both public:

1. **An annotation** -- one line, all triples generated mechanically
   (grammar in :mod:`hapc.theory.annotation`)::

       hapc.register_op(my_matmul, "b s h, f h -> b s f", linear="each")

   or, for a new function, declare and register it in one go::

       @hapc.custom_op("... h, f h -> ... f", linear="each")
       def my_matmul(x, w): ...

2. **A rule function** -- for ops that do not fit (vocabulary-sharded embedding, reshape dim
   mapping, MoE dispatch); it receives an :class:`OpView` and yields
   :class:`~hapc.theory.strategy.Strategy` objects::

       @hapc.register_rule(my_op, doc="rows shard; columns must stay whole")
       def _(op):
           yield Strategy((shard(0),), shard(0))

Every op additionally gets the replicate-everything strategy from the theory itself, so an op with
no rule never makes synthesis impossible (it warns; ``strict=True`` raises).

Rules are looked up by canonical op name (:mod:`hapc.theory.opnames`), so ``x + y`` and
``torch.add(x, y)`` share the rule ``"add"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from ..errors import RuleError
from .graph import RefGraph, RefNode, TensorMeta
from .opnames import canonical_name, qualified_name
from .strategy import Strategy

RuleFn = Callable[["OpView"], Iterable[Strategy]]


@dataclass
class OpView:
    """What a rule sees of one node: its operands' shapes, its result, its constant arguments."""

    node: RefNode
    graph: RefGraph

    @property
    def operands(self) -> list[TensorMeta]:
        return [self.graph[i].meta for i in self.node.operands]

    @property
    def out(self) -> TensorMeta:
        return self.node.meta

    @property
    def num_operands(self) -> int:
        return len(self.node.operands)

    def arg(self, position: int, name: str | None = None, default: Any = None) -> Any:
        """A constant argument by keyword ``name`` or by ``position`` (self counts as 0 for methods)."""
        if name is not None and name in self.node.kwargs:
            return self.node.kwargs[name]
        if position < len(self.node.args):
            return self.node.args[position]
        return default

    def annotate(self, annotation: str, linear: Any = None) -> list[Strategy]:
        """Strategies from an annotation string, resolved against this node (see ``annotation``)."""
        from .annotation import strategies_from_annotation

        return strategies_from_annotation(self, annotation, linear)

    def dim(self, d: int, rank: int | None = None) -> int:
        """Normalise a possibly negative dim against ``rank`` (default: the first operand's)."""
        r = self.operands[0].rank if rank is None else rank
        return d + r if d < 0 else d

    def fail(self, message: str) -> RuleError:
        return RuleError(f"rule for op {self.node.op!r} at node {self.node.name} ({self.node.source}): {message}")


@dataclass
class OpRule:
    """A registered rule: a strategy generator plus what ``hapc rules`` prints about it."""

    name: str
    fn: RuleFn
    doc: str
    annotation: str | None = None
    linear: Any = None
    builtin: bool = True
    aliases: list[str] = field(default_factory=list)

    def strategies(self, view: OpView) -> list[Strategy]:
        try:
            out = list(self.fn(view))
        except RuleError as exc:
            if view.node.name in str(exc):
                raise
            raise RuleError(f"rule for op {self.name!r} on node {view.node.name} ({view.node.source}): {exc}") from exc
        except Exception as exc:  # a broken rule must name itself
            raise RuleError(
                f"rule for op {self.name!r} failed on node {view.node.name} "
                f"({view.node.source}): {type(exc).__name__}: {exc}"
            ) from exc
        for s in out:
            if len(s.inputs) != view.num_operands:
                raise view.fail(
                    f"strategy {s.key()} gives {len(s.inputs)} operand layouts but the node has "
                    f"{view.num_operands} tensor operands"
                )
        return out


class Registry:
    """Name -> rule table. ``default_registry`` holds the built-in rules plus user registrations."""

    def __init__(self) -> None:
        self._rules: dict[str, OpRule] = {}
        self.custom_functions: dict[int, Callable] = {}  # leaf functions the tracer must not enter

    # -- registration -----------------------------------------------------------------------
    def register_op(
        self,
        target: Any,
        annotation: str,
        *,
        linear: Any = None,
        doc: str | None = None,
        override: bool = True,
        _builtin: bool = False,
    ) -> OpRule:
        """Register ``target`` (callable, module class or op name) with an annotation."""
        from .annotation import parse_annotation

        parse_annotation(annotation)  # fail now, not at trace time
        name = self._name(target)

        def fn(view: OpView) -> list[Strategy]:
            return view.annotate(annotation, linear)

        rule = OpRule(name, fn, doc or annotation, annotation, linear, builtin=_builtin)
        return self._add(rule, override)

    def register_rule(
        self,
        target: Any,
        fn: RuleFn | None = None,
        *,
        doc: str = "",
        override: bool = True,
        _builtin: bool = False,
    ) -> Any:
        """Register a rule function (usable as a decorator)."""

        def deco(f: RuleFn) -> RuleFn:
            lines = (f.__doc__ or "").strip().splitlines()
            text = doc or (lines[0] if lines else "custom rule")
            self._add(OpRule(self._name(target), f, text, builtin=_builtin), override)
            return f

        return deco(fn) if fn is not None else deco

    def alias(self, name: str, *others: str) -> None:
        """Make ``others`` use the rule of ``name`` (``view`` / ``reshape`` / ``flatten``...)."""
        rule = self._rules[name]
        for o in others:
            self._rules[o] = rule
            rule.aliases.append(o)

    def _add(self, rule: OpRule, override: bool) -> OpRule:
        if not override and rule.name in self._rules:
            raise RuleError(f"op {rule.name!r} already has a rule; pass override=True to replace it")
        self._rules[rule.name] = rule
        return rule

    def _name(self, target: Any) -> str:
        if isinstance(target, str):
            return target
        if isinstance(target, type):
            return qualified_name(target)
        name = canonical_name(target)
        if name == qualified_name(target):  # a user function: remember it as a tracing leaf
            self.custom_functions[id(target)] = target
        return name

    # -- lookup ---------------------------------------------------------------------------------
    def get(self, name: str) -> OpRule | None:
        return self._rules.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._rules

    def __iter__(self) -> Iterator[OpRule]:
        seen: set[int] = set()
        for rule in self._rules.values():
            if id(rule) not in seen:
                seen.add(id(rule))
                yield rule

    def names(self) -> list[str]:
        return sorted(self._rules)

    def table(self) -> list[dict[str, Any]]:
        """One row per op name, for ``hapc rules``."""
        rows = []
        for name in self.names():
            r = self._rules[name]
            rows.append(
                {
                    "op": name,
                    "rule": r.name if r.name != name else None,
                    "kind": "annotation" if r.annotation else "function",
                    "annotation": r.annotation,
                    "linear": _linear_text(r.linear),
                    "shards": r.doc,
                    "builtin": r.builtin,
                }
            )
        return rows


def _linear_text(linear: Any) -> str | None:
    if linear is None:
        return None
    return linear if isinstance(linear, str) else ",".join(map(str, linear))


default_registry = Registry()


def register_op(target: Any, annotation: str, *, linear: Any = None, doc: str | None = None) -> OpRule:
    """Register how ``target`` may shard, with an annotation (see :mod:`hapc.theory.annotation`).

    Example::

        hapc.register_op(my_matmul, "b s h, f h -> b s f", linear="each")
    """
    return default_registry.register_op(target, annotation, linear=linear, doc=doc)


def register_rule(target: Any, fn: RuleFn | None = None, *, doc: str = "") -> Any:
    """Register a rule function yielding :class:`Strategy` objects (decorator or direct call)."""
    return default_registry.register_rule(target, fn, doc=doc)


def custom_op(annotation: str | None = None, *, linear: Any = None, doc: str | None = None) -> Callable:
    """Declare a function a single op of the reference graph, optionally with its annotation.

    The tracer records a call to it as one node instead of tracing into its body, and the
    registry knows how it may shard::

        @hapc.custom_op("... h, f h -> ... f", linear="each")
        def my_linear(x, w):
            return x @ w.t()
    """

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            proxy = _find_proxy((args, kwargs))
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
            return fn(*args, **kwargs)

        wrapper.__hapc_custom_op__ = True  # type: ignore[attr-defined]
        if annotation is not None:
            default_registry.register_op(wrapper, annotation, linear=linear, doc=doc)
        else:
            default_registry.custom_functions[id(wrapper)] = wrapper
        return wrapper

    return deco


def _find_proxy(value: Any) -> torch.fx.Proxy | None:
    if isinstance(value, torch.fx.Proxy):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            p = _find_proxy(v)
            if p is not None:
                return p
    if isinstance(value, dict):
        return _find_proxy(tuple(value.values()))
    return None
