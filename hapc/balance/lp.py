"""Sharding ratios for a fixed program by linear programming (HAP §5.1, Eq. 3).

For a program ``Q`` the stage boundaries are fixed, and every stage's time is linear in the
ratios: ``t_i(B) = comm_i(max_t B_t) + max_t comp_it(B_t)``. With ``M >= B_t`` and ``z_i >= comp_it(B_t)``::

    minimise   sum_i (comm_const_i + comm_max_i * M + z_i)
    subject to sum_t count_t * B_t = 1,  B_t >= 0,  M >= B_t,  z_i >= comp_it(B_t)   for all i, t
               memory_t(B_t) <= capacity_t                                          for all t

an LP (HAP used CBC; so do we, through pulp -- HiGHS when ``solver="highs"`` and highspy is
installed). Device *types* are the variables: identical devices get identical ratios at an
optimum, by symmetry and convexity. The memory rows are hapc's addition (HAP ignored memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulp

from ..errors import InfeasibleError
from ..synth.cost import CostModel, LinearStage, Vec
from ..theory.cost import CostProfile

SOLVERS = ("cbc", "highs")


@dataclass
class LPResult:
    ratios: Vec
    objective: float
    status: str


def solve_ratios(
    model: CostModel,
    parts: Sequence[Sequence[CostProfile]],
    *,
    memory: bool = True,
    solver: str = "cbc",
) -> LPResult:
    """The best ratios for a program given per segment (each segment's stages are separate)."""
    nt = len(model.types)
    stages: list[LinearStage] = []
    grad = 0.0
    for part in parts:
        st, g = model.linear_stages(part)
        stages += st
        grad += g
    # Identical stages (repeated layers) become one row with a multiplicity; stages without a
    # ratio-dependent term are constants.
    rows: dict[tuple, int] = {}
    constant = 0.0
    for st in stages:
        if not st.comm_max and not any(st.comp_slope):
            constant += st.comm_const + max(st.comp_const, default=0.0)
            continue
        key = (st.comm_const, st.comm_max, tuple(st.comp_const), tuple(st.comp_slope))
        rows[key] = rows.get(key, 0) + 1
    stages = [LinearStage(k[0], k[1], list(k[2]), list(k[3])) for k in rows]
    mult = list(rows.values())
    # Times can be microseconds: solvers' absolute tolerances (~1e-7) would see them as zero, so
    # the rows are scaled to O(1): times by the largest coefficient, ratios by the device count.
    scale = max([1e-300] + [abs(x) for s in stages for x in (s.comm_max, *s.comp_const, *s.comp_slope)])
    m = sum(model.counts)
    prob = pulp.LpProblem("hapc_ratios", pulp.LpMinimize)
    var = _variable_factory(prob)
    b = [var(f"B_{t}") for t in range(nt)]  # m * B_t
    mx = var("M")
    z = [var(f"z_{i}") for i in range(len(stages))]
    prob += pulp.lpSum(c * ((s.comm_max / (scale * m)) * mx + z[i]) for i, (s, c) in enumerate(zip(stages, mult)))
    prob += pulp.lpSum(c * b[t] for t, c in enumerate(model.counts)) == float(m)
    for t in range(nt):
        prob += mx >= b[t]
    for i, s in enumerate(stages):
        for t in range(nt):
            if s.comp_const[t] or s.comp_slope[t]:
                prob += z[i] >= s.comp_const[t] / scale + (s.comp_slope[t] / (scale * m)) * b[t]
    if memory:
        for t, dt in enumerate(model.types):
            const = sum(c.param_bytes.const * model.memory_factor + c.act_bytes.const for part in parts for c in part)
            slope = sum(
                c.param_bytes.per_ratio * model.memory_factor + c.act_bytes.per_ratio for part in parts for c in part
            )
            prob += const / dt.memory + (slope / (dt.memory * m)) * b[t] <= 1.0
    status = prob.solve(_solver(solver))
    name = pulp.LpStatus[status]
    if name != "Optimal":
        raise InfeasibleError(f"sharding-ratio LP is {name.lower()} for this program (memory limits?)")
    ratios = tuple(max(0.0, v.value() or 0.0) / m for v in b)
    total = sum(c * r for c, r in zip(model.counts, ratios))
    ratios = tuple(r / total for r in ratios)
    objective = sum(
        c
        * (
            s.comm_const
            + s.comm_max * max(ratios)
            + max((a + k * r for a, k, r in zip(s.comp_const, s.comp_slope, ratios)), default=0.0)
        )
        for s, c in zip(stages, mult)
    )
    return LPResult(ratios, objective + constant + grad, name)


def _variable_factory(prob: pulp.LpProblem):
    """Non-negative continuous variables, with the PuLP >= 3.3 API when present."""
    if hasattr(prob, "add_variable"):
        return lambda name: prob.add_variable(name, lowBound=0.0)
    return lambda name: pulp.LpVariable(name, lowBound=0.0)


def _solver(name: str):
    if name == "cbc":
        try:  # pulp[cbc] ships the CBC binary in cbcbox (PuLP 4 drops its bundled copy)
            import cbcbox

            return pulp.COIN_CMD(path=cbcbox.cbc_bin_path(), msg=False)
        except ImportError:  # pragma: no cover - older PuLP with its bundled CBC
            return pulp.PULP_CBC_CMD(msg=False)
    if name == "highs":
        try:
            import highspy  # noqa: F401
        except ImportError as exc:
            raise InfeasibleError("solver='highs' needs highspy: pip install 'hapc[highs]'") from exc
        return pulp.HiGHS(msg=False)
    raise ValueError(f"solver must be one of {SOLVERS}, got {name!r}")
