"""Gradient norms that are the single-device norms, so ``torch.nn.utils.clip_grad_norm_`` is exact.

A parameter the plan shards (``S(d)``) ends the backward with this rank's slice of its gradient.
Torch's clipping computes ``‖g‖_p`` per gradient and then the norm of those norms; on a slice
that is a per-rank number, and every rank would clip by its own, wrong coefficient. As FSDP2's
DTensor parameters do (but lighter), the ``.grad`` of every sharded parameter is a
:class:`ShardedGrad`: a plain tensor in every respect except that its *norm* is the norm of the
whole gradient. For ``p`` finite and non-zero

    ‖g‖_p = (Σ_ranks Σ_local |g_i|^p)^(1/p)       (one SUM all-reduce of each slice's ‖g_r‖_p^p)

``p = ∞`` / ``-∞`` take a MAX / MIN of the slices' norms, ``p = 0`` (a count) a SUM. One call of
``torch._foreach_norm`` (what ``clip_grad_norm_`` and ``get_total_norm`` use on CPU and GPU)
sends one all-reduce for all the sharded gradients in its list, a vector with one slot per
sharded parameter of the module (a slot stays at the identity where a rank holds no gradient),
so ranks agree on its length whatever they hold. Replicated parameters' gradients are whole
after the bucketed all-reduce and stay plain tensors. Every other op -- the optimizer's foreach
updates, ``clip_grad_norm_``'s ``_foreach_mul_``, ``clip_grad_value_``'s clamps (elementwise:
exact on slices) -- runs on the plain tensor and returns plain tensors; nothing propagates.
``torch.amp.GradScaler.unscale_``'s inf/NaN check is likewise the whole gradients' (a MAX
all-reduce of its flag): ranks skip the same steps and keep the same scale.

**Pipelines** (HARP): a stage holds only its own parameters, so the norm of its gradients is not
the model's. Its gradients (sharded or not) are marked with the stage's reducer; their norms come
back as :class:`_StageNorm` scalars (exact within the stage), and the norm of the *stacked*
norms -- the total ``clip_grad_norm_`` computes, once per call -- adds every stage's total in one
all-reduce over the job (each stage's is counted once, by its first rank).

Marking a gradient switches its Python class in place (``t.__class__ = ShardedGrad``, as torch's
own ``UninitializedParameter`` does), so ``p.grad`` keeps its identity (the module's bucket views
and in-place ``zero_grad(set_to_none=False)`` are untouched). Norms are collectives: every rank
of the module must compute them, in the same order (SPMD code does).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import flush_losses
from ..errors import HapcError

_ids = itertools.count()


class GradNorms:
    """One module's reducer: the group its sharded gradients' slices live on, one slot per sharded
    parameter; for a pipeline stage also the job's group and whether this rank speaks for the stage."""

    def __init__(self, group: Any, slots: int):
        self.group, self.slots, self.uid = group, slots, next(_ids)
        self.job: Any = None  # a pipeline stage: the job's group (None: the default group)
        self.pipeline = False
        self.stage_leader = True  # this rank adds the stage's total in the job's all-reduce

    def mark(self, grad: torch.Tensor | None, slot: int, sharded: bool = True) -> None:
        if grad is None or (type(grad) is ShardedGrad and grad._hapc_norms is self):
            return
        if type(grad) is not torch.Tensor and type(grad) is not ShardedGrad:
            return  # someone else's subclass: leave it alone
        grad.__class__ = ShardedGrad
        grad._hapc_norms, grad._hapc_slot, grad._hapc_sharded = self, slot, sharded

    def hook(self, slot: int):
        """A post-accumulate-grad hook marking the parameter's gradient (cheap: a type check)."""

        def mark(p: torch.Tensor) -> None:
            self.mark(p.grad, slot)

        return mark


class _Plain(torch.Tensor):
    """Copies and pickles (``copy.deepcopy``, ``torch.save``) are plain tensors of the local values."""

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)


