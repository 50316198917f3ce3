"""Run a function on N local processes joined by a gloo process group (tests, demos, benchmarks).

``run_distributed(fn, 3, *args)`` forks three processes, initialises ``torch.distributed`` in each
(gloo over loopback, one thread per process), calls ``fn(rank, world_size, *args)`` and returns
the results in rank order. A process that fails, dies or hangs makes the call raise naming each
rank's fate (its traceback, the signal that killed it, hung, never started) -- within
``timeout + grace`` seconds, never a hang. ``fork`` is used: spawning would cost
about a second per process here.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cluster import Cluster
from .errors import DistributedRunError


def cluster_of(
    flops: list[float],
    *,
    bandwidth: str = "2 GB/s",
    latency: str = "50 us",
    memory: str = "4 GiB",
    name: str = "test",
) -> Cluster:
    """A cluster of ``len(flops)`` devices, each its own group (so each gets its own ratio),
    joined by one uniform link: the shape of cluster the equivalence tests need."""
    link = {"bandwidth": bandwidth, "latency": latency}
    return Cluster.from_dict(
        {
            "name": name,
            "group": [
                {"name": f"d{i}", "devices": 1, "devices_per_host": 1, "flops": f, "memory": memory}
                for i, f in enumerate(flops)
            ],
            "links": {"intra_host": link, "inter_host": link},
        }
    )


def _worker(
    fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple, timeout: float, speed: Any = None
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if speed is not None:  # before any thread of ours starts: they join its control group
            from . import emulate

            emulate.apply(speed[0], rank, world, speed[1])
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        # every rank past gloo's connectFullMesh before any goes on: a rank whose function needs no
        # collective could otherwise finish and close its connections while a peer still connects
        # ("Connection closed by peer" there, seen once under a loaded CI with emulated ranks)
        dist.barrier()
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # by value: shared-memory handles die with the process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # report everything, including SystemExit from the function
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    grace: float = 30.0,
    absent: Sequence[int] = (),
    speeds: Sequence[float] | None = None,
) -> list[Any]:
    """``[fn(0, n, *args), ..., fn(n-1, n, *args)]``, each in its own gloo process.

    ``timeout`` is the process group's: a collective (or the rendezvous) that waits longer raises
    in that rank. The call returns or raises within ``timeout + grace`` seconds: a rank still
    running then is reported as hung and killed. On failure it raises
    :class:`~hapc.errors.DistributedRunError` naming every rank's fate -- its exception, the
    signal or exit code it died with, hung, or never started (``absent``: ranks deliberately
    not launched, to test a job where a rank never joins).

    ``speeds``: each rank's relative speed in (0, 1] -- pinned to a core of its own and throttled to
    that fraction of it (:mod:`hapc.emulate`; raises where the host cannot)."""
    tags: list[str] = []
    if speeds is not None:
        from . import emulate

        speeds = emulate.check_speeds(list(speeds), world_size)
        if any(s < 1 for s in speeds):
            emulate.require()  # raises, naming the cause, before any process starts
        emulate.sweep()  # groups an earlier run killed by SIGKILL left behind
        tags = [f"hapc-{os.getpid()}-{time.monotonic_ns()}-rank{r}" for r in range(world_size)]
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    # the rendezvous is a file of this call's own: a TCP port picked free and bound later by the
    # store could be taken meanwhile by another job's (two suites or test workers at once), whose
    # ranks then met ours ("Gloo connectFullMesh failed ... Connection closed by peer")
    rendezvous = tempfile.mkdtemp(prefix="hapc-rendezvous-")
    store = os.path.join(rendezvous, "store")
    procs = {
        r: ctx.Process(
            target=_worker,
            args=(fn, r, world_size, store, queue, args, timeout, (speeds[r], tags[r]) if speeds is not None else None),
        )
        for r in range(world_size)
        if r not in set(absent)
    }
    for p in procs.values():
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    died: dict[int, int] = {}
    pending = set(procs)
    deadline = time.monotonic() + timeout + grace
    while pending and time.monotonic() < deadline:
        exited = [r for r in pending if procs[r].exitcode is not None]  # before draining: their reports are in
        while not queue.empty():
            rank, status, value = queue.get()
            pending.discard(rank)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors[rank] = value
        for r in exited:
            if r in pending:
                died[r] = procs[r].exitcode
                pending.discard(r)
        time.sleep(0.01)
    hung = sorted(pending)
    for r in hung:
        procs[r].kill()
    for p in procs.values():
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    shutil.rmtree(rendezvous, ignore_errors=True)
    if tags:
        from . import emulate

        emulate.release(tags)
    if errors or died or hung or absent:
        raise DistributedRunError(
            _describe_failure(world_size, errors, died, hung, sorted(absent), timeout + grace),
            errors=errors,
            died=died,
            hung=hung,
            absent=sorted(absent),
        )
    return [results[r] for r in range(world_size)]


def _describe_failure(
    world: int, errors: dict[int, str], died: dict[int, int], hung: list[int], absent: list[int], limit: float
) -> str:
    lines = [f"distributed run failed ({world} ranks):"]
    for r in range(world):
        if r in errors:
            lines.append(f"rank {r}: {errors[r]}")
        elif r in died:
            code = died[r]
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            lines.append(f"rank {r} died ({how}) without reporting a result")
        elif r in hung:
            lines.append(f"rank {r} hung: still running after {limit:.0f}s (timeout + grace); killed")
        elif r in absent:
            lines.append(f"rank {r} was never started (absent)")
    return "\n".join(lines)
