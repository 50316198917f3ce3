"""H-1F1B vs 1F1B vs Eager-1F1B in the discrete-event simulator (HARP §2.3, §4), side by side.

Scenarios (times in units of one stage's forward + backward, ``f : b = 1 : 2``):

* ``harp-2.3.2`` -- HARP's case study: Table 1's fine-grained plan (stage costs 1.13t, 1.10t,
  1.10t), a slow first link at 0.3 / 0.6 / 0.9 t_max and InfiniBand (0.01 t_max) after it;
* ``moe-4`` -- four stages, a mid-cost link between two groups (HARP §6's ``[5,4,2,1]``);
* ``deep-8`` -- eight stages, one cross-group link at 0.6 t_max in the middle.

For each: warm-up counts, simulated step time, HARP Eq. 12, peak in-flight activations (memory)
and the simulator's own speed. Numbers are simulated, not measured on GPUs.

    python benchmarks/schedule_sim.py [--micro 128] [--quick] [--json out.json] [--trace-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from hapc.pipeline.simulate import chrome_trace, compare_policies, policy_table


def scenarios() -> dict[str, tuple[list[float], list[float], list[float]]]:
    """name -> (fwd, bwd, comm) per stage / link."""
    out = {}
    t = [1.13, 1.10, 1.10]
    for x in (0.3, 0.6, 0.9):
        out[f"harp-2.3.2 c={x}"] = ([s / 3 for s in t], [2 * s / 3 for s in t], [x * 1.13, 0.01 * 1.13])
    out["moe-4"] = ([1 / 3] * 4, [2 / 3] * 4, [0.02, 0.4, 0.02])
    out["deep-8"] = ([1 / 3] * 8, [2 / 3] * 8, [0.01, 0.01, 0.01, 0.6, 0.01, 0.01, 0.01])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=128, help="micro-batches per step (HARP §2.2.2 uses 128)")
    ap.add_argument("--quick", action="store_true", help="16 micro-batches (smoke test)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--trace-dir", help="write each scenario's H-1F1B Chrome trace here")
    args = ap.parse_args()
    M = 16 if args.quick else args.micro
    console = Console(highlight=False)
    report = {"num_micro": M, "scenarios": {}}
    for name, (fwd, bwd, comm) in scenarios().items():
        t0 = time.perf_counter()
        runs = compare_policies(fwd, bwd, comm, M)
        secs = time.perf_counter() - t0
        events = sum(len(r.result.events) for r in runs)
        console.print(policy_table(runs, title=f"{name} (B={M})"))
        h = runs[0].result
        console.print(
            f"Eq. 12: {runs[0].eq12:.4g}; 1F1B / H-1F1B step time {runs[1].result.step_time / h.step_time:.3f}, "
            f"Eager / H-1F1B {runs[2].result.step_time / h.step_time:.3f}; simulated {events} events in "
            f"{secs * 1e3:.1f} ms\n"
        )
        report["scenarios"][name] = {
            "eq12": runs[0].eq12,
            "policies": {
                r.policy: {
                    "warmups": r.warmups,
                    "step_time": r.result.step_time,
                    "peak_inflight": r.result.peak_inflight,
                    "max_bubble": max(r.result.bubble),
                }
                for r in runs
            },
            "sim_seconds": secs,
        }
        if args.trace_dir:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            chrome_trace(h, Path(args.trace_dir) / f"{name.replace(' ', '_').replace('=', '')}.json")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
