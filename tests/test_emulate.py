"""Emulated heterogeneous ranks (issue 15, hapc.emulate): a rank at speed s is pinned to a core of its
own and its process sits in a cgroup whose CFS quota is s of the period; speeds are validated; the
profile of such ranks has one device group per speed, labelled emulated. No timing is asserted."""

from __future__ import annotations

import os

import pytest

from hapc import emulate
from hapc.errors import HapcError
from hapc.testing import run_distributed

needs_cgroup = pytest.mark.skipif(emulate.how() is None, reason="no writable cgroup cpu controller here")


def _where(rank, world):
    lines = open(f"/proc/{os.getpid()}/cgroup").read().splitlines()
    group = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] in ("cpu", "cpu,cpuacct", "")), "/")
    quota = None
    for root, name in (("/sys/fs/cgroup/cpu", "cpu.cfs_quota_us"), ("/sys/fs/cgroup", "cpu.max")):
        path = os.path.join(root, group.lstrip("/"), name)
        if group != "/" and os.path.isfile(path):
            quota = open(path).read().split()[0]
            break
    return sorted(os.sched_getaffinity(0)), os.environ.get(emulate.SPEED_ENV), group, quota


@needs_cgroup
def test_a_slow_rank_runs_in_its_own_throttled_group():
    fast, slow = run_distributed(_where, 2, speeds=[1.0, 0.5])
    assert fast[1] == "1" and slow[1] == "0.5"
    assert fast[3] is None, "a full-speed rank is not throttled"
    assert slow[2].startswith("/hapc-") and int(slow[3]) == emulate.PERIOD_US // 2
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(fast[0]) == 1 and len(slow[0]) == 1 and fast[0] != slow[0], "one core each"
    # the groups are removed once the ranks are gone
    roots = [r for r in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup") if os.path.isdir(os.path.join(r, slow[2].lstrip("/")))]
    assert not roots


def _threads(rank, world):
    import time

    import torch.distributed as dist

    dist.new_group()  # a process group started after apply(): its gloo threads inherit pin and quota
    time.sleep(10 * emulate.WATCH_S)
    out = {}
    for tid in os.listdir("/proc/self/task"):
        lines = open(f"/proc/self/task/{tid}/cgroup").read().splitlines()
        group = next(ln.split(":", 2)[2] for ln in lines if "cpu" in ln.split(":")[1].split(","))
        out[int(tid)] = (group, sorted(os.sched_getaffinity(int(tid))))
    return os.getpid(), out


@needs_cgroup
def test_only_the_compute_thread_is_throttled_and_pinned():
    """gloo's threads -- also those of a group made after apply() -- leave the quota and the pin: a
    throttled communication thread waited for the compute thread's quota (3 ms for a 1 KB all-reduce)."""
    cores = sorted(os.sched_getaffinity(0))
    ranks = run_distributed(_threads, 2, speeds=[1.0, 0.5])
    for main, threads in ranks:
        others = [v for tid, v in threads.items() if tid != main]
        assert len(others) >= 4, "gloo's threads of two process groups"
        assert all(not group.rsplit("/", 1)[-1].startswith("hapc-") for group, _ in others), others
        assert all(affinity == cores for _, affinity in others), others
        if len(cores) >= 2:
            assert len(threads[main][1]) == 1, "the compute thread keeps its core"
    slow_main, slow = ranks[1]
    assert slow[slow_main][0].rsplit("/", 1)[-1].startswith("hapc-"), "the compute thread is throttled"


def test_speeds_are_checked():
    with pytest.raises(HapcError, match="one per rank"):
        run_distributed(_where, 2, speeds=[1.0])
    with pytest.raises(HapcError, match=r"\(0, 1\]"):
        run_distributed(_where, 2, speeds=[1.0, 1.5])


def _kinds(rank, world):
    import torch

    from hapc.profile import device_kind

    return device_kind(torch.device("cpu"))


@needs_cgroup
def test_emulated_ranks_are_their_own_device_kinds():
    assert run_distributed(_kinds, 2, speeds=[1.0, 0.5]) == ["cpu-at-100%", "cpu-at-50%"]
    assert run_distributed(_kinds, 2) == ["cpu", "cpu"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile", "--speeds", "1,0.5"], "give it with --local N"),
        (["profile", "--local", "2", "--speeds", "1,half"], "fractions of a core separated by commas"),
        (["profile", "--local", "2", "--speeds", "1"], "one per rank"),
    ],
)
def test_profile_speeds_usage_errors(argv, message, capsys):
    from hapc.cli import main

    assert main(argv) != 0
    assert message in capsys.readouterr().err
