"""Uneven, autograd-aware collectives on ``torch.distributed`` (HAP §2.5.1, DESIGN §3, §5).

Each collective is an ``autograd.Function`` whose backward is its adjoint under the
partial-gradient convention, so a program built from them back-propagates correctly by itself:

=====================  ==========================  ================================
forward                layouts                     backward (adjoint)
=====================  ==========================  ================================
``all_gather``         ``S(d) -> R``               ``reduce_scatter`` on ``d``
``reduce_scatter``     ``P -> S(d)``               ``all_gather`` on ``d``
``all_reduce``         ``P -> R``                  ``all_reduce``
``all_to_all``         ``S(d1) -> S(d2)``          ``all_to_all`` ``S(d2) -> S(d1)``
=====================  ==========================  ================================

Shards are uneven: ``sizes[r]`` is rank ``r``'s length along the sharded dim. gloo's and NCCL's
all-gather and reduce-scatter need equal sizes, so the *padded* variant pads every shard to the
largest and trims after, packing and unpacking the blocks in one pass
(:mod:`hapc.collectives.pack`, Triton kernels on GPU); the *grouped* variant sends each shard
with its own broadcast / reduce (HAP Fig. 3). All-to-all packs the pieces into one flat buffer per rank and uses
``all_to_all_single`` with split sizes, which both backends support unevenly. The semantics match
``hapc.theory.simulate`` exactly; the tests check one against the other.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..balance.rounding import bounds
from ..errors import HapcError
from .pack import pack, unpack

Group = dist.ProcessGroup | None


def _rank(group: Group) -> int:
    return dist.get_rank(group)


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()


# torch 2.13 names them *_single; older releases *_into_tensor / *_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    _reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=group)


def _global_rank(group: Group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


def gather_impl(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Group, variant: str) -> torch.Tensor:
    flush_losses()  # every collective: see flush_losses
    me = _rank(group)
    if x.shape[dim] != sizes[me]:
        raise RuntimeError(f"all_gather: local shard has {x.shape[dim]} on dim {dim}, expected {sizes[me]}")
    if variant == "grouped":
        parts = []
        for r, n in enumerate(sizes):
            shape = list(x.shape)
            shape[dim] = n
            buf = x.contiguous() if r == me else x.new_empty(shape)
            dist.broadcast(buf, src=_global_rank(group, r), group=group)
            parts.append(buf)
        return torch.cat(parts, dim=dim)
    # padded: every rank contributes a block of the largest shard's size into one flat buffer
    m, big = len(sizes), max(sizes)
    local = _pad(x, dim, big)
    buf = local.new_empty(m * local.numel())
    _all_gather_single(buf, local.reshape(-1), group)
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return unpack(buf, dim, sizes, shape)


def scatter_impl(x: torch.Tensor, dim: int, sizes: Sequence[int], group: Group, variant: str) -> torch.Tensor:
    flush_losses()
    me = _rank(group)
    if x.shape[dim] != sum(sizes):
        raise RuntimeError(f"reduce_scatter: tensor has {x.shape[dim]} on dim {dim}, expected {sum(sizes)}")
    if variant == "grouped":
        out = None
        for r, (lo, hi) in enumerate(bounds(sizes)):
            piece = x.narrow(dim, lo, hi - lo).contiguous().clone()
            dist.reduce(piece, dst=_global_rank(group, r), op=dist.ReduceOp.SUM, group=group)
            if r == me:
                out = piece
        return out
    packed = pack(x, dim, sizes)  # [m, outer, M, inner]: rank r's slice, zero-padded
    out = packed.new_empty(packed[0].shape)
    _reduce_scatter_single(out.view(-1), packed.view(-1), group)
    shape = list(x.shape)
    shape[dim] = max(sizes)
    return out.view(shape).narrow(dim, 0, sizes[me])


def reduce_impl(x: torch.Tensor, group: Group) -> torch.Tensor:
    flush_losses()
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def a2a_impl(
    x: torch.Tensor, src_dim: int, dst_dim: int, src_sizes: Sequence[int], dst_sizes: Sequence[int], group: Group
) -> torch.Tensor:
    flush_losses()
    me = _rank(group)
    if x.shape[src_dim] != src_sizes[me]:
        raise RuntimeError(f"all_to_all: local shard has {x.shape[src_dim]} on dim {src_dim}, expected {src_sizes[me]}")
    if src_dim == dst_dim:  # a re-split of the same dim: gather the overlapping ranges
        full_lo = bounds(src_sizes)[me][0]
        pieces = []
        for lo, hi in bounds(dst_sizes):
            a, b = max(lo, full_lo), min(hi, full_lo + src_sizes[me])
            pieces.append(x.narrow(src_dim, a - full_lo, b - a) if b > a else x.narrow(src_dim, 0, 0))
    else:
        pieces = [x.narrow(dst_dim, lo, hi - lo) for lo, hi in bounds(dst_sizes)]
    send = torch.cat([p.contiguous().reshape(-1) for p in pieces]) if pieces else x.new_zeros(0)
    recv_shapes = []
    for r in range(len(src_sizes)):
        shape = list(x.shape)
        if src_dim == dst_dim:
            lo_s, hi_s = bounds(src_sizes)[r]
            lo_d, hi_d = bounds(dst_sizes)[me]
            shape[src_dim] = max(min(hi_s, hi_d) - max(lo_s, lo_d), 0)
        else:
            shape[src_dim] = src_sizes[r]
            shape[dst_dim] = dst_sizes[me]
        recv_shapes.append(shape)
    recv_counts = [int(torch.Size(s).numel()) for s in recv_shapes]
    out = x.new_empty(sum(recv_counts))
    dist.all_to_all_single(
        out, send, output_split_sizes=recv_counts, input_split_sizes=[p.numel() for p in pieces], group=group
    )
    parts = [chunk.reshape(s) for chunk, s in zip(torch.split(out, recv_counts), recv_shapes)]
    return torch.cat(parts, dim=src_dim if src_dim != dst_dim else dst_dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group, variant):
        ctx.args = (dim, sizes, group, variant)
        return gather_impl(x, dim, sizes, group, variant)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group, variant = ctx.args
        return scatter_impl(grad, dim, sizes, group, variant), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, group, variant):
        ctx.args = (dim, sizes, group, variant)
        return scatter_impl(x, dim, sizes, group, variant)

    @staticmethod
    def backward(ctx, grad):
        dim, sizes, group, variant = ctx.args
        return gather_impl(grad.contiguous(), dim, sizes, group, variant), None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_impl(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_impl(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, src_sizes, dst_sizes, group):
        ctx.args = (src_dim, dst_dim, src_sizes, dst_sizes, group)
        return a2a_impl(x, src_dim, dst_dim, src_sizes, dst_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        src_dim, dst_dim, src_sizes, dst_sizes, group = ctx.args
        return a2a_impl(grad.contiguous(), dst_dim, src_dim, dst_sizes, src_sizes, group), None, None, None, None, None


def all_gather(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: Group = None, variant: str = "padded"
) -> torch.Tensor:
    """``S(dim) -> R``: concatenate every rank's shard (rank ``r`` holds ``sizes[r]``)."""
    return _AllGather.apply(x, dim, list(sizes), group, variant)


