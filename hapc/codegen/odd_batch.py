"""Calls whose inputs differ from the plan's shapes in the batch dimension only (issue 13): the
last partial batch of an epoch (``drop_last=False``), an evaluation loop with another batch size.

The rank programs are shape-specialised (DESIGN §5: local sizes are literals, and so are the
reference graph's), so such a call runs an exact *replicated step* instead of the plan:

1. the ranks agree on what they were given (one ``all_gather`` of a few integers: the rows, hashes
   of the batch): the same global batch on every rank (identical shares read as one), or each rank
   its share (``DistributedSampler`` pads its indices so the shares are equal; uneven and empty
   shares work too, as long as no rank's is a size the program takes -- ``batch / world`` rows or
   its share of the plan's split -- which that rank alone would run), all-gathered in rank order
   into the global batch: the rows single-device training would see. How the loop passes
   batches (global, even shares, the plan's shares) is agreed on the first call
   (:meth:`OddBatches.agree`), so the ranks take one path;
2. the model is traced again at the global batch's shapes (on meta tensors, cached per shape
   and mode); its parameters and buffers must be the compiled graph's, node by node, else the call
   is refused naming the node;
3. every rank evaluates that single-device graph on the whole batch with whole parameters
   (sharded ones all-gathered, cached until they change). Random ops draw from the module's
   :class:`~hapc.ops.RandomStream` by global index, as the one-rank program does;
4. the backward keeps what each rank owns: a sharded parameter's slice of the (identical on every
   rank) whole gradient; a replicated parameter's whole gradient on rank 0 and zeros elsewhere, so
   that the usual bucket all-reduce (accumulation, ``no_sync`` and all) sums it to exactly the
   whole gradient; a parameter whose gradient the plan makes whole keeps it everywhere. Buffers
   updated in place (batch norm's running statistics) are written back to every local copy.

Every rank computes the whole batch: ``world`` times the arithmetic of the plan's step for that
batch -- a warning says so once per module (measured on 3 gloo ranks, float32: a step of the
tiny GPT 1.8x, of the MLP 1.2x the plan's step). The model's other outputs come back whole (also
under ``outputs="local"``) and detached, as the program's do. Rescaling the plan's split instead
would need programs without literal shapes (DESIGN §5): not done. Whatever is refused is decided from gathered numbers,
so every rank raises the same :class:`~hapc.errors.HapcError`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..errors import HapcError
from ..theory.graph import BUFFER, INPUT, OP, PARAM, RefGraph, map_refs
from ..theory.props import Layout
from ..theory.strategy import Operand, ShardMarker, StreamMarker
from ..theory.trace import CurrentDevice


def is_odd(module: Any, bound: dict[str, Any]) -> bool:
    """Whether a call's inputs differ from the plan's in dim 0 only and are neither the global
    batch nor this rank's share the program takes as is (local shapes only: no communication)."""
    for n in module._graph_inputs:
        x = bound.get(n.name)
        if not isinstance(x, torch.Tensor) or x.dim() != len(n.shape) or x.dim() == 0:
            continue
        if tuple(x.shape) == tuple(n.shape) or tuple(x.shape[1:]) != tuple(n.shape[1:]):
            continue  # the plan's shape, or not a batch change (the usual checks name it)
        if module._batch_mode != "global" and 0 in module._free_dims.get(n.index, ()):
            sizes = module.theory.local_sizes(n.index, 0, module.plan.device_ratios)
            # this rank's share of the plan's split: taken as is where every rank's is alike, or where
            # earlier calls gave the plan's uneven shares (else a rank whose share happens to have
            # this size would run the program while the others run the replicated step)
            if x.shape[0] == sizes[module.rank] and (module._batch_mode == "plan" or len(set(sizes)) == 1):
                continue
        return True
    return False


