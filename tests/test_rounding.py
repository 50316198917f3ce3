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
