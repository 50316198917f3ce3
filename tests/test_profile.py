"""``hapc profile``: alpha-beta fits, grouping of measured devices, a real run on gloo processes."""

from __future__ import annotations

import json

import pytest

import hapc
from hapc import models
from hapc.cli import main, tomllib_loads
from hapc.cluster import PRIMITIVES, Cluster
from hapc.errors import HapcError
from hapc.profile import (
    DEFAULT_SIZES,
    DeviceReport,
    _marginal_time,
    _runtime_call,
    build_cluster,
    fit_alpha_beta,
    measure_collectives,
    profile,
)
from hapc.testing import run_distributed


def test_fit_recovers_a_line_and_stays_non_negative():
    xs = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = fit_alpha_beta(xs, [5e-5 + 2e-9 * x for x in xs])
    assert alpha == pytest.approx(5e-5) and beta == pytest.approx(2e-9)
    assert fit_alpha_beta(xs, [3e-4, 2e-4, 3e-4, 2e-4])[1] == 0.0  # flat: latency only
    alpha, beta = fit_alpha_beta(xs, [1e-9 * x - 1e-6 for x in xs])
    assert alpha == 0.0 and beta > 0


def test_groups_are_runs_of_one_device_kind_in_rank_order():
    r = [
        DeviceReport("h0", "a100", 150e12, 1.5e12, 40e9),
        DeviceReport("h0", "a100", 140e12, 1.5e12, 40e9),
        DeviceReport("h1", "v100", 60e12, 0.9e12, 32e9),
        DeviceReport("h2", "a100", 150e12, 1.5e12, 40e9),
    ]
    coll = {p: (1e-5, 1e-10, []) for p in PRIMITIVES}
    c = build_cluster(r, coll)
    assert [(g.name, g.devices) for g in c.groups] == [("a100", 2), ("v100", 1), ("a100-2", 1)]
    assert c.groups[0].flops == 140e12  # the slowest member: a synchronous program waits for it
    assert c.devices() == ["a100", "a100", "v100", "a100-2"]  # rank order preserved
    assert c.alpha_beta("all_gather").beta == 1e-10
    assert Cluster.load(_roundtrip(c)).to_dict() == c.to_dict()


def test_half_precision_rates_are_a_groups_slowest_and_left_out_where_a_member_lacks_them():
    r = [
        DeviceReport("h0", "a100", 150e12, 1.5e12, 40e9, flops_bf16=300e12, flops_fp16=310e12),
        DeviceReport("h0", "a100", 140e12, 1.5e12, 40e9, flops_bf16=280e12, flops_fp16=0.0),
        DeviceReport("h1", "v100", 60e12, 0.9e12, 32e9, flops_fp16=120e12),
    ]
    c = build_cluster(r, {p: (1e-5, 1e-10, []) for p in PRIMITIVES})
    a100, v100 = c.groups
    assert (a100.flops_bf16, a100.flops_fp16) == (280e12, None)  # one member has no fp16 GEMM
    assert (v100.flops_bf16, v100.flops_fp16) == (None, 120e12)
    assert Cluster.load(_roundtrip(c)).to_dict() == c.to_dict()


def _roundtrip(c: Cluster) -> dict:
    return tomllib_loads(c.to_toml())


def _job(rank, world):
    cluster, raw = profile(sizes=(1024, 65536, 262144), reps=2, gemm=128, half=("bf16",))
    return cluster.to_toml(), raw["devices"][rank]["flops"], raw["collectives"]


