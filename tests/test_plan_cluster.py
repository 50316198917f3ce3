"""Cluster files and plans: validation, presets, JSON round trips, clear refusals."""

import json

import pytest

import hapc
from hapc import models
from hapc.cli import main
from hapc.cluster import Cluster, parse_quantity
from hapc.errors import ClusterError, PlanError
from hapc.presets import PRESETS

GOOD = """
name = "lab"
[[group]]
name = "fast"
devices = 2
devices_per_host = 2
flops = "20 TFLOPS"
memory = "16 GiB"
[[group]]
name = "slow"
devices = 1
flops = 5e12
memory = "8 GB"
[links]
intra_host = { bandwidth = "100 GB/s", latency = "5 us" }
inter_host = { bandwidth = "10 Gbps", latency = "50 us" }
between = [ { groups = ["fast", "slow"], bandwidth = "1 Gbps", latency = "1 ms" } ]
[collectives]
all_reduce = { alpha = 1e-4, beta = 1e-9 }
"""


def test_cluster_file_round_trip(tmp_path):
    path = tmp_path / "lab.toml"
    path.write_text(GOOD)
    c = Cluster.load(path)
    assert [g.name for g in c.groups] == ["fast", "slow"] and c.num_devices == 3
    assert c.groups[0].flops == 20e12 and c.groups[0].memory == 16 * 2**30
    assert c.bottleneck().bandwidth == parse_quantity("1 Gbps", "x")  # the cross-group link
    assert c.alpha_beta("all_reduce").alpha == 1e-4  # fitted values win
    again = tmp_path / "again.toml"
    c.save(again)
    assert Cluster.load(again) == c


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.replace("devices = 2\n", "devices = 0\n", 1), "devices must be a positive integer"),
        (lambda s: s.replace('bandwidth = "10 Gbps"', "bandwidth = -5"), "must be positive"),
        (lambda s: s.replace('["fast", "slow"]', '["fast", "medium"]'), "unknown group 'medium'"),
        (lambda s: s.replace('name = "lab"', 'name = "lab"\ncolour = "blue"'), "unknown key(s) ['colour']"),
        (lambda s: s.replace("flops = 5e12\n", ""), "missing field 'flops'"),
        (lambda s: s.replace('flops = "20 TFLOPS"', 'flops = "fast"'), "cannot read 'fast'"),
        (lambda s: s.replace("[links]", "[links"), "not valid TOML"),
    ],
)
def test_cluster_file_errors_name_the_problem(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(edit(GOOD))
    with pytest.raises(ClusterError) as err:
        Cluster.load(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_every_preset_loads():
    for name in PRESETS:
        c = Cluster.load(name)
        assert c.num_devices >= 1 and c.fingerprint()
    assert Cluster.load("hap-testbed").num_devices == 64
    assert Cluster.load("hap-testbed:16").groups[0].name == "v100"
    assert Cluster.load("local-cpu:3").num_devices == 3
    with pytest.raises(ClusterError, match="no such file and not a preset"):
        Cluster.load("nonexistent-cluster")


def test_plan_round_trip_and_refusals(tmp_path):
    model, inputs = models.load("mlp")
    plan = hapc.synthesize(model, "local-cpu:3", inputs)
    path = tmp_path / "plan.json"
    plan.save(path)
    graph = hapc.trace(model, inputs)
    loaded = hapc.Plan.load(path, graph=graph, cluster=Cluster.load("local-cpu:3"))
    assert loaded.instructions == plan.instructions and loaded.device_ratios == plan.device_ratios
    assert loaded.time == plan.time
    other_model, other_inputs = models.load("cnn")
    with pytest.raises(PlanError, match="another model"):
        hapc.Plan.load(path, graph=hapc.trace(other_model, other_inputs))
    with pytest.raises(PlanError, match="cluster 'local-cpu-3'"):
        hapc.Plan.load(path, cluster=Cluster.load("local-cpu:4"))
    with pytest.raises(PlanError, match="for 3 devices but the process group has 2"):
        loaded.check(world_size=2)
    data = json.loads(path.read_text())
    (tmp_path / "v.json").write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(PlanError, match="version 99"):
        hapc.Plan.load(tmp_path / "v.json")
    (tmp_path / "cut.json").write_text(path.read_text()[:100])
    with pytest.raises(PlanError, match="not valid JSON"):
        hapc.Plan.load(tmp_path / "cut.json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(PlanError, match="not a hapc plan"):
        hapc.Plan.load(tmp_path / "other.json")


def test_synth_command(capsys, tmp_path):
    out = tmp_path / "p.json"
    assert main(["synth", "mlp", "--cluster", "local-cpu:3", "--show-program", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for piece in ["predicted", "sharding ratios", "collectives:", "SFB sites:", "program", "synthesis time"]:
        assert piece in text
    assert json.loads(out.read_text())["format"] == "hapc-plan"
    assert main(["synth", "mlp", "--cluster", "local-cpu:3", "--baseline", "dp-ev"]) == 0
    assert "baseline dp-ev" in capsys.readouterr().out
