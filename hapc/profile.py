"""Measure the live cluster and write a cluster file (``hapc profile``; HAP §6 "profiling").

Run under ``torchrun`` (one process per device), or with ``--local N`` for N local gloo
processes. Every rank measures

* its sustained matrix-multiply rate (``flops``: ``2 n^3 / t`` of an ``n x n`` GEMM, in the
  dtype asked for), and the same GEMM in bfloat16 and float16 (``flops_bf16`` / ``flops_fp16``:
  what a plan with ``precision="bf16"`` / ``"fp16"`` prices, since autocast runs its matrix
  multiplies in that dtype; a dtype the device cannot multiply in is left out of the file),
* its memory bandwidth (``2 * bytes / t`` of a large copy) and memory capacity,
* its per-operator overhead (``op_overhead``): the framework's fixed work per operator launch
  (Python, dispatch, autograd bookkeeping), from the forward + backward time of a chain of ``k``
  tiny operators in a transformer layer's mix (linear, gelu, add, layer norm), ``t / 2k`` (one
  forward and one backward launch each).
  The cost model charges it per computing triple and direction; it dominates small models on CPUs.

and together they time every collective primitive at several message sizes and fit
``t = alpha + beta * x`` by least squares, with ``x`` in the cost model's convention
(:mod:`hapc.theory.cost`): the per-rank shard for all-gather and reduce-scatter, the message for
broadcast and reduce, the whole tensor for all-reduce, each rank's send buffer for all-to-all.
The fit minimises *relative* residuals ``sum ((alpha + beta x_i - t_i) / t_i)^2``, so the small
messages (where alpha dominates, and where most of a small model's collectives fall) are fitted
as well as the large ones. By default each timed collective follows a barrier (the collective
alone); ``gap > 0`` times it after ``gap`` seconds of computation on every rank instead, as it
runs inside a program -- on a host whose cores are shared, a rank then also waits for its peers
to be scheduled, which the barrier hides (``benchmarks/fidelity.py`` measures the difference).
``marginal=True`` (with ``gap > 0``) measures what a collective *adds to a program*: the runtime's
own implementation of the primitive (:mod:`hapc.collectives.ops`: padding, packing, the flat
gloo/NCCL call) called ``k`` times between bursts of ``gap`` seconds of computation, minus the
same bursts alone, per call::

    t(x) = ( T[k x (burst + collective(x))] - T[k x burst] ) / k

so it also holds what the call costs the computation around it (waking the communication
threads, which share the cores with the computation on a CPU host, and the slower compute right
after), which timing the call alone misses: on this project's 2-core host a small all-reduce adds
about 0.8 ms to a program, where the call alone takes 0.3-0.4 ms. The fit is the same.

Device numbers are medians of loops lasting ``window`` seconds that every rank runs at once
between two barriers: ranks sharing a host's cores (``--local N`` on a CPU) are thus measured at
the speed a synchronous program gets from them, waiting for the slowest included.

Ranks are grouped into device groups by runs of consecutive ranks on the same kind of device
(so rank order matches the cluster's device order, as plans require); a group's flops is the
slowest member's (a synchronous program waits for it). Rank 0 writes the TOML; every rank
returns the :class:`Cluster`. Only tensors travel between ranks (no pickled objects).
"""

from __future__ import annotations

import math
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
import torch.nn.functional as F

from .cluster import PRIMITIVES, Cluster
from .errors import HapcError

#: message sizes (bytes) every collective is timed at: up to past the cost model's 25 MB gradient
#: bucket (:meth:`hapc.synth.cost.CostModel.grad_time` prices the bucketed gradient all-reduce of
#: every replicated parameter with the all-reduce's beta), so the fitted line covers the sizes it
#: prices. Fitted on 1 KiB-4 MiB alone, beta rests on the 4 MiB point beside latency-dominated
#: small ones: on emulated [1.0, 0.5] ranks (gloo, loopback) the fit gave 0.4-0.9 ns/B where an
#: 8-16 MiB all-reduce takes 1.5 ns/B (2.1 at 32 MiB), and an 8.4 MB gradient all-reduce was
#: charged 4.3 ms against 12-16 ms measured; the points to 32 MiB fit 1.2-1.3 ns/B.
DEFAULT_SIZES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24, 2**25)
NAME_BYTES = 64


