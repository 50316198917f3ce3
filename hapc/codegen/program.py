"""Plan -> one rank's program as a ``torch.fx.GraphModule`` (DESIGN §5).

Every instruction of the plan becomes one line of ordinary PyTorch: sources read the rank's
parameter shards (``self.linear_weight``) or slice the global batch; computations call the
reference op with this rank's shapes written as literals (``x.reshape(8, 5, 64)`` on a rank holding
5 of 12 heads); collectives call ``hapc.collectives`` with the shard sizes of every rank. The
``.code`` of the result reads like hand-written code and is what ``hapc synth --emit-code`` writes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import collectives as C
from ..balance.rounding import bounds
from ..ops import add_bias
from ..plan import Plan
from ..theory.graph import BUFFER, INPUT, PARAM
from ..theory.instructions import Collective, Compute, Loss, Source
from ..theory.local import default_call, local_call
from ..theory.props import Layout
from ..theory.strategy import OUT, LocalCall, Operand, ShardMarker, Strategy, StreamMarker
from ..theory.trace import CurrentDevice
from ..theory.triples import Theory
from .regions import AUTOCAST, REGION, autocast_regions, checkpoint_regions

#: convolutions whose bias add the program fuses back, by their number of spatial dims
_CONVS: dict[Callable, int] = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}


@dataclass
class _Fused:
    """A strategy that communicates inside: which runtime function runs it, and its extra args."""

    fn: Callable
    extra: Callable[[RankProgram, Any, Strategy], dict[str, Any]]


def _no_extra(rp: RankProgram, node: Any, s: Strategy) -> dict[str, Any]:
    return {}


def _sfb_extra(rp: RankProgram, node: Any, s: Strategy) -> dict[str, Any]:
    d = s.inputs[0].dim
    return {"sizes": rp.sizes(node.operands[0], d), "dim": d}


def _experts_out(rp: RankProgram, node: Any, s: Strategy) -> dict[str, Any]:
    return {"expert_sizes": rp.sizes(node.index, 0)}


def _experts_in(rp: RankProgram, node: Any, s: Strategy) -> dict[str, Any]:
    return {"expert_sizes": rp.sizes(node.operands[0], 0)}


FUSED: dict[tuple[str, str], _Fused] = {
    ("batch_norm", "sync-batch"): _Fused(C.sync_batch_norm, _no_extra),
    ("linear", "sfb"): _Fused(C.sfb_linear, _sfb_extra),
    ("hapc.ops.moe_dispatch", "all-to-all"): _Fused(C.moe_dispatch_all_to_all, _experts_out),
    ("hapc.ops.moe_dispatch", "tokens"): _Fused(C.moe_dispatch_tokens, _no_extra),
    ("hapc.ops.moe_combine", "tokens"): _Fused(C.moe_combine_tokens, _no_extra),
    ("hapc.ops.moe_combine", "all-to-all"): _Fused(C.moe_combine_all_to_all, _experts_in),
}


def _key(value: Any) -> Any:
    """A hashable identity for call arguments (fx nodes by identity, containers by content)."""
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _key(value.start), _key(value.stop), _key(value.step))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _layout_name(lay: Layout) -> str:
    return {"R": "R", "P": "P"}.get(lay.kind, f"S{lay.dim}")


def state_name(node: Any, layout: Layout, kind: str) -> str:
    """Attribute holding a parameter's (one layout) or buffer's (per layout) local tensor."""
    return node.name if kind == PARAM else f"{node.name}__{_layout_name(layout)}"


class RankProgram:
    """Builds rank ``rank``'s graph for a plan (see module docstring)."""

    def __init__(self, theory: Theory, plan: Plan, rank: int, outputs: str = "whole"):
        self.theory, self.plan, self.rank = theory, plan, rank
        self.outputs = outputs  # the model's other returned tensors: "whole", "local" or "loss" (none)
        self.world = len(plan.device_ratios)
        self.graph = fx.Graph()
        self.env: dict[tuple[int, Layout], fx.Node] = {}
        self.placeholders: dict[int, fx.Node] = {}
        self.state: dict[str, tuple[int, Layout]] = {}  # attribute -> (node, layout) to shard from
        self.grad_complete: set[int] = set()
        # optional trailing arguments: name -> data-only node whose whole-batch value they carry
        self.batch_values: dict[str, int] = {}
        self._batch_args: dict[str, fx.Node] = {}
        self._group: fx.Node | None = None
        self._device: fx.Node | None = None
        self._stream: fx.Node | None = None
        self.uses_stream = False  # the program reads self.rng (it has random ops)
        self._calls: dict[Any, fx.Node] = {}
        self._grad_memo: dict[int, bool] = {}

    # -- per-rank numbers ---------------------------------------------------------------------------
    def sizes(self, ref: int, dim: int) -> list[int]:
        return self.theory.local_sizes(ref, dim, self.plan.device_ratios)

    def span(self, ref: int, dim: int) -> tuple[int, int]:
        return bounds(self.sizes(ref, dim))[self.rank]

    def group(self) -> fx.Node:
        if self._group is None:  # defined up front: early-started collectives may need it anywhere
            with self.graph.inserting_after(self._last_placeholder()):
                self._group = self.graph.get_attr("group")
        return self._group

    def _batch_value(self, node: Any) -> fx.Node | None:
        """An optional argument for the whole-batch value of data-only node ``node`` (when it
        depends on the model's inputs alone, not on its buffers)."""
        graph = self.theory.graph
        kinds = {graph[i].kind for i in graph.ancestors(node.index)}
        if INPUT not in kinds or PARAM in kinds or BUFFER in kinds:
            return None
        name = f"{node.name}_global"
        if name not in self._batch_args:
            with self.graph.inserting_after(self._last_placeholder()):
                self._batch_args[name] = self.graph.placeholder(name, default_value=None)
            self.batch_values[name] = node.index
        return self._batch_args[name]

    def _last_placeholder(self) -> fx.Node | None:
        last = None
        for n in self.graph.nodes:
            if n.op == "placeholder":
                last = n
        return last

    def _needs_grad(self, ref: int) -> bool:
        """Whether a reference tensor depends on a parameter (so its collectives need autograd)."""
        memo = self._grad_memo
        if ref not in memo:
            node = self.theory.graph[ref]
            memo[ref] = node.kind == PARAM or any(self._needs_grad(o) for o in node.operands)
        return memo[ref]

    def device(self) -> fx.Node:
        if self._device is None:
            self._device = self.graph.get_attr("device")
        return self._device

    def stream(self) -> fx.Node:
        """The module's random stream (``self.rng``, a :class:`hapc.ops.RandomStream`)."""
        if self._stream is None:
            self._stream = self.graph.get_attr("rng")
            self.uses_stream = True
        return self._stream

    # -- building -------------------------------------------------------------------------------
    def build_graph(self) -> fx.Graph:
        """Emit every instruction; afterwards ``state`` lists the tensors the program reads."""
        g = self.graph
        for n in self.theory.graph.inputs:
            self.placeholders[n.index] = g.placeholder(n.name)
        loss = None
        for seg in self.plan.program:
            for triple in seg:
                for ins in triple:
                    last = g._root.prev  # the nodes after it are this instruction's
                    out = self.emit(ins)
                    ref = self.theory.graph[ins.ref]
                    if isinstance(ins, (Compute, Collective)) and (ref.region is not None or ref.autocast):
                        n = last.next
                        while n is not g._root:  # hapc.codegen.regions
                            if ref.region is not None:  # recomputed in backward
                                n.meta[REGION] = ref.region
                            if ref.autocast and isinstance(ins, Compute):  # under the model's autocast contexts
                                n.meta[AUTOCAST] = ref.autocast  # (collectives stay outside: recompute cuts at them)
                            n = n.next
                    if isinstance(ins, Loss):
                        loss = out
        if loss is None:
            raise RuntimeError("the plan has no loss instruction")
        extras = self._extra_outputs()
        g.output((loss, *extras) if extras else loss)
        self._fuse_linear_bias()
        self._hoist_data_only()
        g.lint()
        return g

    def _hoist_data_only(self) -> None:
        """Move work that depends on the inputs alone (no parameter) to the top of the program.

        Such values -- this rank's slice of the batch, token counts of a mean loss -- are then
        ready early, and a collective on them (``all_reduce_start``) runs while the forward
        computes; its ``wait`` stays where the value is used. Relative order is kept, so every
        rank still issues its collectives in the same order."""
        g = self.graph
        params = {attr for attr, (ref, _) in self.state.items() if self.theory.graph[ref].kind == PARAM}
        data_only: set[fx.Node] = set()
        hoist: list[fx.Node] = []
        for n in g.nodes:
            if n.op == "placeholder" or (n.op == "get_attr" and n.target not in params):
                data_only.add(n)
                if n.op == "get_attr":
                    hoist.append(n)
            elif n.op in ("call_function", "call_method") and all(a in data_only for a in n.all_input_nodes):
                if n.target is not C.wait:  # a wait stays put, and so does everything that reads it
                    data_only.add(n)
                    hoist.append(n)
        anchor = self._last_placeholder()
        for n in hoist:
            if anchor is None:  # a program without inputs: the top is the first node
                first = next(iter(g.nodes))
                if first is not n:
                    first.prepend(n)
            elif anchor.next is not n:
                anchor.append(n)
            anchor = n

    def _local_len(self, attr: str, dim: int) -> int:
        ref, lay = self.state[attr]
        if lay.is_sharded and lay.dim == dim:
            lo, hi = self.span(ref, dim)
            return hi - lo
        return self.theory.graph[ref].shape[dim]

    def _fuse_linear_bias(self) -> None:
        """``F.linear(x, w) + b`` -> ``F.linear(x, w, b)``; ``F.conv2d(x, w, None, ...) + b.view(-1, 1, 1)``
        -> ``F.conv2d(x, w, b, ...)`` (conv1d and conv3d alike).

        Tracing splits ``nn.Linear`` and ``nn.Conv*d`` into the product and a bias add so that a
        row-parallel linear (a convolution split on its input channels) can add its bias after the
        reduction; where the plan adds it locally right away, the fused call is what the
        single-device module runs: one kernel, where the split form passes over the whole
        activation twice more (the add forward, a sum over batch and space for the bias's gradient
        backward) -- measured 10-15% of a small CNN's step on CPU."""
        g = self.graph
        for add in list(g.nodes):
            if add.op != "call_function" or add.target not in (operator.add, add_bias) or len(add.args) != 2:
                continue
            for lin, bias in (add.args, add.args[::-1]):
                if not (isinstance(lin, fx.Node) and isinstance(bias, fx.Node)):
                    continue
                view = None
                if lin.op == "call_function" and lin.target in _CONVS and not lin.kwargs:
                    # F.convNd(x, w, None, stride, padding, dilation, groups) + b.view(-1, 1, ..., 1)
                    dims = _CONVS[lin.target]
                    if len(lin.args) < 3 or lin.args[2] is not None or len(bias.users) != 1:
                        continue
                    if not (bias.op == "call_method" and bias.target in ("view", "reshape") and not bias.kwargs):
                        continue
                    shape = bias.args[1] if len(bias.args) == 2 and isinstance(bias.args[1], tuple) else bias.args[1:]
                    # (-1, 1, 1) as traced; (n, 1, 1) with this rank's channel count where the bias is sharded
                    if tuple(shape[1:]) != (1,) * dims or not isinstance(bias.args[0], fx.Node):
                        continue
                    view, bias = bias, bias.args[0]
                    if bias.op != "get_attr" or bias.target not in self.state:
                        continue
                    if shape[0] not in (-1, self._local_len(bias.target, 0)):
                        continue
                elif lin.op != "call_function" or lin.target is not F.linear or len(lin.args) != 2 or lin.kwargs:
                    continue
                if len(lin.users) != 1 or bias.op != "get_attr" or bias.target not in self.state:
                    continue
                if lin.meta.get(AUTOCAST) != add.meta.get(AUTOCAST):  # one in an autocast region, one not
                    continue
                weight = lin.args[1]
                if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target in self.state):
                    continue
                b_ref = self.state[bias.target][0]
                b_node = self.theory.graph[b_ref]
                if b_node.kind != PARAM or len(b_node.shape) != 1:
                    continue
                if self._local_len(bias.target, 0) != self._local_len(weight.target, 0):
                    continue
                args = (lin.args[0], weight, bias) if view is None else (lin.args[0], weight, bias, *lin.args[3:])
                with g.inserting_before(add):
                    fused = g.call_function(lin.target, args)
                for mark in (REGION, AUTOCAST):
                    if mark in add.meta:
                        fused.meta[mark] = add.meta[mark]
                add.replace_all_uses_with(fused)
                g.erase_node(add)
                g.erase_node(lin)
                if view is not None:
                    g.erase_node(view)
                break

    def _extra_outputs(self) -> list[fx.Node | None]:
        """The model's other returned tensors (logits...), after the loss: whole on every rank
        (``outputs="whole"``), this rank's piece (``"local"``), or not returned (``"loss"``)."""
        graph = self.theory.graph
        wanted = [i for k, i in enumerate(graph.outputs) if k != graph.loss_leaf]
        if not wanted:
            return []
        out: list[fx.Node | None] = []
        for ref in wanted:
            if ref is None or self.outputs == "loss":
                out.append(None)
                continue
            have = {lay: n for (r, lay), n in self.env.items() if r == ref}
            if not have:  # never computed by this program (not needed for the loss)
                out.append(None)
                continue
            name = graph[ref].name
            if self.outputs == "local":
                lay, x = next(iter(have.items()))
                out.append(self.graph.call_function(C.output_local, (x, name), name=f"{name}_out"))
                continue
            lay = next((lay for lay in have if lay.is_replicated), None) or next(
                (lay for lay in have if lay.is_sharded), next(iter(have))
            )
            kind = "R" if lay.is_replicated else "S" if lay.is_sharded else "P"
            dim = lay.dim if lay.is_sharded else 0
            sizes = self.sizes(ref, dim) if lay.is_sharded else []
            out.append(
                self.graph.call_function(
                    C.output_whole, (have[lay], kind, dim, sizes, self.group(), name), name=f"{name}_out"
                )
            )
        return out

    def module(self, root: torch.nn.Module) -> fx.GraphModule:
        """The program over ``root``, which holds every tensor named in ``state`` plus ``group``
        and ``device``."""
        gm = fx.GraphModule(root, self.graph, class_name=f"Rank{self.rank}")
        checkpoint_regions(gm)  # the model's torch.utils.checkpoint regions, recomputed in backward
        autocast_regions(gm)  # and its torch.autocast regions, run under the contexts it entered
        return gm

    def emit(self, ins: Any) -> fx.Node | None:
        g, th = self.graph, self.theory
        node = th.graph[ins.ref]
        if isinstance(ins, Source):
            return self._source(node, ins.layout)
        if isinstance(ins, Compute):
            return self._compute(node, th.strategy(ins.ref, ins.strategy_key))
        if isinstance(ins, Collective):
            return self._collective(node, ins)
        if isinstance(ins, Loss):
            x = self.env[(ins.ref, ins.layout)]
            if ins.layout.is_partial:
                return g.call_function(C.global_value, (x, self.group()), name="loss")
            if ins.layout.is_sharded:  # a pipeline stage's rows: each rank's own, gradients arrive whole
                return x
            if self.world == 1:  # nothing to scale (a one-rank pipeline stage): no extra pass in backward
                return x
            return g.call_function(C.grad_scale, (x, 1.0 / self.world), name="loss")
        raise TypeError(f"unknown instruction {ins!r}")

    def _source(self, node: Any, lay: Layout) -> fx.Node:
        g = self.graph
        if node.kind == INPUT:
            x = self.placeholders[node.index]
            if lay.is_sharded:
                lo, hi = self.span(node.index, lay.dim)
                total = node.shape[lay.dim]
                out = g.call_function(
                    C.take_shard, (x, lay.dim, lo, hi - lo, total, node.name), name=f"{node.name}_local"
                )
            else:
                out = g.call_function(C.take_whole, (x, node.shape, node.name), name=f"{node.name}_whole")
        elif node.kind in (PARAM, BUFFER):
            attr = state_name(node, lay, node.kind)
            self.state[attr] = (node.index, lay)
            out = g.get_attr(attr)
        else:
            raise RuntimeError(f"node {node.name} ({node.kind}) cannot be a source")
        self.env[(node.index, lay)] = out
        return out

    def _marker(self, node: Any) -> Callable[[ShardMarker], int]:
        def value(m: ShardMarker) -> int:
            ref = node.index if m.which == OUT else node.operands[m.which]
            lo, hi = self.span(ref, m.dim)
            return {"len": hi - lo, "start": lo, "end": hi}[m.kind]

        return value

    def _fill(self, value: Any, operands: Sequence[fx.Node], marker: Callable[[ShardMarker], int]) -> Any:
        if isinstance(value, Operand):
            return operands[value.position]
        if isinstance(value, ShardMarker):
            return marker(value)
        if isinstance(value, CurrentDevice):
            return self.device()
        if isinstance(value, StreamMarker):
            return self.stream()
        if isinstance(value, tuple):
            return tuple(self._fill(v, operands, marker) for v in value)
        if isinstance(value, list):
            return [self._fill(v, operands, marker) for v in value]
        if isinstance(value, dict):
            return {k: self._fill(v, operands, marker) for k, v in value.items()}
        return value

    def _compute(self, node: Any, s: Strategy) -> fx.Node:
        g = self.graph
        operands = [self.env[(o, lay)] for o, lay in zip(node.operands, s.inputs)]
        fused = FUSED.get((node.op, s.name)) if (s.simulate is not None or s.grad_complete) else None
        if s.simulate is not None and fused is None:
            raise NotImplementedError(f"no runtime for strategy {s.name!r} of {node.op!r} (node {node.name})")
        marker = self._marker(node)
        if fused is not None:
            call: LocalCall = default_call(node)
            args = self._fill(call.args, operands, marker)
            kwargs = self._fill(dict(call.kwargs), operands, marker)
            kwargs.update(fused.extra(self, node, s))
            kwargs["group"] = self.group()
            out = g.call_function(fused.fn, tuple(args), kwargs, name=node.name)
            for i in s.grad_complete:
                self.grad_complete.add(node.operands[i])
        else:
            call = local_call(node, s)
            args = self._fill(call.args, operands, marker)
            kwargs = self._fill(dict(call.kwargs), operands, marker)
            kind = "call_method" if call.is_method else "call_function"
            if call.out_index is None:
                out = g.create_node(kind, call.target, tuple(args), kwargs, name=node.name)
            else:  # one output of a multi-output op (topk, split): call it once, index it per output
                key = (kind, call.target, _key(args), _key(kwargs))
                whole = self._calls.get(key)
                if whole is None:
                    whole = self._calls[key] = g.create_node(kind, call.target, tuple(args), kwargs, name=node.name)
                out = g.call_function(operator.getitem, (whole, call.out_index), name=f"{node.name}_{call.out_index}")
        self.env[(node.index, s.output)] = out
        return out

    def _collective(self, node: Any, ins: Collective) -> fx.Node:
        g = self.graph
        x = self.env[(node.index, ins.src)]
        name = f"{node.name}_{_layout_name(ins.dst)}"
        if ins.op == "all_gather":
            d = ins.src.dim
            out = g.call_function(C.all_gather, (x, d, self.sizes(node.index, d), self.group(), ins.variant), name=name)
        elif ins.op == "reduce_scatter":
            d = ins.dst.dim
            out = g.call_function(
                C.reduce_scatter, (x, d, self.sizes(node.index, d), self.group(), ins.variant), name=name
            )
        elif ins.op == "all_reduce" and not self._needs_grad(node.index):
            # data-only values (token counts of a sharded batch): start the all-reduce as soon as
            # the value exists and wait where it is used, hiding its latency behind the forward.
            # Given the whole batch, the caller computes the sum itself and passes it in (known=)
            known = self._batch_value(node)
            with g.inserting_after(x):
                handle = g.call_function(C.all_reduce_start, (x, self.group()), {"known": known}, name=f"{name}_start")
            out = g.call_function(C.wait, (handle,), name=name)
        elif ins.op == "all_reduce":
            out = g.call_function(C.all_reduce, (x, self.group()), name=name)
        elif ins.op == "all_to_all":
            s, d = ins.src.dim, ins.dst.dim
            args = (x, s, d, self.sizes(node.index, s), self.sizes(node.index, d), self.group())
            out = g.call_function(C.all_to_all, args, name=name)
        elif ins.op == "slice":
            lo, hi = self.span(node.index, ins.dst.dim)
            out = g.create_node("call_method", "narrow", (x, ins.dst.dim, lo, hi - lo), name=name)
        else:
            raise ValueError(f"unknown collective {ins.op!r}")
        self.env[(node.index, ins.dst)] = out
        return out