class ShardedGrad(_Plain):
    """This rank's slice of a gradient (or a pipeline stage's gradient): a plain tensor whose
    norms (``torch._foreach_norm``, ``torch.linalg.vector_norm``, ``torch.linalg.norm``,
    ``torch.norm`` / ``Tensor.norm`` over all elements) are those of the whole gradient."""

    _hapc_norms: GradNorms
    _hapc_slot: int
    _hapc_sharded: bool
    _hapc_elsewhere = False  # a pipeline stage's copy of a tied weight another stage counts (mark_stage)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(not issubclass(t, _Plain) for t in types):
            return NotImplemented  # another subclass (a GlobalLoss to resolve) handles it first
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        with torch._C.DisableTorchFunctionSubclass():
            if handler is not None:
                out = handler(*args, **kwargs)
                if out is not NotImplemented:
                    return out
            return func(*args, **kwargs)


class _StageNorm(_Plain):
    """A pipeline stage's norm (of one gradient, or the stack of them): the norm of a stack of
    these is the norm over every stage (one all-reduce over the job)."""

    _hapc_norms: GradNorms

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        if any(not issubclass(t, _Plain) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        norms = _stage_norms(args)
        with torch._C.DisableTorchFunctionSubclass():
            if func in _NORM_FUNCS and isinstance(args[0], _StageNorm):
                out = _job_norm(func, args, kwargs)
                if out is not NotImplemented:
                    return out
            out = func(*args, **kwargs)
        if func in (torch.stack, torch.Tensor.to, torch.Tensor.reshape, torch.Tensor.view) and norms is not None:
            return _as_stage_norm(out, norms)
        return out


# -- the per-gradient norms -----------------------------------------------------------------------------------
def _kind(p: float) -> str:
    if p == math.inf:
        return "max"
    if p == -math.inf:
        return "min"
    return "count" if p == 0 else "pow"


_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "count": dist.ReduceOp.SUM, "pow": dist.ReduceOp.SUM}
_IDENTITY = {"max": 0.0, "min": math.inf, "count": 0.0, "pow": 0.0}


def _to_p(p: Any) -> float | None:
    """The vector order of a norm argument, or None for what is not a vector norm (``'nuc'``)."""
    if p is None or p == "fro":
        return 2.0
    if isinstance(p, str):
        return None
    return float(p)


