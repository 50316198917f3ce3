"""Check a theory against the single-device model: is every triple sound, forward and backward?

For each computation strategy of each node and each collective, with ``m`` simulated devices and
given (uneven) ratios:

1. build per-device operands from the reference operands so the precondition holds
   (``simulate.instances``: slices for Sharded, copies for Replicated, random summands for Partial);
2. run the instruction on every device (``simulate.run_compute`` / ``run_collective``);
3. check the postcondition against the reference result;
4. seed per-device output gradients satisfying the *dual* of the postcondition, back-propagate
   through the simulated devices, and check each operand's gradients satisfy the dual of its
   precondition against the reference gradient (a weight whose gradient the strategy completes --
   SFB -- must be whole on every device).

``hapc theory MODEL --verify`` runs this on a user's model, so a newly registered rule can be
checked before it is trusted; the test suite runs it over every built-in rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .graph import BUFFER, OP, RefNode
from .instructions import Collective
from .local import default_call, run_call
from .props import REPLICATED, Layout
from .simulate import (
    SimContext,
    grad_holds,
    grad_instances,
    holds,
    instances,
    run_collective,
    run_compute,
)
from .strategy import OUT, RNG, Strategy
from .triples import Theory

#: Ops whose values are random: only their shapes can be checked.
RANDOM_OPS = {"empty", "empty_like", "rand_like", "randn_like"}


@dataclass
class Failure:
    """One unsound triple instance."""

    node: str
    op: str
    triple: str
    ratios: tuple[float, ...]
    what: str
    error: float

    def __str__(self) -> str:
        r = ", ".join(f"{x:.3g}" for x in self.ratios)
        return f"{self.node} ({self.op}) {self.triple} with ratios [{r}]: {self.what} (max error {self.error:.3g})"


_EPS = {torch.float64: 1e-9, torch.float32: 2e-5}


def _tolerance(t: torch.Tensor, *involved: torch.Tensor) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing against ``t``: the coarsest float type involved decides."""
    scale = float(torch.nan_to_num(t.detach().abs(), posinf=0.0).max()) if t.numel() and t.is_floating_point() else 1.0
    scale = max(scale, 1.0)
    eps = (
        max(_EPS.get(x.dtype, 2e-2) for x in (t, *involved) if x.is_floating_point()) if t.is_floating_point() else 0.0
    )
    return eps, eps * scale


def _err(parts: Sequence[torch.Tensor], layout: Layout, ref: torch.Tensor) -> float:
    try:
        if layout.is_replicated:
            return max(float((p.detach().double() - ref.double()).abs().max()) if p.numel() else 0.0 for p in parts)
        got = torch.cat(list(parts), layout.dim) if layout.is_sharded else sum(parts[1:], parts[0])
        return float((got.detach().double() - ref.double()).abs().max()) if got.numel() else 0.0
    except Exception:  # shapes do not even line up
        return float("inf")


def _drawn(theory: Theory, n: RefNode) -> Strategy | None:
    """The replicated strategy of a random op that draws from the module's stream (dropout):
    its local call is the op's deterministic reference, so the op's triples are checked."""
    first = theory.strategies.get(n.index, [None])[0] if n.kind == OP else None
    local = getattr(first, "local", None)
    return first if local is not None and ("stream", RNG) in local.kwargs else None


def _is_random(n: RefNode, theory: Theory | None = None) -> bool:
    if theory is not None and _drawn(theory, n) is not None:
        return False
    if n.op in RANDOM_OPS:
        return True
    if n.op == "dropout":
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
        return bool(training) and p > 0
    if n.op == "scaled_dot_product_attention":
        return float(n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)) > 0
    return False


def verify(
    theory: Theory,
    inputs: Mapping[str, torch.Tensor],
    ratios: Sequence[Sequence[float]],
    *,
    seed: int = 0,
    nodes: Sequence[int] | None = None,
    checked: Counter | None = None,
    skipped: Counter | None = None,
) -> list[Failure]:
    """All unsound triple instances of ``theory`` on ``inputs`` for each ratio vector (empty = sound).

    ``checked``, if given, counts the ``(op, strategy)`` pairs actually exercised. Instances that
    would hold an empty shard (``[n, 0, 0]``) cannot be simulated here; ``skipped``, if given,
    counts their pairs, so that the caller verifies them again on a shape where every shard is
    non-empty (``tests/test_theory_soundness.py`` does) -- a wrong rule must not hide there.
    """
    g = theory.graph
    values = [v.detach() if isinstance(v, torch.Tensor) else v for v in g.evaluate(dict(inputs))]
    gen = torch.Generator().manual_seed(seed)
    failures: list[Failure] = []
    wanted = set(range(len(g))) if nodes is None else set(nodes)
    for n in g:
        if n.kind != OP or n.index not in wanted or _is_random(n, theory):
            continue
        for s in theory.strategies[n.index]:
            for r in ratios:
                found = _check_compute(theory, n, s, values, tuple(r), gen)
                if found is not None:
                    failures += found
                    if checked is not None:
                        checked[(n.op, s.name)] += 1
                elif skipped is not None:
                    skipped[(n.op, s.name)] += 1
    for t in theory.triples:
        ins = t.instrs[-1]
        if isinstance(ins, Collective) and ins.ref in wanted and not _is_random(g[ins.ref], theory):
            for r in ratios:
                failures += _check_collective(theory, ins, values, tuple(r), gen)
    return failures


def _leaf(t: torch.Tensor, grad: bool = True) -> torch.Tensor:
    t = t.detach().clone()
    return t.requires_grad_() if grad and t.is_floating_point() else t


