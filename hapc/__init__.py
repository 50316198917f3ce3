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

from . import checkpoint, ops, pipeline
from .api import compile, synthesize
from .cluster import Cluster
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
    "compile",
    "custom_op",
    "derive",
    "ops",
    "pipeline",
    "register_op",
    "register_rule",
    "shard",
    "synthesize",
    "trace",
    "verify",
]