def _global_norms(tensors: Sequence[torch.Tensor], p: float, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Each tensor's norm: a :class:`ShardedGrad`'s of its whole gradient, any other's its own.
    One all-reduce per module whose sharded gradients are in the list, in the modules' creation
    order. Runs with torch functions of subclasses disabled (plain tensors throughout)."""
    kind = _kind(p)
    empty = {i for i, t in enumerate(tensors) if type(t) is ShardedGrad and t._hapc_sharded and t.numel() == 0}
    keep = [i for i in range(len(tensors)) if i not in empty]
    out: list[Any] = [None] * len(tensors)
    if keep:
        for i, n in zip(keep, torch._foreach_norm([tensors[i] for i in keep], p, dtype=dtype)):
            out[i] = n
    reducers = {id(t._hapc_norms): t._hapc_norms for t in tensors if type(t) is ShardedGrad}
    for red in sorted(reducers.values(), key=lambda r: r.uid):
        mine = [i for i, t in enumerate(tensors) if type(t) is ShardedGrad and t._hapc_norms is red]
        sharded = [i for i in mine if tensors[i]._hapc_sharded]
        if sharded and red.slots and dist.get_world_size(red.group) > 1:
            device = tensors[sharded[0]].device
            vec = torch.full((red.slots,), _IDENTITY[kind], dtype=torch.float64, device=device)
            present = [i for i in sharded if i not in empty]
            if present:
                vals = torch.stack([out[i].to(device=device, dtype=torch.float64) for i in present])
                slots = torch.tensor([tensors[i]._hapc_slot for i in present], device=device)
                vec.index_copy_(0, slots, vals.pow(p) if kind == "pow" else vals)
            flush_losses()  # a deferred loss all-reduce of the module goes first, on every rank
            dist.all_reduce(vec, op=_OPS[kind], group=red.group)
            totals = vec[torch.tensor([tensors[i]._hapc_slot for i in sharded], device=device)]
            totals = totals.pow(1.0 / p) if kind == "pow" else totals
            for i, n in zip(sharded, totals.unbind()):
                out[i] = n.to(dtype=dtype or tensors[i].dtype, device=tensors[i].device)
        for i in sharded:
            if out[i] is None:  # one rank's empty slice on one rank (a whole gradient that is empty)
                out[i] = torch.zeros((), dtype=dtype or tensors[i].dtype, device=tensors[i].device)
        if red.pipeline:
            for i in mine:
                if tensors[i]._hapc_elsewhere:  # counted by another stage's copy: the identity here
                    out[i] = torch.full_like(out[i], _IDENTITY[kind])
                out[i] = _as_stage_norm(out[i], red)
    return out


def _as_stage_norm(t: torch.Tensor, red: GradNorms) -> torch.Tensor:
    if type(t) is torch.Tensor:
        t.__class__ = _StageNorm
        t._hapc_norms = red
    return t


def _stage_norms(args: Iterable[Any]) -> GradNorms | None:
    for a in args:
        if isinstance(a, _StageNorm):
            return a._hapc_norms
        if isinstance(a, list | tuple):
            for b in a:
                if isinstance(b, _StageNorm):
                    return b._hapc_norms
    return None


def _single(t: torch.Tensor, p: Any, dim: Any, keepdim: bool, dtype: Any, what: str) -> Any:
    """A norm of one tensor over all its elements (``dim`` None or every dim), or NotImplemented."""
    if type(t) is not ShardedGrad:
        return NotImplemented
    if dim is not None:
        dims = [dim] if isinstance(dim, int) else list(dim)
        if t.dim() == 0 or sorted(d % t.dim() for d in dims) != list(range(t.dim())):
            return NotImplemented  # a norm along some dims is the slice's own (a plain tensor)
    order = _to_p(p)
    if order is None:
        kind = "a matrix norm" if p == "matrix" else f"the {p!r} norm"
        raise HapcError(
            f"{what}: {kind} of a gradient the plan shards cannot be computed from this rank's slice; "
            "use a vector norm (what clip_grad_norm_ uses) or gather the gradient with module.full_gradients()"
        )
    (n,) = _global_norms([t], order, dtype)
    return n.reshape([1] * t.dim()) if keepdim else n


def _foreach_norm(tensors: Sequence[torch.Tensor], ord: Any = 2, dtype: Any = None) -> Any:
    return _global_norms(list(tensors), float(ord), dtype)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if out is not None:
        return NotImplemented
    return _single(x, ord, dim, keepdim, dtype, "torch.linalg.vector_norm")


def _linalg_norm(x, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    if out is not None:
        return NotImplemented
    matrix = ord is not None and (x.dim() != 1 if dim is None else not isinstance(dim, int))
    if matrix:  # a matrix norm (ord given over two dims): a slice's is nobody's
        return _single(x, "matrix", dim, keepdim, dtype, "torch.linalg.norm")
    return _single(x, ord, dim, keepdim, dtype, "torch.linalg.norm")


def _torch_norm(x, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    if out is not None:
        return NotImplemented
    return _single(x, p, dim, keepdim, dtype, "torch.norm")


def _tensor_norm(x, p="fro", dim=None, keepdim=False, dtype=None):
    return _single(x, p, dim, keepdim, dtype, "Tensor.norm")


def _unscale(grads: Sequence[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> Any:
    """``GradScaler.unscale_``'s check: ``found_inf`` is set where any of the *whole* gradients has an
    inf or NaN, so every rank skips (or takes) the same optimizer steps as one device would and the
    scales stay equal -- a slice's own check would let the ranks without the overflow step."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    reducers = {id(t._hapc_norms): t._hapc_norms for t in grads if type(t) is ShardedGrad}
    for red in sorted(reducers.values(), key=lambda r: r.uid):
        if red.pipeline or dist.get_world_size(red.group) > 1:
            flush_losses()
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=red.job if red.pipeline else red.group)
    return None