def test_profile_measures_a_live_group():
    results = run_distributed(_job, 2)
    assert results[0][0] == results[1][0]  # every rank builds the same cluster from shared numbers
    cluster = Cluster.load(tomllib_loads(results[0][0]))
    assert cluster.num_devices == 2 and cluster.groups[0].flops > 1e8
    assert {p for p, _ in cluster.collectives} == set(PRIMITIVES)
    # fit_alpha_beta clamps at 0, so "alpha, beta >= 0" holds for any fit, even a failed one:
    # assert instead that each line explains its own measurements (a busy machine may measure a
    # flat line, beta = 0, so beta > 0 cannot be required)
    for prim, fit in results[0][2].items():
        ab = cluster.alpha_beta(prim)
        assert (ab.alpha, ab.beta) == pytest.approx((fit["alpha"], fit["beta"]), rel=1e-6, abs=1e-15), prim
        xs, ts = zip(*fit["points"])
        assert (fit["alpha"], fit["beta"]) == pytest.approx(fit_alpha_beta(xs, ts, relative=True), rel=1e-9), prim
        pred = [ab.alpha + ab.beta * x for x in xs]
        assert all(p > 0 for p in pred), (prim, ab)  # not clamped to nothing
        errs = sorted(abs(p - t) / t for p, t in zip(pred, ts))
        assert errs[len(errs) // 2] < 1.0, (prim, ab, fit["points"])  # within 2x of what was measured
    model, inputs = models.load("mlp")
    plan = hapc.synthesize(model, cluster, inputs)  # the measured cluster is directly usable
    assert len(plan.device_ratios) == 2
    # the bf16 GEMM rate was measured (torch multiplies bf16 on CPU), so a bf16 plan prices it
    assert cluster.groups[0].flops_bf16 > 1e8 and cluster.groups[0].flops_fp16 is None
    bf16 = hapc.synthesize(model, cluster, inputs, precision="bf16")
    assert bf16.time != plan.time


def test_default_sizes_cover_the_gradient_bucket_the_cost_model_prices():
    """The bucketed gradient all-reduce (``CostModel.grad_time``) prices buckets of up to
    ``bucket_bytes`` with the all-reduce's fitted beta: the profile must time the collectives at
    those sizes, not extrapolate from 4 MiB (on emulated ranks that fit gave a third of the
    per-byte time of an 8-16 MiB all-reduce). ``hapc profile``'s --sizes default is the same list."""
    from hapc.cli import build_parser
    from hapc.quantities import SIZE, parse_quantity
    from hapc.synth.cost import CostModel
    from hapc.testing import cluster_of

    bucket = CostModel(cluster_of([1e12, 1e12])).bucket_bytes
    assert max(DEFAULT_SIZES) >= bucket
    assert sum(x >= 2**22 for x in DEFAULT_SIZES) >= 3  # beta rests on several large messages
    default = build_parser().parse_args(["profile"]).sizes
    assert tuple(int(parse_quantity(s, "--sizes", SIZE)) for s in default.split(",")) == DEFAULT_SIZES


def test_cli_profile_local_writes_a_cluster_file(tmp_path, capsys):
    out = tmp_path / "c.toml"
    assert (
        main(["profile", "--local", "2", "--out", str(out), "--reps", "1", "--gemm", "64", "--sizes", "1KiB,64KiB"])
        == 0
    )
    assert Cluster.load(str(out)).num_devices == 2
    assert Cluster.load(str(out)).groups[0].flops_bf16 > 0  # --half bf16,fp16 by default
    assert "all_reduce" in capsys.readouterr().out


def test_cli_profile_marginal_times_collectives_between_bursts(tmp_path):
    """``--marginal`` profiles as benchmarks/fidelity.py does (what a collective adds to bursts of
    computation); the raw measurements say how the collectives were timed."""
    raw = tmp_path / "raw.json"
    argv = ["profile", "--local", "2", "--reps", "1", "--gemm", "64", "--sizes", "1KiB,64KiB", "--half", "none"]
    assert main([*argv, "--marginal", "--json", str(raw)]) == 0
    assert json.loads(raw.read_text())["collective_timing"] == {"method": "marginal", "gap": 5e-4, "calls": 4}
    assert main([*argv, "--json", str(raw)]) == 0
    assert json.loads(raw.read_text())["collective_timing"] == {"method": "barrier", "gap": 0.0}
    # --gap: the bursts as long as a program computes between its collectives
    assert main([*argv, "--marginal", "--gap", "2ms", "--json", str(raw)]) == 0
    assert json.loads(raw.read_text())["collective_timing"] == {"method": "marginal", "gap": 2e-3, "calls": 4}


@pytest.mark.parametrize(
    "extra, says",
    [(["--gap", "2ms"], "give it with --marginal"), (["--marginal", "--gap", "0"], "positive time"),
     (["--marginal", "--gap", "2 parsecs"], "expected s, ms")],
)  # fmt: skip
def test_cli_profile_gap_refuses_what_it_cannot_time(extra, says, capsys):
    assert main(["profile", "--local", "2", "--reps", "1", *extra]) == 2
    assert says in capsys.readouterr().err


def test_cli_profile_outside_torchrun_says_how_to_start(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["profile"]) == 2
    assert "torchrun" in capsys.readouterr().err


class _Clock:
    """A clock that only moves when the timed code says it worked: ``_marginal_time``'s arithmetic
    is checked exactly, whatever else the host is running (wall-clock bounds were flaky under CI)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds


def _marginal_job(rank, world):
    import types

    import torch

    import hapc.profile

    clock = _Clock()
    hapc.profile.time = types.SimpleNamespace(perf_counter=clock.perf_counter)  # this worker only
    burst = lambda: clock.work(2e-3)  # noqa: E731
    cpu = torch.device("cpu")
    return (
        _marginal_time(lambda: clock.work(5e-4), burst, cpu, reps=3, k=4),
        _marginal_time(lambda: None, burst, cpu, reps=3, k=4),
    )


def test_marginal_time_is_what_a_call_adds_to_the_computation_around_it():
    # a call that takes 0.5 ms adds 0.5 ms to the loop; one that does nothing adds nothing (the
    # one-microsecond floor): the bursts' own 2 ms are subtracted, not counted as the call's
    half_ms, nothing = run_distributed(_marginal_job, 1)[0]
    assert half_ms == pytest.approx(5e-4, rel=1e-9)
    assert nothing == 1e-6


def _runtime_job(rank, world):
    import torch

    cpu = torch.device("cpu")
    shapes = {p: tuple(_runtime_call(p, 64, world, cpu)().shape) for p in ("all_gather", "reduce_scatter")}
    shapes["all_reduce"] = float(_runtime_call("all_reduce", 64, world, cpu)()[0])
    shapes["all_to_all"] = int(_runtime_call("all_to_all", 64, world, cpu)().numel())
    coll = measure_collectives(cpu, (1024, 65536), reps=1, gap=1e-4, marginal=True, calls=2)
    return shapes, {p: pts for p, (_, _, pts) in coll.items()}


def test_marginal_collectives_call_the_runtime_in_the_cost_models_convention():
    # x bytes: the per-rank shard of an all-gather and reduce-scatter, the whole tensor of an
    # all-reduce, each rank's send buffer of an all-to-all (hapc.theory.cost)
    shapes, points = run_distributed(_runtime_job, 2)[0]
    assert shapes == {"all_gather": (32,), "reduce_scatter": (16,), "all_reduce": 2.0, "all_to_all": 16}
    assert set(points) == set(PRIMITIVES)
    assert all([x for x, _ in pts] == [1024, 65536] and all(t > 0 for _, t in pts) for pts in points.values())


def test_marginal_collectives_need_computation_between_calls():
    import torch

    with pytest.raises(HapcError, match="gap > 0"):
        measure_collectives(torch.device("cpu"), (1024,), marginal=True)
