"""Pipeline schedules as data: per-stage action lists for 1F1B, Eager-1F1B and H-1F1B (HARP §2.3, §4).

A 1F1B-style schedule of ``M`` micro-batches over ``S`` stages is fixed by one number per stage,
its *warm-up count* ``N_i``: the forwards stage ``i`` runs before its first backward. Stage ``i``
then runs ``F(0..N_i-1)``, alternates ``B(k), F(N_i+k)`` for ``k < M-N_i`` (steady phase) and
drains the last ``N_i`` backwards (cool-down). ``N_i`` is also the stage's peak number of
in-flight activations (forwards done whose backward is not), so it prices activation memory
(HARP Eq. 18: ``mem_p + N·mem_a <= mem_device``). Indices here are 0-based; the paper's are
1-based (its stage ``i`` is our ``i-1``).

The three policies (all capped by ``M`` when the list is built):

* **1F1B** (HARP §2.1, Fig. 2): ``N_i = S - i``.
* **Eager-1F1B** (HARP §2.3.1, Zhuang et al. 2023): ``N_i = 2(S - i) - 1``, e.g. ``{5,3,1}``
  for ``S = 3``: two more forwards than the next stage, whatever the link.
* **H-1F1B** (HARP §4.1, Eq. 1-2): ``N_{S-1} = 1`` and ``N_i = 1 + Σ_{k>=i} δ_k`` with, for the
  one-way per-micro-batch transfer time ``c_k`` between stages ``k`` and ``k+1`` and
  ``t_max = max_i t_i`` (``t_i`` = forward + backward time of stage ``i``)::

      δ_k = 1  if 0 <= c_k <= ε·t_max
            2  if ε·t_max < c_k <= t_max/2
            3  if t_max/2 < c_k <= t_max

  Two points the paper leaves implicit, decided here:

  - ``c_k = 0`` (Eq. 2 only covers ``c_k > 0``) gets ``δ_k = 1``: a link that costs nothing
    needs no extra launch, and with every ``δ = 1`` Eq. 1 gives ``N_i = 1 + (S-1-i) = S - i``,
    exactly plain 1F1B. So 1F1B is H-1F1B on a network with no (or only ε-cheap) links, and
    H-1F1B never launches fewer forwards than 1F1B.
  - Outside the ε band Eq. 2 is the smallest integer ``δ >= 1 + 2c/t_max`` (HARP Eq. 10 / 27, the
    bubble-free condition proved in §4.2 and App. B); the ε band trades up to ``c_k`` of stall per
    micro-batch for one activation less. ``c_k > t_max`` cannot be hidden at all (the link
    itself is slower than the bottleneck stage) and raises :class:`ScheduleError` unless
    ``clamp=True`` (then ``δ = 3``, the largest Eq. 2 gives, and the link bounds throughput).

  ε: the paper calls it "a small positive constant" without a value; HARP's released planner
  (github.com/Lssyes/harp, ``stage_construction.py``, ``training_dp_hetero_impl``) uses
  ``cc < t_max / 10 -> delta = 1``, so :data:`HARP_EPSILON` is ``0.1``. ``epsilon=0`` is the
  strictly bubble-free rule of Eq. 10 (every link with ``c > 0`` gets ``δ >= 2``).

**Action lists.** Each stage's list interleaves compute with point-to-point messages:
``RECV_ACT(m)`` before each ``F(m)`` (not on stage 0), ``SEND_ACT(m)`` after it (not on the last
stage), ``RECV_GRAD(m)`` before each ``B(m)`` (not on the last stage), ``SEND_GRAD(m)`` after it
(not on stage 0). Under "sends never block, receives block until the matching send was issued"
these lists cannot deadlock whenever the warm-up counts are non-increasing along the pipeline
(``N_i >= N_{i+1}``): before stage ``i`` waits for gradient ``k`` it has sent activations
``0..N_i+k-1``, a superset of the ``0..N_{i+1}+k-1`` stage ``i+1`` consumes before it sends
gradient ``k``; :func:`schedule` refuses other vectors. ``tests/test_schedule.py`` checks this by
abstract execution for random ``S``, ``M`` and all three policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from ..errors import HapcError

__all__ = [
    "HARP_EPSILON",
    "KINDS",
    "POLICIES",
    "Action",
    "ScheduleError",
    "eager_1f1b_warmup",
    "grid",
    "h1f1b_delta",
    "h1f1b_warmup",
    "one_f_one_b_warmup",
    "policy_warmup",
    "schedule",
    "stage_actions",
]

HARP_EPSILON = 0.1
"""ε of HARP Eq. 2 (links cheaper than ``ε·t_max`` get no extra launch); the value of HARP's code."""

