"""The planner's micro-batch count search (issue 14): :func:`hapc.planner.search_micro` over
:func:`hapc.planner.micro_candidates`, on synthetic price functions (no model: each landscape is a
function of the count), so its exactness and its pricing count are checked directly."""

from __future__ import annotations

import math

import pytest
from harness import two_groups

from hapc.planner import START_MICRO, micro_candidates, search_micro


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_candidates_are_the_divisors_up_to_four_per_device():
    assert micro_candidates(1, 16) == [1]
    assert micro_candidates(6, 4) == [1, 2, 3, 6]
    assert micro_candidates(1024, 16) == [1, 2, 4, 8, 16, 32, 64]
    assert micro_candidates(1024, 1) == [1, 2, 4, 8]  # never below the old fixed count of 8
    assert all(1024 % d == 0 for d in micro_candidates(1024, 300))


def _eq12(N: int, a: list[float], b: list[float]):
    """HARP Eq. 12 with affine stage times t_s = a_s + b_s N / B (convex in B)."""

    def price(B: int) -> float:
        t = [x + y * N / B for x, y in zip(a, b)]
        return sum(t) + (B - 1) * max(t)

    return price


@pytest.mark.parametrize("N", [64, 96, 360, 1024])
@pytest.mark.parametrize(
    ("a", "b"), [([1e-3, 2e-3, 1e-3], [1e-4, 1e-4, 2e-4]), ([5e-2], [1e-3]), ([1e-5] * 4, [1e-2] * 4)]
)
def test_the_search_finds_the_least_of_a_convex_landscape(N, a, b):
    price = _eq12(N, a, b)
    calls: list[int] = []
    cands = micro_candidates(N, 16)
    start = max(d for d in cands if d <= START_MICRO)
    got = search_micro(lambda B: calls.append(B) or price(B), cands, start)
    best = min(cands, key=price)
    assert price(got) == pytest.approx(price(best), rel=1e-12), (got, best, calls)
    assert len(calls) == len(set(calls))  # each count priced once
    assert start in calls and got in calls


def test_the_descent_steps_over_a_dearer_odd_count():
    """Replica counts must divide the count, so the least time over replicas is not unimodal along
    the sorted divisors: 6 -> 3 is dearer, 6 -> 2 is not. The lattice step by a prime finds 2."""
    times = {1: 0.225, 2: 0.214, 3: 0.416, 6: 0.408}  # mlp, 6 rows, two groups (measured)
    assert search_micro(times.__getitem__, _divisors(6), 6) == 2


def test_where_nothing_fits_it_climbs_to_smaller_micro_batches():
    times = {1: math.inf, 2: math.inf, 4: math.inf, 8: math.inf, 16: 3.0, 32: 2.0, 64: 2.5}
    calls: list[int] = []
    got = search_micro(lambda B: calls.append(B) or times[B], sorted(times), 8)
    assert got == 32 and 1 not in calls
    # nothing fits anywhere: the start is returned (the caller reports every count as infeasible)
    assert search_micro(lambda B: math.inf, [1, 2, 4, 8], 8) == 8


def test_it_stops_at_a_local_minimum_and_prices_little():
    times = {d: abs(math.log2(d) - 3) + 1 for d in _divisors(1024)}  # the least at 8
    calls: list[int] = []
    assert search_micro(lambda B: calls.append(B) or times[B], micro_candidates(1024, 16), 8) == 8
    assert sorted(calls) == [4, 8, 16]  # the start and its two neighbours only


# -- the runtime runs the count the planner chose ------------------------------------------------------


def _searched_job(rank, world):
    import torch

    from hapc.models import load
    from hapc.pipeline import compile_pipeline

    torch.set_num_threads(1)
    model, inputs = load("gpt", batch=6, dtype=torch.float64)  # 6 rows: the old fixed 8 does not divide
    ref = float(model(*inputs))
    pm = compile_pipeline(model, two_groups("two-groups-slow"), inputs, num_micro=None)
    return {"num_micro": pm.spec.num_micro, "loss": float(pm.train_step(*inputs)), "ref": ref}


def test_compile_pipeline_runs_the_chosen_count():
    import torch

    from hapc.models import load
    from hapc.planner import choose_plan
    from hapc.testing import run_distributed

    model, inputs = load("gpt", batch=6, dtype=torch.float64)
    choice = choose_plan(model, two_groups("two-groups-slow"), inputs, kinds=("pipeline",))
    want = choice.chosen.num_micro
    assert 6 % want == 0
    results = run_distributed(_searched_job, 2, timeout=300)
    for res in results:
        assert res["num_micro"] == want
        assert res["loss"] == pytest.approx(res["ref"], rel=1e-9)
