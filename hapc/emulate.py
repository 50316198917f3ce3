"""Heterogeneous ranks on one CPU host, for real (issue 15): each local rank pinned to a core of its
own and throttled to a fraction of it.

A rank at relative speed ``s`` (``0 < s <= 1``) gets ``s`` of one core: the Linux CFS bandwidth
controller lets the processes of a control group run ``quota`` microseconds in every ``period``,

    quota = s * period          (cgroup v1: cpu.cfs_quota_us / cpu.cfs_period_us; v2: cpu.max)

so its computation takes ``1 / s`` as long as on a full core, while its waits (collectives, sleeps)
cost nothing. The period is short (10 ms) so that a throttled rank is slowed evenly rather than in
long stalls. Pinning (``sched_setaffinity``) keeps ranks from competing for a core; it needs one core
per rank, else ranks share the host's cores and their speeds are relative shares of those.

Only the rank's compute thread is pinned and throttled (cgroup v1 places single threads): the
communication threads (gloo's) run free, unthrottled and on any core, as a slower GPU's links are
no slower; :func:`apply` says why.

The controller must be writable (root in a container whose cgroup file system is mounted read-write,
as on this project's machines); :func:`how` says whether it is, and every result measured under it is
labelled "emulated". Where it is not, :func:`apply` raises :class:`~hapc.errors.HapcError` naming the
cause: a silent fallback would report an even cluster as a heterogeneous one.

    run_distributed(fn, 2, speeds=[1.0, 0.5])       # rank 1 runs at half speed
    hapc profile --local 2 --speeds 1,0.5           # measures it: two device groups
"""

from __future__ import annotations

import os
import threading
import time
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
    #: the quota covers the whole process (cgroup v2), communication threads included
    whole_process: bool = False

    def describe(self) -> str:
        where = f"core {self.core}" if self.core is not None else "shared cores"
        who = "the whole process" if self.whole_process else "the compute thread"
        how = f"{self.speed:.0%} of a core for {who} by CFS quota" if self.cgroup else "a full core"
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


def _home(kind: str) -> str:
    """This process's control group in the cpu hierarchy (absolute path under the mount)."""
    root = _V1 if kind == "v1" else _V2
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (kind == "v1" and "cpu" in controllers.split(",")) or (kind == "v2" and controllers == ""):
                return os.path.join(root, path.lstrip("/"))
    return root


def _free_threads(main: int, home: str | None, seen: set[int], cores: set[int]) -> None:
    """Move every thread of this process but ``main`` (and those in ``seen``) out of the throttled
    group into ``home`` and let it run on ``cores``; threads that exited meanwhile are skipped."""
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid == main or tid in seen:
            continue
        try:
            if home is not None:
                _write(os.path.join(home, "tasks"), str(tid))
            os.sched_setaffinity(tid, cores)
        except (OSError, ValueError):  # exited between listing and moving
            continue
        seen.add(tid)


def _watch(main: int, home: str | None, cores: set[int], every: float) -> None:
    """The watcher thread's loop: free each thread the rank starts (gloo's, one set per process group)."""
    seen: set[int] = set()
    last: set[str] = set()
    while True:
        names = set(os.listdir("/proc/self/task"))
        if names != last:
            _free_threads(main, home, seen, cores)
            last = names
        time.sleep(every)


#: seconds between the watcher's looks at the process's threads (a new thread is throttled at most this long)
WATCH_S = 0.02


def apply(speed: float, rank: int, world: int, tag: str) -> Emulation:
    """Emulate this rank at ``speed``: its *computation* -- the calling thread, which runs every
    torch op (``torch.set_num_threads(1)``; CPU autograd runs backward on the calling thread) -- is
    pinned to core ``rank`` (when the host has a core per rank) and, for ``speed < 1``, moved alone
    into a new control group limited to ``speed`` of a core.

    Every other thread of the process (gloo's I/O and worker threads, started by each process group
    after this call) is moved out of that group again and left free to run on any core, by a watcher
    thread that looks every :data:`WATCH_S` seconds. The CFS quota covers every thread of its group:
    with the whole process inside, a collective waited for the compute thread's quota to refill (up
    to half a period) and shared its pinned core, measured 3.3 ms for a 1 KB all-reduce against
    0.55 ms free -- a slow rank slowed its communication as much as its computation, which a slower
    GPU does not. Every contender measured in the process (hapc, DDP, FSDP) gets the same treatment.

    cgroup v2 places single threads only in threaded subtrees; there the whole process is throttled
    (communication included), and :meth:`Emulation.describe` says so."""
    cores = set(os.sched_getaffinity(0))
    ordered = sorted(cores)
    core = ordered[rank] if len(ordered) >= world else None
    os.environ[SPEED_ENV] = f"{speed:g}"
    kind = require() if speed < 1 else how()
    main = threading.get_native_id()
    home = _home(kind) if kind == "v1" else None
    if core is not None or (speed < 1 and kind == "v1"):  # started first: free itself, unthrottled
        threading.Thread(target=_watch, args=(main, home, cores, WATCH_S), daemon=True, name="hapc-emulate").start()
    if core is not None:
        os.sched_setaffinity(0, {core})  # this thread only; threads it starts inherit it until freed
    if speed >= 1:
        return Emulation(speed, core, None)
    quota = max(1000, int(speed * PERIOD_US))
    if kind == "v1":
        path = os.path.join(home or _V1, tag)
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        _write(os.path.join(path, "tasks"), str(main))  # v1: this thread alone
    else:
        path = os.path.join(_V2, tag)
        with open(os.path.join(_V2, "cgroup.subtree_control")) as f:
            if "cpu" not in f.read().split():
                _write(os.path.join(_V2, "cgroup.subtree_control"), "+cpu")
        os.makedirs(path, exist_ok=True)
        _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
        _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    return Emulation(speed, core, path, whole_process=kind != "v1")


def release(tags: list[str]) -> None:
    """Remove the control groups named ``tags`` once their processes have exited (the parent calls)."""
    kind = how()
    if kind is None:
        return
    root = _home(kind) if kind == "v1" else _V2  # v1: the ranks' groups sit in this process's group
    for tag in tags:
        path = os.path.join(root, tag)
        if os.path.isdir(path):
            try:
                os.rmdir(path)
            except OSError:  # a process still inside (killed late): the kernel frees it once empty
                pass
