"""Cost-model fidelity on this machine (issue 5, item 4; HAP §7.7 / Fig. 18 reports Pearson r = 0.970).

For every variant (model family x depth / width / sequence length x world size 2-3 x plan), the
step time ``t(Q, B)`` that HAP §3.2's stage cost model (:class:`hapc.synth.cost.CostModel`)
predicts for the plan's program under the profiled local cluster, against the step time measured
with ``hapc.compile`` on real gloo processes: a step is ``zero_grad``, forward, backward,
``optimizer.step()``; its time is the slowest rank's; we report the median over steps. Pearson r
(goal >= 0.97) and Kendall tau (goal >= 0.8) over all variants, a table and a log-log scatter plot.

Method (:mod:`fidelity_measure`):

1. ``hapc profile`` (:func:`hapc.profile.profile`) on ``W`` local gloo processes; the plans are
   made for that cluster. Plans: ``dp`` = ``baseline="dp-ev"``; ``tp`` = ``baseline="tp"``
   (Megatron-style even sharding); ``opt`` = hapc's optimum; ``slow`` = hapc's optimum for the
   same devices on a 10 MB/s link (compiled as planned, priced under the profiled cluster).
2. The variants of one world size run in one process group, in rounds: each round repeats the
   profiler's measurements and then runs a block of steps of every variant, so that the shared
   machine's changing load hits the profile and every variant alike.
3. Each program is priced (:func:`hapc.synth.synthesizer.program_cost`) under the cluster built
   from the rounds' medians -- the reported prediction -- and, for the ablation, under the same
   cluster without ``op_overhead`` (the cost model before this benchmark), with collectives timed
   right after a barrier instead of after ``GAP`` of computation, and under step 1's cluster.

A one-process control group (no collectives) checks the computation terms alone; it is reported
separately and is not part of r and tau.

    python benchmarks/fidelity.py [--quick] [--steps 24] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from hapc.cluster import Cluster
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import program_cost

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from fidelity_measure import GAP, initial_profile, make_plan, measure, variants  # noqa: E402

GOALS = {"pearson": 0.97, "kendall": 0.8}
MAIN = "concurrent"  # the cluster the reported predictions use


def without_overhead(cluster: Cluster) -> Cluster:
    """The same cluster priced by the cost model before ``op_overhead`` existed."""
    return dataclasses.replace(cluster, groups=tuple(dataclasses.replace(g, op_overhead=None) for g in cluster.groups))


def price(plan: Any, cluster: Cluster) -> dict[str, float]:
    """``t(Q, B)`` of the plan's program under ``cluster``, with its computation / collective /
    gradient-sync parts (:func:`hapc.synth.synthesizer.program_cost`, HAP §3.2)."""
    theory, parts, ratios = plan._theory, plan._parts, tuple(plan.ratios)
    model = CostModel(cluster)
    bd = [model.breakdown([theory.triples[k].cost for k in part], ratios) for part in parts]
    return {
        "predicted_s": program_cost(theory, model, parts, ratios),
        "comp_s": sum(b.comp for b in bd),
        "comm_s": sum(sum(s.comm for s in b.stages if s.direction != "gradients") for b in bd),
        "grad_s": sum(sum(s.comm for s in b.stages if s.direction == "gradients") for b in bd),
    }


def cost_models(initial: Cluster, concurrent: dict[str, Cluster]) -> dict[str, Cluster]:
    """Every cost model a program is priced with: the reported one (``MAIN``) and the ablation."""
    main = concurrent["concurrent"]
    return {
        MAIN: main,
        "without op_overhead": without_overhead(main),
        "collectives after a barrier": concurrent["concurrent, collectives after a barrier"],
        "hapc profile before measuring": initial,
    }


def correlations(pred: list[float], meas: list[float]) -> dict[str, float | None]:
    from scipy.stats import kendalltau, pearsonr

    if len(pred) < 3 or len(set(pred)) < 2 or len(set(meas)) < 2:
        return {"pearson": None, "kendall": None}
    r, tau = float(pearsonr(pred, meas)[0]), float(kendalltau(pred, meas)[0])
    return {"pearson": None if math.isnan(r) else r, "kendall": None if math.isnan(tau) else tau}


def run(quick: bool, steps: int | None = None) -> dict[str, Any]:
    """Profile, plan, measure and price every variant; the result is JSON-ready."""
    steps = steps or (3 if quick else 24)
    warmup = 1 if quick else 3
    t_start = time.perf_counter()
    rows, clusters = [], {}
    for w in sorted({v.world for v in variants(quick)}):
        mine = [v for v in variants(quick) if v.world == w]
        initial = initial_profile(w, quick)
        plans = [make_plan(v, initial) for v in mine]
        measured, concurrent = measure([(v, p, c) for v, (p, c) in zip(mine, plans)], w, steps, warmup, quick)
        models = cost_models(initial, concurrent)
        clusters[str(w)] = {k: c.to_dict() for k, c in models.items()}
        for v, (plan, _), m in zip(mine, plans, measured):
            priced = {k: price(plan, c) for k, c in models.items()}
            row = {"variant": v.name, "family": v.family, "world": w, "plan": v.plan, **priced[MAIN], **m}
            row["collectives"] = len(plan.collectives())
            row["ratio"] = m["measured_s"] / row["predicted_s"]
            row["alternatives_s"] = {k: p["predicted_s"] for k, p in priced.items() if k != MAIN}
            rows.append(row)
    main = [r for r in rows if r["world"] > 1]
    control = [r for r in rows if r["world"] == 1]
    meas = [r["measured_s"] for r in main]
    return {
        "quick": quick,
        "steps": steps,
        "gap_s": GAP,
        "seconds": time.perf_counter() - t_start,
        "goals": GOALS,
        "stats": correlations([r["predicted_s"] for r in main], meas),
        "ablation": {
            k: correlations([r["alternatives_s"][k] for r in main], meas)
            for k in (main[0]["alternatives_s"] if main else {})
        },
        "control": correlations([r["predicted_s"] for r in control], [r["measured_s"] for r in control]),
        "clusters": clusters,
        "rows": rows,
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _verdict(value: float | None, goal: float) -> str:
    return "n/a" if value is None else ("met" if value >= goal else "missed")


def _counts(result: dict[str, Any]) -> str:
    main = sum(r["world"] > 1 for r in result["rows"])
    return f"{main} variants on 2-3 processes (+ {len(result['rows']) - main} one-process controls)"


def summary_rows(result: dict[str, Any]) -> list[tuple[str, dict[str, float | None]]]:
    """``(cost model, statistics)``: the reported one first, then the ablation, then the control."""
    return (
        [(f"{MAIN} profile (reported)", result["stats"])]
        + list(result.get("ablation", {}).items())
        + [("one-process control group (no collectives)", result["control"])]
    )


def markdown(result: dict[str, Any]) -> str:
    """The RESULTS.md section: the statistics against the goals, the ablation, a row per variant."""
    s = result["stats"]
    lines = [
        "## Cost-model fidelity on this machine (issue 5, item 4)",
        "",
        f"{_counts(result)}: step time predicted under the profiled local cluster vs measured "
        f"with `hapc.compile` on gloo processes (median of {result['steps']} steps, slowest rank; "
        f"{'quick run' if result['quick'] else 'full run'}, {result['seconds']:.0f} s).",
        "",
        f"Pearson r = {_fmt(s['pearson'])} (goal >= {GOALS['pearson']}: {_verdict(s['pearson'], GOALS['pearson'])}), "
        f"Kendall tau = {_fmt(s['kendall'])} (goal >= {GOALS['kendall']}: {_verdict(s['kendall'], GOALS['kendall'])}).",
        "",
        "| cost model (W >= 2 unless noted) | Pearson r | Kendall tau |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {_fmt(st['pearson'])} | {_fmt(st['kendall'])} |" for name, st in summary_rows(result)]
    lines += [
        "",
        "| variant | predicted ms | measured ms | measured / predicted | comp / comm / grads ms | collectives "
        "| spread |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | {r['ratio']:.2f} "
            f"| {r['comp_s'] * 1e3:.2f} / {r['comm_s'] * 1e3:.2f} / {r['grad_s'] * 1e3:.2f} | {r['collectives']} "
            f"| {r['spread']:.2f} |"
        )
    lines += [
        "",
        "comp / comm / grads: the prediction's computation, collective and gradient all-reduce parts; "
        "collectives: in the forward program (each has a backward too); spread: interquartile range / "
        "median of the measured steps (machine noise).",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Log-log scatter of measured vs predicted step time: colour = plan, marker = model family,
    size = world size, hollow = the one-process control group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    colours = {"dp": "tab:blue", "tp": "tab:red", "opt": "tab:green", "slow": "tab:purple"}
    markers = {"gpt": "o", "bert": "s", "mlp": "^"}
    for r in result["rows"]:
        colour = colours.get(r["plan"], "k") if r["world"] > 1 else "grey"
        ax.scatter(
            r["predicted_s"] * 1e3,
            r["measured_s"] * 1e3,
            facecolors=colour if r["world"] > 1 else "none",
            edgecolors=colour,
            marker=markers.get(r["family"], "x"),
            s=20 + 15 * r["world"],
        )
    values = [r[k] * 1e3 for r in result["rows"] for k in ("predicted_s", "measured_s")]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    for plan, c in colours.items():
        ax.scatter([], [], c=c, label=f"plan {plan}")
    ax.scatter([], [], facecolors="none", edgecolors="grey", label="1 process (control)")
    for fam, m in markers.items():
        ax.scatter([], [], c="grey", marker=m, label=fam)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    s = result["stats"]
    ax.set_title(f"cost-model fidelity: Pearson r = {_fmt(s['pearson'])}, Kendall tau = {_fmt(s['kendall'])}")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few tiny variants, few steps (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 24; quick 3)")
    ap.add_argument("--json", default=str(HERE / "fidelity.json"))
    ap.add_argument("--plot", default=str(HERE / "fidelity.png"))
    args = ap.parse_args()
    result = run(args.quick, args.steps)
    table = Table(title=f"cost-model fidelity: {_counts(result)}, {result['seconds']:.0f} s")
    for col in ("variant", "pred ms", "meas ms", "meas/pred", "comp/comm/grad ms", "colls", "spread"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(
            r["variant"],
            f"{r['predicted_s'] * 1e3:.2f}",
            f"{r['measured_s'] * 1e3:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['comp_s'] * 1e3:.2f}/{r['comm_s'] * 1e3:.2f}/{r['grad_s'] * 1e3:.2f}",
            str(r["collectives"]),
            f"{r['spread']:.2f}",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    stats = Table(title="predicted vs measured")
    for col in ("cost model", "Pearson r", "Kendall tau"):
        stats.add_column(col, justify="right")
    for name, st in summary_rows(result):
        stats.add_row(name, _fmt(st["pearson"]), _fmt(st["kendall"]))
    console.print(stats)
    s = result["stats"]
    for key, label in (("pearson", "Pearson r"), ("kendall", "Kendall tau")):
        console.print(f"{label} = {_fmt(s[key])} (goal >= {GOALS[key]}: {_verdict(s[key], GOALS[key])})")
    Path(args.json).write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
