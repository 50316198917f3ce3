"""The theory layer: trace a model, derive its Hoare-triple theory, and the op-rule registry.

See ``DESIGN.md`` §3 and HAP §4.1-4.2, §4.5. Nothing here knows about devices, costs in seconds,
or processes.
"""

from . import rules as _rules  # noqa: F401  (registers the built-in rules)
from .graph import RefGraph, RefNode, TensorMeta
from .props import DONE, PARTIAL, REPLICATED, Layout, Partial, Prop, Replicated, Sharded, shard
from .registry import OpView, Registry, custom_op, default_registry, register_op, register_rule
from .strategy import OUT, LocalCall, Operand, ShardEnd, ShardLen, ShardStart, Strategy
from .trace import trace
from .triples import Theory, Triple, derive

__all__ = [
    "DONE",
    "OUT",
    "PARTIAL",
    "REPLICATED",
    "Layout",
    "LocalCall",
    "OpView",
    "Operand",
    "Partial",
    "Prop",
    "RefGraph",
    "RefNode",
    "Registry",
    "Replicated",
    "ShardEnd",
    "ShardLen",
    "ShardStart",
    "Sharded",
    "Strategy",
    "TensorMeta",
    "Theory",
    "Triple",
    "custom_op",
    "default_registry",
    "derive",
    "register_op",
    "register_rule",
    "shard",
    "trace",
]