KINDS = ("F", "B", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD")
COMPUTE = ("F", "B")
POLICIES = ("h1f1b", "1f1b", "eager-1f1b")

_SHORT = {"F": "F", "B": "B", "SEND_ACT": "sA", "RECV_ACT": "rA", "SEND_GRAD": "sG", "RECV_GRAD": "rG"}


class ScheduleError(HapcError, ValueError):
    """Warm-up counts, costs or an action list that cannot make a valid pipeline schedule."""


@dataclass(frozen=True)
class Action:
    """One step of one stage: compute (``F``/``B``) or a point-to-point message of micro-batch ``micro``.

    ``stage`` is the stage executing it; a message's peer is :attr:`peer` (``stage + 1`` for
    ``SEND_ACT``/``RECV_GRAD``, ``stage - 1`` for ``RECV_ACT``/``SEND_GRAD``).
    """

    kind: str
    micro: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def peer(self) -> int | None:
        """The other stage of a message (``None`` for compute)."""
        if self.kind in ("SEND_ACT", "RECV_GRAD"):
            return self.stage + 1
        if self.kind in ("RECV_ACT", "SEND_GRAD"):
            return self.stage - 1
        return None

    @property
    def label(self) -> str:
        """Short name: ``F3``, ``B1``, ``sA3`` (send activation 3), ``rG1`` (receive gradient 1)..."""
        return f"{_SHORT[self.kind]}{self.micro}"

    def __str__(self) -> str:
        return f"{self.label}@{self.stage}"


# --------------------------------------------------------------------------- warm-up policies


def h1f1b_delta(c: float, t_max: float, epsilon: float = HARP_EPSILON, *, clamp: bool = False) -> int:
    """HARP Eq. 2: extra forwards a stage launches over the next one, for a link of one-way cost ``c``.

    Compared exactly (rational arithmetic on the float inputs), so boundary values land on the
    side Eq. 2 says (``c = t_max/2`` -> 2, ``c = t_max`` -> 3).
    """
    if not t_max > 0:
        raise ScheduleError(f"t_max must be positive, got {t_max}")
    if not 0 <= epsilon <= 0.5:
        raise ScheduleError(f"epsilon must lie in [0, 1/2] for Eq. 2's bands to be ordered, got {epsilon}")
    if not c >= 0:
        raise ScheduleError(f"communication time must be >= 0, got {c}")
    cq, tq = Fraction(c), Fraction(t_max)
    if cq <= Fraction(epsilon) * tq:
        return 1
    if cq <= tq / 2:
        return 2
    if cq <= tq or clamp:
        return 3
    raise ScheduleError(
        f"link cost c={c} exceeds t_max={t_max}: H-1F1B cannot hide it (HARP §4.1 assumes c_i <= t_max). "
        "Give this link fewer bytes (cut the pipeline elsewhere), a faster link, or pass clamp=True to accept "
        "δ=3 with the link as the throughput bound."
    )


def h1f1b_warmup(
    stage_times: Sequence[float],
    comm_times: Sequence[float],
    epsilon: float = HARP_EPSILON,
    *,
    clamp: bool = False,
) -> list[int]:
    """H-1F1B warm-up counts (HARP Eq. 1-2), 0-based: ``N[S-1] = 1``, ``N[i] = N[i+1] + δ(comm_times[i])``.

    ``stage_times[i]`` is stage ``i``'s forward + backward time per micro-batch; ``comm_times[i]``
    the one-way transfer time of one micro-batch between stages ``i`` and ``i+1`` (``S - 1`` of
    them). Not capped by the number of micro-batches (:func:`stage_actions` caps).

    >>> h1f1b_warmup([1.13, 1.10, 1.10], [0.8, 0.0])   # HARP §2.3.2: slow link, then InfiniBand
    [5, 2, 1]
    """
    S = len(stage_times)
    if S < 1:
        raise ScheduleError("a pipeline needs at least one stage")
    if len(comm_times) != S - 1:
        raise ScheduleError(
            f"{S} stages need {S - 1} link times (comm_times[i] between stage i and i+1), got {len(comm_times)}"
        )
    if any(not t >= 0 for t in stage_times) or max(stage_times) <= 0:
        raise ScheduleError(f"stage times must be >= 0 with a positive maximum, got {list(stage_times)}")
    t_max = max(stage_times)
    counts = [1]
    for c in reversed(comm_times):
        counts.append(counts[-1] + h1f1b_delta(c, t_max, epsilon, clamp=clamp))
    return counts[::-1]


def one_f_one_b_warmup(num_stages: int) -> list[int]:
    """Classic 1F1B (HARP §2.1): stage ``i`` launches ``S - i`` forwards before its first backward."""
    _check_stages(num_stages)
    return [num_stages - i for i in range(num_stages)]


def eager_1f1b_warmup(num_stages: int) -> list[int]:
    """Eager-1F1B (HARP §2.3.1): stage ``i`` launches ``2(S - i) - 1`` forwards (``{5,3,1}`` for S=3)."""
    _check_stages(num_stages)
    return [2 * (num_stages - i) - 1 for i in range(num_stages)]


def policy_warmup(
    policy: str,
    stage_times: Sequence[float],
    comm_times: Sequence[float],
    epsilon: float = HARP_EPSILON,
    *,
    clamp: bool = False,
) -> list[int]:
    """Warm-up counts of ``policy`` (one of :data:`POLICIES`) for these stage and link times."""
    if policy == "h1f1b":
        return h1f1b_warmup(stage_times, comm_times, epsilon, clamp=clamp)
    if policy == "1f1b":
        return one_f_one_b_warmup(len(stage_times))
    if policy == "eager-1f1b":
        return eager_1f1b_warmup(len(stage_times))
    raise ScheduleError(f"unknown pipeline schedule {policy!r}; choose one of {POLICIES}")


def _check_stages(num_stages: int) -> None:
    if num_stages < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {num_stages}")


# --------------------------------------------------------------------------- action lists


def stage_actions(stage: int, num_stages: int, num_micro: int, warmup: int) -> list[Action]:
    """The ordered actions of ``stage``: ``min(warmup, M)`` forwards, steady 1F1B, cool-down backwards."""
    _check_stages(num_stages)
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} outside 0..{num_stages - 1}")
    if num_micro < 1:
        raise ScheduleError(f"need at least one micro-batch, got {num_micro}")
    if warmup < 1:
        raise ScheduleError(
            f"stage {stage}: warm-up count must be >= 1 (one forward before any backward), got {warmup}"
        )
    first, last = stage == 0, stage == num_stages - 1
    n = min(warmup, num_micro)
    out: list[Action] = []

    def fwd(m: int) -> None:
        if not first:
            out.append(Action("RECV_ACT", m, stage))
        out.append(Action("F", m, stage))
        if not last:
            out.append(Action("SEND_ACT", m, stage))

    def bwd(m: int) -> None:
        if not last:
            out.append(Action("RECV_GRAD", m, stage))
        out.append(Action("B", m, stage))
        if not first:
            out.append(Action("SEND_GRAD", m, stage))

    for m in range(n):
        fwd(m)
    for k in range(num_micro - n):
        bwd(k)
        fwd(n + k)
    for k in range(num_micro - n, num_micro):
        bwd(k)
    return out


