"""Heterogeneous ranks on one CPU host, for real (issue 15): each local rank pinned to a core of its
own and slowed to a fraction of it.

A rank at relative speed ``s`` (``0 < s <= 1``) must compute ``1 / s`` times as long as on a full core,
whenever it computes -- as a slower GPU does -- while its waits (collectives, sleeps) cost no more.
Its compute thread shares its core with a *rival*: a spinning process pinned to the same core, in the
same control group, weighted so that the Linux CFS scheduler gives the compute thread ``s`` of the core
whenever both are runnable,

    shares(rival) = 1024 * (1 - s) / s      against 1024 for the compute thread (cgroup v1 cpu.shares;
                                             v2: cpu.weight, 100 for the compute side)

so a stretch of computation of any length takes ``1 / s`` as long. A CFS *quota* (``s`` of each period)
was used first and is wrong for this: it caps the share of wall time, not the speed, so a rank that
waits part of each period computes the rest at full speed. Measured here (a 256 GEMM loop, ranks at
1.0 and 0.5, 10 ms period): continuous work ran at 0.50, work in 7 ms bursts between 4 ms sleeps at
0.75 of the fast rank -- and a training step is such bursts between collectives, so the slow rank of a
benchmark was faster than its profile said. With the rival, the same bursts run at 0.53-0.54
(1-20 ms sleeps) and continuous work at 0.49.

The rival needs a core per rank (``sched_setaffinity``); where the host has fewer cores than ranks,
ranks share the host's cores, their speeds are relative shares of those, and a slow rank falls back to
the CFS quota (period 10 ms), with the caveat above (:meth:`Emulation.describe` says which).

Only the rank's compute thread is slowed (cgroup v1 places single threads): the communication threads
(gloo's) run free, on any core, as a slower GPU's links are no slower; :func:`apply` says why.

What the emulation adds that a slower GPU does not: the slow rank computes in the scheduler's slices
(a few ms each, alternating with the rival), so at every collective its peers wait, on average, for
part of a rival slice. Measured on this project's 2-core host (kernel 6.18, ranks at 1.0 / 0.5, each
computing 2 ms of its own work between all-reduces of 16 floats): 6.1 ms a round, against 2.3 ms at
even speeds. A plan with a collective in every stage pays it at each; profile the collectives after
bursts as long as the program's stages (``hapc profile --marginal --gap 5ms``) so that the plans are
priced as they run here (``benchmarks/hetero_speedup.py``'s ``PROFILE_GAP``).

The controller must be writable (root in a container whose cgroup file system is mounted read-write,
as on this project's machines); :func:`how` says whether it is, and every result measured under it is
labelled "emulated". Where it is not, :func:`apply` raises :class:`~hapc.errors.HapcError` naming the
cause: a silent fallback would report an even cluster as a heterogeneous one.

    run_distributed(fn, 2, speeds=[1.0, 0.5])       # rank 1 runs at half speed
    hapc profile --local 2 --speeds 1,0.5           # measures it: two device groups
    hapc profile --local 2 --speeds 1,0.5 --marginal --gap 5ms   # collectives as a 5 ms-stage program meets them
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from .errors import HapcError

#: the CFS period of the quota fallback (ranks sharing cores), in microseconds
PERIOD_US = 10_000
#: per controller: the weight file, the weight of a nice-0 task, its least and greatest weight, and
#: the file a process (v1: a thread) is moved into a group by
_KNOBS = {"v1": ("cpu.shares", 1024, 2, 262144, "tasks"), "v2": ("cpu.weight", 100, 1, 10000, "cgroup.procs")}
_V1 = "/sys/fs/cgroup/cpu"
_V2 = "/sys/fs/cgroup"
#: the environment variable a throttled rank carries (``hapc profile`` names its device kind by it)
SPEED_ENV = "HAPC_EMULATED_SPEED"


@dataclass
class Emulation:
    """One rank's emulated speed: where it runs and how it is slowed."""

    speed: float
    core: int | None
    cgroup: str | None
    #: the slowing covers the whole process (cgroup v2), communication threads included
    whole_process: bool = False
    #: the pid of the rival process sharing the core (None: slowed by a CFS quota, or not at all)
    rival: int | None = None

    def describe(self) -> str:
        where = f"core {self.core}" if self.core is not None else "shared cores"
        who = "the whole process" if self.whole_process else "the compute thread"
        if self.cgroup is None:
            how = "a full core"
        elif self.rival is not None:
            how = f"{self.speed:.0%} of a core for {who}, a spinning rival process taking the rest"
        else:
            how = f"{self.speed:.0%} of a core's time for {who} by CFS quota (full speed while quota lasts)"
        return f"emulated: {how}, {where}"


def rival_weight(speed: float, kind: str = "v1") -> int:
    """The rival's CFS weight giving the compute thread ``speed`` of a shared core: the thread has the
    weight of a nice-0 task ``w`` and CFS shares a core by weight, ``w / (w + r) = speed``, so
    ``r = w (1 - speed) / speed``, at least the controller's minimum (v1 2, v2 1).

    >>> rival_weight(0.5), rival_weight(0.25), rival_weight(0.5, "v2")
    (1024, 3072, 100)
    """
    _, w, least, most, _ = _KNOBS[kind]
    return max(least, min(most, round(w * (1 - speed) / speed)))


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


def _start_rival(core: int) -> int:
    """Fork the rival: a process that spins on ``core`` and dies with this one (``PR_SET_PDEATHSIG``),
    so that a rank killed or crashed leaves no spinning process behind."""
    import ctypes
    import signal

    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the rival
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the rank died before the line above
                os._exit(0)
            os.sched_setaffinity(0, {core})
            while True:
                pass
        finally:
            os._exit(0)
    return pid


