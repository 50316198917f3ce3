from hypothesis import given
from hypothesis import strategies as st

from hapc.balance.rounding import bounds, round_shares


@given(st.integers(0, 500), st.lists(st.floats(0.01, 1.0), min_size=1, max_size=6))
def test_shares_sum_and_are_close(total, ratios):
    sizes = round_shares(total, ratios)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    exact = [total * r / sum(ratios) for r in ratios]
    assert all(abs(s - e) < 2 + total / 100 for s, e in zip(sizes, exact))
    if total >= len(ratios):
        assert min(sizes) >= 1  # nobody idles while there is work to share


def test_hap_examples_and_bounds():
    assert round_shares(10, [0.5, 0.3, 0.2]) == [5, 3, 2]
    assert round_shares(7, [1, 1, 1]) == [3, 2, 2]
    assert round_shares(8, [0.9, 0.05, 0.05]) == [6, 1, 1]
    assert bounds([3, 2, 2]) == [(0, 3), (3, 5), (5, 7)]


# HAP §5.1's rule, by hand: round to nearest (half to even), then move one atom at a time on the
# device whose rounding error the move reduces most, ties to the lower index; an empty active
# device then takes one atom from the share furthest above its exact value.
PINNED = [
    (7, [1, 1, 1], [3, 2, 2]),  # 2.33 each -> 2, 2, 2; the leftover to device 0 (tie)
    (5, [0.3, 0.3, 0.4], [1, 2, 2]),  # 1.5 -> 2, 1.5 -> 2, 2 -> 2: one atom back, from device 0 (tie)
    (9, [0.7, 0.15, 0.15], [6, 2, 1]),  # 6.3, 1.35, 1.35 -> 6, 1, 1: the leftover to the largest error (0.35)
    (14, [0.41, 0.41, 0.18], [6, 6, 2]),  # 5.74, 5.74, 2.52 -> 6, 6, 3: one back from the most rounded-up
    (10, [0.45, 0.45, 0.1], [5, 4, 1]),  # 4.5, 4.5 -> 4, 4 (half to even): the leftover to device 0
    (13, [0.5, 0.26, 0.24], [7, 3, 3]),
    (6, [0.45, 0.35, 0.2], [3, 2, 1]),
    (3, [0.9, 0.05, 0.05], [1, 1, 1]),  # nobody idles: 3, 0, 0 -> 1, 1, 1
    (4, [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]),  # fewer atoms than devices: 0.8 each
]


def test_rounding_follows_haps_rule_on_pinned_cases():
    for total, ratios, want in PINNED:
        assert round_shares(total, ratios) == want, (total, ratios)


@given(st.integers(0, 300), st.lists(st.floats(0.01, 1.0), min_size=1, max_size=6))
def test_rounding_errors_cannot_be_reduced_by_moving_an_atom(total, ratios):
    """Without the no-idle fix-up, HAP's rule minimises the total rounding error: no atom can
    move from a device rounded up to one rounded down and reduce it, and no share is off by 1."""
    exact = [total * r / sum(ratios) for r in ratios]
    if min(exact) < 1:
        return  # the no-idle fix-up may intervene
    sizes = round_shares(total, ratios)
    assert all(abs(s - e) < 1 + 1e-9 for s, e in zip(sizes, exact))
    for i, (si, ei) in enumerate(zip(sizes, exact)):
        for j, (sj, ej) in enumerate(zip(sizes, exact)):
            if i != j and si > ei and sj < ej:
                # moving the atom makes the errors 1 - (si - ei) and 1 - (ej - sj): no better
                assert (si - ei) + (ej - sj) <= 1 + 1e-9, (sizes, exact)