def reduce_scatter(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: Group = None, variant: str = "padded"
) -> torch.Tensor:
    """``P -> S(dim)``: sum over ranks, keep rank ``r``'s slice of ``sizes[r]``."""
    return _ReduceScatter.apply(x, dim, list(sizes), group, variant)


def all_reduce(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """``P -> R``: the sum over ranks, on every rank."""
    return _AllReduce.apply(x, group)


def all_to_all(
    x: torch.Tensor, src_dim: int, dst_dim: int, src_sizes: Sequence[int], dst_sizes: Sequence[int], group: Group = None
) -> torch.Tensor:
    """``S(src_dim) -> S(dst_dim)`` with uneven shards on both sides."""
    return _AllToAll.apply(x, src_dim, dst_dim, list(src_sizes), list(dst_sizes), group)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity whose gradient is multiplied by ``factor`` (a replicated loss seeds ``1/m`` per rank)."""
    return _GradScale.apply(x, factor)


class Pending:
    """A collective in flight (:func:`all_reduce_start`), or a loss all-reduce its
    :class:`LossChannel` has not started yet; :func:`wait` yields its result."""

    __slots__ = ("channel", "error", "messages", "replicated", "tensor", "work", "world")

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None, channel: LossChannel | None = None):
        self.tensor, self.work, self.channel = tensor, work, channel
        self.error: Exception | None = None
        self.world = 0  # > 0: the tensor is [loss, h1, h1^2, h2, h2^2, ...] over that many ranks
        self.messages: list[str] = []  # per hash: the error when the ranks' hashes differ
        self.replicated = False  # the loss is whole on every rank already: only the hashes travel


def all_reduce_start(x: torch.Tensor, group: Group = None, known: torch.Tensor | None = None) -> Pending:
    """Start ``all_reduce`` of a tensor that needs no gradient (data-derived values such as token
    counts) without waiting for it. ``known``: the sum, already computed by the caller from the
    global batch (``CompiledModule`` does when every rank was given the whole batch): no
    communication then."""
    if known is not None:
        return Pending(known, None)
    if x.requires_grad:
        raise RuntimeError("all_reduce_start is for tensors without gradients; use all_reduce")
    out = x.detach().contiguous().clone()
    flush_losses()
    return Pending(out, dist.all_reduce(out, group=group, async_op=True))


def wait(pending: Pending) -> torch.Tensor:
    """The result of a started collective (blocks until it has arrived)."""
    if pending.error is not None:
        raise pending.error
    if pending.channel is not None:
        raise RuntimeError(
            "this loss's all-reduce was never started in this process (a loss made before os.fork?): "
            "read losses in the process that computed them"
        )
    if pending.work is not None:
        pending.work.wait()
        pending.work = None
    return pending.tensor


def global_value(partial: torch.Tensor, group: Group = None) -> torch.Tensor:
    """A Partial scalar whose *value* is the sum over ranks but whose gradient flows to this
    rank's summand unchanged: what the loss of a program returns, so every rank reports the loss.

    The result is a :class:`GlobalLoss` that waits for the sum on first use. The all-reduce starts
    here -- unless the caller runs the program inside :func:`deferring` (``CompiledModule`` on
    gloo does), which hands it to a :class:`LossChannel` that starts it later, when it is cheapest."""
    stack = _LOCAL.__dict__.get("stack")
    channel, checks = stack[-1] if stack else (None, ())
    if channel is not None and channel.group is group:
        return channel.defer(partial, checks)
    total = partial.detach().clone()
    flush_losses()
    return _global_loss(partial, Pending(total, dist.all_reduce(total, group=group, async_op=True)))


def _global_loss(partial: torch.Tensor, pending: Pending) -> GlobalLoss:
    out = partial.clone().as_subclass(GlobalLoss)  # clone: the value is overwritten on arrival
    out._hapc_pending = pending
    return out


class LossChannel:
    """Starts the all-reduces of the losses a module returns lazily, on the module's own process
    group.

    An all-reduce running in the background costs the compute threads on CPU (gloo's threads
    wake while the forward and backward run): started at the end of every forward it made a
    data-parallel step 5-10% slower than DDP's (``benchmarks/runtime_overhead.py``). Deferred, each
    loss's all-reduce starts at the earliest of

    * a read of its value (any torch op on the :class:`GlobalLoss`, ``item()``, ``print``),
    * the backward pass's first collective: right before its first gradient bucket (data
      parallel: then it costs nothing measurable), or at its start when the program's backward
      communicates before that (tensor parallel),
    * the next call or collective of any hapc module (``CompiledModule`` calls :func:`flush_losses`),
    * the end of a forward that no backward can follow (no grad),
    * ``DEADLINE_S`` (50-75 ms) after the forward, from a background thread: a step long enough
      to get there pays at most one overlapped scalar all-reduce (~0.5 ms here, <= 1% of it).

    Every start flushes all older losses first (of every module, one queue per process), so each
    rank starts them in creation order -- the same on every rank however the ranks differ in when
    they read; nothing else runs on a module's group, so a loss all-reduce never pairs with another
    collective; and the deadline means a rank that reads the loss early never waits on peers
    that went on to do something else (another module, a barrier) -- at most ``DEADLINE_S``."""

    def __init__(self, group: Group):
        self.group = group

    def defer(
        self, partial: torch.Tensor, checks: Sequence[tuple[int, str]] = (), replicated: bool = False
    ) -> GlobalLoss:
        """``partial``'s value summed over the ranks, started later. ``checks``: ``(hash, message)``
        pairs (hashes < 2**20) of values every rank must hold alike; they ride in the same
        all-reduce and reading the loss raises ``HapcError(message)`` where the ranks' hashes
        differ. ``replicated``: ``partial`` is already the whole loss on every rank (a program
        whose loss is Replicated): only the checks travel, the value is kept."""
        value = partial.detach().clone()
        if checks:  # [loss, h, h^2, ...] summed: equal hashes iff world * sum(h^2) == sum(h)^2
            hashes = [float(h) for h, _ in checks]
            head = 0.0 if replicated else float(value)
            value = torch.tensor(
                [head, *(x for h in hashes for x in (h, h * h))], dtype=torch.float64, device=value.device
            )
        pending = Pending(value, None, self)
        pending.world = dist.get_world_size(self.group) if checks else 0
        pending.messages = [m for _, m in checks]
        pending.replicated = replicated
        with _QUEUE.cond:
            _QUEUE.waiting.append((time.monotonic() + DEADLINE_S, pending))
            _QUEUE.start_thread()
        return _global_loss(partial, pending)


DEADLINE_S = 0.05


class _Queue:
    """The process's deferred loss all-reduces, oldest first, and the thread that starts each at
    its deadline. One lock orders every start, from any thread."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: list[tuple[float, Pending]] = []
        self.thread: threading.Thread | None = None

    def start_thread(self) -> None:  # under cond
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="hapc-loss-deadline", daemon=True)
            self.thread.start()

    def flush(self) -> None:  # under cond
        while self.waiting:
            _, p = self.waiting[0]
            try:
                p.work = dist.all_reduce(p.tensor, group=p.channel.group, async_op=True)
            except Exception as exc:  # the read raises it; later losses still go out, in order
                p.error = exc
            p.channel = None
            self.waiting.pop(0)

    def _run(self) -> None:
        # polls (a wake-up per step would cost more on busy cores than this one every 25 ms)
        with self.cond:
            while True:
                self.cond.wait(DEADLINE_S / 2)
                if self.waiting and self.waiting[0][0] <= time.monotonic():
                    self.flush()


