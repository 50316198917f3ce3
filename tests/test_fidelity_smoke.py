"""The cost-model fidelity benchmark (``benchmarks/fidelity.py``) at its quick size.

Wall-clock numbers are not asserted (the machine is shared). Checked: every variant has a
positive, finite prediction and measurement; the reported prediction is the cost model's price of
the program that ran, under the cluster recorded in the result (re-priced here from a fresh plan
of the same variant); the per-operator overhead reaches that cluster and raises the price by
exactly ``op_overhead`` x (forward + backward launches); the statistics are scipy's on the rows,
Kendall's tau-b over the fixed tie classes; the isolation (a CPU-weighted control group, one core
per rank) is applied and undone; the report and the plot are written.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402
import fidelity_measure  # noqa: E402

from hapc.cluster import Cluster  # noqa: E402


@pytest.fixture(scope="module")
def full():
    return fidelity.run(quick=True)


@pytest.fixture(scope="module")
def result(full):
    """The (only) run of the quick result."""
    return full["runs"][0]


def test_quick_run_structure(full, result):
    assert len(full["runs"]) == 1 and full["tie"] == fidelity.TIE
    assert full["met_every_run"] == fidelity.met(result["stats"])
    if fidelity_measure.emulate.how() is not None:  # the isolation was applied and is recorded
        assert full["priority"].startswith("cgroup")
    rows = result["rows"]
    assert [r["variant"] for r in rows] == [v.name for v in fidelity_measure.variants(True)]
    assert {r["plan"] for r in rows} >= {"dp", "tp"}
    for r in rows:
        for key in ("predicted_s", "measured_s", "ratio", "comp_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["variant"], key, r[key])
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
        assert r["predicted_s"] >= r["comp_s"] + r["comm_s"] - 1e-12  # stages add up (a max per stage)
        for name, t in r["alternatives_s"].items():
            assert math.isfinite(t) and t > 0, (r["variant"], name)
        assert r["alternatives_s"]["without op_overhead"] < r["predicted_s"]
    assert set(result["ablation"]) == set(rows[0]["alternatives_s"])
    for stats in (result["stats"], *result["ablation"].values()):
        assert all(v is None or -1.0 <= v <= 1.0 for v in stats.values())
    cluster = Cluster.from_dict(result["clusters"]["2"][fidelity.MAIN])
    assert cluster.num_devices == 2 and cluster.groups[0].op_overhead > 0
    assert {p for p, _ in cluster.collectives} == {"all_gather", "reduce_scatter", "all_reduce"} | {
        "broadcast",
        "reduce",
        "all_to_all",
    }


def test_statistics_are_scipys_on_the_rows(result):
    from scipy.stats import kendalltau, pearsonr

    pred = [r["predicted_s"] for r in result["rows"] if r["world"] > 1]
    meas = [r["measured_s"] for r in result["rows"] if r["world"] > 1]
    assert result["stats"] == fidelity.correlations(pred, meas)
    assert result["stats"]["pearson"] == pytest.approx(pearsonr(pred, meas)[0])
    assert result["stats"]["kendall"] == pytest.approx(kendalltau(fidelity.tie_classes(pred), meas)[0])
    assert result["stats"]["kendall_no_ties"] == pytest.approx(kendalltau(pred, meas)[0])
    too_few = fidelity.correlations([1.0, 2.0], [1.0, 2.0])
    assert too_few == {"pearson": None, "kendall": None, "kendall_no_ties": None}


def test_ties_are_a_fixed_rule():
    """Classes start at their smallest member and span less than TIE above it (no chaining), and
    only the pairs inside a class count as ties."""
    tol = fidelity.TIE
    pred = [1.0, 1.0 + 0.8 * tol, 1.0 + 1.2 * tol, 1.0 + 1.9 * tol, 3.0, 0.999]
    assert fidelity.tie_classes(pred) == [0.999, 0.999, pred[2], pred[2], 3.0, 0.999]
    # the two closest predictions are measured in the wrong order: a discordant pair without ties,
    # a tie with them (tau-b), everything else concordant
    meas = [2.0, 1.0, 3.0, 4.0, 5.0]
    stats = fidelity.correlations([1.0, 1.0 + tol / 2, 2.0, 3.0, 4.0], meas)
    assert stats["kendall_no_ties"] == pytest.approx(0.8)
    assert stats["kendall"] == pytest.approx(9 / math.sqrt(9 * 10))
    assert fidelity.met({"pearson": 0.99, "kendall": fidelity.GOALS["kendall"]})
    assert not fidelity.met({"pearson": 0.99, "kendall": None})


@pytest.mark.skipif(fidelity_measure.emulate.how() is None, reason="no writable cgroup cpu controller")
def test_priority_weights_this_process_and_its_children_then_undoes_it():
    import multiprocessing as mp

    def where() -> str:
        return next(ln for ln in Path("/proc/self/cgroup").read_text().split("\n") if ln.split(":")[1] in ("cpu", ""))

    before = where()
    with fidelity_measure.priority() as how:
        inside = where()
        assert inside.endswith(f"hapc-fidelity-{os.getpid()}") and how.startswith("cgroup")
        knob, weight = fidelity_measure.PRIORITY[fidelity_measure.emulate.how()]
        assert f"{knob} = {weight}" in how
        ctx = mp.get_context("fork")
        q = ctx.SimpleQueue()
        child = ctx.Process(target=lambda: q.put(where()))
        child.start()
        child.join()
        assert q.get() == inside  # a rank forked meanwhile is weighted too
    assert where() == before


def test_pin_gives_each_rank_its_own_core_when_there_are_enough():
    import multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()

    def child(rank: int, world: int) -> None:
        core = fidelity_measure.pin(rank, world)
        q.put((core, sorted(os.sched_getaffinity(0))))

    p = ctx.Process(target=child, args=(len(cores) - 1, len(cores)))
    p.start()
    p.join()
    assert q.get() == (cores[-1], [cores[-1]])
    p = ctx.Process(target=child, args=(0, len(cores) + 1))  # more ranks than cores: not pinned
    p.start()
    p.join()
    assert q.get() == (None, cores)


def test_prediction_is_the_price_of_the_program_that_ran(result):
    """A fresh plan of the first variant under the recorded initial cluster is the same program;
    priced under the recorded main cluster it gives the reported prediction, and without
    ``op_overhead`` exactly overhead x (forward + backward launches) less."""
    clusters = {k: Cluster.from_dict(d) for k, d in result["clusters"]["2"].items()}
    v, row = fidelity_measure.variants(True)[0], result["rows"][0]
    plan, target = fidelity_measure.make_plan(v, clusters["hapc profile before measuring"])
    assert target == clusters["hapc profile before measuring"]
    main = clusters[fidelity.MAIN]
    priced = fidelity.price(plan, main)
    assert priced["predicted_s"] == pytest.approx(row["predicted_s"], rel=1e-9)
    costs = [plan._theory.triples[k].cost for part in plan._parts for k in part]
    launches = sum(
        bool(c.fwd_flops.total or c.fwd_bytes.total) + bool(c.bwd_flops.total or c.bwd_bytes.total) for c in costs
    )
    bare = fidelity.price(plan, fidelity.without_overhead(main))["predicted_s"]
    assert bare == pytest.approx(row["alternatives_s"]["without op_overhead"], rel=1e-9)
    assert priced["predicted_s"] - bare == pytest.approx(launches * main.groups[0].op_overhead, rel=1e-6)


def test_markdown_and_plot(full, result, tmp_path):
    md = fidelity.markdown(full)
    assert all(f"| {r['variant']} |" in md for r in result["rows"])
    assert all(f"| {name} |" in md for name, _ in fidelity.summary_rows(result))
    assert "Ties (fixed rule)" in md and f"| 1 | {fidelity._fmt(result['stats']['pearson'])} |" in md
    png = tmp_path / "f.png"
    fidelity.plot(full, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- the op_overhead term of the cost model (no processes) -------------------------------------------
def _two_kinds(overheads: tuple[float | None, float | None]) -> Cluster:
    groups = []
    for name, flops, ovh in (("fast", 4e10, overheads[0]), ("slow", 1e10, overheads[1])):
        g = {"name": name, "devices": 1, "flops": flops, "memory": "4 GiB", "mem_bandwidth": "10 GB/s"}
        if ovh is not None:
            g["op_overhead"] = ovh
        groups.append(g)
    link = {"bandwidth": "1 GB/s", "latency": "50 us"}
    return Cluster.from_dict({"name": "two", "group": groups, "links": {"intra_host": link, "inter_host": link}})


def test_op_overhead_round_trips_and_is_absent_by_default():
    from hapc.cli import tomllib_loads

    with_ovh, without = _two_kinds((2e-5, 5e-5)), _two_kinds((None, None))
    assert Cluster.from_dict(tomllib_loads(with_ovh.to_toml())) == with_ovh
    assert [t.op_overhead for t in with_ovh.device_types()] == [2e-5, 5e-5]
    assert "op_overhead" not in without.to_toml()  # old cluster files and fingerprints are unchanged
    assert [t.op_overhead for t in without.device_types()] == [0.0, 0.0]


def test_op_overhead_keeps_the_lp_exact_and_charges_each_launch():
    """The LP's objective is the cost model's price at the LP's ratios (the term is linear: a
    constant per stage and type), no grid point beats it, and each computing triple pays the
    overhead once per direction."""
    import hapc
    from hapc import models
    from hapc.balance.lp import solve_ratios
    from hapc.synth.cost import CostModel
    from hapc.synth.synthesizer import SynthSpace, program_cost, synthesize_program

    model, inputs = models.mlp()
    theory = hapc.derive(hapc.trace(model, inputs))
    cluster, bare = _two_kinds((2e-5, 5e-5)), _two_kinds((None, None))
    cm = CostModel(cluster)
    res = synthesize_program(SynthSpace(theory, cm.m), cm, cm.proportional_ratios())
    costs = [[theory.triples[k].cost for k in part] for part in res.parts]
    lp = solve_ratios(cm, costs)
    at_lp = program_cost(theory, cm, res.parts, lp.ratios)
    assert math.isclose(lp.objective, at_lp, rel_tol=1e-7)
    for k in range(1, 20):
        b = k / 20
        assert at_lp <= program_cost(theory, cm, res.parts, (b, 1 - b)) + 1e-12
    # per stage: comp_t = no-overhead comp_t + launches in that stage * overhead_t
    plain = CostModel(bare)
    for part in costs:
        for st, st0 in zip(cm.breakdown(part, lp.ratios).stages, plain.breakdown(part, lp.ratios).stages):
            launches = 0
            for i in st.triples:
                c = part[i]
                f, by = (c.fwd_flops, c.fwd_bytes) if st.direction == "forward" else (c.bwd_flops, c.bwd_bytes)
                launches += bool(f.total or by.total) if st.direction != "gradients" else 0
            for t, ovh in enumerate((2e-5, 5e-5)):
                assert st.comp[t] == pytest.approx(st0.comp[t] + launches * ovh, rel=1e-9, abs=1e-15)