def apply(speed: float, rank: int, world: int, tag: str) -> Emulation:
    """Emulate this rank at ``speed``: its *computation* -- the calling thread, which runs every
    torch op (``torch.set_num_threads(1)``; CPU autograd runs backward on the calling thread) -- is
    pinned to core ``rank`` (when the host has a core per rank) and, for ``speed < 1``, moved alone
    into a new control group ``tag`` where a rival process pinned to the same core takes ``1 - speed``
    of it (:func:`rival_weight`; the module docstring says why not a CFS quota). The group as a whole
    weighs as one task, so a communication thread that lands on the core slows this rank as much as it
    slows a full-speed rank on its own core.

    Every other thread of the process (gloo's I/O and worker threads, started by each process group
    after this call) is moved out of that group again and left free to run on any core, by a watcher
    thread that looks every :data:`WATCH_S` seconds. With the whole process inside a throttled group, a
    collective waited for the compute thread's turn and shared its pinned core, measured 3.3 ms for a
    1 KB all-reduce against 0.55 ms free -- a slow rank slowed its communication as much as its
    computation, which a slower GPU does not. Every contender measured in the process (hapc, DDP, FSDP)
    gets the same treatment.

    cgroup v2 places single threads only in threaded subtrees; there the whole process is slowed
    (communication included), and :meth:`Emulation.describe` says so. Without a core per rank the
    rival cannot share the compute thread's core, and a CFS quota of ``speed`` of each
    :data:`PERIOD_US` slows the rank instead."""
    cores = set(os.sched_getaffinity(0))
    ordered = sorted(cores)
    core = ordered[rank] if len(ordered) >= world else None
    os.environ[SPEED_ENV] = f"{speed:g}"
    kind = require() if speed < 1 else how()
    main = threading.get_native_id()
    home = _home(kind) if kind == "v1" else None
    if core is not None or (speed < 1 and kind == "v1"):  # started first: free itself, unslowed
        threading.Thread(target=_watch, args=(main, home, cores, WATCH_S), daemon=True, name="hapc-emulate").start()
    if core is not None:
        os.sched_setaffinity(0, {core})  # this thread only; threads it starts inherit it until freed
    if speed >= 1:
        return Emulation(speed, core, None)
    path = os.path.join(home or _V1, tag) if kind == "v1" else os.path.join(_V2, tag)
    os.makedirs(path, exist_ok=True)
    if core is None:  # shared cores: the quota fallback
        quota = max(1000, int(speed * PERIOD_US))
        if kind == "v1":
            _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
            _write(os.path.join(path, "tasks"), str(main))  # v1: this thread alone
        else:
            _enable_cpu(_V2)
            _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
            _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
        return Emulation(speed, core, path, whole_process=kind != "v1")
    weight, nice0, _, _, procs = _KNOBS[kind]
    rival_group = os.path.join(path, "rival")
    if kind == "v1":
        os.makedirs(rival_group, exist_ok=True)
        _write(os.path.join(path, procs), str(main))  # v1: this thread alone
    else:  # v2: no process in an inner group, so the rank and its rival are two leaves under it
        _enable_cpu(_V2)
        _enable_cpu(path)
        ours = os.path.join(path, "rank")
        os.makedirs(ours, exist_ok=True)
        os.makedirs(rival_group, exist_ok=True)
        _write(os.path.join(ours, weight), str(nice0))
        _write(os.path.join(ours, procs), str(os.getpid()))
    _write(os.path.join(rival_group, weight), str(rival_weight(speed, kind)))
    pid = _start_rival(core)  # forked from this thread: it starts in this thread's group and core
    _write(os.path.join(rival_group, procs), str(pid))
    return Emulation(speed, core, path, whole_process=kind != "v1", rival=pid)


def _enable_cpu(group: str) -> None:
    """cgroup v2: let the children of ``group`` use the cpu controller."""
    with open(os.path.join(group, "cgroup.subtree_control")) as f:
        if "cpu" not in f.read().split():
            _write(os.path.join(group, "cgroup.subtree_control"), "+cpu")


def _remove_group(path: str, wait: float = 1.0) -> None:
    """Remove control group ``path`` and its ``rival`` / ``rank`` children, retrying for up to
    ``wait`` seconds while a process is still leaving it."""
    for group in (os.path.join(path, "rival"), os.path.join(path, "rank"), path):
        deadline = time.monotonic() + wait
        while os.path.isdir(group):
            try:
                os.rmdir(group)
            except OSError:  # a process still inside (killed late): the kernel frees it once empty
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)


def sweep() -> list[str]:
    """Remove the groups of ranks whose parent process is gone (``hapc-<pid>-...``, named by
    ``run_distributed``): a parent killed by SIGKILL never ran :func:`release`. Returns their names."""
    kind = how()
    if kind is None:
        return []
    root = _home(kind) if kind == "v1" else _V2
    gone = []
    for name in os.listdir(root):
        head, _, rest = name.partition("-")
        pid = rest.split("-", 1)[0]
        if head != "hapc" or not pid.isdigit() or not os.path.isdir(os.path.join(root, name)):
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its parent lives: its own release() removes it
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's live process
            continue
        _remove_group(os.path.join(root, name), wait=0.0)
        gone.append(name)
    return gone


def release(tags: list[str]) -> None:
    """Remove the control groups named ``tags`` (and their rival and rank groups) once their processes
    have exited (the parent calls). A rival is killed when its rank exits, but may take a moment to
    leave its group: the removal is retried for up to a second."""
    kind = how()
    if kind is None:
        return
    root = _home(kind) if kind == "v1" else _V2  # v1: the ranks' groups sit in this process's group
    for tag in tags:
        _remove_group(os.path.join(root, tag))