def schedule(warmups: Sequence[int], num_micro: int) -> list[list[Action]]:
    """Every stage's action list (one per stage) for these warm-up counts.

    Refuses increasing counts (``warmups[i] < warmups[i+1]``, after capping by ``M``): stage ``i``
    would wait for a gradient while stage ``i+1`` waits for an activation stage ``i`` has not sent.
    """
    S = len(warmups)
    _check_stages(S)
    capped = [min(w, num_micro) for w in warmups]
    for i in range(S - 1):
        if capped[i] < capped[i + 1]:
            raise ScheduleError(
                f"warm-up counts {list(warmups)} increase from stage {i} to {i + 1}: stage {i} would block on "
                f"gradient 0 while stage {i + 1} waits for activation {capped[i]} -- a deadlock. Warm-up counts "
                "must not increase along the pipeline (every policy here gives non-increasing counts)."
            )
    return [stage_actions(i, S, num_micro, w) for i, w in enumerate(warmups)]


def grid(sched: Sequence[Sequence[Action]], *, bwd_steps: int = 1, idle: str = ".") -> str:
    """A step × stage grid of the compute actions (``F3``, ``B1``...), like HARP Fig. 2.

    Each forward takes one step and each backward ``bwd_steps`` steps (later cells show ``~``);
    messages are free and every action starts as soon as its stage and inputs allow (the
    discrete-event simulator with unit times). Rows are stages, columns steps; reading a row left
    to right gives that stage's compute actions in list order.
    """
    from .simulate import simulate  # the grid is the simulator's timeline at unit times

    S = len(sched)
    res = simulate(sched, [1.0] * S, [float(bwd_steps)] * S, [0.0] * max(S - 1, 0))
    steps = round(res.step_time)
    cells = [[idle] * steps for _ in range(S)]
    for e in res.events:
        if e.kind in COMPUTE:
            t0, t1 = round(e.start), round(e.end)
            cells[e.stage][t0] = f"{e.kind}{e.micro}"
            for t in range(t0 + 1, t1):
                cells[e.stage][t] = "~"
    width = max([len(c) for row in cells for c in row] + [len(str(steps - 1))]) + 1
    head_w = len(f"stage {S - 1}") + 1
    lines = ["step".ljust(head_w) + "".join(str(t).ljust(width) for t in range(steps))]
    for i, row in enumerate(cells):
        lines.append(f"stage {i}".ljust(head_w) + "".join(c.ljust(width) for c in row))
    return "\n".join(line.rstrip() for line in lines)
