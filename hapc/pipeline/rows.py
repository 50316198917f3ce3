"""Does a pipeline compute what the batch does? Row independence of a model (HARP §3's premise).

A pipeline runs the forward and backward of each micro-batch on its own -- the batch's rows
``m b .. (m + 1) b`` for micro-batch ``m`` -- and sums the micro-batches' weighted losses and
gradients (:func:`~hapc.pipeline.stages.loss_weighting`). That equals single-device training of the
batch iff every value the loss depends on is *row-separable*: for each tensor ``e`` of the batch's
program and its counterpart ``e_m`` in micro-batch ``m``'s,

    either  ``e_m = e``                               (it does not depend on the batch: a weight),
    or      ``e_m = e.narrow(d, m * |e_m|_d, |e_m|_d)`` (micro-batch ``m``'s rows of ``e`` along a
                                                       batch dim ``d``),

up to the loss, a sum or mean over rows. In HAP's property algebra (DESIGN §3) the second form is
``e | Sharded(d)`` over ``M`` even shards, and the first ``e | Replicated``: so a model is
row-separable when the data-parallel program -- inputs sharded along the batch, weights
replicated -- needs *no forward communication* before the loss. That is checked node by node
against the op's own sharding rules (:func:`rows_coupled`):

* an op whose operands are all ``Replicated`` (not batch-dependent) is too;
* an op with a batch-dependent operand needs a strategy of its rule with exactly those layouts
  (``Sharded(d)`` for each batch-dependent operand, ``Replicated`` for the others) and no embedded
  collective, giving ``Sharded(d')`` where its result has a batch dim ``d'``, or ``Partial`` where
  it has none: a sum or mean over the rows, after which only scalar arithmetic may follow up to
  the loss (``sum / count``, ``loss / accumulation_steps``; how the micro-batches' values combine is
  :func:`~hapc.pipeline.stages.loss_weighting`'s). A reduction read back by the rows
  (``h - h.mean(0)``) couples them;
* a reshape moves the rows in row-major order: they may come out interleaved with another dim
  (``[t, b, d] -> [t b, d]``, ``nn.MultiheadAttention``), tracked as ``(dim, outer, inner)``
  (:data:`Rows`, :func:`_refactor`); a strategy sharding a dim holds for every split of it, so for
  interleaved rows too;
* a tensor the forward makes from no input or weight (``torch.zeros(x.shape[0], d)``, a mask, a
  scalar ``x.shape[0]``) is compared *by value* in the two traces: its micro-batch value must be its
  batch value's rows (or equal it), which ``zeros`` passes and ``linspace`` does not. The rows' own
  indices, ``torch.arange(b)`` along the batch, pass only as the index selecting each row's own row
  (``x[torch.arange(b), lengths]``: Hugging Face's padding masks and last-token pooling);
* ``expand`` / ``repeat`` / ``*_like`` fills of a tensor the same for every row are the same in
  every row.

Which dim is the batch's comes from the shapes of the two traces (the batch's and one
micro-batch's, node by node: they must be the same program): the one dim ``M`` times larger in
the batch's. A node whose shape changes otherwise (``z @ z.T``: two dims) couples rows. A refusal
names the first coupling node with its source line; ops without a rule are refused (a rule is the
only witness that an op treats rows independently: ``hapc.register_op`` gives one). Backward-only
couplings (``scale_grad_by_freq``) are :func:`hapc.pipeline.runtime.batch_coupled`'s table.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..theory.graph import BUFFER, INPUT, OP, PARAM, _with_device, map_refs
from ..theory.props import PARTIAL, REPLICATED, shard
from ..theory.registry import OpView, default_registry

__all__ = ["micro_trace", "rows_coupled"]

#: ops whose value does not depend on their operands' values, only their shapes and dtypes
FILLS = frozenset(
    {"zeros_like", "ones_like", "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty"}
)
#: ops that broadcast their first operand: position-invariant along a dim they expand
BROADCASTS = frozenset({"expand", "expand_as", "broadcast_to"})
#: ops that keep their first operand's elements in row-major order (a view of it, or a copy)
VIEWS = frozenset(
    {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "ravel", "contiguous",
     "squeeze", "unsqueeze"}
)  # fmt: skip
_SHAPE_CHANGED = -1  # a node's shape changes with the batch other than along one dim by the factor

#: where a tensor holds the batch's rows: ``(d, outer, inner)`` -- dim ``d`` of size
#: ``outer * B * inner`` with index ``(o * B + b) * inner + i`` (``o < outer``, ``i < inner``) for
#: row ``b``; ``(d, 1, 1)`` is the batch along ``d`` as it is, ``(0, T, 1)`` a ``[t, b]`` pair
#: flattened. Micro-batch ``m`` holds the same positions for its rows ``b``.
Rows = tuple[int, int, int]


def _split_dim(whole: tuple[int, ...], micro: tuple[int, ...], parts: int) -> int | None:
    """The batch dim of a node whose shapes are ``whole`` / ``micro`` (None: equal shapes)."""
    if whole == micro:
        return None
    moved = [d for d in range(len(whole)) if len(whole) == len(micro) and whole[d] != micro[d]]
    if len(moved) == 1 and whole[moved[0]] == parts * micro[moved[0]]:
        return moved[0]
    return _SHAPE_CHANGED


def _refactor(shape: tuple[int, ...], rows: Rows, out: tuple[int, ...]) -> Rows | None:
    """The rows of a tensor of ``shape`` holding the batch as ``rows``, viewed as ``out`` (a
    reshape keeps the row-major order): the batch's digit of the flat index has stride
    ``C = inner * prod(shape[d+1:])`` and ``B`` values; it lies in the output dim ``d'`` whose
    stride divides ``C`` and whose span is a multiple of ``C B``. None: the view splits it."""
    d, outer, inner = rows
    rows_b = shape[d] // (outer * inner)
    stride = inner * math.prod(shape[d + 1 :])
    for k in range(len(out)):
        st = math.prod(out[k + 1 :])
        span = st * out[k]
        if stride % st == 0 and span % (stride * rows_b) == 0:
            return (k, span // (stride * rows_b), stride // st)
    return None


class _Values:
    """Values of a graph's data-free nodes, evaluated on demand with the constants of that trace
    (:attr:`~hapc.theory.graph.RefGraph.constants`); None where they cannot be (meta tensors)."""

    def __init__(self, graph: Any):
        self.g, self.memo = graph, {}
        self.device = next((t.device for t in graph.module.parameters()), torch.device("cpu"))
        self.buffers: dict[str, torch.Tensor] | None = None  # the module's, by name (on first need)

    def __call__(self, i: int) -> torch.Tensor | None:
        if i in self.memo:
            return self.memo[i]
        n = self.g[i]
        value = None
        try:
            if n.kind == BUFFER:
                value = self.g.constants.get(n.target)
                if value is None:
                    if self.buffers is None:
                        self.buffers = dict(self.g.module.named_buffers())
                    value = self.buffers.get(n.target)
            elif n.kind == OP and all(self(o) is not None for o in n.operands):
                a, k = map_refs((n.args, n.kwargs), lambda r: self(r.index))
                a, k = _with_device((a, k), self.device)  # `device=x.device`: the model's device
                value = n.call(*a, **k)
        except Exception:  # an op that needs a device, a value that cannot be computed: unknown
            value = None
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            value = None
        self.memo[i] = value
        return value


def _same_rows(whole: Any, micro: Any, d: int | None, parts: int) -> bool:
    if not isinstance(whole, torch.Tensor) or not isinstance(micro, torch.Tensor):
        return bool(whole == micro)
    if d is None:
        return whole.shape == micro.shape and bool(torch.equal(whole, micro))
    c = micro.shape[d]
    return all(torch.equal(whole.narrow(d, k * c, c), micro) for k in range(parts))


def _row_ids(whole: Any, micro: Any, d: int | None, parts: int) -> bool:
    """Whether ``whole`` / ``micro`` are each row's own index, ``arange`` along the batch dim ``d``
    (an index selecting every row of the batch, or of the micro-batch, in order: HF's padding masks
    index ``mask[torch.arange(b)[:, None], ...]``)."""
    if d is None or not isinstance(whole, torch.Tensor) or not isinstance(micro, torch.Tensor):
        return False
    for t in (whole, micro):
        shape = [1] * t.dim()
        shape[d] = t.shape[d]
        ids = torch.arange(t.shape[d], device=t.device).view(shape).expand_as(t)
        if t.dtype not in (torch.int32, torch.int64) or not torch.equal(t, ids.to(t.dtype)):
            return False
    return whole.shape[d] == parts * micro.shape[d]


def _row_gather(n: Any, whole: Any, rows: dict, row_ids: set[int]) -> bool:
    """``x[ids, ...]`` with ``ids`` the rows' own indices (:func:`_row_ids`) and ``x`` holding the
    batch along dim 0 as it is: each row reads its own row, in a micro-batch as in the batch."""
    if n.op != "getitem" or len(n.args) < 2 or not isinstance(n.args[1], tuple) or not n.args[1]:
        return False
    x, first = n.args[0], n.args[1][0]
    if getattr(first, "index", None) not in row_ids or rows.get(getattr(x, "index", None)) != (0, 1, 1):
        return False
    ids = whole[first.index]
    at = ids.meta.rank - rows[first.index][0]  # the batch dim's place from the right, as indices broadcast
    for o in n.operands[1:]:  # other indices: the batch's rows at the same broadcast place, or none
        r = rows.get(o)
        if o != first.index and r is not None and (r != (r[0], 1, 1) or whole[o].meta.rank - r[0] != at):
            return False
    return True


def _witness(n: Any, graph: Any, ins: list[Rows | None], out: Any) -> bool:
    """Whether ``n``'s rule computes it from operands laid out as ``ins`` (None: replicated) into
    layout ``out`` with no collective: independently along each batch dim. A strategy sharding a
    dim holds for every split of it (uneven ratios, one index per device): each index of the dim is
    computed on its own, so rows spread over the dim (``outer`` or ``inner`` above 1) are too, in
    units of the strategy's ``units`` where it has them."""
    rule = default_registry.get(n.op)
    if rule is None:
        return False
    want = tuple(REPLICATED if r is None else shard(r[0]) for r in ins)
    for s in rule.strategies(OpView(n, graph)):
        if s.inputs != want or s.output != out or s.fwd_comm or s.bwd_comm or s.name == "sfb":
            continue
        spread = [(ins[which], unit) for which, _, unit in s.units if which >= 0 and ins[which] is not None]
        if all(r[2] % unit == 0 for r, unit in spread):
            return True
    return False


