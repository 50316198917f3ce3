"""Mixed precision: the dtypes a traced graph has when its forward runs under ``torch.autocast``.

Training "in bf16/fp16" means (as PyTorch's AMP does it) fp32 *master* parameters, gradients and
optimizer state, and a forward under ``torch.autocast(device, dtype)``: matmul-like ops cast their
floating operands to the half dtype and return it, a short list of numerically sensitive ops
(softmax, norms, losses, exp/log, reductions) compute in fp32, everything else runs in the widest
dtype of its operands. The backward follows autograd through those casts, so a parameter's
gradient arrives in the parameter's dtype.

The planner prices a plan from tensor metadata (bytes of activations, of communicated tensors,
of memory traffic), so :func:`autocast_graph` relabels a traced graph's op outputs with the
dtypes autocast gives them; parameters, buffers and inputs keep theirs. Meta tensors carry no
autocast dispatch key (``torch.mm`` on meta under autocast stays fp32), so the dtypes are derived
here from a table -- autocast's op lists (PyTorch AMP docs, CUDA: "ops that can autocast to
float16 / float32") -- rather than by running the ops: the planner's targets are GPU clusters,
and the table keeps the theory device-free and deterministic whatever torch build plans it.
CPU autocast differs on a few ops (e.g. ``layer_norm`` and ``softmax`` stay bf16 there): the
predicted bytes are the CUDA ones, and the runtime does not depend on them (it computes with
whatever dtypes autocast gives, and a pipeline sends its boundary tensors in the traced dtype).

hapc's graph holds ``nn.Linear`` as ``linear`` then ``add`` of the bias (``hapc.ops.add_bias``, in
the product's dtype); the per-rank program fuses them back into ``F.linear(x, w, b)`` where the bias
is added locally right away, so the table gives that add the product's half dtype (as autocast's
``F.linear`` returns). A row-parallel linear adds its bias after the reduction, unfused, and
``add_bias`` keeps the half dtype there too.

A model's own ``torch.autocast`` regions (``RefNode.autocast``, recorded by the capture and run
under their contexts by the program) are honoured too: the innermost context decides, with or
without ``precision=``.

Memory of the mixed-precision step per parameter: fp32 weight, gradient and two Adam moments (the
planner's ``x4`` of the parameter's bytes, unchanged) plus autocast's half copy of every weight a
matmul-like op reads (2 bytes per element), which the op saves for the backward: it is counted
with the saved activations (:func:`half_copies`), once per forward in flight.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..errors import HapcError
from .graph import OP, RefGraph, TensorMeta
from .trace import set_traffic

#: ``precision=`` values: None / the model's dtype (no autocast), or an autocast dtype
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: autocast's lower-precision ops (CUDA and CPU lists), plus composites that reach them (einsum ->
#: bmm): they compute in the half dtype and return it
LOWER = frozenset(
    {
        "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "addr", "mv", "chain_matmul",
        "multi_dot", "einsum", "tensordot", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "prelu", "scaled_dot_product_attention", "linalg_vecdot",
    }
)  # fmt: skip

#: autocast's fp32 ops (CUDA list): their output is fp32 whatever the operands
FP32 = frozenset(
    {
        "pow", "rpow", "rdiv", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10",
        "log1p", "log2", "reciprocal", "rsqrt", "softmax", "log_softmax", "softmin", "softplus", "layer_norm",
        "group_norm", "norm", "normalize", "renorm", "sum", "prod", "cumsum", "cumprod", "dist", "cdist", "pdist",
        "cosine_similarity", "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div",
        "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "multi_margin_loss", "soft_margin_loss",
        "triplet_margin_loss",
    }
)  # fmt: skip

#: explicit casts: the model chose the dtype, autocast leaves it
CASTS = frozenset({"to", "type", "float", "double", "half", "bfloat16", "type_as"})

#: dtypes autocast casts (float64 operands are left alone)
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(precision: str | None) -> torch.dtype | None:
    """The autocast dtype of a ``precision=`` value (None: no autocast). HapcError for an unknown one."""
    if precision is None:
        return None
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise HapcError(
            f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)} (or None: the model's dtype), "
            f"got {precision!r}"
        )
    return PRECISIONS[precision]


def autocast_graph(graph: RefGraph, dtype: torch.dtype | None) -> RefGraph:
    """A copy of ``graph`` whose op outputs carry the dtypes of a forward under autocast to ``dtype``
    (None: no autocast around the forward) and under the model's own ``torch.autocast`` regions
    (``RefNode.autocast``: the innermost context wins, ``enabled=False`` turns it off), with each
    op's memory traffic recomputed from them (see the module docstring). ``graph`` is left as it is."""
    nodes: list[Any] = []
    for n in graph:
        if n.kind != OP:
            nodes.append(replace(n))
            continue
        half = _in_effect(n, dtype)
        ops = [nodes[o] for o in n.operands]
        if half is None:
            out = _promoted(n.meta.dtype, [o.meta.dtype for o in ops], [graph[o].meta.dtype for o in n.operands])
        elif _bias_add(n):  # nn.Linear / nn.ConvNd's bias: in the product's dtype, as F.linear's own
            out = ops[0].meta.dtype
        else:
            now, was = [o.meta.dtype for o in ops], [graph[o].meta.dtype for o in n.operands]
            out = _out_dtype(n.op, n.meta.dtype, now, was, half)
        m = replace(n, meta=TensorMeta(n.meta.shape, out))
        # a matmul-like op reads its operands at the half dtype (autocast's cast copies)
        cast = half if n.op in LOWER else None
        set_traffic(m, [_nbytes(o.meta, cast if o.meta.dtype in _CASTABLE else None) for o in ops])
        nodes.append(m)
    out = RefGraph(nodes, graph.module, graph.input_names)
    for k, v in vars(graph).items():
        if k not in ("nodes", "module", "input_names"):
            setattr(out, k, v)
    return out


