"""Which optimizers train a compiled module's parameters exactly (issue 13: no silent divergence).

A plan that shards a parameter ``p`` leaves rank ``r`` with its slice ``p_r`` and the slice ``g_r``
of its gradient. An optimizer whose update of element ``i`` reads only element ``i`` of the
parameter, of its gradient and of its own state (SGD, Adam, AdamW, ...) computes on the slices
exactly what it computes on the whole tensor:

    update(p, g)[slice_r] = update(p_r, g_r)

An optimizer that reads across elements does not: Adafactor factors its second moment over the
rows and columns of a matrix, Muon orthogonalises the whole matrix, LBFGS takes dot products over
every parameter it holds. On slices each rank would silently train something else. So before the
first step of an optimizer that holds a sharded gradient (a
:class:`~hapc.codegen.grad_norm.ShardedGrad`), hapc checks its class:

=====================  ==========================================================================
elementwise            ``SGD Adam AdamW Adamax NAdam RAdam Adagrad RMSprop Rprop ASGD Adadelta``,
                       and what a user declares with :func:`elementwise_optimizer`: always exact
per tensor             ``Adafactor Muon``: exact on whole tensors (a pipeline stage's), refused on
                       sharded ones
anything else          ``LBFGS``, third-party and user optimizers: refused on a sharded module or a
                       pipeline stage (they may read across tensors), with the fix named
=====================  ==========================================================================

A subclass that overrides ``step`` is "anything else" until declared. Modules whose plan
replicates every parameter (data parallel) hold whole tensors with whole gradients: any optimizer
is exact there, and nothing is checked.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, TypeVar

import torch

from ..errors import HapcError

T = TypeVar("T", bound=type)

#: update element i from element i of (param, grad, state) alone
ELEMENTWISE: set[type] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD,
    torch.optim.Adadelta,
}  # fmt: skip
#: read across the elements of one tensor, never across tensors
PER_TENSOR: set[type] = {c for c in (getattr(torch.optim, n, None) for n in ("Adafactor", "Muon")) if c is not None}

_PASSED: weakref.WeakSet = weakref.WeakSet()  # optimizers checked once, with sharded gradients in hand
_HOOK: Any = None


def elementwise_optimizer(cls: T) -> T:
    """Declare an optimizer class elementwise -- its update of each element reads only that element of
    the parameter, its gradient and its state (SGD/Adam-like; e.g. Lion) -- so hapc lets it step
    sharded parameters. Usable as a decorator. A wrong declaration trains differently from one
    device: declare only what is true."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise HapcError(f"elementwise_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}")
    ELEMENTWISE.add(cls)
    return cls


def _kind(optimizer: torch.optim.Optimizer) -> str:
    """``"elementwise"``, ``"per tensor"`` or ``"unknown"`` (a subclass overriding ``step`` is unknown)."""
    cls = type(optimizer)
    for base in cls.__mro__:
        if base in ELEMENTWISE or base in PER_TENSOR:
            if inspect.unwrap(cls.step) is not inspect.unwrap(base.step):  # torch wraps step per class
                return "unknown"
            return "elementwise" if base in ELEMENTWISE else "per tensor"
    return "unknown"


def check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: refuse an optimizer that would update sharded slices (or a pipeline
    stage's tensors) differently from whole tensors. Checked until the optimizer's parameters have
    gradients, then never again."""
    if optimizer in _PASSED:
        return
    from .grad_norm import ShardedGrad

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return  # nothing to update yet: checked again at the next step
    marked = [g for g in grads if type(g) is ShardedGrad]
    kind = _kind(optimizer)
    sharded = any(g._hapc_sharded for g in marked)
    name = type(optimizer).__name__
    if not marked or kind == "elementwise" or (kind == "per tensor" and not sharded):
        _PASSED.add(optimizer)
        return
    if kind == "per tensor":
        raise HapcError(
            f"{name} reads across the elements of each parameter (e.g. whole rows and columns), but this "
            "module's plan shards parameters: each rank would update its slice differently from one device. "
            "Use an elementwise optimizer (SGD, Adam, AdamW, ...), or compile with a plan that replicates "
            "parameters (hapc.compile(..., baseline='dp-ev'))"
        )
    where = "shards parameters" if sharded else "is a pipeline stage holding part of the model"
    raise HapcError(
        f"hapc cannot tell whether {name} updates each parameter element from that element alone, and this "
        f"module {where}: an optimizer that reads across elements or tensors (LBFGS, Adafactor, Muon, "
        "layer-wise LARS/LAMB) would train differently from one device. If its update is elementwise "
        f"(SGD/Adam-like), declare it: hapc.elementwise_optimizer({name}); otherwise compile with a plan "
        "that replicates parameters (hapc.compile(..., baseline='dp-ev'), pipeline=False)"
    )


def install() -> None:
    """Register :func:`check_optimizer` as a global optimizer step pre-hook (once)."""
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(check_optimizer)
