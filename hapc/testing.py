"""Run a function on N local processes joined by a gloo process group (tests, demos, benchmarks).

``run_distributed(fn, 3, *args)`` forks three processes, initialises ``torch.distributed`` in each
(gloo over loopback, one thread per process), calls ``fn(rank, world_size, *args)`` and returns
the results in rank order. A process that fails or dies makes the call raise with its traceback
(or exit code) -- within ``timeout`` seconds, never a hang. ``fork`` is used: spawning would cost
about a second per process here.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cluster import Cluster
from .errors import HapcError


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple, timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
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


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``[fn(0, n, *args), ..., fn(n-1, n, *args)]``, each in its own gloo process."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, timeout)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout + 30
    while len(results) + len(errors) < world_size:
        if not queue.empty():
            rank, status, value = queue.get()
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors.append(f"rank {rank}: {value}")
            continue
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
        if dead and queue.empty():
            time.sleep(0.5)
            if queue.empty():
                errors += [
                    f"rank {r} died with exit code {code}"
                    for r, code in dead
                    if all(f"rank {r}:" not in e for e in errors)
                ]
                break
        if time.monotonic() > deadline:
            errors.append(
                f"timed out after {timeout:.0f}s waiting for ranks {sorted(set(range(world_size)) - set(results))}"
            )
            break
        time.sleep(0.01)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise HapcError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
