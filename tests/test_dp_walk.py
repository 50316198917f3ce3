"""The pipeline DP's shortcuts are exact: the early end of the downward walk over ``t_max``
(:data:`hapc.pipeline.dp.STOP_WALK`) returns the solution the whole walk returns, bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_planner import _random_instance

import hapc.pipeline.dp as dpm
from hapc.pipeline.dp import CostTable, GroupSpec, Links, Option, PipelineDP
from hapc.pipeline.schedule import HARP_EPSILON

#: the stage costs of ``pipeline x2 (blocked) [16 micro]`` of a 4-expert tiny BERT on hap-testbed:16
#: (one replica: 8 V100 on a host, 8 micro-batches), as :func:`hapc.planner.choose_plan` priced them
#: on 11-27; the fwd + bwd + sync / B of every layer, bit for bit, put in ``fwd``
_MOE_OPTIONS = [(0, 1), (0, 2), (0, 4), (0, 8)]
_MOE_PER_MB = [
    [
        1.5615469401709402e-06,
        1.607510192918193e-06,
        5.318203858363858e-07,
        3.7412847277167274e-06,
        1.607510192918193e-06,
        5.318203858363858e-07,
        1.389416041025641e-05,
        1.5889948107448109e-06,
    ],
    [
        3.225701524786325e-06,
        3.0199439159951157e-06,
        9.933086319902319e-07,
        7.419206204639805e-06,
        3.0199439159951157e-06,
        9.933086319902319e-07,
        2.827543193162393e-05,
        2.9361471199023197e-06,
    ],
    [
        6.268410694017094e-06,
        5.602411362148962e-06,
        1.8370851242979241e-06,
        1.4143849158485959e-05,
        5.602411362148962e-06,
        1.8370851242979241e-06,
        5.463424164102564e-05,
        5.787843595360195e-06,
    ],
    [
        1.2211029032478633e-05,
        1.0646146254456655e-05,
        3.4850381089133085e-06,
        2.7277535066178264e-05,
        1.0646146254456655e-05,
        3.4850381089133085e-06,
        0.00010607034994871795,
        1.1089071141514041e-05,
    ],
]
_MOE_MEM_PARAM = [
    [60928.0, 51712.0, 16896.0, 134656.0, 51712.0, 16896.0, 527360.0, 54352.0],
    [60928.0, 51712.0, 16896.0, 134656.0, 51712.0, 16896.0, 527360.0, 54352.0],
    [60928.0, 51712.0, 16896.0, 134656.0, 51712.0, 16896.0, 527360.0, 54352.0],
    [60928.0, 51712.0, 16896.0, 134656.0, 51712.0, 16896.0, 527360.0, 54352.0],
]
_MOE_MEM_ACT = [
    [8192.0, 20480.0, 4096.0, 40960.0, 20480.0, 4096.0, 111744.0, 42880.0],
    [8192.0, 20480.0, 4096.0, 40960.0, 20480.0, 4096.0, 113792.0, 21440.0],
    [8192.0, 20480.0, 4096.0, 40960.0, 20480.0, 4096.0, 111744.0, 42880.0],
    [8192.0, 20480.0, 4096.0, 40960.0, 20480.0, 4096.0, 111744.0, 42880.0],
]
_MOE_OUT_BYTES = [4096.0, 8192.0, 4096.0, 4096.0, 8192.0, 4096.0, 4096.0, 0.0]


def _key(sol):
    """Everything a solution says, floats by repr."""
    if sol is None:
        return None
    stages = [(s.lo, s.hi, s.option, s.start, repr(s.time), repr(s.comm), s.link, s.recompute) for s in sol.stages]
    return repr(sol.value), repr(sol.t_max), stages, sol.warmups


def _solve(args, stop: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(dpm, "STOP_WALK", stop)
    dp = PipelineDP(*args)
    return _key(dp.solve()), dp.runs


def _moe() -> tuple:
    per_mb = np.array(_MOE_PER_MB)
    zero = np.zeros_like(per_mb)
    options = [Option(g, n) for g, n in _MOE_OPTIONS]
    table = CostTable(
        options,
        per_mb,
        zero,
        zero,
        np.array(_MOE_MEM_PARAM),
        np.array(_MOE_MEM_ACT),
        np.array(_MOE_OUT_BYTES),
        keep=zero,
    )
    groups = [GroupSpec("v100", 8, 8, 16e9, 14e12)]
    links = Links((1e10, 9.999999999999999e-06), (1.3e9, 4.9999999999999996e-05), ())
    return table, groups, links, 8, HARP_EPSILON


def test_the_walk_ends_early_with_the_same_solution_on_random_instances(monkeypatch):
    rng = random.Random(15)
    runs = [0, 0]
    for n in range(300):
        table, groups, links, B = _random_instance(rng)
        mode = ("auto", "never", "always")[n % 3]
        whole, r0 = _solve((table, groups, links, B, HARP_EPSILON, mode), False, monkeypatch)
        short, r1 = _solve((table, groups, links, B, HARP_EPSILON, mode), True, monkeypatch)
        assert short == whole
        runs[0] += r0
        runs[1] += r1
    assert runs[1] < runs[0]  # it does skip runs


def test_the_walk_ends_no_higher_than_the_lower_bound_allows(monkeypatch):
    """A recorded table where :meth:`PipelineDP.lower_bound` (per-layer minima, summed apart) is an
    ulp above the smallest feasible ``t_max`` (a prefix-sum difference): the gallop starts above it,
    and only the walk, through a plan's own ``t_max``, finds the optimum there. Ending the walk at
    ``F(t) + (B - 1) t_S`` exactly would stop before (a 0.9 % dearer plan); the floor is the least
    of the two less a rounding margin, so the walk returns what the whole walk returns."""
    args = _moe()
    dp = PipelineDP(*args)
    cands = dp.candidates()
    first = int(np.searchsorted(cands, dp.lower_bound(), side="left"))
    assert cands[first - 1] < dp.lower_bound() <= cands[first]  # the bound sits above a candidate ...
    assert np.isfinite(dp.run(float(cands[first - 1]))[0, 0, dp.Kr + 1])  # ... at which a plan is feasible
    whole, _ = _solve(args, False, monkeypatch)
    short, _ = _solve(args, True, monkeypatch)
    assert short == whole
    assert float(whole[1]) == pytest.approx(float(cands[first - 1]), rel=0)  # the optimum runs at that t_max
