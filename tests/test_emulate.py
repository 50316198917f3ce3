"""Emulated heterogeneous ranks (issue 15, hapc.emulate): a rank at speed s is pinned to a core of its
own, and its compute thread shares that core with a rival process weighted to leave it s of the core
(a CFS quota where ranks share cores); the rival dies with its rank; speeds are validated; the profile
of such ranks has one device group per speed, labelled emulated. No timing is asserted."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hapc import emulate
from hapc.errors import DistributedRunError, HapcError
from hapc.testing import run_distributed

needs_cgroup = pytest.mark.skipif(emulate.how() is None, reason="no writable cgroup cpu controller here")


def _group(pid: int | str = "self") -> str:
    lines = open(f"/proc/{pid}/cgroup").read().splitlines()
    return next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] in ("cpu", "cpu,cpuacct", "")), "/")


def _read(group: str, name: str) -> str | None:
    for root in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup"):
        path = os.path.join(root, group.lstrip("/"), name)
        if group != "/" and os.path.isfile(path):
            return open(path).read().strip()
    return None


def _where(rank, world):
    """(this thread's cores, speed variable, control group, its quota, the rival's pid, cores, weight)."""
    group = _group(f"{os.getpid()}/task/{threading.get_native_id()}")
    quota = _read(group, "cpu.cfs_quota_us") or (_read(group, "cpu.max") or "").split(" ")[0] or None
    rival = weight = cores = None
    if group.rsplit("/", 1)[-1].startswith("hapc-"):
        pids = (_read(group + "/rival", "tasks") or _read(group + "/rival", "cgroup.procs") or "").split()
        if pids:
            rival = int(pids[0])
            cores = sorted(os.sched_getaffinity(rival))
            weight = int(_read(group + "/rival", "cpu.shares") or _read(group + "/rival", "cpu.weight"))
    return sorted(os.sched_getaffinity(0)), os.environ.get(emulate.SPEED_ENV), group, quota, rival, cores, weight


def _gone(pid: int, within: float = 5.0) -> bool:
    """Has process ``pid`` exited (absent, or a zombie) within ``within`` seconds?"""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _groups_removed(group: str) -> bool:
    roots = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup")
    return not [r for r in roots if os.path.isdir(os.path.join(r, group.lstrip("/")))]


@needs_cgroup
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the rival needs a core per rank")
def test_a_slow_rank_shares_its_core_with_a_rival_that_dies_with_it():
    fast, slow = run_distributed(_where, 2, speeds=[1.0, 0.5])
    assert fast[1] == "1" and slow[1] == "0.5"
    assert fast[2] == _group() and fast[4] is None, "a full-speed rank is not slowed"
    assert len(fast[0]) == 1 and len(slow[0]) == 1 and fast[0] != slow[0], "one core each"
    assert slow[2].rsplit("/", 1)[-1].startswith("hapc-") and slow[3] in (None, "-1", "max"), "no quota"
    assert slow[4] is not None and slow[5] == slow[0], "the rival spins on the compute thread's core"
    assert slow[6] == emulate.rival_weight(0.5, emulate.how()), "weighted to take half of it"
    assert _gone(slow[4]), "the rival exits with its rank"
    assert _groups_removed(slow[2]), "the groups are removed once the ranks are gone"


def _dies(rank, world, where):
    import signal

    if rank == 1:
        Path(where).write_text(str(_where(rank, world)[4]))
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@needs_cgroup
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the rival needs a core per rank")
def test_a_killed_rank_leaves_no_spinning_rival(tmp_path):
    where = tmp_path / "rival"
    with pytest.raises(DistributedRunError, match="rank 1"):
        run_distributed(_dies, 2, str(where), speeds=[1.0, 0.5], timeout=10, grace=5)
    assert _gone(int(where.read_text())), "the rival dies with its rank (PR_SET_PDEATHSIG)"


@needs_cgroup
def test_ranks_sharing_cores_are_slowed_by_a_quota():
    """More ranks than cores: no core to share with a rival, so the slow rank's thread gets a quota."""
    if len(os.sched_getaffinity(0)) >= 3:
        pytest.skip("needs fewer cores than ranks")
    ranks = run_distributed(_where, 3, speeds=[1.0, 1.0, 0.5])
    slow = ranks[2]
    assert slow[4] is None, "no rival"
    assert int(slow[3]) == emulate.PERIOD_US // 2, "half of each period"
    assert _groups_removed(slow[2])


def test_the_rival_weight_leaves_the_rank_its_speed():
    for kind in ("v1", "v2"):
        w = emulate._KNOBS[kind][1]
        for speed in (0.25, 0.5, 0.75, 0.9):
            assert w / (w + emulate.rival_weight(speed, kind)) == pytest.approx(speed, rel=0.01)
    assert emulate.rival_weight(1e-6, "v1") == 262144 and emulate.rival_weight(0.999, "v2") == 1, "clamped"


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


@needs_cgroup
def test_groups_left_by_a_killed_run_are_swept():
    """A parent killed by SIGKILL never removes its ranks' groups: the next run does, and leaves the
    groups of live parents alone."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)  # its pid is free now: a parent that is gone
    home = emulate._home(emulate.how()) if emulate.how() == "v1" else emulate._V2
    stale = os.path.join(home, f"hapc-{child}-1-rank1")
    live = os.path.join(home, f"hapc-{os.getpid()}-2-rank1")
    os.makedirs(os.path.join(stale, "rival"))
    os.makedirs(live)
    try:
        run_distributed(_where, 2, speeds=[1.0, 0.5])
        assert not os.path.isdir(stale), "the dead parent's groups are removed"
        assert os.path.isdir(live), "a live parent's are its own to remove"
    finally:
        for path in (os.path.join(stale, "rival"), stale, live):
            if os.path.isdir(path):
                os.rmdir(path)
