"""Planner speed at HARP's granularity and workload: GPT-39B, 146 layers, harp-setting1 (64 GPUs, 2 groups).

HARP (§6, App. C) plans this model in 133 s of DP search after 1248 s of profiling. hapc's full
plan -- tracing on the meta device, theory, layer construction, stage costs from the SPMD
synthesizer for every sub-mesh kind, and the exact-memory DP of HARP Eq. 13-19 -- is timed here
end to end, with the stage table, η (HARP Eq. 20) and the Eq. 12 time split.

    python benchmarks/planner_speed.py [--batch 1024] [--seq 1024] [--micro 512]
        [--recompute auto|never|always] [--precision fp16|bf16|fp32] [--json out.json]

HARP's workload (§6): a global batch of ``--batch`` 1024 sequences of ``--seq`` 1024 tokens, cut
into ``--micro`` micro-batches (512 by default: 2 sequences each, the traced micro-batch), trained
in mixed precision as HARP (and Alpa under it) train it: ``--precision fp16`` by default (V100s have
no bf16 units; ``fp32`` prices full precision); the planner chooses activation recomputation per
stage (``--recompute``, :mod:`hapc.pipeline.dp`).
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
from hapc.theory import derive, trace


def run(
    num_micro: int = 512,
    model: str = "gpt-39b",
    cluster: str = "harp-setting1",
    *,
    batch: int = 1024,
    seq: int = 1024,
    recompute: str = "auto",
    precision: str | None = None,
) -> dict:
    if batch % num_micro:
        raise SystemExit(f"--micro {num_micro} must divide --batch {batch}")
    t0 = time.perf_counter()
    net, inputs = models.load(model, batch=batch // num_micro, seq=seq)
    theory = derive(trace(net, inputs), **({"precision": precision} if precision else {}))
    built = time.perf_counter() - t0
    plan = plan_pipeline(net, cluster, inputs, num_micro=num_micro, theory=theory, recompute=recompute)
    plan.timings["trace+derive"] = built  # model build + trace + theory, done here
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
        "batch": batch,
        "seq": seq,
        "recompute": recompute,
        "precision": precision,
        "recomputed_stages": [k + 1 for k, s in enumerate(plan.stages) if s.recompute],
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
    ap.add_argument("--micro", type=int, default=512, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=1024, help="sequences per step (HARP: 1024)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (HARP: 1024)")
    ap.add_argument("--recompute", default="auto", choices=["auto", "never", "always"])
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--model", default="gpt-39b")
    ap.add_argument("--cluster", default="harp-setting1")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    args = ap.parse_args()
    r = run(
        args.micro,
        args.model,
        args.cluster,
        batch=args.batch,
        seq=args.seq,
        recompute=args.recompute,
        precision=None if args.precision == "fp32" else args.precision,
    )
    print(r["table"])
    t = r["timings"]
    print(
        f"workload: {r['batch']} x {r['seq']} tokens in {r['num_micro']} micro-batches of "
        f"{r['batch'] // r['num_micro']} x {r['seq']}; precision {r['precision'] or 'fp32'}; recompute "
        f"{r['recompute']}: stages {r['recomputed_stages'] or 'none'} recompute"
    )
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
