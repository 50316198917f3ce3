"""Is cutting stages at every node harmless? The default synthesis (``segments="node"``) prices each
op as its own stage; HAP's stage model lets ops between two collectives share one. This compares,
under HAP's unsegmented stage model, the program found with node segments against the true
optimum found by the whole-program A* (``segments="none"``), where the latter finishes.

    python benchmarks/segmentation.py [--samples 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

import hapc
from hapc import models
from hapc.cluster import Cluster
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, synthesize_program

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from randgraph import OPS, RandomNet


def gap(theory, cluster: Cluster) -> tuple[float, float, float]:
    """(stage cost of the node-segmented program, optimal stage cost, seconds of the A*)."""
    cm = CostModel(cluster)
    ratios = cm.proportional_ratios()
    node = synthesize_program(SynthSpace(theory, cm.m, "node"), cm, ratios)
    as_one = cm.cost([theory.triples[k].cost for k in node.triples], ratios)
    t0 = time.perf_counter()
    best = synthesize_program(SynthSpace(theory, cm.m, "none"), cm, ratios)
    return as_one, best.cost, time.perf_counter() - t0


def random_case(rng: random.Random):
    sizes = [2, 3, 4, 6, 8]
    width = rng.choice(sizes)
    widths, spec = [width], []
    for i in range(rng.randint(1, 4)):
        op = rng.choice(OPS)
        out = rng.choice(sizes) if op == "linear" else widths[-1]
        spec.append((op, rng.randint(0, i), out))
        widths.append(out)
    model = RandomNet(spec, widths)
    x = torch.randn(rng.choice(sizes), width, dtype=torch.float64)
    n = rng.randint(2, 4)
    kinds = rng.randint(1, min(3, n))
    counts = [1] * kinds
    for _ in range(n - kinds):
        counts[rng.randrange(kinds)] += 1
    groups = [
        {"name": f"g{k}", "devices": c, "devices_per_host": c, "flops": rng.uniform(1e6, 1e8), "memory": "1 GB"}
        for k, c in enumerate(counts)
    ]
    bw = rng.uniform(1e5, 1e8)
    cluster = Cluster.from_dict(
        {"name": "random", "group": groups, "links": {"intra_host": {"bandwidth": bw, "latency": rng.uniform(0, 1e-4)}}}
    )
    return model, (x,), cluster


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a few samples, MLP only (the CI smoke run)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    if args.quick:
        args.samples = 5
    gaps = []
    for _ in range(args.samples):
        model, inputs, cluster = random_case(rng)
        got, best, _ = gap(hapc.derive(hapc.trace(model, inputs)), cluster)
        gaps.append(max(0.0, (got - best) / best) if best > 0 else 0.0)
    rows = {
        "random graphs": {
            "cases": len(gaps),
            "identical": sum(g <= 1e-9 for g in gaps),
            "mean_gap": statistics.mean(gaps),
            "max_gap": max(gaps),
        }
    }
    zoo = {}
    for name in ("mlp",) if args.quick else ("mlp", "cnn"):
        for cname in ("local-cpu:3",) if args.quick else ("local-cpu:3", "hap-testbed:8", "metis-t4v100"):
            model, inputs = models.load(name)
            got, best, secs = gap(hapc.derive(hapc.trace(model, inputs)), Cluster.load(cname))
            zoo[f"{name} on {cname}"] = {
                "node": got,
                "optimum": best,
                "gap": max(0.0, (got - best) / best),
                "astar_seconds": secs,
            }
    console = Console(width=140)
    t = Table(title="node segments vs HAP's stage model: gap of the node-segmented program to the A* optimum")
    for col in ("case", "node-segmented (s)", "optimum (s)", "gap", "A* time (s)"):
        t.add_column(col, justify="right")
    r = rows["random graphs"]
    t.add_row(
        f"{r['cases']} random graphs",
        f"{r['identical']} identical",
        "",
        f"mean {r['mean_gap']:.2%}, max {r['max_gap']:.2%}",
        "",
    )
    for k, v in zoo.items():
        t.add_row(k, f"{v['node']:.4g}", f"{v['optimum']:.4g}", f"{v['gap']:.2%}", f"{v['astar_seconds']:.2f}")
    console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**rows, "zoo": zoo}, f, indent=1)


if __name__ == "__main__":
    main()