_QUEUE = _Queue()


def _after_fork() -> None:  # a forked child has the queue's memory but not its thread or lock state
    global _QUEUE
    _QUEUE = _Queue()


os.register_at_fork(after_in_child=_after_fork)


def flush_losses() -> None:
    """Start every deferred loss all-reduce of this process now, oldest first (see
    :class:`LossChannel`). Every collective of hapc's calls it first -- a module's own, and every
    collective of a program (the gathers of its other outputs come *after* its loss's
    ``global_value``): the deadline thread may start a loss at any moment, so a collective that
    did not flush first could go out before the loss on one rank and after it on another, and the
    ranks' collectives would pair wrongly (a hang, or a wrong sum; CI saw tiny T5 time out)."""
    if _QUEUE.waiting:
        with _QUEUE.cond:
            _QUEUE.flush()


_LOCAL = threading.local()  # per thread: the channels of the programs running (deferring)


@contextlib.contextmanager
def deferring(channel: LossChannel | None, checks: Sequence[tuple[int, str]] = ()) -> Iterator[None]:
    """Inside, :func:`global_value` on ``channel.group`` defers its all-reduce to ``channel``.
    ``checks``: ``(hash < 2**20, message)`` pairs of values every rank must hold alike (the batch,
    inputs the plan takes whole); they ride in the loss all-reduce and reading the loss raises
    ``HapcError(message)`` for the first whose hashes differ between the ranks."""
    stack = _LOCAL.__dict__.setdefault("stack", [])
    stack.append((channel, tuple(checks)))
    try:
        yield
    finally:
        stack.pop()


