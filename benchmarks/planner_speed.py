"""Planner speed at HARP's granularity: GPT-39B, 146 layers, harp-setting1 (64 GPUs, 2 groups).

HARP (§6, App. C) plans this model in 133 s of DP search after 1248 s of profiling. hapc's full
plan -- tracing on the meta device, theory, layer construction, stage costs from the SPMD
synthesizer for every sub-mesh kind, and the exact-memory DP of HARP Eq. 13-19 -- is timed here
end to end, with the stage table, η (HARP Eq. 20) and the Eq. 12 time split.

    python benchmarks/planner_speed.py [--micro 128] [--json out.json]

The micro-batch is the traced one (1 sequence of 2048 tokens); ``--micro`` micro-batches make a
step (128 x 2048 tokens by default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hapc import models
from hapc.cluster import Cluster
from hapc.pipeline.planner import plan_pipeline


def run(num_micro: int = 128, model: str = "gpt-39b", cluster: str = "harp-setting1") -> dict:
    t0 = time.perf_counter()
    net, inputs = models.load(model)
    plan = plan_pipeline(net, cluster, inputs, num_micro=num_micro)
    total = time.perf_counter() - t0
    cl = Cluster.load(cluster)
    compute = {g.name: g.devices * g.flops for g in cl.groups}
    layers = {g.name: 0 for g in cl.groups}
    for s in plan.stages:
        layers[s.group] += s.hi - s.lo
    share = {
        g: {
            "layers": layers[g],
            "layer_share": layers[g] / plan.num_layers,
            "compute_share": compute[g] / sum(compute.values()),
        }
        for g in layers
    }
    return {
        "model": model,
        "cluster": cluster,
        "num_layers": plan.num_layers,
        "num_micro": num_micro,
        "seconds_total": total,
        "timings": plan.timings,
        "search": plan.search,
        "eta": plan.eta,
        "step_time": plan.time,
        "time_split": plan.time_split(),
        "groups": share,
        "plan": plan.to_json(),
        "table": plan.describe(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=128)
    ap.add_argument("--model", default="gpt-39b")
    ap.add_argument("--cluster", default="harp-setting1")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    r = run(args.micro, args.model, args.cluster)
    print(r["table"])
    t = r["timings"]
    print(
        f"{r['model']} at {r['num_layers']} layers on {r['cluster']}: full plan {r['seconds_total']:.2f} s "
        f"(model build + trace + theory {t['trace+derive']:.2f} s, layers {t['layers']:.2f} s, "
        f"stage costs {t['costing']:.2f} s for {r['search']['syntheses']} sub-mesh kinds, "
        f"DP index {t['index']:.2f} s, DP {t['dp']:.2f} s over {r['search']['dp_runs']} t_max values of "
        f"{r['search']['t_max_candidates']}); HARP: 1248 s profiling + 133 s DP"
    )
    split = r["time_split"]
    print(
        f"eta {r['eta'] * 100:.1f}%; Eq. 12 step {r['step_time']:.3f} s = first micro-batch "
        f"{split['first_compute']:.3f} s compute + {split['first_comm']:.3f} s links + steady {split['steady']:.3f} s"
    )
    for g, s in r["groups"].items():
        print(
            f"  {g}: {s['layers']} layers ({s['layer_share'] * 100:.1f}%) "
            f"for {s['compute_share'] * 100:.1f}% of peak flop/s"
        )
    out = {k: v for k, v in r.items() if k != "table"}
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
