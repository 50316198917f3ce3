"""The cost-model fidelity benchmark (``benchmarks/fidelity.py``) at its quick size.

Wall-clock numbers are not asserted (the machine is shared). Checked: every variant has a
positive, finite prediction and measurement; the reported prediction is the cost model's price of
the program that ran, under the cluster recorded in the result (re-priced here from a fresh plan
of the same variant); the per-operator overhead reaches that cluster and raises the price by
exactly ``op_overhead`` x (forward + backward launches); the statistics are scipy's on the rows;
the report and the plot are written.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402
import fidelity_measure  # noqa: E402

from hapc.cluster import Cluster  # noqa: E402


@pytest.fixture(scope="module")
def result():
    return fidelity.run(quick=True)


def test_quick_run_structure(result):
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
    assert result["stats"]["kendall"] == pytest.approx(kendalltau(pred, meas)[0])
    assert fidelity.correlations([1.0, 2.0], [1.0, 2.0]) == {"pearson": None, "kendall": None}  # too few points


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


def test_markdown_and_plot(result, tmp_path):
    md = fidelity.markdown(result)
    assert all(f"| {r['variant']} |" in md for r in result["rows"])
    assert all(f"| {name} |" in md for name, _ in fidelity.summary_rows(result))
    png = tmp_path / "f.png"
    fidelity.plot(result, png)
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