@dataclass
class DeviceReport:
    """One rank's measurements."""

    host: str
    kind: str
    flops: float
    mem_bandwidth: float
    memory: float
    op_overhead: float = 0.0
    flops_bf16: float = 0.0  # 0: not measured, or the device cannot multiply in bfloat16
    flops_fp16: float = 0.0


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


def _loop_time(fn: Callable[[], Any], device: torch.device, reps: int, window: float, synced: bool) -> float:
    """Seconds per call of ``fn``: the median over ``reps`` of a loop of calls lasting ``window``.

    ``synced``: every rank runs the same number of calls between two barriers, so the time
    includes waiting for the slowest rank -- what a synchronous program sees when its ranks
    share a host's cores (one rank's compute then runs while another waits in a collective)."""
    fn()  # warm-up
    n = max(1, math.ceil(window / max(_median_time(fn, device, 3), 1e-9))) if window > 0 else 1
    if synced:
        count = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n = int(count.item())
    times = []
    for _ in range(reps):
        if synced:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        _sync(device)
        if synced:
            dist.barrier()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def measure_flops(
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    reps: int = 5,
    *,
    window: float = 0.0,
    synced: bool = False,
) -> float:
    """Sustained flop/s of an ``n x n @ n x n`` matrix multiply (``window``/``synced``: see
    :func:`_loop_time`; the default times single calls)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _loop_time(lambda: a @ b, device, reps, window, synced)


def measure_half_flops(device: torch.device, precision: str, n: int = 1024, **timing: Any) -> float:
    """:func:`measure_flops` in the half dtype of ``precision`` (``"bf16"`` / ``"fp16"``); 0.0 where
    the device has no matrix multiply in it (the cluster file then leaves the rate out, and a plan
    asking for that precision is refused naming the key)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    try:
        # a device may emulate the dtype hundreds of times slower (float16 on most CPUs): a probe
        # GEMM first, and the timed one shrunk so that one multiply takes about 0.1 s at most
        m = min(n, 256)
        a = torch.randn(m, m, device=device, dtype=dtype)
        a @ a  # the first call also initialises the kernels
        _sync(device)
        t0 = time.perf_counter()
        a @ a
        _sync(device)
        probe = max(time.perf_counter() - t0, 1e-9)
        if probe * (n / m) ** 3 > 0.1:
            n = max(m // 2, int(m * (0.1 / probe) ** (1 / 3)))
        return measure_flops(device, dtype, n, **timing)
    except (RuntimeError, NotImplementedError):  # e.g. "addmm_impl_cpu_" not implemented for 'Half'
        return 0.0


def measure_mem_bandwidth(
    device: torch.device, nbytes: int = 2**26, reps: int = 5, *, window: float = 0.0, synced: bool = False
) -> float:
    """Bytes/s of a large device-to-device copy (read + write).

    64 MiB on a CPU too, though a CPU rank's operators work on tensors of a few MiB that its caches
    hold: a 4 MiB copy, tried on ranks emulated at [1.0, 0.5] of a core, gave a steadier slow/fast
    ratio (0.46-0.50 in every run, against 0.31-0.59 at 64 MiB, timed alone or both ranks at once
    alike) but 3-4x the bandwidth, and ``benchmarks/fidelity.py`` fell from r 0.985, tau 0.869 to
    r 0.941, tau 0.772 in the same session: the cost model's ``bytes / mem_bandwidth`` prices real
    memory-bound operators (gelu + add + layer norm, forward + backward in its byte count: 6-19
    GB/s at 0.25-4 MiB on the full-speed rank) near the DRAM copy's rate, not the cache's."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _loop_time(lambda: dst.copy_(src), device, reps, window, synced)


def measure_op_overhead(
    device: torch.device, ops: int = 64, reps: int = 7, *, window: float = 0.0, synced: bool = False
) -> float:
    """Seconds per operator launch: forward + backward of ``ops`` chained tiny operators, in a
    transformer layer's mix (linear, gelu, residual add, layer norm on a ``2 x 8`` tensor, with
    parameter gradients), over ``2 ops`` (one forward and one backward launch each)."""
    x = torch.ones(2, 8, device=device, requires_grad=True)
    w = torch.full((8, 8), 0.1, device=device, requires_grad=True)
    b = torch.zeros(8, device=device, requires_grad=True)
    gamma = torch.ones(8, device=device, requires_grad=True)
    beta = torch.zeros(8, device=device, requires_grad=True)
    layers = max(1, ops // 4)

    def step() -> None:
        y = x
        for _ in range(layers):
            y = F.layer_norm(y + F.gelu(F.linear(y, w, b)), (8,), gamma, beta)
        y.sum().backward()

    return _loop_time(step, device, reps, window, synced) / (2 * 4 * layers)


def device_memory(device: torch.device, world_on_host: int) -> float:
    """Capacity of this device (a CPU process gets its share of the host's RAM)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / max(world_on_host, 1)


def device_kind(device: torch.device) -> str:
    """The device's kind (ranks of one kind form a device group); a rank throttled by
    :mod:`hapc.emulate` is its own kind, ``cpu-at-50%``, labelled as emulated in the cluster file."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    speed = os.environ.get("HAPC_EMULATED_SPEED")
    return f"cpu-at-{float(speed):.0%}" if speed is not None else "cpu"


# torch 2.13 names them *_single; older releases *_into_tensor / *_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _primitive(name: str, x_bytes: int, world: int, device: torch.device) -> Callable[[], Any]:
    """A closure running one call of ``name`` with ``x_bytes`` in the cost model's convention."""
    n = max(1, x_bytes // 4)
    # the flat-tensor forms hapc's runtime calls (hapc.collectives.ops), not the list forms
    if name == "all_gather":
        src = torch.ones(n, device=device)
        out = torch.empty(n * world, device=device)
        return lambda: _ALL_GATHER(out, src)
    if name == "reduce_scatter":
        src = torch.ones(n * world, device=device)
        out = torch.empty(n, device=device)
        return lambda: _REDUCE_SCATTER(out, src)
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


#: ``hapc profile --marginal`` (and the benchmarks that profile so): seconds of computation between
#: timed collectives, and collectives per timed loop (:func:`measure_collectives`)
MARGINAL_GAP = 5e-4
MARGINAL_CALLS = 4


def _runtime_call(name: str, x_bytes: int, world: int, device: torch.device) -> Callable[[], Any]:
    """A closure running the runtime's own implementation of ``name`` (:mod:`hapc.collectives.ops`,
    padded variants, as a program calls them) on ``x_bytes`` in the cost model's convention; the
    grouped variants' broadcast and reduce are plain ``torch.distributed`` calls there too."""
    from .collectives import ops

    n = max(1, x_bytes // 4)
    if name == "all_gather":
        shard = torch.ones(n, device=device)
        return lambda: ops.gather_impl(shard, 0, [n] * world, None, "padded")
    if name == "reduce_scatter":
        full = torch.ones(n * world, device=device)
        return lambda: ops.scatter_impl(full, 0, [n] * world, None, "padded")
    if name == "all_reduce":
        buf = torch.ones(n, device=device)
        return lambda: ops.reduce_impl(buf, None)
    if name == "all_to_all":
        per = max(1, n // world)
        send = torch.ones(1, per * world, device=device)  # one row, split by columns: each rank's send buffer
        return lambda: ops.a2a_impl(send, 0, 1, [1] * world, [per] * world, None)
    return _primitive(name, x_bytes, world, device)


def _marginal_time(fn: Callable[[], Any], burst: Callable[[], Any], device: torch.device, reps: int, k: int) -> float:
    """Seconds a call of ``fn`` adds to a loop of computation bursts: the median over ``reps`` of
    ``k x (burst + fn)`` minus the median of ``k x burst``, over ``k`` (see the module docstring).
    Floored at one microsecond (two noisy medians can differ the wrong way for the smallest calls)."""
    fn()
    burst()
    dist.barrier()
    timed: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for with_call, out in ((True, timed[0]), (False, timed[1])):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(k):
                burst()
                if with_call:
                    fn()
            _sync(device)
            out.append(time.perf_counter() - t0)
    return max((statistics.median(timed[0]) - statistics.median(timed[1])) / k, 1e-6)


def fit_alpha_beta(xs: Sequence[float], ts: Sequence[float], relative: bool = False) -> tuple[float, float]:
    """Least-squares ``t = alpha + beta * x`` with both coefficients kept non-negative.

    ``relative``: weight each point by ``1 / t`` (minimise relative residuals)."""
    x = np.asarray(xs, dtype=float)
    t = np.asarray(ts, dtype=float)
    w = 1.0 / np.maximum(t, 1e-12) if relative else np.ones_like(t)
    a = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if beta < 0:  # flat timings: all latency
        return float(max((w @ t) / w.sum(), 0.0)), 0.0
    if alpha < 0:  # a line through the origin
        xw, tw = x * w, t * w
        return 0.0, float(max((xw @ tw) / (xw @ xw), 0.0))
    return float(alpha), float(beta)


def _burst(device: torch.device, seconds: float, alike: bool = True) -> Callable[[], Any]:
    """A closure computing for about ``seconds`` (small GEMMs), as a program does between collectives.

    ``alike``: every rank runs the same number of GEMMs (the slowest rank's count); else each rank
    its own count, so that every rank computes for ``seconds`` -- as the ranks of a plan balanced
    for their speeds do between collectives."""
    if seconds <= 0:
        return lambda: None
    a = torch.randn(64, 64, device=device)
    once = _median_time(lambda: a @ a, device, 5)
    count = torch.tensor([max(1, round(seconds / max(once, 1e-9)))], dtype=torch.int64, device=device)
    if alike:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank computes alike
    n = int(count.item())

    def burst() -> None:
        for _ in range(n):
            a @ a

    return burst


def measure_collectives(
    device: torch.device,
    sizes: Sequence[int] = DEFAULT_SIZES,
    reps: int = 5,
    gap: float = 0.0,
    *,
    marginal: bool = False,
    calls: int = 8,
) -> dict[str, tuple[float, float, list[tuple[int, float]]]]:
    """Per primitive: ``(alpha, beta, [(x_bytes, seconds), ...])``. Every rank must call.

    ``gap = 0``: every timed call follows a barrier (the collective alone). ``gap > 0``: every
    timed call follows about ``gap`` seconds of computation on each rank instead, as in a
    program, so its time includes what a rank waits for its peers to be scheduled and reach the
    call (on a host whose cores are shared, much more than the collective alone).
    ``marginal`` (needs ``gap > 0``): the time the runtime's implementation adds to ``calls``
    bursts of ``gap`` seconds of computation on every rank (each rank's own, so ranks of different
    speeds compute alike long, as under a balanced plan), per call (:func:`_marginal_time`, the
    module docstring)."""
    if marginal and gap <= 0:
        raise HapcError("measure_collectives: marginal=True times calls between bursts of computation; give gap > 0")
    world = dist.get_world_size()
    burst = _burst(device, gap, alike=not marginal)
    out = {}
    for name in PRIMITIVES:
        points = []
        for x in sizes:
            fn = (_runtime_call if marginal else _primitive)(name, x, world, device)
            if marginal:
                t = _marginal_time(fn, burst, device, reps, calls)
            elif gap > 0:
                times = []
                fn()
                dist.barrier()
                for _ in range(reps):
                    burst()
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                t = statistics.median(times)
            else:
                t = _median_time(fn, device, reps, barrier=True)
            t_max = torch.tensor([t], dtype=torch.float64, device=device)
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)  # the slowest rank decides
            points.append((int(x), float(t_max.item())))
        alpha, beta = fit_alpha_beta([p[0] for p in points], [p[1] for p in points], relative=True)
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
    nums = torch.tensor(
        [mine.flops, mine.mem_bandwidth, mine.memory, mine.op_overhead, mine.flops_bf16, mine.flops_fp16],
        dtype=torch.float64,
        device=device,
    )
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
        if any(r.op_overhead for r in run):
            groups[-1]["op_overhead"] = max(r.op_overhead for r in run)
        for key in ("flops_bf16", "flops_fp16"):  # only where every member multiplies in that dtype
            if all(getattr(r, key) > 0 for r in run):
                groups[-1][key] = min(getattr(r, key) for r in run)
    one_host = len({r.host for r in reports}) == 1
    alpha, beta = collectives.get("broadcast", (0.0, 0.0, None))[:2]
    link = {"bandwidth": 1.0 / max(beta, 1e-12), "latency": alpha}  # flat timings: 1 TB/s, not infinite
    data = {
        "name": name,
        "group": groups,
        "links": {"intra_host": link, "inter_host": link} if one_host else {"inter_host": link},
        "collectives": {p: {"alpha": a, "beta": b} for p, (a, b, _) in collectives.items()},
        "notes": "measured by hapc profile"
        + ("; device speeds emulated on one host (hapc.emulate)" if any("-at-" in r.kind for r in reports) else ""),
    }
    return Cluster.from_dict(data)


def _check_half(half: Sequence[str]) -> list[str]:
    bad = [p for p in half if p not in ("bf16", "fp16")]
    if bad:
        raise HapcError(f"half precisions to measure are 'bf16' and 'fp16', got {bad[0]!r}")
    return list(dict.fromkeys(half))


def profile(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    reps: int = 5,
    gemm: int = 1024,
    window: float = 0.02,
    gap: float = 0.0,
    marginal: bool = False,
    calls: int = 8,
    dtype: torch.dtype = torch.float32,
    half: Sequence[str] = ("bf16", "fp16"),
    name: str = "profiled",
    out: str | None = None,
) -> tuple[Cluster, dict[str, Any]]:
    """Measure this rank's device and the collectives of the default group (all ranks call).

    ``window``: seconds each timed loop of device measurements lasts (longer: steadier numbers).
    ``gap``: seconds of computation before each timed collective instead of a barrier (see
    :func:`measure_collectives`); ``marginal``: time what each collective adds to a program
    instead (needs ``gap > 0``; ``calls`` per timed loop; :func:`measure_collectives`).
    ``half``: the precisions whose GEMM rate is measured too (``flops_bf16`` / ``flops_fp16`` in
    the file; ``()``: none).

    Returns the cluster and the raw measurements; rank 0 writes ``out`` when given."""
    if not dist.is_initialized():
        raise HapcError("hapc profile runs under torchrun (or pass --local N to start N local processes)")
    half = _check_half(half)
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    # every rank measures at once, in loops between barriers (see _loop_time), so ranks sharing
    # a host's cores are measured at the speed a synchronous program gets from them
    timing = {"reps": reps, "window": window, "synced": True}
    if os.environ.get("HAPC_EMULATED_SPEED") is not None and len(os.sched_getaffinity(0)) == 1:
        # a rank of hapc.emulate on a core of its own: nothing shared to wait for, and a loop spanning
        # many scheduler slices so that the rival's share (or the quota's), not the phase, sets the rate
        timing = {"reps": reps, "window": max(window, 0.2), "synced": False}
    mine = DeviceReport(
        host=socket.gethostname(),
        kind=device_kind(device),
        flops=measure_flops(device, dtype, gemm, **timing),
        mem_bandwidth=measure_mem_bandwidth(device, **timing),
        memory=device_memory(device, world_on_host),
        op_overhead=measure_op_overhead(device, **timing),
        **{f"flops_{p}": measure_half_flops(device, p, gemm, **timing) for p in half},
    )
    reports = gather_reports(mine, device)
    collectives = measure_collectives(device, sizes, reps, gap, marginal=marginal, calls=calls)
    cluster = build_cluster(reports, collectives, name)
    if out is not None and dist.get_rank() == 0:
        with open(out, "w") as f:
            f.write(cluster.to_toml())
    raw = {
        "devices": [r.__dict__ for r in reports],
        "collectives": {p: {"alpha": a, "beta": b, "points": pts} for p, (a, b, pts) in collectives.items()},
        # how the collectives were timed (measure_collectives): alone after a barrier, after gap
        # seconds of computation, or what calls add between bursts of computation
        "collective_timing": {"method": "marginal" if marginal else "gap" if gap > 0 else "barrier", "gap": gap}
        | ({"calls": calls} if marginal else {}),
    }
    return cluster, raw
