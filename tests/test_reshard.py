"""Routing a stage's output rows to the next stage (HetAuto §5.2): every needed row arrives exactly
once per receiver, each slice crosses the link once, relays spread over the receivers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hapc.errors import HapcError
from hapc.pipeline.reshard import Slice, needs, routes, slices


def _sizes(draw, rows, n, allow_zero):
    cuts = sorted(draw(st.lists(st.integers(0, rows), min_size=n - 1, max_size=n - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, rows])]
    return sizes if allow_zero or all(sizes) else [rows // n + (i < rows % n) for i in range(n)]


@st.composite
def layouts(draw):
    rows = draw(st.integers(1, 40))
    senders, receivers = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    s_sizes = None if draw(st.booleans()) else _sizes(draw, rows, senders, True)
    r_sizes = None if draw(st.booleans()) else _sizes(draw, rows, receivers, True)
    return rows, list(range(senders)), list(range(10, 10 + receivers)), s_sizes, r_sizes


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_needed_row_arrives_once_and_each_slice_crosses_once(layout):
    rows, send_ranks, recv_ranks, s_sizes, r_sizes = layout
    held = slices(send_ranks, s_sizes, rows)
    need = needs(recv_ranks, r_sizes, rows)
    rts = routes(held, need)
    assert len({(r.src, r.lo, r.hi) for r in rts}) == len(rts)  # one crossing per slice
    for r, (lo, hi) in need.items():
        got = sorted((a, b) for rt in rts for q, a, b in rt.copies if q == r)
        covered = [i for a, b in got for i in range(a, b)]
        assert covered == list(range(lo, hi))  # each needed row once, nothing else
    for rt in rts:
        assert rt.relay in [q for q, _, _ in rt.copies]
        assert all(rt.lo <= a < b <= rt.hi for _, a, b in rt.copies)


def test_relays_spread_over_receivers_that_need_everything():
    rts = routes([Slice(0, 0, 4), Slice(1, 4, 8), Slice(2, 8, 12)], needs([5, 6], None, 12))
    assert [r.relay for r in rts] == [5, 6, 5]


def test_a_row_nobody_holds_is_an_error():
    with pytest.raises(HapcError, match="held by no sender"):
        routes([Slice(0, 0, 3)], {7: (0, 5)})