class GlobalLoss(torch.Tensor):
    """The loss a program returns while the all-reduce of its value is pending.

    To autograd it is this rank's Partial summand (``backward()`` seeds this rank's share of the
    gradient); its value becomes the sum over ranks before anything can read it: every torch
    operation on it (``item()``, ``print``, arithmetic, ``detach()``...) first waits for the
    all-reduce and writes the global value in place. ``loss.backward()`` does not wait for it
    first (the all-reduce runs beside the backward, see :class:`LossChannel`) and resolves it
    after, when it has started. Results of operations are plain tensors.

    >>> loss = module(*batch)        # doctest: +SKIP
    >>> loss.backward()              # the loss all-reduce goes out with the gradients
    >>> loss.item()                  # the global loss, on every rank
    """

    _hapc_pending: Pending | None

    def _hapc_resolve(self, started_only: bool = False) -> None:
        pending = self.__dict__.get("_hapc_pending")
        if pending is None or (started_only and pending.channel is not None):
            return
        if pending.channel is not None:  # deferred and not started yet: start it (and older ones)
            flush_losses()
        value = wait(pending)  # raises if it failed; the loss stays pending, so every read raises
        if pending.world:
            for i, message in enumerate(pending.messages):
                h, h2 = float(value[1 + 2 * i]), float(value[2 + 2 * i])
                if pending.world * h2 != h * h:
                    raise HapcError(message)  # the same sums on every rank: the same error everywhere
            value = value[0]
        if not pending.replicated:
            with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
                self.copy_(value)
        del self.__dict__["_hapc_pending"]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.backward:
            _resolve_losses(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            plain = tuple(a.as_subclass(torch.Tensor) if isinstance(a, GlobalLoss) else a for a in args)
            out = func(*plain, **kwargs)  # plain tensors: ``Tensor.__format__`` & co. check the type
        if func is torch.Tensor.backward:  # a loss still waiting (no_sync: no bucket went out) keeps waiting
            _resolve_losses(args, kwargs, started_only=True)
        return out


def on_backward(x: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(grad)`` when a backward pass reaches ``x``. A :class:`GlobalLoss` is an alias of
    its value's tensor whose autograd node is replaced when the global value is written into it (a
    read before ``backward()``), which would drop a hook on the alias: it goes on the base."""
    with torch._C.DisableTorchFunctionSubclass():  # a GlobalLoss must not wait for its value here
        target = x._base if isinstance(x, GlobalLoss) and x._base is not None else x
        target.register_hook(hook)


def _resolve_losses(*trees: object, started_only: bool = False) -> None:
    for x in trees:
        if isinstance(x, GlobalLoss):
            x._hapc_resolve(started_only)
        elif isinstance(x, (list, tuple)):
            _resolve_losses(*x, started_only=started_only)
        elif isinstance(x, dict):
            _resolve_losses(*x.values(), started_only=started_only)
