"""Moving a stage's output rows to the next stage's ranks: one relay per layout slice (HetAuto §5.2).

A stage's output is ``[rows, features]`` (the batch is the rows). The sending stage holds it as
*slices*: every rank its own rows when the output is batch-sharded, or the first rank all of them
when it is replicated. Each rank of the receiving stage *needs* a row range: its own rows when its
program takes the activations batch-sharded, all rows otherwise. Sending every needed piece
straight across the (slow) link between the stages would cross it once per receiver; instead,
each slice crosses it **once**, to a *relay* -- the receiving rank that needs most of it, relays
spread over the receivers on ties -- which forwards the overlaps the other receivers need over the
fast links inside its group.

The backward pass mirrors it: every receiver sends the gradient of its overlap with a slice to
that slice's relay, which sums the contributions (a row needed by several receivers has a Partial
gradient, DESIGN §3) and sends the slice's gradient back across the link, once.

    >>> held = [Slice(0, 0, 5), Slice(1, 5, 8)]          # two senders, rows 0-4 and 5-7
    >>> need = {2: (0, 8), 3: (0, 8)}                     # both receivers need every row
    >>> [(r.src, r.relay, r.copies) for r in routes(held, need)]
    [(0, 2, [(2, 0, 5), (3, 0, 5)]), (1, 3, [(2, 5, 8), (3, 5, 8)])]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import HapcError


@dataclass(frozen=True)
class Slice:
    """Rows ``lo:hi`` of a stage output, held by global rank ``rank``."""

    rank: int
    lo: int
    hi: int


@dataclass
class Route:
    """How the slice ``lo:hi`` held by ``src`` reaches the receivers: across the link to ``relay``,
    then ``copies`` -- ``(rank, lo, hi)``, the overlap each receiver needs (the relay's included)."""

    src: int
    lo: int
    hi: int
    relay: int
    copies: list[tuple[int, int, int]] = field(default_factory=list)


def routes(held: Sequence[Slice], need: Mapping[int, tuple[int, int]]) -> list[Route]:
    """One route per slice that any receiver needs, in the order of ``held``.

    Raises :class:`HapcError` when a needed row is held by no sender."""
    out = []
    load: dict[int, int] = dict.fromkeys(need, 0)  # rows each receiver already relays
    for s in held:
        copies = []
        for r in sorted(need):
            lo, hi = max(s.lo, need[r][0]), min(s.hi, need[r][1])
            if lo < hi:
                copies.append((r, lo, hi))
        if copies:
            # the receiver that needs most of the slice; ties go to the one relaying least so far
            relay = max(copies, key=lambda c: (c[2] - c[1], -load[c[0]], -c[0]))[0]
            load[relay] += s.hi - s.lo
            out.append(Route(s.rank, s.lo, s.hi, relay, copies))
    for r, (lo, hi) in need.items():
        covered = sorted((c[1], c[2]) for rt in out for c in rt.copies if c[0] == r)
        at = lo
        for a, b in covered:
            if a > at:
                break
            at = max(at, b)
        if at < hi:
            raise HapcError(f"rank {r} needs rows {lo}..{hi - 1} of the stage output but row {at} is held by no sender")
    return out


def slices(ranks: Sequence[int], sizes: Sequence[int] | None, rows: int) -> list[Slice]:
    """The sending stage's slices: ``sizes[i]`` rows on ``ranks[i]`` (batch-sharded), or all rows on
    the first rank (``sizes=None``: replicated, every rank holds them all and one sends)."""
    if sizes is None:
        return [Slice(ranks[0], 0, rows)]
    if sum(sizes) != rows or len(sizes) != len(ranks):
        raise HapcError(f"shard sizes {list(sizes)} over ranks {list(ranks)} do not cover {rows} rows")
    out, at = [], 0
    for r, n in zip(ranks, sizes):
        if n:
            out.append(Slice(r, at, at + n))
        at += n
    return out


def needs(ranks: Sequence[int], sizes: Sequence[int] | None, rows: int) -> dict[int, tuple[int, int]]:
    """What each receiving rank needs: its own rows (``sizes``, batch-sharded) or all of them."""
    if sizes is None:
        return {r: (0, rows) for r in ranks}
    out, at = {}, 0
    for r, n in zip(ranks, sizes):
        out[r] = (at, at + n)
        at += n
    return out
