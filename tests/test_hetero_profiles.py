"""benchmarks/hetero_speedup.py plans on every measured number's median over its profiles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hapc.cluster import Cluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from hetero_speedup import median_cluster  # noqa: E402


def _profile(fast: tuple[float, float, float], slow: tuple[float, float, float], alpha: float) -> Cluster:
    """A profiled pair of groups: (flops, mem_bandwidth, op_overhead) each, one all-reduce alpha."""
    link = {"bandwidth": 1e9 / alpha, "latency": alpha}
    return Cluster.from_dict(
        {
            "name": "profiled",
            "group": [
                {"name": n, "devices": 1, "memory": 8e9, "flops": f, "mem_bandwidth": b, "op_overhead": o}
                for n, (f, b, o) in (("cpu-at-100%", fast), ("cpu-at-50%", slow))
            ],
            "links": {"intra_host": link, "inter_host": link},
            "collectives": {"all_reduce": {"alpha": alpha, "beta": 1e-9}},
        }
    )


def test_every_rate_is_its_own_median_over_the_profiles():
    # the profile whose flops ratio is the median (the second) has the outlying bandwidth draw: each
    # rate is taken apart, so the plan sees bandwidth 12 (the median of 9, 12, 14), not 9
    profiles = [
        _profile((100e9, 25e9, 9e-6), (45e9, 14e9, 19e-6), 4e-4),
        _profile((100e9, 26e9, 9e-6), (47e9, 9e9, 20e-6), 6e-4),
        _profile((100e9, 24e9, 10e-6), (50e9, 12e9, 18e-6), 5e-4),
    ]
    fast, slow = median_cluster(profiles).groups
    assert (fast.flops, fast.mem_bandwidth, fast.op_overhead) == (100e9, 25e9, 9e-6)
    assert (slow.flops, slow.mem_bandwidth, slow.op_overhead) == (47e9, 12e9, 19e-6)
    merged = median_cluster(profiles)
    assert merged.alpha_beta("all_reduce").alpha == pytest.approx(5e-4)
    assert merged.intra_host.latency == pytest.approx(5e-4)


def test_one_profile_is_planned_as_measured():
    one = _profile((100e9, 25e9, 9e-6), (47e9, 9e9, 20e-6), 6e-4)
    assert median_cluster([one]).to_dict() == one.to_dict()
