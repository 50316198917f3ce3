"""Cluster files read units by kind and refuse magnitudes that look like a unit slip (issue 13)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hapc.cli import main
from hapc.cluster import Cluster, parse_quantity
from hapc.errors import ClusterError
from hapc.presets import PRESETS
from hapc.profile import DeviceReport, build_cluster
from hapc.quantities import BANDWIDTH, FLOPS, SIZE, TIME

ROOT = Path(__file__).resolve().parents[1]

GOOD = {
    "flops": '"20 TFLOPS"',
    "memory": '"16 GiB"',
    "mem_bandwidth": '"900 GB/s"',
    "op_overhead": '"5 us"',
    "bandwidth": '"25 GB/s"',
    "latency": '"20 us"',
    "beta": "2e-10",
}


def _file(tmp_path: Path, **fields: str) -> Path:
    f = {**GOOD, **fields}
    text = f"""name = "lab"
[[group]]
name = "fast"
devices = 2
flops = {f["flops"]}
memory = {f["memory"]}
mem_bandwidth = {f["mem_bandwidth"]}
op_overhead = {f["op_overhead"]}
[[group]]
name = "slow"
devices = 1
flops = "5 TFLOPS"
memory = "8 GiB"
[links]
inter_host = {{ bandwidth = {f["bandwidth"]}, latency = {f["latency"]} }}
between = [ {{ groups = ["fast", "slow"], bandwidth = "1 Gbps", latency = "1 ms" }} ]
[collectives]
all_reduce = {{ alpha = 1e-5, beta = {f["beta"]} }}
"""
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


def test_the_good_file_loads(tmp_path):
    c = Cluster.load(_file(tmp_path))
    assert c.groups[0].flops == 20e12 and c.inter_host.bandwidth == 25e9
    assert c.inter_host.latency == pytest.approx(20e-6)


@pytest.mark.parametrize(
    ("field", "value", "where", "kind", "accepted"),
    [
        ("bandwidth", '"2 GB"', "links.inter_host.bandwidth", "a size, but this field is a bandwidth", "Gbps"),
        ("latency", '"5 GB/s"', "links.inter_host.latency", "a bandwidth, but this field is a time", "us"),
        ("memory", '"16 GB/s"', "group 'fast': memory", "a bandwidth, but this field is a size", "GiB"),
        ("flops", '"20 GB/s"', "group 'fast': flops", "a bandwidth, but this field is a flop rate", "TFLOPS"),
        ("mem_bandwidth", '"1.5 TB"', "group 'fast': mem_bandwidth", "a size, but this field is a bandwidth", "TB/s"),
        ("op_overhead", '"5 TFLOPS"', "group 'fast': op_overhead", "a flop rate, but this field is a time", "ms"),
        ("beta", '"1 GB/s"', "collectives.all_reduce.beta", "a bandwidth, but this field is a seconds per", "plain"),
    ],
)
def test_a_unit_of_the_wrong_kind_names_file_field_value_and_units(tmp_path, field, value, where, kind, accepted):
    path = _file(tmp_path, **{field: value})
    with pytest.raises(ClusterError) as err:
        Cluster.load(path)
    msg = str(err.value)
    assert str(path) in msg and where in msg and repr(value.strip('"')) in msg and kind in msg and accepted in msg


@pytest.mark.parametrize(
    ("field", "value", "where", "expected"),
    [
        ("bandwidth", '"1e-30 GB/s"', "links.inter_host.bandwidth", "1 MB/s .. 100 TB/s"),
        ("bandwidth", "25", "links.inter_host.bandwidth", "1 MB/s .. 100 TB/s"),  # 25 bytes/s: GB/s forgotten
        ("latency", '"1e9 s"', "links.inter_host.latency", "0 .. 10 s"),
        ("latency", "20", "links.inter_host.latency", "0 .. 10 s"),  # 20 s: us forgotten
        ("memory", "40", "group 'fast': memory", "1 MiB .. 100 TiB"),
        ("memory", '"200 TiB"', "group 'fast': memory", "1 MiB .. 100 TiB"),
        ("flops", "156", "group 'fast': flops", "100 MFLOP/s .. 100 PFLOP/s"),
        ("flops", '"1e6 PFLOPS"', "group 'fast': flops", "100 MFLOP/s .. 100 PFLOP/s"),
        ("mem_bandwidth", '"1.5 KB/s"', "group 'fast': mem_bandwidth", "1 MB/s .. 100 TB/s"),
        ("op_overhead", '"1 min"', "group 'fast': op_overhead", "cannot read"),
        ("beta", "0.5", "collectives.all_reduce.beta", "at least 1 MB/s"),
    ],
)
def test_an_absurd_magnitude_looks_wrong(tmp_path, field, value, where, expected):
    path = _file(tmp_path, **{field: value})
    with pytest.raises(ClusterError) as err:
        Cluster.load(path)
    msg = str(err.value)
    assert str(path) in msg and where in msg and expected in msg
    if expected != "cannot read":
        assert "looks wrong" in msg


@pytest.mark.parametrize("spec", [*PRESETS, "hap-testbed:8", "hap-testbed:16", "local-cpu:1", "local-cpu:8"])
def test_every_preset_is_within_range(spec):
    assert Cluster.load(spec).num_devices >= 1


def test_every_cluster_file_in_the_repository_is_within_range():
    files = subprocess.run(["git", "ls-files", "*.toml"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    # every TOML file with device groups (pyproject.toml and benchmarks/mutants.toml are not clusters)
    clusters = [f for f in files if "[[group]]" in (ROOT / f).read_text()]
    assert clusters, "examples/two-groups.toml at least"
    for f in clusters:
        Cluster.load(ROOT / f)


def test_profiled_clusters_are_within_range(tmp_path):
    """What ``hapc profile`` writes loads back, also with flat timings (beta 0) or a tiny fitted beta."""
    reports = [DeviceReport("h0", "cpu", 1.4e10, 8.8e9, 1.2e10, 2e-5)] * 2
    for beta in (0.0, 1e-16, 1e-10):
        path = tmp_path / f"p{beta}.toml"
        build_cluster(reports, {"broadcast": (2e-4, beta, []), "all_reduce": (2e-4, beta, [])}).save(path)
        assert Cluster.load(path).inter_host.bandwidth <= 1e12


def test_dicts_are_kind_checked_but_may_be_toy_sized():
    """Tests scale clusters down (MFLOP/s devices, KB/s links) to make tiny models interesting."""
    toy = {
        "group": [{"name": "d", "devices": 1, "flops": 1.7e6, "memory": "2 KiB"}],
        "links": {"inter_host": {"bandwidth": 5e4, "latency": 0.0}},
    }
    assert Cluster.load(toy).groups[0].flops == 1.7e6
    with pytest.raises(ClusterError, match="looks wrong"):
        Cluster.from_dict(toy, check_ranges=True)
    with pytest.raises(ClusterError, match="is a size, but this field is a bandwidth"):
        Cluster.load({**toy, "links": {"inter_host": {"bandwidth": "2 GB"}}})


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("10 Gbps", BANDWIDTH, 1.25e9),
        ("2 GiB/s", BANDWIDTH, 2 * 2**30),
        ("100 MB/s", BANDWIDTH, 1e8),
        ("16 GiB", SIZE, 16 * 2**30),
        ("14 TFLOP/s", FLOPS, 14e12),
        ("1 PFLOPS", FLOPS, 1e15),
        ("5 us", TIME, 5e-6),
        ("1e-3", TIME, 1e-3),
        (3, SIZE, 3.0),
    ],
)
def test_units_of_each_kind(text, kind, value):
    assert parse_quantity(text, "x", kind) == pytest.approx(value)
    assert parse_quantity(text, "x") == pytest.approx(value)  # without a kind: any unit (old callers)


def test_profile_sizes_must_be_sizes(capsys):
    assert main(["profile", "--local", "2", "--sizes", "1KiB,2 GB/s"]) == 2
    assert "--sizes: '2 GB/s' is a bandwidth, but this field is a size" in capsys.readouterr().err
