"""H-1F1B vs 1F1B vs Eager-1F1B on real processes over one slow (emulated) link (issue 6, acceptance 3).

Three gloo processes each run one stage of a GPT, cut where the stages cost about the same: HARP
§2.3.2's setting, a slow link between stages 0 and 1 and a fast one between 1 and 2. The slow
link is *emulated* in hapc's pipeline transport: a message of ``b`` bytes may be
consumed ``b / bandwidth`` after the link is free (a clock all local processes share); the sender's
compute is not slowed (see :mod:`hapc.pipeline.runtime`). A calibration run measures the stages'
forward + backward time per micro-batch ``t_i``; the bandwidth is then set so that one message
costs ``c = 0.6 t_max`` (HARP's regime ``t_max/2 < c <= t_max``, where H-1F1B launches 3 extra
forwards: HARP Eq. 2).

Reported side by side, interleaved in blocks so machine noise hits all alike: the median step
time of each policy over the slow link, the *compute bound* (H-1F1B with the link delay off), and
each stage's peak number of in-flight micro-batches (activations held). Goals: H-1F1B within 5% of
the compute bound, fastest of the three, and holding no more activations than Eager-1F1B.

    python benchmarks/pipeline_schedules.py [--steps 12] [--micro 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hapc import models
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.schedule import eager_1f1b_warmup, h1f1b_warmup, one_f_one_b_warmup
from hapc.pipeline.stages import balanced_cuts
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

RATIO = 0.6  # c / t_max


S = 3


def _pipeline(cfg: dict, micro: int, warmups: list[int], emulate: dict | None):
    model, inputs = models.gpt(**cfg)
    graph = trace(model, micro_batches(inputs, micro, inputs[0].shape[0])[0])
    cuts = balanced_cuts(graph, [1] * S)
    spec = PipelineSpec(cuts, [[k] for k in range(S)], [cluster_of([1e10])] * S, warmups, micro)
    return PipelineModule(model, inputs, spec, emulate=emulate), inputs


def _calibrate(rank: int, world: int, cfg: dict, micro: int, steps: int) -> dict:
    torch.set_num_threads(1)
    pm, inputs = _pipeline(cfg, micro, one_f_one_b_warmup(S), None)
    times = []
    for _ in range(steps):
        pm.train_step(*inputs)
        times.append(pm.compute_seconds / micro)
    return {"t": statistics.median(times), "bytes": pm.sg.send_numel * 4 if rank == 0 else 0}


def _compare(rank: int, world: int, cfg: dict, micro: int, steps: int, runs: dict, bandwidth: float) -> dict:
    torch.set_num_threads(1)
    slow = {"bandwidth": bandwidth, "latency": 0.0, "between": [(0, 1)]}
    mods = {name: _pipeline(cfg, micro, w, None if name == "compute bound" else slow) for name, w in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for pm, inputs in mods.values():  # warm-up
        pm.train_step(*inputs)
        pm.peak_in_flight = 0
    while len(times["h1f1b"]) < steps:
        for name, (pm, inputs) in mods.items():
            for _ in range(2):
                dist.barrier()
                t0 = time.perf_counter()
                pm.train_step(*inputs)
                times[name].append(time.perf_counter() - t0)
    return {"times": times, "peak": {name: pm.peak_in_flight for name, (pm, _) in mods.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro", type=int, default=64, help="micro-batches per step (32 samples each)")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    args = ap.parse_args()
    # many micro-batches, so the unavoidable fill and drain (one link crossing each way) amortise
    cfg = {"size": "tiny", "batch": 2 * args.micro} if args.quick else {"size": "small", "batch": 32 * args.micro}
    steps = 2 if args.quick else args.steps
    cal = run_distributed(_calibrate, S, cfg, args.micro, 3, timeout=1800)
    t = [c["t"] for c in cal]
    t_max, nbytes = max(t), cal[0]["bytes"]
    c = RATIO * t_max
    bandwidth = nbytes / c
    h1 = h1f1b_warmup(t, [c, 0.0])  # the link between stages 1 and 2 is not slowed
    runs = {
        "h1f1b": h1,
        "1f1b": one_f_one_b_warmup(S),
        "eager-1f1b": eager_1f1b_warmup(S),
        "compute bound": h1,
    }
    res = run_distributed(_compare, S, cfg, args.micro, steps, runs, bandwidth, timeout=1800)
    # a step ends when the slower rank finishes
    med = {name: statistics.median(max(x) for x in zip(*(r["times"][name] for r in res))) for name in runs}
    peak = {name: [r["peak"][name] for r in res] for name in runs}
    bound = med["compute bound"]
    table = Table(
        title=f"pipeline schedules, {S} stages on {S} gloo processes, {args.micro} micro-batches, "
        f"t = {[round(x * 1e3, 2) for x in t]} ms, c = {c * 1e3:.2f} ms ({RATIO} t_max, emulated)"
    )
    for col in ("schedule", "warm-ups", "step ms", "/ compute bound", "peak in-flight per stage"):
        table.add_column(col, justify="right")
    rows = []
    for name in runs:
        rows.append({"schedule": name, "warmups": runs[name], "step_s": med[name], "ratio": med[name] / bound})
        rows[-1]["peak"] = peak[name]
        table.add_row(name, str(runs[name]), f"{med[name] * 1e3:.1f}", f"{med[name] / bound:.3f}", str(peak[name]))
    Console().print(table)
    fastest = min(("h1f1b", "1f1b", "eager-1f1b"), key=med.get)
    goals = {
        "h1f1b within 5% of the compute bound": med["h1f1b"] / bound <= 1.05,
        "h1f1b fastest": fastest == "h1f1b",
        "h1f1b holds no more activations than eager-1f1b": max(peak["h1f1b"]) <= max(peak["eager-1f1b"]),
    }
    for goal, ok in goals.items():
        print(f"{'met   ' if ok else 'MISSED'}  {goal}")
    Path(args.json).write_text(
        json.dumps({"config": cfg, "micro": args.micro, "t": t, "c": c, "rows": rows, "goals": goals}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
