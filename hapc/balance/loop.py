"""Alternating synthesis and balancing (HAP §3.1, Eq. 1-2), keeping the best pair.

``B0`` is proportional to device speed; then ``Q_s = argmin_Q t(Q, B_{s-1})`` (synthesis) and
``B_s = argmin_B t(Q_s, B)`` (the LP), until the cost stops improving or the pair repeats
(oscillation); the best ``(Q, B)`` seen is returned.

Memory: the search prices time only. When the LP finds no ratios under which a program fits
every device, synthesis is repeated with a price on memory (added to each triple's time, growing
tenfold per retry) until a program fits; the price is then bisected once between the last that
did not fit and the first that did, keeping the fastest fitting program (a lower price lets faster,
larger programs through). If none fits, :class:`InfeasibleError` lists the best program's need
against each device's capacity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import InfeasibleError
from ..synth.cost import CostModel, Vec
from ..synth.search import Progress
from ..synth.synthesizer import SynthResult, SynthSpace, program_cost, synthesize_program
from .lp import solve_ratios


@dataclass
class Round:
    ratios_in: Vec
    search_cost: float
    ratios_out: Vec
    cost: float
    seconds_search: float
    seconds_lp: float


@dataclass
class Balanced:
    result: SynthResult
    ratios: Vec
    cost: float
    rounds: list[Round] = field(default_factory=list)
    memory_price: float = 0.0

    @property
    def seconds_search(self) -> float:
        return sum(r.seconds_search for r in self.rounds)

    @property
    def seconds_lp(self) -> float:
        return sum(r.seconds_lp for r in self.rounds)


def balance(
    space: SynthSpace,
    model: CostModel,
    *,
    rounds: int = 4,
    initial: Vec | None = None,
    fixed: bool = False,
    memory: bool = True,
    solver: str = "cbc",
    progress: Progress | None = None,
    deadline: float | None = None,
) -> Balanced:
    """Alternate synthesis and the ratio LP. ``fixed`` keeps ``initial`` ratios (baselines).
    ``deadline``: a :func:`time.monotonic` value, one for every search of every round (and of the
    memory price's bisection): once it passes, each program search returns the best program it has
    (:func:`~hapc.synth.synthesizer.synthesize_program`) and no further round starts; off by
    default. A program that fits no ratios' memory once it passed raises :class:`InfeasibleError`
    naming the time limit (a memory retry would only get the fallback program, which holds
    everything whole)."""
    th = space.theory
    ratios = initial or model.proportional_ratios()
    best: Balanced | None = None
    history: list[Round] = []
    seen: set[tuple] = set()
    price = 0.0
    last_costs: list = []
    attempts, retries = 0, 0
    refined = False
    while attempts < max(1, rounds):
        attempts += 1
        t0 = time.perf_counter()
        res, costs = _synthesize_at(space, model, ratios, price, progress, deadline)
        t1 = time.perf_counter()
        last_costs = costs
        search_cost = program_cost(th, model, res.parts, ratios)
        if fixed:
            new_ratios, cost = ratios, search_cost
            if memory:
                _check_memory(model, costs, ratios)
        else:
            try:
                lp = solve_ratios(model, costs, memory=memory, solver=solver)
            except InfeasibleError as exc:
                retries += 1
                if deadline is not None and time.monotonic() > deadline:
                    # a retry would only get the fallback program, which holds everything whole
                    raise InfeasibleError(
                        f"no program found within the time limit fits the devices' memory ({exc}); raise "
                        "time_limit (or leave it unset) so the search can price memory and find one that fits"
                    ) from exc
                if not memory or retries > 8:
                    _check_memory(model, costs, ratios)
                    raise
                price = price * 10 if price else max(search_cost, 1e-9) * 0.01
                attempts -= 1  # a memory retry is not a Q/B round
                continue
            new_ratios = lp.ratios
            cost = program_cost(th, model, res.parts, new_ratios)
            if price and retries and not refined:
                # the first price that fits may be far above the least that does: a cheaper
                # price lets a faster program through, so bisect between them once
                refined = True
                better = _refine_price(space, model, ratios, price, memory, solver, progress, deadline)
                if better is not None and better[2] < cost - 1e-12:
                    res, new_ratios, cost, price = better
        t2 = time.perf_counter()
        history.append(Round(ratios, search_cost, new_ratios, cost, t1 - t0, t2 - t1))
        if best is None or cost < best.cost - 1e-12:
            best = Balanced(res, new_ratios, cost, history, price)
        key = (tuple(res.triples), tuple(round(r, 9) for r in new_ratios))
        if deadline is not None and time.monotonic() > deadline:
            break  # out of time: later rounds would only get the fallback program
        if fixed or key in seen or max(abs(a - b) for a, b in zip(new_ratios, ratios)) < 1e-9:
            break
        seen.add(key)
        ratios = new_ratios
    if best is None:
        _check_memory(model, last_costs, model.proportional_ratios())
        raise InfeasibleError("no program fits the devices' memory")
    best.rounds = history
    return best


def _synthesize_at(
    space: SynthSpace, model: CostModel, ratios: Vec, price: float, progress, deadline: float | None = None
) -> tuple:
    """The best program for ``ratios`` with memory priced at ``price``, and its triples' costs."""
    model.memory_price = price
    try:
        res = synthesize_program(space, model, ratios, progress, deadline=deadline)
    finally:
        model.memory_price = 0.0
    return res, [[space.theory.triples[k].cost for k in part] for part in res.parts]


def _refine_price(space, model, ratios, price, memory, solver, progress, deadline=None, steps: int = 4):
    """Bisect (geometrically) the memory price between ``price / 10`` (too cheap: nothing fitted)
    and ``price`` (fits): the best fitting ``(program, ratios, cost, price)`` seen, or ``None``."""
    th = space.theory
    lo, hi, best = price / 10, price, None
    for _ in range(steps):
        if deadline is not None and time.monotonic() > deadline:
            break
        mid = (lo * hi) ** 0.5
        res, costs = _synthesize_at(space, model, ratios, mid, progress, deadline)
        try:
            lp = solve_ratios(model, costs, memory=memory, solver=solver)
        except InfeasibleError:
            lo = mid
            continue
        hi = mid
        cost = program_cost(th, model, res.parts, lp.ratios)
        if best is None or cost < best[2]:
            best = (res, lp.ratios, cost, mid)
    return best


def _check_memory(model: CostModel, costs, ratios: Vec) -> None:
    need = [0.0] * len(ratios)
    for part in costs:
        for t, m in enumerate(model.memory([c for c in part], ratios)):
            need[t] += m
    over = [(dt, n) for dt, n in zip(model.types, need) if n > dt.memory]
    if over:
        rows = "; ".join(
            f"{dt.name}: needs {n / 2**30:.3g} GiB, has {dt.memory / 2**30:.3g} GiB" for dt, n in zip(model.types, need)
        )
        raise InfeasibleError(
            f"the model does not fit the cluster's memory with the best program found ({rows}). "
            "Add devices or memory, use a smaller batch, or allow sharded parameters (param_comm=True)"
        )