_HANDLERS = {
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale,
    torch._foreach_norm: _foreach_norm,
    torch.linalg.vector_norm: _vector_norm,
    torch.linalg.norm: _linalg_norm,
    torch.norm: _torch_norm,
    torch.Tensor.norm: _tensor_norm,
}
_NORM_FUNCS = (torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm)


def _job_norm(func: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The norm of a stack of stage norms over every stage of the pipeline: this stage's total
    (exact within the stage) combined with the other stages' in one all-reduce over the job."""
    x = args[0]
    red = x._hapc_norms
    names = {torch.linalg.vector_norm: "ord", torch.linalg.norm: "ord"}.get(func, "p")
    default = {"ord": 2 if func is torch.linalg.vector_norm else None, "p": "fro"}[names]
    p = _to_p(args[1] if len(args) > 1 else kwargs.get(names, default))
    rest = args[2:] + tuple(v for k, v in kwargs.items() if k not in (names, "dtype") and v not in (None, False))
    if p is None or rest:
        return NotImplemented
    kind = _kind(p)
    local = torch.linalg.vector_norm(x, p).to(torch.float64)
    if kind in ("pow", "count"):
        contrib = (local.pow(p) if kind == "pow" else local) if red.stage_leader else torch.zeros_like(local)
    else:
        contrib = local.clone()
    flush_losses()
    dist.all_reduce(contrib, op=_OPS[kind], group=red.job)
    total = contrib.pow(1.0 / p) if kind == "pow" else contrib
    return total.to(kwargs.get("dtype") or x.dtype)


def _register_foreach() -> None:
    """``clip_grad_norm_`` / the optimizers take the foreach path only for tensor types listed as
    supporting it (DTensor registers itself the same way)."""
    from torch.utils import _foreach_utils

    if ShardedGrad not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(ShardedGrad)


_register_foreach()


# -- hook-up ------------------------------------------------------------------------------------------------
def install(module: Any) -> GradNorms | None:
    """Mark the gradients of ``module``'s (a :class:`~hapc.codegen.module.CompiledModule`) sharded
    parameters as they are accumulated; returns the module's reducer (None on one rank)."""
    if module.world == 1:
        return None
    params = [
        module._tensor(attr)
        for attr, (ref, lay) in module._layouts.items()
        if lay.is_sharded and isinstance(module._tensor(attr), torch.nn.Parameter)
    ]
    red = GradNorms(module.group, len(params))
    for slot, p in enumerate(params):
        p.register_post_accumulate_grad_hook(red.hook(slot))
    return red


def install_pipeline(stage_module: Any, job: Any, stage_leader: bool) -> GradNorms:
    """A pipeline stage's reducer: norms of its gradients add up over every stage (see module doc)."""
    red = stage_module._grad_norms or GradNorms(stage_module.group, 0)
    red.pipeline, red.job, red.stage_leader = True, job, stage_leader
    stage_module._grad_norms = red
    return red


def mark_stage(stage_module: Any, counted_elsewhere: Sequence[torch.Tensor] = ()) -> None:
    """After a pipeline step: every gradient of the stage is marked (the sharded ones already are).
    ``counted_elsewhere``: parameters whose gradient another stage's copy counts in norms too (a
    tied weight several stages use): here it adds nothing -- one device counts it once."""
    red = stage_module._grad_norms
    skip = {id(p) for p in counted_elsewhere}
    for p in stage_module.parameters():
        if p.grad is not None and type(p.grad) is not ShardedGrad:
            red.mark(p.grad, -1, sharded=False)
        if p.grad is not None and type(p.grad) is ShardedGrad:
            p.grad._hapc_elsewhere = id(p) in skip
