"""hapc: compile one PyTorch training model for a heterogeneous GPU cluster.

The public API. Everything not listed in ``__all__`` is internal.

    graph  = hapc.trace(model, example_inputs)     # the single-device reference graph
    theory = hapc.derive(graph)                    # its Hoare-triple theory (HAP §4)
    hapc.register_op(fn, "b s h, f h -> b s f")    # teach the theory a custom op
    plan   = hapc.synthesize(model, "hap-testbed:16", example_inputs)  # program + ratios
    module = hapc.compile(model, cluster, example_inputs)  # this rank's part, under torchrun
    pm = hapc.pipeline.compile_pipeline(model, "harp-setting1", batch)  # HARP stages, H-1F1B
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Lazy: `import hapc` (and so the `hapc` command's argument parsing) imports neither torch nor the
# model zoo; each public name below is imported from its module on first use (PEP 562).
_EXPORTS = {
    ".api": ("compile", "synthesize"),
    ".cluster": ("Cluster",),
    ".planner": ("choose_plan",),
    ".codegen.optimizers": ("elementwise_optimizer",),
    ".errors": (
        "ClusterError",
        "DistributedRunError",
        "HapcError",
        "InfeasibleError",
        "PlanError",
        "RuleError",
        "TraceError",
        "UnsupportedOpError",
        "UnsupportedOpWarning",
    ),
    ".plan": ("Plan",),
    ".theory": (
        "DONE",
        "PARTIAL",
        "REPLICATED",
        "Layout",
        "LocalCall",
        "Operand",
        "OpView",
        "Partial",
        "Prop",
        "RefGraph",
        "Replicated",
        "Sharded",
        "ShardEnd",
        "ShardLen",
        "ShardStart",
        "Strategy",
        "Theory",
        "Triple",
        "custom_op",
        "derive",
        "register_op",
        "register_rule",
        "shard",
        "trace",
    ),
    ".theory.verify": ("verify",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("checkpoint", "ops", "pipeline")

if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from . import checkpoint, ops, pipeline
    from .api import compile, synthesize
    from .cluster import Cluster
    from .codegen.optimizers import elementwise_optimizer
    from .errors import (
        ClusterError,
        DistributedRunError,
        HapcError,
        InfeasibleError,
        PlanError,
        RuleError,
        TraceError,
        UnsupportedOpError,
        UnsupportedOpWarning,
    )
    from .plan import Plan
    from .planner import choose_plan
    from .theory import (
        DONE,
        PARTIAL,
        REPLICATED,
        Layout,
        LocalCall,
        Operand,
        OpView,
        Partial,
        Prop,
        RefGraph,
        Replicated,
        Sharded,
        ShardEnd,
        ShardLen,
        ShardStart,
        Strategy,
        Theory,
        Triple,
        custom_op,
        derive,
        register_op,
        register_rule,
        shard,
        trace,
    )
    from .theory.verify import verify


def __getattr__(name: str) -> Any:
    """A public name, or any submodule (``hapc.theory``, ``hapc.models``...), imported on first use."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"

__all__ = [
    "DONE",
    "PARTIAL",
    "REPLICATED",
    "Cluster",
    "ClusterError",
    "DistributedRunError",
    "HapcError",
    "InfeasibleError",
    "Layout",
    "LocalCall",
    "OpView",
    "Operand",
    "Partial",
    "Plan",
    "PlanError",
    "Prop",
    "RefGraph",
    "Replicated",
    "RuleError",
    "ShardEnd",
    "ShardLen",
    "ShardStart",
    "Sharded",
    "Strategy",
    "Theory",
    "TraceError",
    "Triple",
    "UnsupportedOpError",
    "UnsupportedOpWarning",
    "__version__",
    "checkpoint",
    "choose_plan",
    "compile",
    "custom_op",
    "derive",
    "elementwise_optimizer",
    "ops",
    "pipeline",
    "register_op",
    "register_rule",
    "shard",
    "synthesize",
    "trace",
    "verify",
]
