"""Equivalence fuzzer: random models x random clusters -> synthesize -> run on gloo processes ->
the loss, every parameter's gradient, two optimizer steps and the final state equal single-device
training (float64, the harness tolerances: rtol 1e-9).

Models come from :mod:`fuzzgen` (the rule library's ops, odd and prime sizes, residuals, shared
weights, several inputs); clusters have 1-4 devices with skewed flops and memory and a slow,
medium or fast link; the theory options (collective variants, SFB, parameter communication) are
drawn too. One hypothesis example is a batch of ``BATCH`` models: their plans are synthesized in
the parent and all models of one world size run in one launch of processes (a launch costs more
than a small model), each model caught separately so one failure does not hide the others.

Profiles: the default (CI) runs 5 batches, derandomized (40 models, ~10-25 s here);
``HYPOTHESIS_PROFILE=fuzz`` (``make fuzz``) runs 60 batches (480 models, ~360 of them run) with
fresh randomness and prints the counts. A plan the cluster's memory cannot hold
(``InfeasibleError``) is counted, not run.
Every failure found becomes a named test below.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Any

import pytest
import torch
from fuzzgen import SYNTH_OPTIONS, ModelSpec, fuzz_clusters, model_specs
from harness import assert_close, train
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import hapc
from hapc.cluster import Cluster
from hapc.errors import InfeasibleError
from hapc.testing import cluster_of, run_distributed
from hapc.theory.graph import PARAM
from hapc.theory.instructions import Source

F64 = torch.float64
BATCH = 8
STEPS = 2
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]
# no shrinking: a batch re-runs processes per step, and every mismatch already prints its model
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
settings.register_profile(
    "hapc-fuzz-ci", max_examples=5, deadline=None, derandomize=True, phases=_PHASES, suppress_health_check=_HEALTH
)
settings.register_profile("fuzz", max_examples=60, deadline=None, phases=_PHASES, suppress_health_check=_HEALTH)
PROFILE = "fuzz" if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else "hapc-fuzz-ci"

COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_counts():
    yield
    if COUNTS:
        worlds = ", ".join(f"{k[6:]} rank(s): {v}" for k, v in sorted(COUNTS.items()) if k.startswith("world "))
        print(
            f"\nfuzz [{PROFILE}]: {COUNTS['examples']} models, {COUNTS['ran']} run against single-device "
            f"({worlds}), {COUNTS['infeasible']} refused (InfeasibleError: memory, or the baseline does not apply), "
            f"{COUNTS['mismatches']} mismatches; "
            f"multi-rank plans with collectives {COUNTS['with collectives']}, with sharded parameters "
            f"{COUNTS['sharded parameters']}, with uneven ratios {COUNTS['uneven ratios']}"
        )


# -- one model, single device and distributed ---------------------------------------------------


def single_device(spec: ModelSpec) -> dict[str, Any]:
    model, inputs = spec.build()
    loss = model(*inputs)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    losses, opt = train(model, inputs, loss.item(), STEPS, "sgd")
    return {"loss": loss.item(), "grads": grads, "losses": losses, "state": hapc.checkpoint.full_state(model, opt)}


def _one(spec: ModelSpec, cluster: Cluster, plan: hapc.Plan) -> dict[str, Any]:
    model, inputs = spec.build()
    m = hapc.compile(model, cluster, inputs, plan=plan)
    loss = m(*inputs)
    loss.backward()
    first, grads = loss.detach().item(), m.full_gradients()
    losses, opt = train(m, inputs, first, STEPS, "sgd")
    return {"loss": first, "grads": grads, "losses": losses, "state": m.full_state_dict(opt)}


def _job(rank: int, world: int, items: list[tuple[ModelSpec, Cluster, hapc.Plan]]) -> list[Any]:
    out: list[Any] = []
    for spec, cluster, plan in items:
        try:
            out.append(_one(spec, cluster, plan))
        except Exception as exc:  # reported per model by the parent; the other models still run
            out.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}")
    return out


def check_batch(examples: list[tuple[ModelSpec, Cluster, dict[str, Any]]], counts: Counter[str] = COUNTS) -> list[str]:
    """Run every example; return one line per mismatch (empty when all equal single-device)."""
    failures: list[str] = []
    by_world: dict[int, list[tuple[ModelSpec, Cluster, hapc.Plan]]] = {}
    for spec, cluster, opts in examples:
        counts["examples"] += 1
        model, inputs = spec.build()
        try:
            plan = hapc.synthesize(model, cluster, inputs, **opts)
        except InfeasibleError:
            counts["infeasible"] += 1
            continue
        except Exception as exc:
            failures.append(f"synthesize failed: {type(exc).__name__}: {exc}\n  {spec!r}\n  {cluster.to_dict()}")
            continue
        by_world.setdefault(cluster.num_devices, []).append((spec, cluster, plan))
        if cluster.num_devices > 1:  # what the multi-rank plans exercise
            counts["with collectives"] += bool(plan.collectives())
            counts["sharded parameters"] += any(
                isinstance(i, Source) and i.layout.is_sharded and plan._theory.graph[i.ref].kind == PARAM
                for i in plan.instructions
            )
            counts["uneven ratios"] += max(plan.device_ratios) - min(plan.device_ratios) > 1e-6
    for world, items in sorted(by_world.items()):
        results = run_distributed(_job, world, items, timeout=120)
        for k, (spec, cluster, plan) in enumerate(items):
            counts["ran"] += 1
            counts[f"world {world}"] += 1
            ref = single_device(spec)
            for rank in range(world):
                got = results[rank][k]
                try:
                    if isinstance(got, str):
                        raise AssertionError(got)
                    for key in ("loss", "grads", "losses", "state"):
                        assert_close(got[key], ref[key], F64, f"rank {rank} {key}")
                except AssertionError as exc:
                    failures.append(
                        f"{str(exc)[:2000]}\n  spec={spec!r}\n  cluster={cluster.to_dict()}\n  "
                        f"ratios={plan.device_ratios} options={plan.options}"
                    )
                    break
    counts["mismatches"] += len(failures)
    return failures


examples = st.tuples(model_specs(), fuzz_clusters(), SYNTH_OPTIONS)
FAILURES: list[str] = []


@settings(settings.get_profile(PROFILE))
@given(st.lists(examples, min_size=BATCH, max_size=BATCH))
def _fuzz(batch):
    FAILURES.extend(check_batch(batch))  # all batches run; the test reports every mismatch


def test_random_models_on_random_clusters_equal_single_device():
    FAILURES.clear()
    _fuzz()
    assert not FAILURES, f"{len(FAILURES)} models differ from single-device:\n" + "\n\n".join(FAILURES)


# -- regressions the fuzzer found -------------------------------------------------------------------


def test_regression_wait_stays_above_the_data_only_work_that_reads_it():
    """A Gram product of the input alone (``h (h^T h)`` with the batch sharded) all-reduces
    data-only work; codegen hoisted data-only nodes to the top but left the collective's ``wait``
    in place, so the product that reads the wait came before it ("used before it has been
    defined"). Fixed in ``RankProgram._hoist_data_only``: nothing that reads a wait is hoisted."""
    spec = ModelSpec(
        inputs=(("x", (5, 7), "float"),), ops=(("reduce", "sum", 1, True), ("gram",), ("shared", 1)), loss="mse", seed=1
    )
    cluster = cluster_of([1.7e6, 3.5e6, 4.8e6], bandwidth="100 GB/s", latency="0 us")
    opts = {"variants": ("grouped",), "param_comm": True, "sfb": False}
    model, inputs = spec.build()
    plan = hapc.synthesize(model, cluster, inputs, **opts)
    assert "all_reduce" in [c.op for c in plan.collectives()]  # the case: a collective on data-only work
    assert check_batch([(spec, cluster, opts)], Counter()) == []


class _SkipsAnInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 9, dtype=F64).reshape(3, 3))

    def forward(self, x, unused, y):
        return (x @ self.w * y).sum()


def _skips_job(rank: int, world: int, plan: hapc.Plan, inputs: tuple) -> float:
    m = hapc.compile(_SkipsAnInput(), cluster_of([1e9] * world), inputs, plan=plan)
    return m(*inputs).item()


def test_regression_an_unused_input_does_not_shift_the_others():
    """The traced graph drops an input the model never reads; the compiled module bound
    positional arguments to the graph's input names, so ``y`` silently received ``unused``'s
    value and the loss was wrong without an error. Fixed: arguments bind by the model's
    ``forward`` signature."""
    g = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(4, 3, generator=g, dtype=F64) for _ in range(3))
    plan = hapc.synthesize(_SkipsAnInput(), cluster_of([1e9, 1e9]), inputs)
    want = _SkipsAnInput()(*inputs).item()
    assert run_distributed(_skips_job, 2, plan, inputs) == [pytest.approx(want, rel=1e-12)] * 2
