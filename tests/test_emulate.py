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
