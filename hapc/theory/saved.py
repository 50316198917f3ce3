"""Which activations autograd keeps for the backward: the saved-activation term of the memory model.

A forward result stays in memory until the backward when the backward reads it: either its own
op's backward reads its result (``softmax``, ``relu``, ``tanh``...: :data:`READS_OUTPUT`) or a
consumer's backward reads it as an input (``linear`` reads its input for the weight's gradient,
``gelu`` reads its input). A result that only input-free consumers read -- an addition's
gradient passes straight through (a Linear's output before its bias, the residual branch before
the residual add, an embedding before the position add), ``masked_fill`` needs only its mask,
``mul`` / ``div`` by a constant only the constant, ``softmax`` its own output -- is freed in the
forward, and counting it overstated the saved activations of a transformer by ~40 %
(``benchmarks/memory_fidelity.py``). Views are looked through (a view's consumers read its base).

Conservative by construction: an op not listed reads every input (what was assumed for every op
before), so the saved set only loses results that provably nobody reads in the backward. Two terms
are added where the peak holds more than the saved results: buffers an op keeps of its own (max
pooling's indices, :data:`KEEPS`) and the loss's gradient buffers, live beside every saved
activation when the backward starts (:data:`LOSS_GRADIENTS`; on a GPT the peak is there). On the
zoo's models the result equals autograd's saved bytes within 5 % and the one-device peak of an Adam
step within 15 % (``tests/test_memory_fidelity.py``). Not modelled: the backward's other working
gradients and Adam's temporaries (the peak of a model whose activations are small is in
``Adam.step``), and weights a codegen fusion concatenates and saves per forward.
"""

from __future__ import annotations

from .graph import RefGraph

#: Ops whose backward reads none of their tensor inputs (gradient = a function of the incoming
#: gradient, the result, shapes or non-differentiable operands such as masks and indices).
INPUT_FREE = frozenset(
    {
        "add", "sub", "rsub", "neg", "sum", "mean", "cat", "stack", "clone", "masked_fill", "where",
        "softmax", "log_softmax", "relu", "sigmoid", "tanh", "exp", "pad", "roll", "flip", "repeat",
        "tile", "split", "chunk", "unbind", "to", "float", "half", "bfloat16", "double", "type_as",
    }
)  # fmt: skip
#: Ops whose backward reads their own result.
READS_OUTPUT = frozenset({"softmax", "log_softmax", "relu", "sigmoid", "tanh", "exp", "scaled_dot_product_attention"})
#: Ops that keep a buffer of their own for the backward: bytes per element of their result
#: (max pooling's int64 argmax indices).
KEEPS = {"max_pool1d": 8, "max_pool2d": 8, "max_pool3d": 8, "adaptive_max_pool1d": 8, "adaptive_max_pool2d": 8}
#: Losses: gradient buffers the size of their input live at the start of the backward, beside every
#: saved activation (the peak): cross-entropy's gradient of its log-probabilities and of the logits.
LOSS_GRADIENTS = {
    "cross_entropy": 2, "nll_loss": 1, "mse_loss": 1, "l1_loss": 1, "smooth_l1_loss": 1, "huber_loss": 1,
    "binary_cross_entropy_with_logits": 1, "binary_cross_entropy": 1, "kl_div": 1,
}  # fmt: skip


def _reads(graph: RefGraph, user: int, operand: int, views: frozenset[str]) -> bool:
    """Whether ``user``'s backward reads ``operand`` (through ``user``'s consumers if a view)."""
    u = graph[user]
    if u.op in views:
        return u.requires_grad and any(_reads(graph, v, user, views) for v in u.users)
    if u.op in INPUT_FREE or not u.requires_grad:
        return False
    ops = u.operands
    if u.op in ("mul", "div") and len(ops) == 2:
        other = ops[1] if ops[0] == operand else ops[0]
        if ops[0] == ops[1]:
            return True
        # d(a*b)/da = b: a is read only for b's gradient; d(a/b)/da = 1/b: a read only for b's
        if u.op == "mul" or ops[0] == operand:
            return graph[other].requires_grad
    return True


def _loss_gradients(graph: RefGraph, node: int, views: frozenset[str]) -> int:
    """How many gradient buffers of ``node``'s size its loss consumers hold (through views)."""
    out = 0
    for u in set(graph[node].users):
        if graph[u].op in views:
            out += _loss_gradients(graph, u, views)
        elif graph[u].requires_grad:
            out += LOSS_GRADIENTS.get(graph[u].op, 0)
    return out


def saved_bytes(graph: RefGraph, views: frozenset[str]) -> dict[int, int]:
    """Bytes each op (by index; ops keeping nothing are left out) adds to the backward's peak: its
    result where the backward reads it, its own buffers (:data:`KEEPS`) and, for a loss's input,
    the loss's gradient buffers (:data:`LOSS_GRADIENTS`: counted with the input, so they shard as
    it does). ``views``: ops whose result aliases their input (they keep nothing of their own)."""
    out = {}
    for n in graph:
        if n.kind != "op" or not n.requires_grad or n.op in views:
            continue
        read = n.op in READS_OUTPUT or any(_reads(graph, u, n.index, views) for u in set(n.users))
        kept = n.meta.nbytes if read else 0
        kept += KEEPS.get(n.op, 0) * n.meta.numel + _loss_gradients(graph, n.index, views) * n.meta.nbytes
        if kept:
            out[n.index] = kept
    return out