def _empty_shard(ctx: SimContext, s: Strategy) -> bool:
    """Some device would hold an empty shard: synthesis never shards a dim that small."""
    for which, lay in [*enumerate(s.inputs), (OUT, s.output)]:
        if lay.is_sharded and 0 in ctx.sizes(which, lay.dim):
            return True
    return False


def _check_compute(theory: Theory, n: RefNode, s: Strategy, values: list[Any], ratios, gen) -> list[Failure] | None:
    ctx = SimContext(theory, n, ratios)
    m = len(ratios)
    if _empty_shard(ctx, s):
        return None
    label = theory.fmt_triple(_compute_triple(theory, n, s))
    # gradients w.r.t. every floating operand but buffers (running statistics, class weights)
    grad_ok = [theory.graph[o].kind != BUFFER for o in n.operands]
    ref_ops = [_leaf(values[o], g) for o, g in zip(n.operands, grad_ok)]
    drawn = _drawn(theory, n)
    y = run_call(drawn.local if drawn is not None else default_call(n), ref_ops, _no_marker)
    parts = []
    for i, (v, lay) in enumerate(zip(ref_ops, s.inputs)):
        sizes = ctx.sizes(i, lay.dim) if lay.is_sharded else None
        parts.append([_leaf(p, grad_ok[i]) for p in instances(v.detach(), lay, sizes, m, gen)])
    try:
        outs = run_compute(ctx, s, parts)
    except Exception as exc:
        return [Failure(n.name, n.op, label, ratios, f"forward raised {type(exc).__name__}: {exc}", float("inf"))]
    rtol, atol = _tolerance(y, *ref_ops)
    fails = []
    if not holds(outs, s.output, y.detach(), rtol, atol):
        fails.append(Failure(n.name, n.op, label, ratios, "forward postcondition", _err(outs, s.output, y.detach())))
        return fails
    diff = [i for i, v in enumerate(ref_ops) if v.requires_grad]
    if not (y.requires_grad and diff):
        return fails
    dy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    try:
        ref_grads = torch.autograd.grad(y, [ref_ops[i] for i in diff], dy, allow_unused=True)
    except RuntimeError:  # the op has no derivative (floor_divide): nothing to compare
        return fails
    out_sizes = ctx.sizes(OUT, s.output.dim) if s.output.is_sharded else None
    dparts = grad_instances(dy, s.output, out_sizes, m, gen)
    pairs = [(o, d) for o, d in zip(outs, dparts) if o.requires_grad]
    leaves = [p for i in diff for p in parts[i]]
    if pairs:
        got = torch.autograd.grad([o for o, _ in pairs], leaves, [d for _, d in pairs], allow_unused=True)
    else:
        got = [None] * len(leaves)
    for k, i in enumerate(diff):
        ref = ref_grads[k] if ref_grads[k] is not None else torch.zeros_like(ref_ops[i])
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(got[k * m : (k + 1) * m], parts[i])]
        if i in s.grad_complete:  # SFB: the weight gradient is whole on every device
            ok = holds(grads, REPLICATED, ref, *_tolerance(ref, y, *ref_ops))
        else:
            ok = grad_holds(grads, s.inputs[i], ref, *_tolerance(ref, y, *ref_ops))
        if not ok:
            what = f"gradient of operand {i} ({theory.graph[n.operands[i]].name})"
            fails.append(Failure(n.name, n.op, label, ratios, what, _err(grads, s.inputs[i].grad(), ref)))
    return fails


def _check_collective(theory: Theory, ins: Collective, values: list[Any], ratios, gen) -> list[Failure]:
    v = values[ins.ref]
    m = len(ratios)
    for lay in (ins.src, ins.dst):
        if lay.is_sharded and 0 in theory.local_sizes(ins.ref, lay.dim, ratios):
            return []
    sizes = theory.local_sizes(ins.ref, ins.src.dim, ratios) if ins.src.is_sharded else None
    parts = [_leaf(p) for p in instances(v, ins.src, sizes, m, gen)]
    label = theory.fmt_instr(ins)
    name = theory.graph[ins.ref].name
    outs = run_collective(theory, ins, parts, ratios)
    rtol, atol = _tolerance(v)
    if not holds(outs, ins.dst, v, rtol, atol):
        return [Failure(name, ins.op, label, ratios, "forward postcondition", _err(outs, ins.dst, v))]
    if not v.is_floating_point():
        return []
    dy = torch.randn(v.shape, generator=gen, dtype=v.dtype)
    dsizes = theory.local_sizes(ins.ref, ins.dst.dim, ratios) if ins.dst.is_sharded else None
    dparts = grad_instances(dy, ins.dst, dsizes, m, gen)
    got = torch.autograd.grad(outs, parts, dparts, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(got, parts)]
    if not grad_holds(grads, ins.src, dy, rtol, atol):
        return [Failure(name, ins.op, label, ratios, "gradient (adjoint)", _err(grads, ins.src.grad(), dy))]
    return []


def _no_marker(m) -> int:
    raise TypeError("reference calls have no shard markers")


def _compute_triple(theory: Theory, n: RefNode, s: Strategy):
    from .instructions import Compute
    from .props import Prop
    from .triples import Triple

    pre = frozenset(Prop(o, lay) for o, lay in zip(n.operands, s.inputs))
    return Triple(pre, frozenset({Prop(n.index, s.output)}), (Compute(n.index, s.key(), s.inputs, s.output),), None)  # type: ignore[arg-type]
