"""The measuring half of ``benchmarks/fidelity.py``: variants, plans, and step timing interleaved
with profiling rounds (see that file's docstring for the method).

On a host shared with other work the speed a process gets changes from second to second, so a
cluster profiled once and steps measured a minute later see different machines. Here every rank
runs, in each round, the profiler's measurements (:mod:`hapc.profile`: GEMM flop/s, memory
bandwidth, per-operator overhead, every collective at several sizes -- by what it adds to a
program, and, for the ablation, alone after computation and after a barrier) and then a few passes over
the variants, one step of each per pass; the cluster is built from the medians over rounds, so
profile and steps sample the same load.

Isolation (:func:`priority`, :func:`pin`): the run's processes share a control group weighted 100x
the host's other processes, and each rank's computation has a core of its own where there are
enough. Tried and dropped: pinning every thread of a rank (gloo's threads then wait for the
computation's time slice: collectives 3-5x slower) and SCHED_FIFO ranks (on 3 ranks over 2 cores a
rank starved its peer and the host's other work: a run hung and was killed).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import hapc
from hapc import emulate
from hapc.cluster import Cluster
from hapc.profile import (
    MARGINAL_CALLS,
    MARGINAL_GAP,
    DeviceReport,
    build_cluster,
    device_memory,
    fit_alpha_beta,
    measure_collectives,
    measure_flops,
    measure_mem_bandwidth,
    measure_op_overhead,
    profile,
)
from hapc.testing import run_distributed

GAP = MARGINAL_GAP  # seconds of computation before each profiled collective, as in a program (hapc profile --marginal)
CALLS = MARGINAL_CALLS  # collectives per timed loop of the marginal measurement (hapc.profile.measure_collectives)
SLOW_LINK = {"bandwidth": "10 MB/s", "latency": "1 ms"}
QUICK_PROFILE = {"sizes": (2**10, 2**16, 2**20), "reps": 3, "gemm": 128, "window": 0.005}
#: CPU weight of the benchmark's processes against the host's other work (cgroup v1 ``cpu.shares``,
#: default 1024; v2 ``cpu.weight``, default 100): see :func:`priority`
PRIORITY = {"v1": ("cpu.shares", 100 * 1024), "v2": ("cpu.weight", 10_000)}
FULL_PROFILE = {"sizes": (2**8, 2**12, 2**16, 2**20, 2**22), "reps": 3, "gemm": 256, "window": 0.01}


@dataclass(frozen=True)
class Variant:
    """One measured point: a model ``family`` built with ``cfg``, on ``world`` ranks, under ``plan``."""

    family: str  # "gpt" | "bert" | "mlp"
    cfg: dict[str, Any] = field(hash=False)
    world: int = 2
    plan: str = "dp"  # "dp" | "tp" | "opt" | "slow"

    @property
    def name(self) -> str:
        c = self.cfg
        if self.family == "mlp":
            shape = f"w{'-'.join(map(str, c['widths']))} b{c['batch']}"
        else:
            shape = f"L{c['layers']} h{c['hidden']} s{c['seq']} b{c['batch']}"
        return f"{self.family} {shape} W{self.world} {self.plan}"


def build(family: str, cfg: dict[str, Any]) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model and example inputs of a variant (seeded: every rank builds the same weights)."""
    from hapc.models.layers import tokens

    torch.manual_seed(0)
    if family == "mlp":
        from hapc import models

        return models.mlp(batch=cfg["batch"], widths=tuple(cfg["widths"]))
    if family == "gpt":
        from hapc.models.gpt import GPT, GPTConfig

        model = GPT(
            GPTConfig(layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"], vocab=256, seq=cfg["seq"])
        )
    elif family == "bert":
        from hapc.models.bert import Bert, BertConfig

        model = Bert(
            BertConfig(layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"], vocab=256, seq=cfg["seq"])
        )
    else:
        raise ValueError(f"unknown model family {family!r} (gpt, bert or mlp)")
    shape = (cfg["batch"], cfg["seq"])
    return model, (tokens(shape, 256, None, 0), tokens(shape, 256, None, 7))


def variants(quick: bool) -> list[Variant]:
    """The measured grid: depth, width, sequence length, world size 2-3, DP and TP plans; plus a
    one-process control group (no communication: the computation terms alone)."""
    if quick:
        tiny = {"layers": 1, "hidden": 32, "heads": 4, "seq": 16, "batch": 4}
        mlp = {"widths": (64, 128), "batch": 32}
        return [Variant("mlp", mlp, 2, "dp"), Variant("mlp", mlp, 2, "tp"), Variant("gpt", tiny, 2, "dp")] + [
            Variant("gpt", tiny, 2, "tp")
        ]
    g = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 8}
    b = {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "batch": 8}
    m = {"widths": (256, 512, 512), "batch": 64}
    out = [Variant("gpt", g, 2, p) for p in ("dp", "tp", "opt", "slow")]
    out += [Variant("gpt", {**g, "layers": 4}, 2, p) for p in ("dp", "tp")]
    out += [Variant("gpt", {**g, "hidden": 128}, 2, p) for p in ("dp", "tp")]
    out += [Variant("gpt", {**g, "seq": 64}, 2, p) for p in ("dp", "slow")]
    out += [Variant("gpt", {**g, "batch": 16}, 2, "dp")]
    out += [Variant("gpt", {**g, "hidden": 96, "heads": 6}, 3, p) for p in ("dp", "tp")]
    out += [Variant("bert", b, 2, p) for p in ("dp", "tp", "opt")]
    out += [Variant("bert", {**b, "layers": 3, "hidden": 96, "heads": 6}, 3, p) for p in ("dp", "tp")]
    out += [Variant("mlp", m, 2, p) for p in ("dp", "tp", "opt")]
    out += [Variant("mlp", {"widths": (1024, 1024), "batch": 32}, 2, p) for p in ("dp", "tp")]
    out += [Variant("mlp", {"widths": (384, 768, 768), "batch": 96}, 3, p) for p in ("dp", "tp")]
    control = [g, {**g, "layers": 4}, {**g, "hidden": 128}, {**g, "seq": 64}]
    out += [Variant("gpt", {**c, "batch": 4}, 1, "opt") for c in control]
    out += [Variant("bert", {**b, "batch": 4}, 1, "opt"), Variant("mlp", {**m, "batch": 32}, 1, "opt")]
    return out


# -- isolation from the shared host: a CPU-weighted control group, one core per rank -------------
def _cgroup_of_self(kind: str) -> str:
    """This process's control group (relative path) in the cpu hierarchy."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (kind == "v1" and "cpu" in controllers.split(",")) or (kind == "v2" and controllers == ""):
                return path
    return "/"


@contextlib.contextmanager
def priority() -> Iterator[str | None]:
    """Run this process, and the rank processes it forks meanwhile, in a control group of its own whose
    CPU weight is 100x the default, so the host's other work (other sessions' tests and benchmarks,
    each weighted 1x) takes the cores only when these processes leave them idle. The step times and
    the profile are then those of the machine the cost model describes, not of a fraction of it that
    changes from second to second. Yields a description of what was done, or None where the cgroup
    cpu controller is not writable (then nothing changes and the result says so)."""
    kind = emulate.how()
    if kind is None:
        yield None
        return
    root = {"v1": emulate._V1, "v2": emulate._V2}[kind]
    knob, weight = PRIORITY[kind]
    home = os.path.join(root, _cgroup_of_self(kind).lstrip("/"))
    path = os.path.join(root, f"hapc-fidelity-{os.getpid()}")
    try:
        if kind == "v2":
            with open(os.path.join(root, "cgroup.subtree_control")) as f:
                if "cpu" not in f.read().split():
                    emulate._write(os.path.join(root, "cgroup.subtree_control"), "+cpu")
        os.makedirs(path, exist_ok=True)
        emulate._write(os.path.join(path, knob), str(weight))
        emulate._write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    except OSError as e:  # a controller that cannot be written after all: measure unweighted, and say so
        with contextlib.suppress(OSError):
            os.rmdir(path)
        yield f"none (cgroup {kind} not writable: {e})"
        return
    try:
        times = weight // (1024 if kind == "v1" else 100)
        yield f"cgroup {kind} {knob} = {weight} ({times}x the host's other processes)"
    finally:
        emulate._write(os.path.join(home, "cgroup.procs"), str(os.getpid()))
        with contextlib.suppress(OSError):  # a rank still exiting: the kernel frees the empty group later
            os.rmdir(path)


def pin(rank: int, world: int) -> int | None:
    """Pin the calling thread -- the rank's computation -- to a core of its own when the host has a
    core per rank, so ranks never queue for one core while another idles; returns the core, or None
    (more ranks than cores: the scheduler places them, and they share the cores).

    Only this thread: gloo's threads (those of every process group created so far) stay free to run
    on any core. Pinned with the computation, a collective waits for the scheduler to switch threads
    on that core: measured here, a 1 KB all-reduce or reduce-scatter took 1.5-3 ms instead of 0.6 ms.
    Call it after creating the process groups (``hapc.compile`` creates one per module on gloo): a
    thread started later inherits the pin."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return None
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]


