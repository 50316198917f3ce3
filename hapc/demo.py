"""The README's main job (``hapc demo``): synthesize, emit, train on local processes, compare.

1. synthesize a program for a small GPT on ``local-cpu:3`` -- three CPU processes described as
   two fast devices and one half as fast (a stand-in for a mixed-generation cluster);
2. print the plan and write every rank's generated code to ``hapc-demo/rank{r}.py``;
3. train a few steps on three real ``torch.distributed`` (gloo) processes under that plan;
4. train the same model on one device and print both loss curves side by side.

The run fails (exit 1) if the distributed losses or final weights differ from single-device
training beyond float32 rounding.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from .api import synthesize
from .cluster import Cluster
from .codegen.emit import emit_code
from .testing import run_distributed

RTOL = 1e-4  # float32; the tests check float64 at 1e-9


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _train(module: Any, inputs: Any, steps: int) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps on one batch: (losses, seconds per step)."""
    opt = _optimizer(module.parameters())
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def _train_distributed(rank: int, world: int, factory: Any, cluster: Cluster, plan: Any, steps: int) -> dict:
    from .api import compile as hapc_compile

    model, inputs = factory()
    module = hapc_compile(model, cluster, inputs, plan=plan)
    losses, times = _train(module, inputs, steps)
    return {"losses": losses, "times": times, "state": module.full_state_dict()}


def _train_single(factory: Any, steps: int) -> dict:
    model, inputs = factory()
    losses, times = _train(model, inputs, steps)
    return {"losses": losses, "times": times, "state": model.state_dict()}


def run_demo(
    factory: Any,
    name: str,
    cluster: Cluster,
    *,
    steps: int = 5,
    out: str | Path = "hapc-demo",
    show: int = 40,
    console: Console | None = None,
) -> int:
    """Synthesize ``factory()``'s model for ``cluster``, train it on ``cluster.num_devices`` local
    gloo processes and compare with single-device training. Returns the exit code."""
    console = console or Console()
    torch.set_num_threads(1)
    world = cluster.num_devices
    console.print(f"[bold]hapc demo[/]: {name} on {cluster.describe()}\n")
    model, inputs = factory()
    plan = synthesize(model, cluster, inputs)
    console.print(str(plan), markup=False)
    program = plan.describe_program()
    console.print(f"\n[bold]program[/] ({len(program)} lines; a collective opens a stage):")
    for line in program[:show]:
        console.print("  " + line, markup=False)
    if len(program) > show:
        console.print(f"  ... {len(program) - show} more lines in {Path(out) / 'program.txt'}")
    paths = emit_code(plan, plan._theory, out)  # type: ignore[attr-defined]
    (Path(out) / "program.txt").write_text("\n".join(program) + "\n")
    console.print(f"\nper-rank code: {', '.join(str(p) for p in paths[:-1])}; plan: {paths[-1]}\n")

    console.print(f"training {steps} steps on {world} gloo processes and on one device ...")
    ranks = run_distributed(_train_distributed, world, factory, cluster, plan, steps, timeout=600)
    single = _train_single(factory, steps)
    table = Table(title=f"loss per step: hapc on {world} processes vs one device")
    for col in ("step", f"hapc ({world} ranks)", "single device", "relative difference"):
        table.add_column(col, justify="right")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ranks[0]["losses"], single["losses"])):
        diff = abs(a - b) / max(abs(b), 1e-30)
        worst = max(worst, diff, *(abs(r["losses"][i] - b) / max(abs(b), 1e-30) for r in ranks))
        table.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{diff:.1e}")
    console.print(table)
    # weights: max |difference| over the largest weight magnitude (a parameter whose gradient is zero
    # in exact arithmetic -- an attention key bias -- moves by rounding noise that Adam normalises)
    scale = max(float(v.abs().max()) for v in single["state"].values() if v.is_floating_point() and v.numel())
    weights = max(
        float((r["state"][k] - v).abs().max()) / scale
        for r in ranks
        for k, v in single["state"].items()
        if v.is_floating_point() and v.numel()
    )
    ok = worst <= RTOL and weights <= RTOL
    verdict = "[green]matches single-device training[/]" if ok else "[red]DOES NOT match single-device training[/]"
    console.print(
        f"largest relative loss difference {worst:.1e}, largest relative weight difference after {steps} steps "
        f"{weights:.1e} (float32): {verdict}"
    )
    return 0 if ok else 1
