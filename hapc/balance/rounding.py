"""Integer shard sizes from fractional sharding ratios (HAP §5.1, last paragraph).

The LP gives real ratios ``B``; a dimension of ``n`` atoms (see ``hapc.theory.granularity``) must be
cut into integers summing to ``n``. HAP's rule: round each ``n * B_j`` to the nearest integer, then
while the sum is off, move one atom on the device whose rounding error that move reduces most.
Ties go to the lower device index, so every process computes the same split. Every device with a
positive ratio gets at least one atom when there are enough.
"""

from __future__ import annotations

from collections.abc import Sequence


def round_shares(total: int, ratios: Sequence[float]) -> list[int]:
    """Split ``total`` integer atoms by ``ratios`` (non-negative, any positive sum).

    >>> round_shares(10, [0.5, 0.3, 0.2])
    [5, 3, 2]
    >>> round_shares(7, [1, 1, 1])
    [3, 2, 2]
    """
    if total < 0:
        raise ValueError(f"cannot split a negative size {total}")
    if not ratios or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ValueError(f"ratios must be non-negative with a positive sum, got {list(ratios)}")
    s = float(sum(ratios))
    exact = [total * r / s for r in ratios]
    sizes = [round(x) for x in exact]
    diff = total - sum(sizes)
    while diff > 0:
        j = max(range(len(sizes)), key=lambda i: (exact[i] - sizes[i], -i))
        sizes[j] += 1
        diff -= 1
    while diff < 0:
        j = min((i for i in range(len(sizes)) if sizes[i] > 0), key=lambda i: (exact[i] - sizes[i], i))
        sizes[j] -= 1
        diff += 1
    # No device with a positive ratio is left empty while there are enough atoms: an empty shard
    # wastes the device and some ops (pooling, convolution) reject zero-size dims.
    active = [i for i, x in enumerate(ratios) if x > 0]
    if total >= len(active):
        for i in active:
            if sizes[i] == 0:
                j = max((k for k in active if sizes[k] > 1), key=lambda k: (sizes[k] - exact[k], sizes[k], -k))
                sizes[j] -= 1
                sizes[i] += 1
    return sizes


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of consecutive shards with the given sizes."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out