def _in_effect(n: Any, dtype: torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype node ``n`` runs under: its innermost own ``torch.autocast``, else ``dtype``."""
    stack = getattr(n, "autocast", ())
    if stack:
        _, inner, enabled, *_ = stack[-1]
        return inner if enabled else None
    return dtype


def _bias_add(n: Any) -> bool:
    """``hapc.ops.add_bias(product, bias)``: ``nn.Linear`` / ``nn.ConvNd``'s bias add, kept apart by the
    capture; it returns the product's dtype, fused back into the call by the per-rank program
    (:meth:`hapc.codegen.program.RankProgram._fuse_linear_bias`) or not (a row-parallel linear)."""
    from ..ops import add_bias

    return n.target is add_bias


def _promoted(traced: torch.dtype, now: list[torch.dtype], was: list[torch.dtype]) -> torch.dtype:
    """Without autocast an op computes in its operands' dtype: type promotion of ``now`` where the
    traced op promoted ``was`` (otherwise the op chose its dtype itself)."""
    floats = [d for d in now if d.is_floating_point]
    widest = [d for d in was if d.is_floating_point]
    if not traced.is_floating_point or not floats or not widest or traced != max(widest, key=_rank):
        return traced
    return max(floats, key=_rank)


def _out_dtype(op: str, traced: torch.dtype, now: list[torch.dtype], was: list[torch.dtype], half: torch.dtype) -> Any:
    """An op's output dtype under autocast: ``traced`` its dtype without, ``now`` / ``was`` its
    operands' dtypes with and without."""
    if not traced.is_floating_point or traced == torch.float64 or op in CASTS:
        return traced
    floats = [d for d in now if d.is_floating_point]
    if op in LOWER:
        return half if all(d in _CASTABLE for d in floats) else traced
    if op in FP32:
        return torch.float32 if traced in _CASTABLE else traced
    return _promoted(traced, now, was)  # the widest floating operand


def _rank(d: torch.dtype) -> int:
    return d.itemsize


def _nbytes(meta: TensorMeta, as_dtype: torch.dtype | None) -> int:
    if as_dtype is None:
        return meta.nbytes
    return TensorMeta(meta.shape, as_dtype).nbytes


def half_copies(graph: RefGraph, dtype: torch.dtype | None) -> dict[int, int]:
    """Parameter index -> bytes of the half copy autocast makes of it for a matmul-like op (and
    keeps for the backward): parameters wider than ``dtype`` read directly by an op in :data:`LOWER`."""
    if dtype is None:
        return {}
    size = torch.empty((), dtype=dtype).element_size()
    return {
        n.index: n.meta.numel * size
        for n in graph.params
        if n.meta.dtype in _CASTABLE and n.meta.dtype.itemsize > size and any(graph[u].op in LOWER for u in n.users)
    }
