"""Uneven, autograd-aware collectives and the ops that communicate inside (``hapc.collectives``).

Generated per-rank code calls these by name: ``hapc.collectives.all_gather(x, 0, [5, 3], group)``.
"""

from .fused import (
    moe_combine_all_to_all,
    moe_combine_tokens,
    moe_dispatch_all_to_all,
    moe_dispatch_tokens,
    sfb_linear,
    sync_batch_norm,
)
from .ops import (
    GlobalLoss,
    LossChannel,
    Pending,
    all_gather,
    all_reduce,
    all_reduce_start,
    all_to_all,
    deferring,
    flush_losses,
    global_value,
    grad_scale,
    on_backward,
    reduce_scatter,
    wait,
)
from .outputs import output_local, output_whole
from .shards import take_shard, take_whole

__all__ = [
    "GlobalLoss",
    "LossChannel",
    "Pending",
    "all_gather",
    "all_reduce",
    "all_reduce_start",
    "all_to_all",
    "deferring",
    "flush_losses",
    "global_value",
    "grad_scale",
    "moe_combine_all_to_all",
    "moe_combine_tokens",
    "moe_dispatch_all_to_all",
    "moe_dispatch_tokens",
    "on_backward",
    "output_local",
    "output_whole",
    "reduce_scatter",
    "sfb_linear",
    "sync_batch_norm",
    "take_shard",
    "take_whole",
    "wait",
]