def _kinds(module: Any, bound: dict[str, Any]) -> int:
    """What this rank was given, as bits: 1 the plan's shapes, 2 this rank's share of the plan's
    split, 4 an even share (``batch / world`` rows); 0 none of these (another batch size)."""
    full, plan, even = True, True, True
    for n in module._graph_inputs:
        x = bound.get(n.name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) == tuple(n.shape):
            continue
        if x.dim() != len(n.shape) or x.dim() == 0 or tuple(x.shape[1:]) != tuple(n.shape[1:]):
            continue  # not a batch change: the usual checks name it
        full = False
        if 0 in module._free_dims.get(n.index, ()):
            plan = plan and x.shape[0] == module.theory.local_sizes(n.index, 0, module.plan.device_ratios)[module.rank]
        else:
            plan = False
        even = even and x.shape[0] * module.world == n.shape[0]
    return 7 if full else 2 * plan + 4 * even


class _Whole(torch.autograd.Function):
    """A parameter's whole value (given, gathered) whose backward keeps this rank's part of the
    whole gradient: the slice ``[start, start + length)`` of dim ``dim`` (sharded), all of it
    (``keep``) or nothing (zeros: another rank contributes it to the bucket all-reduce)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, whole: torch.Tensor, how: tuple) -> torch.Tensor:  # type: ignore[override]
        ctx.how, ctx.shape = how, local.shape
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        kind, dim, start, length = ctx.how
        if kind == "slice":
            return grad.narrow(dim, start, length).contiguous(), None, None
        if kind == "keep":
            return grad, None, None
        return torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device), None, None


class OddBatches:
    """The replicated step of one :class:`~hapc.codegen.module.CompiledModule` (see module docstring)."""

    def __init__(self, module: Any):
        self.m = module
        self.graphs: dict[tuple, tuple[RefGraph, dict[int, Any]]] = {}
        self.warned = False
        self._whole: dict[str, tuple[int, torch.Tensor]] = {}  # attr -> (version, gathered value)

    def agree(self, bound: dict[str, Any]) -> bool:
        """Until the first call of the plan's shapes, the ranks agree on what they were given (one
        ``all_gather`` of a few bits), so that all run the program or all the replicated step --
        a rank whose odd batch happens to have its share's size must not run the program alone."""
        m = self.m
        if m.world == 1:
            return is_odd(m, bound)
        kinds = [row[0] for row in self._all_gather_ints([_kinds(m, bound)])]
        if all(k & 1 for k in kinds):
            m._batch_mode = "global"
        elif all(k & 3 for k in kinds):  # the whole batch on some ranks, the plan's shares on others
            m._batch_mode = "plan"
        elif all(k & 4 and not k & 1 for k in kinds):  # (shares beside the whole batch: refused below)
            m._batch_mode = "even"
        else:
            return True
        return False

    def release(self) -> None:
        """Drop the cached whole parameters (a call of the plan's shape is back)."""
        self._whole.clear()

    # -- agreeing on the global batch -------------------------------------------------------------
    def global_batch(self, bound: dict[str, Any]) -> dict[str, Any]:
        m = self.m
        inputs = m._graph_inputs
        status, where, rows, mask = 0, -1, -1, 0
        batch: dict[str, torch.Tensor] = {}
        rest: dict[str, torch.Tensor] = {}
        for i, n in enumerate(inputs):
            x = bound.get(n.name)
            if not isinstance(x, torch.Tensor):
                continue
            if tuple(x.shape) == tuple(n.shape):
                rest[n.name] = x
                continue
            if x.dim() != len(n.shape) or x.dim() == 0 or tuple(x.shape[1:]) != tuple(n.shape[1:]):
                status, where = status or 1, where if status else i
                continue
            want = n.meta.dtype
            if x.dtype != want and (x.dtype.is_floating_point or want.is_floating_point):
                status, where = status or 2, where if status else i
                continue
            if rows not in (-1, x.shape[0]) or any(inputs[j].shape[0] != n.shape[0] for j in _bits(mask)):
                status, where = status or 3, where if status else i
            rows = x.shape[0] if rows == -1 else rows
            mask |= 1 << i
            batch[n.name] = x
        from .module import _hash_batch

        info = [status, where, rows, mask, _hash_batch(batch) if batch else 0, _hash_batch(rest) if rest else 0]
        table = [info] if m.world == 1 else self._all_gather_ints(info)
        bad = next(((r, row) for r, row in enumerate(table) if row[0]), None)
        if bad is not None:
            r, (code, i, *_) = bad
            n = inputs[i]
            what = {
                1: f"differs from the plan's shape {tuple(n.shape)} in more than the batch dimension (dim 0)",
                2: f"is not {n.meta.dtype}, the dtype the plan was synthesized for (cast it)",
                3: "has a batch size (dim 0) other than the other inputs'",
            }[code]
            raise HapcError(
                f"input {n.name!r} on rank {r} {what}; a call may change only the batch dimension of the inputs that "
                "carry the batch, by the same number of rows; for other shapes synthesize and compile again"
            )
        if len({row[3] for row in table}) > 1:
            raise HapcError(
                "the ranks were given batches of different kinds in one call (an input was the plan's shape on some "
                "ranks and not on others): pass every rank the same global batch, or each its share of it"
            )
        if len({row[5] for row in table}) > 1:
            name = next((n.name for n in inputs if n.name in rest), "?")
            raise HapcError(
                f"input {name!r}, which has the plan's shape, differs between the ranks while the batch changed size; "
                "every rank must be given the same value of the inputs that do not carry the batch"
            )
        same = len({(row[2], row[4]) for row in table}) == 1
        if same:  # the same rows on every rank: the global batch (identical shares read alike)
            total = rows
        elif m._batch_mode == "global":
            raise HapcError(
                "the ranks were given different batches in this call, but earlier calls gave every rank the same "
                "global batch: give every rank the same global batch on every call, or each its own share on "
                "every call (compile again to switch)"
            )
        else:
            sizes = [row[2] for row in table]
            total = sum(sizes)
            if all(0 in m._free_dims.get(inputs[i].index, ()) and sizes == m.theory.local_sizes(
                    inputs[i].index, 0, m.plan.device_ratios) for i in _bits(table[0][3])):  # fmt: skip
                m._batch_mode = "plan"  # the plan's own uneven split: later calls run the program
            elif m._batch_mode is None:
                m._batch_mode = "even"  # shares: later shares of batch / world rows are gathered
            if total:
                bound = dict(bound)
                for name, x in batch.items():
                    bound[name] = self._gather_rows(x, sizes)
        if total <= 0:
            raise HapcError("the batch is empty on every rank: there is nothing to compute (skip the call)")
        return bound

    def _all_gather_ints(self, info: list[int]) -> list[list[int]]:
        m = self.m
        mine = torch.tensor(info, dtype=torch.int64, device=m.device)
        parts = [torch.empty_like(mine) for _ in range(m.world)]
        m._flush()
        dist.all_gather(parts, mine, group=m.group)
        return [[int(v) for v in p] for p in parts]

    def _gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The ranks' rows of ``x`` (``sizes[r]`` on rank ``r``) concatenated in rank order."""
        m = self.m
        top = max(sizes)
        pad = x.new_zeros((top, *x.shape[1:]))
        pad[: x.shape[0]] = x.detach()
        parts = [torch.empty_like(pad) for _ in range(m.world)]
        m._flush()
        dist.all_gather(parts, pad.contiguous(), group=m.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)], 0)

    # -- the single-device graph at the new shape -----------------------------------------------------
    def graph(self, bound: dict[str, Any]) -> tuple[RefGraph, dict[int, Any]]:
        m = self.m
        key = (
            m.training,
            tuple(
                (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
                for k, v in sorted(bound.items())
            ),
        )
        hit = self.graphs.get(key)
        if hit is None:
            if len(self.graphs) >= 8:  # a loop of ever new sizes: keep the latest few
                self.graphs.pop(next(iter(self.graphs)))
            hit = self.graphs[key] = self._trace(bound)
        return hit

    def _trace(self, bound: dict[str, Any]) -> tuple[RefGraph, dict[int, Any]]:
        from ..theory import trace
        from .original import guard_suspended

        old = self.m.theory.graph
        # only shapes are read, but on the real device: tensors the forward creates (positions, masks)
        # become constants with values
        example = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in bound.items()}
        # how hapc.compile traced it (leaf_modules, capture, loss), where it recorded that
        opts = {"capture": old.capture, "loss": old.loss_leaf, **self.m.__dict__.get("_trace_options", {})}
        # the model may be stale by now (the module trained its own copy): a capture that calls it
        # (torch.export) would trip its guard; only shapes are read
        with guard_suspended(old.module):
            new = trace(old.module, example, **opts)
        if len(new) != len(old):
            raise HapcError(
                f"at these input shapes the model computes another graph ({len(new)} operations, {len(old)} at the "
                "compiled shapes): its forward depends on the batch size -- synthesize and compile again for them"
            )
        for a, b in zip(old, new):
            same = a.kind == b.kind and a.op == b.op and (a.name == b.name or (_constant(a) and _constant(b)))
            if same and (a.kind == PARAM or (a.kind == BUFFER and not _constant(a))):
                same = a.target == b.target and a.meta == b.meta
            if not same:
                raise HapcError(
                    f"at these input shapes the model's graph differs from the compiled one at {a.name} "
                    f"({a.source or a.op}): its forward depends on the batch size beyond the shapes -- synthesize and "
                    "compile again for them"
                )
        return new, self._calls(new)

    def _calls(self, new: RefGraph) -> dict[int, Any]:
        """Nodes whose replicated strategy runs a call of its rule's own (random ops: the draw by
        global index), re-derived at the new shapes."""
        from ..theory.registry import OpView, default_registry

        calls: dict[int, Any] = {}
        strategies = self.m.theory.strategies
        for n in new:
            old = strategies.get(n.index)
            if n.kind != OP or not old or old[0].local is None:
                continue
            rule = default_registry.get(n.op)
            found = rule.strategies(OpView(n, new)) if rule is not None else []
            rep = next((s for s in found if s.key() == old[0].key() and s.local is not None), None)
            if rep is None:
                raise HapcError(
                    f"{n.name} ({n.op}) has no replicated call of its rule at these input shapes; synthesize and "
                    "compile again for them"
                )
            calls[n.index] = rep.local
        return calls

    # -- the replicated step ----------------------------------------------------------------------------
    def run(self, bound: dict[str, Any]) -> tuple[torch.Tensor, tuple]:
        m = self.m
        if not self.warned:
            self.warned = True
            warnings.warn(
                "hapc: a call whose batch size differs from the plan's (a partial last batch, an evaluation batch) "
                f"runs as a replicated step: each of the {m.world} ranks computes the whole batch with whole "
                "parameters (sharded ones are all-gathered), exact but about world times the work of the plan's "
                "step; compile a module for that batch size if it is frequent",
                stacklevel=3,
            )
        graph, calls = self.graph(bound)
        values = self._evaluate(graph, calls, bound)
        loss = values[graph.loss.index]
        extras = []
        for k, ref in enumerate(graph.outputs):
            if k == graph.loss_leaf:
                continue
            extras.append(None if ref is None or m._outputs == "loss" else _detached_output(values[ref]))
        return loss, tuple(extras)

    def _evaluate(self, graph: RefGraph, calls: dict[int, Any], bound: dict[str, Any]) -> list[Any]:
        m = self.m
        by_target: dict[str, list[tuple[str, Layout]]] = {}
        for attr, (ref, lay) in m._layouts.items():
            by_target.setdefault(m.theory.graph[ref].target, []).append((attr, lay))
        grad_complete = {m.theory.graph[r].target for r in m.grad_complete}
        values: list[Any] = [None] * len(graph)
        written: list[tuple[torch.Tensor, int, list[tuple[str, Layout]]]] = []
        for n in graph:
            if n.kind == INPUT:
                x = bound[n.name]
                values[n.index] = x.to(m.device) if isinstance(x, torch.Tensor) else x
            elif n.kind == PARAM:
                values[n.index] = self._param(n, by_target.get(n.target, []), n.target in grad_complete)
            elif n.kind == BUFFER and _constant(n):  # a tensor the forward made (a mask): this trace's value
                values[n.index] = getattr(graph.module, n.target).to(m.device)
            elif n.kind == BUFFER:
                whole = self._buffer(n, by_target.get(n.target, []))
                written.append((whole, whole._version, by_target.get(n.target, [])))
                values[n.index] = whole
            else:
                a, k = map_refs((n.args, n.kwargs), lambda r: values[r.index])
                if n.index in calls:
                    values[n.index] = self._call(calls[n.index], n, values)
                else:
                    a, k = _with_device((a, k), m.device)
                    values[n.index] = n.call(*a, **k)
        for whole, version, copies in written:  # in-place updates (running statistics)
            if whole._version == version:
                continue
            with torch.no_grad():
                for attr, lay in copies:
                    local = m._tensor(attr)
                    if local is not whole:
                        local.copy_(m._slice(whole, m._layouts[attr][0], lay))
        return values

    def _call(self, call: Any, n: Any, values: list[Any]) -> Any:
        operands = [values[o] for o in n.operands]
        m = self.m

        def fill(v: Any) -> Any:
            if isinstance(v, Operand):
                return operands[v.position]
            if isinstance(v, ShardMarker):
                raise HapcError(f"{n.name}: a replicated call cannot name a shard")
            if isinstance(v, CurrentDevice):
                return m.device
            if isinstance(v, StreamMarker):
                return m.rng
            if isinstance(v, tuple):
                return tuple(fill(x) for x in v)
            if isinstance(v, list):
                return [fill(x) for x in v]
            if isinstance(v, dict):
                return {k: fill(x) for k, x in v.items()}
            return v

        args, kwargs = fill(call.args), fill(dict(call.kwargs))
        out = getattr(args[0], call.target)(*args[1:], **kwargs) if call.is_method else call.target(*args, **kwargs)
        return out if call.out_index is None else out[call.out_index]

    def _gathered(self, attr: str, lay: Layout) -> torch.Tensor:
        """The whole value of local tensor ``attr`` (gathered when sharded; cached while unchanged)."""
        m = self.m
        local = m._tensor(attr)
        if not lay.is_sharded:
            return local
        hit = self._whole.get(attr)
        if hit is not None and hit[0] == local._version:
            return hit[1]
        m._flush()
        whole = m._gather(local, m._layouts[attr][0], lay)
        self._whole[attr] = (local._version, whole)
        return whole

    def _param(self, n: Any, copies: list[tuple[str, Layout]], complete: bool) -> torch.Tensor:
        m = self.m
        if not copies:
            return m._unused[n.target].to(m.device)  # frozen at compile: a constant
        attr, lay = copies[0]
        local = m._tensor(attr)
        whole = self._gathered(attr, lay)
        if not (torch.is_grad_enabled() and local.requires_grad):
            return whole.detach()
        if lay.is_sharded:
            sizes = m.theory.local_sizes(m._layouts[attr][0], lay.dim, m.plan.device_ratios)
            how = ("slice", lay.dim, sum(sizes[: m.rank]), sizes[m.rank])
        elif complete or m.world == 1:
            how = ("keep", 0, 0, 0)
        else:  # the bucket all-reduce sums the ranks' contributions: only rank 0 gives the whole gradient
            how = ("keep" if m.rank == 0 else "zero", 0, 0, 0)
        return _Whole.apply(local, whole, how)

    def _buffer(self, n: Any, copies: list[tuple[str, Layout]]) -> torch.Tensor:
        m = self.m
        if not copies:
            return m._unused[n.target].to(m.device).clone()
        for attr, lay in copies:
            if not lay.is_sharded:
                return m._tensor(attr)  # updated in place like the single-device model's
        attr, lay = copies[0]
        self._whole.pop(attr, None)
        return self._gathered(attr, lay).clone()


def _constant(n: Any) -> bool:
    """A tensor the forward created from Python values, which tracing attached to the model (its
    name is numbered anew by every trace, and its value may depend on the batch size)."""
    return str(n.target or "").startswith("_tensor_constant")


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _detached_output(x: Any) -> Any:
    """An extra output (logits...) for metrics, as the program returns them: whole and without a
    path back into the parameters (a backward through it would not be synchronised)."""
    return x.detach() if isinstance(x, torch.Tensor) else x


def _with_device(value: Any, device: Any) -> Any:
    from ..theory.graph import _with_device as impl

    return impl(value, device)