# -- the cluster the plans are made for: `hapc profile`, once, before measuring -------------------
def _profile_job(rank: int, world: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    pin(rank, world)
    return profile(**kwargs)[0].to_dict()


def initial_profile(world: int, quick: bool) -> Cluster:
    kwargs = {**(QUICK_PROFILE if quick else FULL_PROFILE), "gap": GAP, "marginal": True, "calls": CALLS, "half": ()}
    kwargs["name"] = f"local-gloo-{world}"
    if not quick:
        kwargs["reps"] = 15
    return Cluster.from_dict(run_distributed(_profile_job, world, kwargs, timeout=600)[0])


def slow_link(cluster: Cluster) -> Cluster:
    """The same devices on a slow link (no fitted collectives): hapc then prefers sharding weights."""
    d = cluster.to_dict()
    d.pop("collectives", None)
    d["links"] = {"intra_host": SLOW_LINK, "inter_host": SLOW_LINK}
    d["name"] = f"{cluster.name}-slow-link"
    return Cluster.from_dict(d)


def make_plan(v: Variant, cluster: Cluster) -> tuple[Any, Cluster]:
    """The variant's plan and the cluster it is made (and compiled) for."""
    model, inputs = build(v.family, v.cfg)
    baseline = {"dp": "dp-ev", "tp": "tp"}.get(v.plan)
    target = slow_link(cluster) if v.plan == "slow" else cluster
    return hapc.synthesize(model, target, inputs, baseline=baseline), target


# -- measuring: profiling rounds interleaved with blocks of steps ---------------------------------
def _profile_round(device: torch.device, opts: dict[str, Any]) -> dict[str, Any]:
    timing = {"reps": 3, "window": opts["window"], "synced": True}
    out: dict[str, Any] = {
        "flops": measure_flops(device, n=opts["gemm"], **timing),
        "mem_bandwidth": measure_mem_bandwidth(device, **timing),
        "op_overhead": measure_op_overhead(device, **timing),
    }
    for key, gap, marginal in (("marginal", GAP, True), (f"gap {GAP:g}", GAP, False), ("gap 0", 0.0, False)):
        coll = measure_collectives(device, opts["sizes"], opts["reps"], gap, marginal=marginal, calls=CALLS)
        out[key] = {p: points for p, (_, _, points) in coll.items()}
    return out


def _measure_job(rank: int, world: int, jobs: list, steps: int, warmup: int, block: int, opts: dict) -> dict:
    """Time every ``(variant, plan, cluster)`` of ``jobs`` on this process group, in rounds: one
    profiling round, then ``block`` passes over the variants, one step of each per pass, until
    every variant has ``steps`` (single steps interleaved: a change of the host's load between
    passes hits every variant alike)."""
    device = torch.device("cpu")
    runs = []
    for v, plan, cluster in jobs:
        model, inputs = build(v.family, v.cfg)
        module = hapc.compile(model, cluster, inputs, plan=plan)
        opt = torch.optim.SGD(module.parameters(), lr=1e-3)

        def step(module=module, opt=opt, inputs=inputs) -> None:
            opt.zero_grad(set_to_none=True)
            module(*inputs).backward()
            opt.step()

        for _ in range(warmup):
            step()
        runs.append(step)
    core = pin(rank, world)  # after the compiles: their process groups' threads stay unpinned
    times: list[list[float]] = [[] for _ in runs]
    rounds = []
    while len(times[0]) < steps:
        rounds.append(_profile_round(device, opts))
        for _ in range(min(block, steps - len(times[0]))):
            for step, out in zip(runs, times):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                out.append(time.perf_counter() - t0)
    return {
        "times": times,
        "rounds": rounds,
        "host": socket.gethostname(),
        "core": -1 if core is None else core,
    }


def concurrent_clusters(results: list[dict], world: int, name: str) -> dict[str, Cluster]:
    """The cluster from the profiling rounds (medians over rounds; each collective timed by what it
    adds to bursts of ``GAP`` of computation, :func:`hapc.profile.measure_collectives` with
    ``marginal=True``), and the same with its collectives timed alone right after ``GAP`` of
    computation (the method before), or after a barrier."""
    reports = []
    for res in results:
        med = {k: statistics.median(r[k] for r in res["rounds"]) for k in ("flops", "mem_bandwidth", "op_overhead")}
        memory = device_memory(torch.device("cpu"), world)
        reports.append(DeviceReport(res["host"], "cpu", med["flops"], med["mem_bandwidth"], memory, med["op_overhead"]))
    out = {}
    for key, label in (
        ("marginal", "concurrent"),
        (f"gap {GAP:g}", "concurrent, collectives timed alone after computation"),
        ("gap 0", "concurrent, collectives after a barrier"),
    ):
        collectives = {}
        for prim, points in results[0]["rounds"][0][key].items():  # every rank holds the max over ranks
            xs = [x for x, _ in points]
            ts = [statistics.median(r[key][prim][i][1] for r in results[0]["rounds"]) for i in range(len(xs))]
            collectives[prim] = (*fit_alpha_beta(xs, ts, relative=True), list(zip(xs, ts)))
        out[label] = build_cluster(reports, collectives, name)
    return out


def measure(jobs: list, world: int, steps: int, warmup: int, quick: bool) -> tuple[list[dict], dict[str, Cluster]]:
    """Median step time (the slowest rank's) and spread (IQR / median) of each job, and the
    clusters profiled in the same rounds."""
    block = 1 if quick else 3
    opts = QUICK_PROFILE if quick else FULL_PROFILE
    res = run_distributed(_measure_job, world, jobs, steps, warmup, block, opts, timeout=1800)
    out = []
    for k in range(len(jobs)):
        per_step = sorted(max(ts) for ts in zip(*(r["times"][k] for r in res)))  # the slowest rank ends a step
        med = statistics.median(per_step)
        q1, q3 = (per_step[round(q * (len(per_step) - 1))] for q in (0.25, 0.75))
        out.append({"measured_s": med, "spread": (q3 - q1) / med if med > 0 else 0.0})
    return out, concurrent_clusters(res, world, f"local-gloo-{world}")
