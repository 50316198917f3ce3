"""Cost profiles of Hoare triples: every quantity is *linear* in the sharding ratios (HAP §3.2, §5).

Device ``j`` holds the fraction ``B_j`` of every sharded dimension (``sum_j B_j = 1``). A triple's
work on device ``j`` is ``Linear(const, per_ratio).at(B_j) = const + per_ratio * B_j``: an op whose
iteration space is split by a sharded dimension does ``per_ratio = total`` work, a replicated op
``const = total``. Communication is described by what moves, not by how long it takes, so the
theory stays device-free; the cost model (``hapc.synth``) turns a :class:`Comm` into seconds with
the cluster's alpha-beta fit for ``primitive``:

=============  ===========================================  ======================================
``scaling``    bytes on the wire per call                    used by
=============  ===========================================  ======================================
``"max"``      ``nbytes * max_j B_j`` (one call)             padded collectives: pad to the largest
``"each"``     ``nbytes * B_j`` (one call per device ``j``)  grouped collectives (m broadcasts)
``"full"``     ``nbytes`` (one call)                         all-reduce, replicated-size messages
=============  ===========================================  ======================================

All three are linear in ``B`` once ``max_j B_j`` is an LP variable, which keeps HAP's load
balancer an LP (§5.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIMITIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")
SCALINGS = ("max", "each", "full")


@dataclass(frozen=True, slots=True)
class Linear:
    """``const + per_ratio * B_j``: a per-device quantity linear in that device's ratio."""

    const: float = 0.0
    per_ratio: float = 0.0

    def at(self, ratio: float) -> float:
        return self.const + self.per_ratio * ratio

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.const + other.const, self.per_ratio + other.per_ratio)

    def __mul__(self, k: float) -> Linear:
        return Linear(self.const * k, self.per_ratio * k)

    @property
    def total(self) -> float:
        """The value on a device holding everything (``B_j = 1``)."""
        return self.const + self.per_ratio

    @staticmethod
    def split(amount: float, scaled: bool) -> Linear:
        """``amount`` divided by the ratios when ``scaled``, else repeated on every device."""
        return Linear(0.0, amount) if scaled else Linear(amount, 0.0)

    def __repr__(self) -> str:
        if self.per_ratio and self.const:
            return f"{self.const:.3g}+{self.per_ratio:.3g}·B"
        if self.per_ratio:
            return f"{self.per_ratio:.3g}·B"
        return f"{self.const:.3g}"


ZERO = Linear()


@dataclass(frozen=True, slots=True)
class Comm:
    """One collective: ``primitive`` moving a reference tensor of ``nbytes``, scaled per the table."""

    primitive: str
    nbytes: float
    scaling: str

    def __post_init__(self) -> None:
        if self.primitive not in PRIMITIVES:
            raise ValueError(f"unknown collective primitive {self.primitive!r}; one of {PRIMITIVES}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; one of {SCALINGS}")

    def __repr__(self) -> str:
        return f"{self.primitive}[{self.scaling}]({self.nbytes:.3g}B)"


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Forward and backward work of one triple on device ``j``, all linear in ``B_j``.

    ``*_flops`` is arithmetic, ``*_bytes`` memory traffic (for memory-bound ops); ``fwd_comm`` /
    ``bwd_comm`` the collectives, which open a new stage (HAP Fig. 6). ``grad_comm`` is the
    all-reduce of a replicated parameter's gradient: bucketed and issued after the backward (as
    DDP does), so it adds its time without cutting a stage. ``param_bytes`` and ``act_bytes`` are
    the resident parameter and saved-activation bytes this triple adds, for memory constraints.
    """

    fwd_flops: Linear = ZERO
    bwd_flops: Linear = ZERO
    fwd_bytes: Linear = ZERO
    bwd_bytes: Linear = ZERO
    fwd_comm: tuple[Comm, ...] = ()
    bwd_comm: tuple[Comm, ...] = ()
    grad_comm: tuple[Comm, ...] = ()
    param_bytes: Linear = ZERO
    act_bytes: Linear = ZERO
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __add__(self, other: CostProfile) -> CostProfile:
        return CostProfile(
            self.fwd_flops + other.fwd_flops,
            self.bwd_flops + other.bwd_flops,
            self.fwd_bytes + other.fwd_bytes,
            self.bwd_bytes + other.bwd_bytes,
            self.fwd_comm + other.fwd_comm,
            self.bwd_comm + other.bwd_comm,
            self.grad_comm + other.grad_comm,
            self.param_bytes + other.param_bytes,
            self.act_bytes + other.act_bytes,
            self.notes + other.notes,
        )

    @property
    def has_comm(self) -> bool:
        return bool(self.fwd_comm or self.bwd_comm)


FREE = CostProfile()
