"""Exhaustive enumeration of distributed programs: the reference the A* is tested against.

Every sequence of theory triples in which each triple's precondition holds, its tokens are free
and its postcondition adds something, until the loss is done. Properties are never dropped here
(the real semantics); only branch-and-bound on the monotone cost prunes. Exponential: for tests
on small graphs.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..theory.props import DONE
from ..theory.triples import Theory
from .cost import CostModel, Vec


def exhaustive_min_cost(
    theory: Theory, model: CostModel, ratios: Vec, allowed: Iterable[int], *, additive: bool = False
) -> float:
    """Least cost of any complete program. ``additive``: every triple is its own stage (the
    cost model of one-node segments); otherwise the stage model over the whole program."""
    ids = sorted(allowed)
    triples = [theory.triples[k] for k in ids]
    times = [model.triple_time(t.cost, ratios) for t in triples]
    alone = [model.cost([t.cost], ratios) for t in triples]
    zero = (0.0,) * len(ratios)
    best = [float("inf")]
    seen: set = set()

    def dfs(props: frozenset, tokens: frozenset, closed: float, fo: Vec, bo: Vec) -> None:
        cost = closed + max(fo) + max(bo)
        if cost >= best[0] - 1e-15:
            return
        if DONE in props:
            best[0] = cost
            return
        key = (props, tokens, closed, fo, bo)
        if key in seen:
            return
        seen.add(key)
        for t, tt, single in zip(triples, times, alone):
            if not t.pre <= props or t.tokens & tokens or t.post <= props:
                continue
            if additive:
                dfs(props | t.post, tokens | t.tokens, closed + single, fo, bo)
                continue
            # the stage accumulation of the cost model, restated here on purpose: the oracle the A*
            # tests compare against shares no code with the search (whose copy is its hot loop)
            c, f, b = closed + tt.grad, fo, bo
            if tt.has_fwd_comm:
                c += max(f) + tt.fwd_comm
                f = tt.fwd_comp
            else:
                f = tuple(x + y for x, y in zip(f, tt.fwd_comp))
            if tt.has_bwd_comm:
                c += max(b) + tt.bwd_comm
                b = tt.bwd_comp
            else:
                b = tuple(x + y for x, y in zip(b, tt.bwd_comp))
            dfs(props | t.post, tokens | t.tokens, c, f, b)

    dfs(frozenset(), frozenset(), 0.0, zero, zero)
    return best[0]