def rows_coupled(whole: Any, micro: Any, parts: int, *, outputs: bool = True) -> str | None:
    """Why the model traced at the batch (``whole``) and at one of its ``parts`` equal micro-batches
    (``micro``) -- :class:`~hapc.theory.graph.RefGraph` s -- would not train in a pipeline as on one
    device (None: it would); see the module docstring. ``outputs``: the model's other returned
    tensors are handed back too: their values must be the batch's rows as well (those whose dim 0
    is not the batch's are :func:`~hapc.pipeline.runtime.check_batch_major`'s to refuse)."""
    if parts <= 1:
        return None
    if [(n.kind, n.op) for n in whole] != [(n.kind, n.op) for n in micro]:
        diff = next((a for a, b in zip(whole, micro) if (a.kind, a.op) != (b.kind, b.op)), whole.loss)
        return _reason(diff, "the model traces to another program for one micro-batch")
    loss = whole[whole.outputs[whole.loss_leaf]] if whole.outputs else whole.loss
    # the other returned tensors that are batch-major (the others: check_batch_major refuses them)
    handed = [r for r in whole.outputs if r is not None and r != loss.index] if outputs else []
    roots = [loss.index] + [r for r in handed if _split_dim(whole[r].meta.shape, micro[r].meta.shape, parts) == 0]
    need: set[int] = set()
    for r in roots:
        need |= whole.ancestors(r)
    batch = next((n.meta.shape[0] for n, m in zip(whole, micro) if n.kind == INPUT and n.meta.shape != m.meta.shape), 0)
    free: dict[int, bool] = {}  # made from no input or weight: compared by value
    for n in whole:
        free[n.index] = n.kind == BUFFER or (n.kind == OP and all(free[o] for o in n.operands))
    rows: dict[int, Rows | None] = {}
    row_ids: set[int] = set()  # torch.arange(batch) along the batch dim (see _row_ids)
    reduced: set[int] = set()  # sums over the rows (Partial) and scalar arithmetic on them: the loss's
    big_values, small_values = _Values(whole), _Values(micro)
    divisor = _loss_divisor(whole, loss, micro[loss.index], parts)
    if divisor is not None:
        return divisor
    for n, m in zip(whole, micro):
        if n.index not in need or n.index == loss.index:  # the loss: a mean or a sum (loss_weighting)
            continue
        shape = tuple(n.meta.shape)
        d = _split_dim(shape, tuple(m.meta.shape), parts)
        if d == _SHAPE_CHANGED or (d is not None and n.kind in (INPUT, PARAM) and d != 0):
            return _reason(
                n,
                f"its shape is {list(shape)} for the batch but {list(m.meta.shape)} for one of {parts} "
                "micro-batches: it mixes the rows of the batch",
            )
        if n.kind in (INPUT, PARAM):
            rows[n.index] = None if d is None else (0, 1, 1)
            continue
        if free[n.index]:
            frontier = n.index in roots or any(not free[u] for u in n.users if u in need)
            if frontier:
                a, b = big_values(n.index), small_values(m.index)
                if a is not None and b is not None and _row_ids(a, b, d, parts):
                    row_ids.add(n.index)  # only an index selecting each row's own row may read it
                elif a is not None and b is not None and not _same_rows(a, b, d, parts):
                    user = next((whole[u] for u in n.users if u in need and whole[u].source), n)
                    return _reason(
                        user,
                        f"it reads {n.name}, a tensor the forward makes from the batch's size whose values in a "
                        "micro-batch are not the batch's rows (torch.arange, torch.linspace, a count of rows)",
                    )
            if d is not None and (not batch or shape[d] % batch):
                return _reason(n, f"its dim {d} ({shape[d]}) is not a multiple of the batch's {batch} rows")
            rows[n.index] = None if d is None else (d, 1, shape[d] // batch)
            continue
        ins = [rows[o] for o in n.operands]
        if any(o in row_ids for o in n.operands):
            if d is None or not _row_gather(n, whole, rows, row_ids) or shape[d] != batch:
                ids = next(o for o in n.operands if o in row_ids)
                return _reason(
                    n,
                    f"it reads {whole[ids].name}, the indices 0 .. {batch - 1} of the batch's rows (torch.arange), "
                    "other than to select each row's own row: in a micro-batch they are 0 .. b - 1",
                )
            rows[n.index] = (d, 1, 1)
            continue
        sums = [o for o in n.operands if o in reduced]
        if sums and (d is not None or any(x is not None for x in ins)):
            return _reason(
                n,
                f"it combines {whole[sums[0]].name}, a reduction over the batch's rows, with the rows themselves "
                "(each micro-batch would use its own)",
            )
        if d is None and all(x is None for x in ins):
            rows[n.index] = None
            if sums:  # arithmetic on the rows' sums (a sum / count): the loss weighting's to combine
                reduced.add(n.index)
            continue
        if n.op in FILLS or (n.op in BROADCASTS and ins and ins[0] is None):
            if d is not None and (not batch or shape[d] % batch):
                return _reason(n, f"its dim {d} ({shape[d]}) is not a multiple of the batch's {batch} rows")
            rows[n.index] = None if d is None else (d, 1, shape[d] // batch)  # the same value in every row
            continue
        if n.op == "repeat" and ins and ins[0] is None and d is not None and batch and shape[d] % batch == 0:
            # a tiling of a tensor the same for every row: position-invariant where its period
            # (the operand's extent along d) divides each row's share of the dim
            src = tuple(whole[n.operands[0]].meta.shape)
            period = ((1,) * (len(shape) - len(src)) + src)[d]
            if (shape[d] // batch) % period == 0:
                rows[n.index] = (d, 1, shape[d] // batch)
                continue
        if n.op in VIEWS and ins[0] is not None and all(x is None for x in ins[1:]) and d is not None:
            got = _refactor(tuple(whole[n.operands[0]].meta.shape), ins[0], shape)
            if got is None or got[0] != d:
                return _reason(n, "the reshape splits the batch's rows")
            rows[n.index] = got
            continue
        batched = {x[1:] for x in ins if x is not None}
        if len(batched) > 1:  # two operands holding the rows in different orders
            return _reason(n, "its operands hold the batch's rows in different orders")
        if not _witness(n, whole, ins, shard(d) if d is not None else PARTIAL):
            why = (
                "it reduces over the batch's rows other than by a sum or mean (each micro-batch reduces its own)"
                if d is None
                else f"no sharding rule of op {n.op!r} computes it row by row"
                if default_registry.get(n.op) is not None
                else f"op {n.op!r} has no sharding rule to show it treats the rows independently "
                "(hapc.register_op names its batch dim)"
            )
            return _reason(n, why)
        if d is not None:
            outer, inner = batched.pop()
            rows_b = shape[d] // batch if batch else 0
            if outer * inner == rows_b:  # the dim keeps its extent: the rows where they were
                rows[n.index] = (d, outer, inner)
            elif outer == 1 and rows_b and shape[d] % batch == 0:  # contiguous rows stay contiguous
                rows[n.index] = (d, 1, rows_b)
            else:
                return _reason(n, "it changes the extent of a dim holding interleaved rows")
        else:  # a sum or mean over the rows: only scalar arithmetic may follow, up to the loss
            rows[n.index] = None
            reduced.add(n.index)
    return None


def micro_trace(model: Any, inputs: Any, parts: int, batch: int, **trace_options: Any) -> Any:
    """``model`` traced at the first of ``parts`` micro-batches of ``inputs`` (a batch of ``batch``
    rows), leaving the tensors an earlier capture attached to the model (``_tensor_constant*``) as
    they were: a program built from that capture reads them."""
    from ..theory import trace
    from ..theory.trace import constants_kept
    from .runtime import micro_batches

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    with constants_kept(model):
        return trace(model, micro_batches(inputs, parts, batch)[0], **trace_options)


def _loss_divisor(whole: Any, loss: Any, small: Any, parts: int) -> str | None:
    """A loss ``total / c`` -- ``total`` a sum over the rows -- whose number ``c`` does not scale
    with the rows (``/ 12.0`` where the batch has 12, against ``/ x.shape[0]``): the pipeline weighs
    such a loss as a mean of its micro-batches' (:func:`~hapc.pipeline.stages.loss_weighting`),
    exact only where a micro-batch divides by ``c / M``. (A sum scaled before the division,
    ``2 * total / c``, is not followed.)"""
    if loss.kind != OP or loss.op not in ("div", "truediv") or len(loss.operands) != 1 or len(loss.args) != 2:
        return None
    total = whole[loss.operands[0]]
    if total.kind != OP or not (total.op == "sum" or total.kwargs.get("reduction") == "sum"):
        return None  # a mean already (or arithmetic on one): averaging the micro-batches' is exact
    c, c_micro = loss.args[1], small.args[1]
    if not isinstance(c, (int, float)) or not isinstance(c_micro, (int, float)) or c == parts * c_micro:
        return None
    return _reason(
        loss,
        f"the loss is divided by {c} for the batch and by {c_micro} for one of {parts} micro-batches: a pipeline "
        "averages the micro-batches' losses, which is the batch's only for a divisor proportional to the rows "
        "(divide by x.shape[0], or end in .mean())",
    )


def _reason(n: Any, why: str) -> str:
    return (
        f"{n.name} ({n.source or n.op}) couples the batch's rows: {why}. A pipeline computes each micro-batch on its "
        "own, so it would train another model than single-device training does; compile it without a pipeline "
        "(pipeline=False)"
    )
