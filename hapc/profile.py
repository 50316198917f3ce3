"""Measure the live cluster and write a cluster file (``hapc profile``; HAP §6 "profiling").

Run under ``torchrun`` (one process per device), or with ``--local N`` for N local gloo
processes. Every rank measures

* its sustained matrix-multiply rate (``flops``: ``2 n^3 / t`` of an ``n x n`` GEMM, median of
  several runs, in the dtype asked for),
* its memory bandwidth (``2 * bytes / t`` of a large copy) and memory capacity,

and together they time every collective primitive at several message sizes and fit
``t = alpha + beta * x`` by least squares, with ``x`` in the cost model's convention
(:mod:`hapc.theory.cost`): the per-rank shard for all-gather and reduce-scatter, the message for
broadcast and reduce, the whole tensor for all-reduce, each rank's send buffer for all-to-all.

Ranks are grouped into device groups by runs of consecutive ranks on the same kind of device
(so rank order matches the cluster's device order, as plans require); a group's flops is the
slowest member's (a synchronous program waits for it). Rank 0 writes the TOML; every rank
returns the :class:`Cluster`. Only tensors travel between ranks (no pickled objects).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .cluster import PRIMITIVES, Cluster
from .errors import HapcError

DEFAULT_SIZES = (2**10, 2**14, 2**17, 2**20, 2**22)  # bytes
NAME_BYTES = 64


@dataclass
class DeviceReport:
    """One rank's measurements."""

    host: str
    kind: str
    flops: float
    mem_bandwidth: float
    memory: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, reps: int, barrier: bool = False) -> float:
    times = []
    fn()  # warm-up
    for _ in range(reps):
        if barrier:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, reps: int = 5) -> float:
    """Sustained flop/s of an ``n x n @ n x n`` matrix multiply."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_time(lambda: a @ b, device, reps)


def measure_mem_bandwidth(device: torch.device, nbytes: int = 2**26, reps: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), device, reps)


def device_memory(device: torch.device, world_on_host: int) -> float:
    """Capacity of this device (a CPU process gets its share of the host's RAM)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / max(world_on_host, 1)


def device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return "cpu"


def _primitive(name: str, x_bytes: int, world: int, device: torch.device) -> Callable[[], Any]:
    """A closure running one call of ``name`` with ``x_bytes`` in the cost model's convention."""
    n = max(1, x_bytes // 4)
    if name == "all_gather":
        src = torch.ones(n, device=device)
        out = [torch.empty_like(src) for _ in range(world)]
        return lambda: dist.all_gather(out, src)
    if name == "reduce_scatter":
        ins = [torch.ones(n, device=device) for _ in range(world)]
        out = torch.empty(n, device=device)
        return lambda: dist.reduce_scatter(out, ins)
    if name == "all_reduce":
        buf = torch.ones(n, device=device)
        return lambda: dist.all_reduce(buf)
    if name == "broadcast":
        buf = torch.ones(n, device=device)
        return lambda: dist.broadcast(buf, src=0)
    if name == "reduce":
        buf = torch.ones(n, device=device)
        return lambda: dist.reduce(buf, dst=0)
    if name == "all_to_all":
        per = max(1, n // world)
        src = torch.ones(per * world, device=device)
        out = torch.empty_like(src)
        return lambda: dist.all_to_all_single(out, src)
    raise HapcError(f"unknown primitive {name!r}")


def fit_alpha_beta(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * x`` with both coefficients kept non-negative."""
    x = np.asarray(xs, dtype=float)
    t = np.asarray(ts, dtype=float)
    a = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, t, rcond=None)
    if beta < 0:  # flat timings: all latency
        return float(max(t.mean(), 0.0)), 0.0
    if alpha < 0:  # a line through the origin
        return 0.0, float(max((x @ t) / (x @ x), 0.0))
    return float(alpha), float(beta)


def measure_collectives(
    device: torch.device, sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 5
) -> dict[str, tuple[float, float, list[tuple[int, float]]]]:
    """Per primitive: ``(alpha, beta, [(x_bytes, seconds), ...])``. Every rank must call."""
    world = dist.get_world_size()
    out = {}
    for name in PRIMITIVES:
        points = []
        for x in sizes:
            t = _median_time(_primitive(name, x, world, device), device, reps, barrier=True)
            t_max = torch.tensor([t], dtype=torch.float64, device=device)
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # the slowest rank decides
            points.append((int(x), float(t_max.item())))
        alpha, beta = fit_alpha_beta([p[0] for p in points], [p[1] for p in points])
        out[name] = (alpha, beta, points)
    return out


def _encode(text: str, device: torch.device) -> torch.Tensor:
    data = text.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> str:
    return t.cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def gather_reports(mine: DeviceReport, device: torch.device) -> list[DeviceReport]:
    """Every rank's report, in rank order, on every rank (tensors only)."""
    world = dist.get_world_size()
    names = torch.stack([_encode(mine.host, device), _encode(mine.kind, device)])
    nums = torch.tensor([mine.flops, mine.mem_bandwidth, mine.memory], dtype=torch.float64, device=device)
    all_names = [torch.empty_like(names) for _ in range(world)]
    all_nums = [torch.empty_like(nums) for _ in range(world)]
    dist.all_gather(all_names, names)
    dist.all_gather(all_nums, nums)
    return [
        DeviceReport(_decode(n[0]), _decode(n[1]), *(float(v) for v in x.tolist())) for n, x in zip(all_names, all_nums)
    ]


def build_cluster(
    reports: Sequence[DeviceReport], collectives: dict[str, tuple[float, float, Any]], name: str = "profiled"
) -> Cluster:
    """A cluster from measurements: groups are runs of consecutive ranks of one device kind."""
    runs: list[list[DeviceReport]] = []
    for r in reports:
        if runs and runs[-1][0].kind == r.kind:
            runs[-1].append(r)
        else:
            runs.append([r])
    groups, seen = [], {}
    for run in runs:
        seen[run[0].kind] = seen.get(run[0].kind, 0) + 1
        gname = run[0].kind if seen[run[0].kind] == 1 else f"{run[0].kind}-{seen[run[0].kind]}"
        per_host: dict[str, int] = {}
        for r in run:
            per_host[r.host] = per_host.get(r.host, 0) + 1
        groups.append(
            {
                "name": gname,
                "devices": len(run),
                "devices_per_host": max(per_host.values()),
                "flops": min(r.flops for r in run),
                "memory": min(r.memory for r in run),
                "mem_bandwidth": min(r.mem_bandwidth for r in run),
            }
        )
    one_host = len({r.host for r in reports}) == 1
    alpha, beta = collectives.get("broadcast", (0.0, 0.0, None))[:2]
    link = {"bandwidth": 1.0 / beta if beta > 0 else 1e12, "latency": alpha}
    data = {
        "name": name,
        "group": groups,
        "links": {"intra_host": link, "inter_host": link} if one_host else {"inter_host": link},
        "collectives": {p: {"alpha": a, "beta": b} for p, (a, b, _) in collectives.items()},
        "notes": "measured by hapc profile",
    }
    return Cluster.from_dict(data)


def profile(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    reps: int = 5,
    gemm: int = 1024,
    dtype: torch.dtype = torch.float32,
    name: str = "profiled",
    out: str | None = None,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure this rank's device and the collectives of the default group (all ranks call).

    Returns the cluster and the raw measurements; rank 0 writes ``out`` when given."""
    if not dist.is_initialized():
        raise HapcError("hapc profile runs under torchrun (or pass --local N to start N local processes)")
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    mine = DeviceReport(
        host=socket.gethostname(),
        kind=device_kind(device),
        flops=measure_flops(device, dtype, gemm, reps),
        mem_bandwidth=measure_mem_bandwidth(device, reps=reps),
        memory=device_memory(device, world_on_host),
    )
    reports = gather_reports(mine, device)
    collectives = measure_collectives(device, sizes, reps)
    cluster = build_cluster(reports, collectives, name)
    if out is not None and dist.get_rank() == 0:
        with open(out, "w") as f:
            f.write(cluster.to_toml())
    raw = {
        "devices": [r.__dict__ for r in reports],
        "collectives": {p: {"alpha": a, "beta": b, "points": pts} for p, (a, b, pts) in collectives.items()},
    }
    return cluster, raw
