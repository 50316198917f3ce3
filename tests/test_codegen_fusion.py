"""The per-rank program calls a layer with its bias where the plan adds the bias locally (codegen).

Tracing splits ``nn.Linear`` and ``nn.Conv*d`` into the product and a bias add (so a row-parallel
layer can add its bias after the reduction). Where the plan adds it locally right away the program
fuses them back into the single-device call: for a convolution the split form costs two extra
passes over the activation (the add, and the bias gradient's sum over batch and space), measured
10-15% of a small CNN's data-parallel step on CPU (benchmarks/hetero_speedup.py). These tests check
the code each rank runs (fused where local, apart where the bias follows a collective) and that a
fused program still trains exactly like one device (float64).
"""

from __future__ import annotations

import re

import torch
from harness import check_plan

import hapc
from hapc import models
from hapc.codegen.emit import emit_code
from hapc.testing import cluster_of

F64 = torch.float64
MKW = {"dtype": F64}


def _codes(plan, tmp_path) -> list[str]:
    paths = emit_code(plan, plan._theory, tmp_path)
    return [p.read_text() for p in paths if p.suffix == ".py"]


def _cnn_plan(cluster, **kw):
    model, inputs = models.load("cnn", **MKW)
    return hapc.synthesize(model, cluster, inputs, **kw)


def test_data_parallel_convolutions_take_their_bias(tmp_path):
    cluster = cluster_of([5e9, 3e9])
    plan = _cnn_plan(cluster, baseline="dp-cp")
    for code in _codes(plan, tmp_path):
        convs = re.findall(r"torch\.conv2d\(([^\n]*)\)", code)
        assert len(convs) == 2, code
        for args in convs:
            assert args.split(", ")[2].startswith("self.") and args.split(", ")[2].endswith("_bias"), args
        assert "_bias.view(" not in code and "_bias.reshape(" not in code, code
    check_plan("cnn", MKW, cluster, plan, 2)


def test_sharded_convolution_bias_fused_and_row_parallel_bias_kept_apart(tmp_path):
    """On a slow network the optimum splits a convolution on its output channels (the bias shard
    reshaped to this rank's channel count: fused) and a linear on its input features (its output is
    Partial: the bias is added after the all-reduce, not fused); the program equals one device."""
    cluster = cluster_of([5e9, 3e9, 2e9], bandwidth="10 MB/s")
    plan = _cnn_plan(cluster)
    codes = _codes(plan, tmp_path)
    sharded_conv = [
        lay for name, lay in plan_sources(plan).items() if name.startswith("features.") and name.endswith("weight")
    ]
    assert "S(0)" in sharded_conv, plan_sources(plan)  # the case exercises a sharded convolution
    for code in codes:
        assert "torch.conv2d(" in code and "None, (1, 1)" not in code, code
        assert not re.search(r"_bias\.(view|reshape)\(", code), code
    # the row-parallel linear's bias follows its all-reduce (in the product's dtype, as F.linear's)
    after_reduce = r"= C\.all_reduce\(linear\w*, self\.group\)\n\s+\w+ = hapc\.ops\.add_bias\(\w+, self\.\w+_bias\)"
    assert any(re.search(after_reduce, c) for c in codes)
    check_plan("cnn", MKW, cluster, plan, 3)


def plan_sources(plan) -> dict[str, str]:
    from hapc.theory.instructions import Source

    th = plan._theory
    return {
        th.graph[i.ref].target: str(i.layout)
        for i in plan.instructions
        if isinstance(i, Source) and th.graph[i.ref].kind == "param"
    }
