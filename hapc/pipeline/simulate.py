"""Discrete-event replay of pipeline schedules, HARP's latency model (Eq. 12) and Chrome traces.

The simulator executes every stage's action list (:mod:`hapc.pipeline.schedule`) in order, as
the runtime does, and is the timed version of HARP's DAG (§4.2.1):

* **compute** -- a stage runs one ``F``/``B`` at a time, taking ``fwd[i]`` / ``bwd[i]``
  (HARP's ``E_comp`` edges);
* **sends never block** the sender (``isend``). A send of micro-batch ``m`` over link ``i``
  (between stages ``i`` and ``i+1``) goes on the wire at ``max(issue time, link free)`` and lands
  ``comm[i]`` later. Links are full duplex: each direction carries one transfer at a time, in
  issue order (HARP's ``E_comm`` edges); activations and gradients never queue behind each other.
  The receiver is assumed to have pre-posted its receive (eager transfer), as the DAG assumes;
* **a receive blocks** until its message has landed (HARP's ``E_dep`` edges); it costs no
  compute time. A receive whose send is never issued is a deadlock, reported with every stage's
  blocked action.

Since every stage's clock depends only on its own actions and on arrival times fixed when the
matching send is issued, the replay is exact and independent of the order stages are visited.

**Eq. 12.** With ``t_i = fwd[i] + bwd[i]``, ``t_max = max t_i`` and one-way link times ``c_i``
(``c_{S-1} = 0``), HARP §5.2.2 models the step time of ``B`` micro-batches under H-1F1B as
``Σ_i (t_i + 2c_i) + (B-1)·t_max`` when every ``c_i <= t_max``: one micro-batch's full round
trip plus ``B-1`` bubble-free periods of the bottleneck. Its slope is exact: outside Eq. 2's ε
band the replayed steady phase runs at ``t_max`` per micro-batch, the bottleneck never idling
(tested for random H-1F1B pipelines of up to 6 stages). Its constant is approximate in two ways
the replay shows:

* links slower than a stage's forward (warm-up) or backward (cool-down) queue those bursts of
  transfers, so the step takes longer than Eq. 12 by up to ``~4 t_max`` (measured: ``S = 6``,
  ``f = 0.2 t``, ``c = (t, t/2, ...)``; 1.5% of the step at ``B = 256``, 0.8% at ``B = 512``);
* for imbalanced stages ``Σ t_i`` over-counts fill and drain (faster stages hide under the
  bottleneck's warm-up): the replay beats Eq. 12 by up to 18% at ``B = 8``, ~1.6% at ``B = 256``.

Inside the ε band (``0 < c <= ε t_max``, ``δ = 1``) each such link stalls the steady phase by up
to ``c`` per micro-batch, and stalls of several such links compound (measured: 4 links at
``≈ 0.09 t_max`` cost 15%): the price of Eq. 2's memory tolerance.
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .schedule import COMPUTE, HARP_EPSILON, POLICIES, Action, ScheduleError, grid, policy_warmup, schedule

__all__ = [
    "Event",
    "PolicyRun",
    "SimResult",
    "chrome_trace",
    "compare_policies",
    "eq12_time",
    "policy_table",
    "simulate",
]


@dataclass(frozen=True)
class Event:
    """One interval of the replay.

    ``F``/``B``: the stage computing. ``RECV_*``: the stage waiting for a message (``start`` = the
    receive was reached, ``end`` = the message had landed; zero length when it was already there).
    ``SEND_*``: the message on the wire (``start`` = left the sending stage's link queue).
    """

    stage: int
    kind: str
    micro: int
    start: float
    end: float


@dataclass
class SimResult:
    """The replay of one schedule: step time, every event, activation and idle statistics per stage."""

    step_time: float
    events: list[Event]
    peak_inflight: list[int]  # max over time of (forwards done - backwards done) per stage
    busy: list[float]  # compute seconds per stage
    bubble: list[float] = field(default_factory=list)  # idle fraction of the step per stage

    def __post_init__(self) -> None:
        if not self.bubble:
            self.bubble = [1.0 - b / self.step_time if self.step_time > 0 else 0.0 for b in self.busy]

    def compute_events(self, stage: int) -> list[Event]:
        """Stage ``stage``'s ``F``/``B`` events in execution order."""
        return [e for e in self.events if e.stage == stage and e.kind in COMPUTE]

    def steady_period(self, stage: int, block: int = 1) -> float:
        """Mean spacing of backward starts on ``stage`` over (about) the middle half of the micro-batches.

        A bubble-free steady phase gives ``t_max`` on every stage (HARP §4.2's ``f + b``): every
        stage is paced by the bottleneck. A schedule with bubbles repeats every ``K`` micro-batches
        (HARP Lemma 2's K-blocks); pass ``block=K`` (or a multiple) so the window spans whole blocks.
        """
        starts = sorted(e.start for e in self.events if e.stage == stage and e.kind == "B")
        lo = len(starts) // 4
        span = (len(starts) - 1 - 2 * lo) // block * block
        if span <= 0:
            raise ScheduleError(f"stage {stage}: too few backwards to measure a steady period over blocks of {block}")
        return (starts[lo + span] - starts[lo]) / span


def _per_stage(name: str, values: Sequence[float], n: int) -> list[float]:
    if len(values) != n:
        raise ScheduleError(f"{name} needs {n} values, got {len(values)}")
    if any(not v >= 0 for v in values):
        raise ScheduleError(f"{name} must be non-negative, got {list(values)}")
    return [float(v) for v in values]


def simulate(
    sched: Sequence[Sequence[Action]],
    fwd: Sequence[float],
    bwd: Sequence[float],
    comm: Sequence[float],
    *,
    comm_bwd: Sequence[float] | None = None,
) -> SimResult:
    """Replay ``sched`` with per-stage compute times and per-link one-way transfer times.

    ``comm[i]`` is the activation transfer time over link ``i`` (stage ``i`` -> ``i+1``);
    gradients take ``comm_bwd[i]`` (default: the same). Raises :class:`ScheduleError` on a
    deadlock, a message sent but never received, or a backward before its forward.
    """
    S = len(sched)
    fwd = _per_stage("fwd", fwd, S)
    bwd = _per_stage("bwd", bwd, S)
    comm = _per_stage("comm (one time per link i -> i+1)", comm, S - 1)
    comm_b = comm if comm_bwd is None else _per_stage("comm_bwd", comm_bwd, S - 1)

    pc = [0] * S
    clock = [0.0] * S
    busy = [0.0] * S
    inflight, peak = [0] * S, [0] * S
    done_f: list[set[int]] = [set() for _ in range(S)]
    done_b: list[set[int]] = [set() for _ in range(S)]
    landed: dict[tuple[str, int, int], float] = {}  # (receive kind, receiving stage, micro) -> arrival
    link_free: dict[tuple[int, str], float] = {}
    events: list[Event] = []

    def send(i: int, a: Action) -> tuple[str, int, int]:
        if a.kind == "SEND_ACT":
            link, direction, dst, recv, cost = i, "act", i + 1, "RECV_ACT", comm
        else:
            link, direction, dst, recv, cost = i - 1, "grad", i - 1, "RECV_GRAD", comm_b
        if not 0 <= dst < S:
            raise ScheduleError(f"{a}: stage {i} has no neighbour {dst} to send to")
        key = (recv, dst, a.micro)
        if key in landed:
            raise ScheduleError(f"{a}: micro-batch {a.micro} sent twice")
        start = max(clock[i], link_free.get((link, direction), 0.0))
        end = start + cost[link]
        link_free[(link, direction)] = end
        landed[key] = end
        events.append(Event(i, a.kind, a.micro, start, end))
        return key

    ready = deque(range(S))  # stages that may move; a blocked stage waits in `waiting` for its message
    waiting: dict[tuple[str, int, int], int] = {}
    while ready:
        i = ready.popleft()
        while pc[i] < len(sched[i]):
            a = sched[i][pc[i]]
            if a.stage != i:
                raise ScheduleError(f"action {a} sits in stage {i}'s list")
            if a.kind in ("RECV_ACT", "RECV_GRAD"):
                key = (a.kind, i, a.micro)
                if key not in landed:
                    waiting[key] = i  # blocked until the peer issues the send
                    break
                t = max(clock[i], landed.pop(key))
                events.append(Event(i, a.kind, a.micro, clock[i], t))
                clock[i] = t
            elif a.kind in ("SEND_ACT", "SEND_GRAD"):
                woken = waiting.pop(send(i, a), None)
                if woken is not None:
                    ready.append(woken)
            else:
                if a.kind == "F":
                    if a.micro in done_f[i]:
                        raise ScheduleError(f"{a}: forward of micro-batch {a.micro} runs twice on stage {i}")
                    done_f[i].add(a.micro)
                    inflight[i] += 1
                    peak[i] = max(peak[i], inflight[i])
                    dur = fwd[i]
                else:
                    if a.micro not in done_f[i] or a.micro in done_b[i]:
                        raise ScheduleError(f"{a}: backward without a pending forward of micro-batch {a.micro}")
                    done_b[i].add(a.micro)
                    inflight[i] -= 1
                    dur = bwd[i]
                events.append(Event(i, a.kind, a.micro, clock[i], clock[i] + dur))
                clock[i] += dur
                busy[i] += dur
            pc[i] += 1
    if waiting:
        blocked = ", ".join(f"stage {i} at {sched[i][pc[i]]}" for i in sorted(waiting.values()))
        raise ScheduleError(f"the schedule deadlocks: {blocked} (no matching send is ever issued)")
    if landed:
        raise ScheduleError(f"messages sent but never received: {sorted(landed)}")
    step = max([e.end for e in events], default=0.0)
    return SimResult(step, events, peak, busy)


def eq12_time(stage_times: Sequence[float], comm_times: Sequence[float], num_micro: int) -> float:
    """HARP Eq. 12: ``Σ_i (t_i + 2c_i) + (B-1)·max_j t_j`` (``t_i`` = forward + backward, ``c`` one-way)."""
    if len(comm_times) != len(stage_times) - 1:
        raise ScheduleError(f"{len(stage_times)} stages need {len(stage_times) - 1} link times, got {len(comm_times)}")
    return sum(stage_times) + 2 * sum(comm_times) + (num_micro - 1) * max(stage_times)


def chrome_trace(result: SimResult, path: str | Path | None = None, *, time_scale: float = 1e6) -> dict:
    """Chrome / Perfetto trace JSON of a replay: one track per stage, one per link direction.

    Times are multiplied by ``time_scale`` into the trace's microseconds (default: inputs in
    seconds). Receive waits show on the stage track as ``wait rA3`` slices. Written to ``path``
    when given; the trace dict is returned either way.
    """
    S = 1 + max((e.stage for e in result.events), default=0)
    out: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "stages"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "links"}},
    ]
    for i in range(S):
        out.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": f"stage {i}"}})
    for link in range(S - 1):
        out.append(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2 * link, "args": {"name": f"link {link}->{link + 1}"}}
        )
        out.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 1,
                "tid": 2 * link + 1,
                "args": {"name": f"link {link + 1}->{link}"},
            }
        )
    for e in result.events:
        dur = (e.end - e.start) * time_scale
        base = {"ph": "X", "ts": e.start * time_scale, "dur": dur, "args": {"micro": e.micro, "stage": e.stage}}
        if e.kind in COMPUTE:
            out.append({**base, "name": f"{e.kind}{e.micro}", "cat": "compute", "pid": 0, "tid": e.stage})
        elif e.kind.startswith("RECV") and dur > 0:
            short = "rA" if e.kind == "RECV_ACT" else "rG"
            out.append({**base, "name": f"wait {short}{e.micro}", "cat": "wait", "pid": 0, "tid": e.stage})
        elif e.kind == "SEND_ACT":
            out.append({**base, "name": f"act {e.micro}", "cat": "comm", "pid": 1, "tid": 2 * e.stage})
        elif e.kind == "SEND_GRAD":
            out.append({**base, "name": f"grad {e.micro}", "cat": "comm", "pid": 1, "tid": 2 * (e.stage - 1) + 1})
    trace = {"traceEvents": out, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


# --------------------------------------------------------------------------- the policies side by side


@dataclass
class PolicyRun:
    """One policy replayed on given costs."""

    policy: str
    warmups: list[int]  # capped by the number of micro-batches
    result: SimResult
    eq12: float


def compare_policies(
    fwd: Sequence[float],
    bwd: Sequence[float],
    comm: Sequence[float],
    num_micro: int,
    *,
    epsilon: float = HARP_EPSILON,
    clamp: bool = False,
    policies: Sequence[str] = POLICIES,
) -> list[PolicyRun]:
    """Replay every policy (H-1F1B, 1F1B, Eager-1F1B) on the same stage and link times."""
    stage_times = [f + b for f, b in zip(fwd, bwd)]
    eq12 = eq12_time(stage_times, comm, num_micro)
    runs = []
    for p in policies:
        w = [min(n, num_micro) for n in policy_warmup(p, stage_times, comm, epsilon, clamp=clamp)]
        runs.append(PolicyRun(p, w, simulate(schedule(w, num_micro), fwd, bwd, comm), eq12))
    return runs


def policy_table(runs: Sequence[PolicyRun], title: str = "pipeline schedules") -> Table:
    """A rich table: warm-up counts, simulated step time, Eq. 12, peak activations and bubbles per policy."""
    table = Table(title=title)
    for col in ("schedule", "warm-up N_i", "step time", "vs Eq. 12", "peak in-flight", "max bubble"):
        table.add_column(col, justify="left" if col in ("schedule", "warm-up N_i", "peak in-flight") else "right")
    for r in runs:
        res = r.result
        table.add_row(
            r.policy,
            " ".join(map(str, r.warmups)),
            f"{res.step_time:.4g}",
            f"{res.step_time / r.eq12:.3f}×",
            " ".join(map(str, res.peak_inflight)),
            f"{max(res.bubble):.1%}",
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hapc.pipeline.simulate --fwd 1 1 1 --bwd 2 2 2 --comm 2.5 0 --micro 16 [--grid] [--trace T]``."""
    ap = argparse.ArgumentParser(prog="python -m hapc.pipeline.simulate", description=main.__doc__)
    ap.add_argument("--fwd", type=float, nargs="+", required=True, help="forward time per stage")
    ap.add_argument("--bwd", type=float, nargs="+", required=True, help="backward time per stage")
    ap.add_argument("--comm", type=float, nargs="*", default=[], help="one-way transfer time per link (S-1)")
    ap.add_argument("--micro", type=int, default=16, help="micro-batches per step")
    ap.add_argument("--epsilon", type=float, default=HARP_EPSILON, help="HARP Eq. 2's ε")
    ap.add_argument("--clamp", action="store_true", help="accept links slower than t_max (δ=3)")
    ap.add_argument("--grid", action="store_true", help="print each policy's step × stage grid")
    ap.add_argument("--trace", help="write the H-1F1B replay as a Chrome/Perfetto trace here")
    args = ap.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    try:
        runs = compare_policies(args.fwd, args.bwd, args.comm, args.micro, epsilon=args.epsilon, clamp=args.clamp)
    except ScheduleError as e:
        console.print(f"error: {e}", markup=False)
        return 2
    console.print(policy_table(runs))
    console.print(f"Eq. 12 predicts {runs[0].eq12:.4g}")
    if args.grid:
        for r in runs:
            console.print(f"\n{r.policy} (warm-up {r.warmups})\n{grid(schedule(r.warmups, args.micro))}", markup=False)
    if args.trace:
        chrome_trace(runs[0].result, args.trace)
        console.print(f"trace of {runs[0].policy} written to {args.trace}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
