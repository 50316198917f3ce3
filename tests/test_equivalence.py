"""Acceptance 1 of the runtime: every generated program trains exactly like the single-device model.

Each case synthesizes (or forces) a plan in the parent, runs it on 1-4 fork-started gloo processes
and checks, against single-device training of the same model: the loss, every parameter's whole
gradient, the losses of three optimizer steps and the full state after them (parameters, buffers,
optimizer moments). float64 cases compare at rtol 1e-9, float32 ones at 1e-4. Each case also checks
that the plan really is what it is meant to exercise (data parallel, tensor parallel, SFB, grouped
collectives, the requested ratios...), so a test never passes vacuously.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from harness import check_plan

import hapc
from hapc import models
from hapc.cluster import Cluster
from hapc.plan import Plan
from hapc.testing import cluster_of
from hapc.theory.instructions import Compute, Source

F64 = torch.float64
UNEVEN = [5e9, 3e9, 2e9]  # ratios 0.5 / 0.3 / 0.2 when balanced by compute

# model alias -> keyword arguments (tiny sizes; some deliberately odd)
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {},
    "mlp-odd": {"batch": 7, "widths": (13, 31, 17), "classes": 5},
    "bert": {},
    "gpt": {},
    "cnn": {},
    "cnn-bn": {"batch_norm": True},
    "moe": {},
    "bert-moe": {},
}
ALIAS = {"mlp-odd": "mlp", "cnn-bn": "cnn"}


def _params(plan: Plan) -> dict[str, str]:
    th = plan._theory  # type: ignore[attr-defined]
    return {
        th.graph[i.ref].target: str(i.layout)
        for i in plan.instructions
        if isinstance(i, Source) and th.graph[i.ref].kind == "param"
    }


def data_parallel(plan: Plan) -> bool:
    return all(lay == "R" for lay in _params(plan).values())


def sharded_params(plan: Plan) -> bool:
    return any(lay != "R" for lay in _params(plan).values())


def variants(plan: Plan) -> set[str]:
    return {c.variant for c in plan.collectives() if c.op in ("all_gather", "reduce_scatter")}


def strategies(plan: Plan, op_part: str) -> set[str]:
    return {
        i.strategy_key.split(":")[0]
        for i in plan.instructions
        if isinstance(i, Compute) and op_part in plan.node_names[i.ref]
    }


@dataclass
class Case:
    id: str
    model: str
    cluster: Cluster | str
    world: int
    synth: dict[str, Any] = field(default_factory=dict)
    expect: Callable[[Plan], bool] | None = None
    dtype: torch.dtype = F64
    opt: str = "sgd"


def ratios_are(*want: float) -> Callable[[Plan], bool]:
    return lambda p: max(abs(a - b) for a, b in zip(p.device_ratios, want)) < 1e-9


SLOW = cluster_of(UNEVEN, bandwidth="10 MB/s")
SLOW4 = cluster_of([*UNEVEN, 1e9], bandwidth="10 MB/s")
FAST2 = cluster_of(UNEVEN[:2], bandwidth="10 MB/s")

CASES: list[Case] = []
# the synthesized optimum on the default local clusters, 1-4 ranks
for name in ["mlp", "bert", "gpt", "cnn", "moe"]:
    for n in (1, 2, 3, 4):
        CASES.append(Case(f"{name}-local{n}", name, f"local-cpu:{n}", n))
CASES += [
    # uneven ratios 0.5/0.3/0.2, data parallel
    *[
        Case(
            f"{m}-dpcp",
            m,
            cluster_of(UNEVEN),
            3,
            {"baseline": "dp-cp"},
            lambda p: data_parallel(p) and ratios_are(0.5, 0.3, 0.2)(p),
        )
        for m in ("mlp-odd", "bert", "gpt", "cnn-bn", "moe")
    ],
    Case("bert-dpev", "bert", cluster_of(UNEVEN), 3, {"baseline": "dp-ev"}, data_parallel),
    # Megatron tensor parallelism, even shards
    *[
        Case(f"{m}-tp{n}", m, cluster_of([1e10] * n), n, {"baseline": "tp"}, sharded_params)
        for m, n in (("mlp", 2), ("bert", 3), ("gpt", 4), ("cnn", 3), ("moe", 2))
    ],
    # a slow network: the synthesized optimum shards parameters (tensor parallel pieces)
    *[
        Case(f"{m}-slow", m, SLOW, 3, {}, sharded_params)
        for m in ("mlp", "mlp-odd", "bert", "gpt", "cnn", "moe", "bert-moe")
    ],
    # collective variants forced
    *[
        Case(f"{m}-grouped", m, SLOW, 3, {"variants": ("grouped",)}, lambda p: variants(p) == {"grouped"})
        for m in ("mlp", "bert", "gpt", "moe")
    ],
    *[
        Case(f"{m}-padded", m, SLOW, 3, {"variants": ("padded",)}, lambda p: variants(p) == {"padded"})
        for m in ("mlp", "bert", "gpt", "cnn")
    ],
    # fixed uneven ratios on four ranks
    *[
        Case(f"{m}-ratios4", m, SLOW4, 4, {"ratios": (0.4, 0.3, 0.2, 0.1)}, ratios_are(0.4, 0.3, 0.2, 0.1))
        for m in ("mlp-odd", "bert", "gpt", "cnn", "bert-moe")
    ],
    # sufficient-factor broadcasting on and off
    Case("mlp-sfb", "mlp", FAST2, 2, {"baseline": "dp-cp", "sfb": True}, lambda p: len(p.sfb_sites()) > 0),
    Case("mlp-nosfb", "mlp", FAST2, 2, {"baseline": "dp-cp", "sfb": False}, lambda p: not p.sfb_sites()),
    Case("cnn-sfb", "cnn", FAST2, 2, {"baseline": "dp-cp", "sfb": True}, lambda p: len(p.sfb_sites()) > 0),
    Case("cnn-nosfb", "cnn", FAST2, 2, {"baseline": "dp-cp", "sfb": False}, lambda p: not p.sfb_sites()),
    # expert parallelism: tokens exchanged by all-to-all inside dispatch / combine
    *[
        Case(f"{m}-ep", m, cluster_of(UNEVEN), 3, {"baseline": "ep"}, lambda p: strategies(p, "moe_") == {"all-to-all"})
        for m in ("moe", "bert-moe")
    ],
    # float32 and Adam
    Case("gpt-f32", "gpt", "local-cpu:3", 3, dtype=torch.float32),
    Case("cnn-bn-f32", "cnn-bn", SLOW, 3, dtype=torch.float32),
    Case("gpt-adam", "gpt", SLOW4, 4, opt="adam"),
    Case("bert-adam", "bert", SLOW, 3, opt="adam"),
]


def model_kwargs(case: Case) -> tuple[str, dict[str, Any]]:
    return ALIAS.get(case.model, case.model), {**MODELS[case.model], "dtype": case.dtype}


# The local clusters on 2 and 4 ranks run in `make test-slow` (about 40 s of the default suite): 1 and
# 3 ranks (uneven shards) stay here, 2 and 4 ranks are trained here by the TP, SFB, ratios4 and Adam
# cases, and every runtime path by the cases of test_cases_cover_every_runtime_path
SLOW_CASES = {f"{m}-local{n}" for m in ("mlp", "bert", "gpt", "cnn", "moe") for n in (2, 4)}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] * (c.id in SLOW_CASES)) for c in CASES]
)
def test_matches_single_device(case: Case) -> None:
    alias, mkw = model_kwargs(case)
    model, inputs = models.load(alias, **mkw)
    plan = hapc.synthesize(model, case.cluster, inputs, **case.synth)
    if case.expect is not None:
        assert case.expect(plan), f"the plan does not exercise what {case.id} is for:\n{plan}"
    check_plan(alias, mkw, case.cluster, plan, case.world, opt=case.opt)


# The cases expected to exercise the runtime paths below, tried first so that the coverage test
# below stops after a few cheap plans (about 2 s instead of synthesizing all ~60, 45 s on CI). The
# order only changes how soon it stops: should one of these no longer exercise its path, the test
# goes on through every other case, so it still passes exactly when some case of CASES covers it.
COVERAGE_FIRST = ["mlp-tp2", "cnn-bn-dpcp", "mlp-sfb", "bert-grouped", "bert-moe-ep"]
RUNTIME_PATHS = [
    "all_gather:padded",
    "all_gather:grouped",
    "reduce_scatter:padded",
    "reduce_scatter:grouped",
    "all_reduce",
    "slice",
    "linear:sfb",
    "batch_norm:sync-batch",
    "moe_dispatch:all-to-all",
    "moe_combine:all-to-all",
]


def test_cases_cover_every_runtime_path() -> None:
    """The matrix above must keep exercising every collective and fused op of the runtime."""
    by_id = {c.id: c for c in CASES}
    assert all(i in by_id for i in COVERAGE_FIRST), "COVERAGE_FIRST names a case that is gone"
    order = [by_id[i] for i in COVERAGE_FIRST] + [c for c in CASES if c.id not in COVERAGE_FIRST]
    seen: set[str] = set()
    for case in order:
        if case.world == 1:
            continue
        if all(path in seen for path in RUNTIME_PATHS):
            break
        alias, mkw = model_kwargs(case)
        model, inputs = models.load(alias, **mkw)
        plan = hapc.synthesize(model, case.cluster, inputs, **case.synth)
        seen |= {f"{c.op}:{c.variant}" if c.variant else c.op for c in plan.collectives()}
        seen |= {
            plan.node_names[i.ref].rstrip("_0123456789") + ":" + i.strategy_key.split(":")[0]
            for i in plan.instructions
            if isinstance(i, Compute)
        }
    for path in RUNTIME_PATHS:
        assert path in seen, f"no equivalence case exercises {path}"
