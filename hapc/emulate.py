"""Heterogeneous ranks on one CPU host, for real (issue 15): each local rank pinned to a core of its
own and throttled to a fraction of it.

A rank at relative speed ``s`` (``0 < s <= 1``) gets ``s`` of one core: the Linux CFS bandwidth
controller lets the processes of a control group run ``quota`` microseconds in every ``period``,

    quota = s * period          (cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us; v2: cpu.max)

so its computation takes ``1 / s`` as long as on a full core, while its waits (collectives, sleeps)
cost nothing. The period is short (10 ms) so that a throttled rank is slowed evenly rather than in
long stalls. Pinning (``sched_setaffinity``) keeps ranks from competing for a core; it needs one core
per rank, else ranks share the host's cores and their speeds are relative shares of those.

The controller must be writable (root in a container whose cgroup file system is mounted read-write,
as on this project's machines); :func:`how` says whether it is, and every result measured under it is
labelled "emulated". Where it is not, :func:`apply` raises :class:`~hapc.errors.HapcError` naming the
cause: a silent fallback would report an even cluster as a heterogeneous one.

    run_distributed(fn, 2, speeds=[1.0, 0.5])       # rank 1 runs at half speed
    hapc profile --local 2 --speeds 1,0.5           # measures it: two device groups
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import HapcError

PERIOD_US = 10_000
_V1 = "/sys/fs/cgroup/cpu"
_V2 = "/sys/fs/cgroup"
#: the environment variable a throttled rank carries (``hapc profile`` names its device kind by it)
SPEED_ENV = "HAPC_EMULATED_SPEED"


@dataclass
class Emulation:
    """One rank's emulated speed: where it runs and the control group that throttles it."""

    speed: float
    core: int | None
    cgroup: str | None

    def describe(self) -> str:
        where = f"core {self.core}" if self.core is not None else "shared cores"
        how = f"{self.speed:.0%} of a core by CFS quota" if self.cgroup else "a full core"
        return f"emulated: {how}, {where}"


def how() -> str | None:
    """The writable cpu controller (``"v1"`` or ``"v2"``), or None."""
    if os.path.isfile(os.path.join(_V1, "cpu.cfs_quota_us")) and os.access(_V1, os.W_OK):
        return "v1"
    controllers = os.path.join(_V2, "cgroup.controllers")
    if os.path.isfile(controllers) and os.access(_V2, os.W_OK):
        with open(controllers) as f:
            if "cpu" in f.read().split():
                return "v2"
    return None


def require() -> str:
    """The writable cpu controller, or a :class:`HapcError` naming why a slower rank cannot be emulated."""
    kind = how()
    if kind is None:
        raise HapcError(
            "emulating a slower rank needs a writable cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 with "
            "the cpu controller), found none: run as root with the cgroup file system mounted read-write, or run "
            "the ranks at full speed"
        )
    return kind


def check_speeds(speeds: list[float], world: int) -> list[float]:
    """Validate ``speeds`` (one per rank, each in (0, 1])."""
    speeds = [float(s) for s in speeds]
    if len(speeds) != world:
        raise HapcError(f"speeds has {len(speeds)} entries for {world} ranks: give one per rank")
    bad = [s for s in speeds if not 0 < s <= 1]
    if bad:
        raise HapcError(f"speeds must lie in (0, 1] (a fraction of one core), got {bad[0]}")
    return speeds


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def apply(speed: float, rank: int, world: int, tag: str) -> Emulation:
    """Pin this process to core ``rank`` (when the host has a core per rank) and, for ``speed < 1``,
    move it into a new control group limited to ``speed`` of a core. Call in the rank's process
    before it starts threads of its own (torch's gloo threads join its group anyway)."""
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank] if len(cores) >= world else None
    if core is not None:
        os.sched_setaffinity(0, {core})
    os.environ[SPEED_ENV] = f"{speed:g}"
    if speed >= 1:
        return Emulation(speed, core, None)
    kind = require()
    quota = max(1000, int(speed * PERIOD_US))
    if kind == "v1":
        path = os.path.join(_V1, tag)
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
    else:
        path = os.path.join(_V2, tag)
        with open(os.path.join(_V2, "cgroup.subtree_control")) as f:
            if "cpu" not in f.read().split():
                _write(os.path.join(_V2, "cgroup.subtree_control"), "+cpu")
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
    _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    return Emulation(speed, core, path)


def release(tags: list[str]) -> None:
    """Remove the control groups named ``tags`` once their processes have exited (the parent calls)."""
    root = {"v1": _V1, "v2": _V2}.get(how() or "")
    if root is None:
        return
    for tag in tags:
        path = os.path.join(root, tag)
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:  # a process still inside (killed late): the kernel frees it once empty
                pass
