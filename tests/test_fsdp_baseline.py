"""The FSDP (ZeRO-3) baseline: its plans shard parameters, train like one device, and are priced so.

``baseline="fsdp"`` (:mod:`hapc.synth.baselines`) is data parallelism with every parameter held
sharded and all-gathered before use, its gradient reduce-scattered back to the shard. Checked here:

* equivalence on gloo processes in float64: ``hapc.compile(model, cluster, inputs, baseline="fsdp")``
  on 2 processes (even ratios) and on 3 with fixed uneven ratios, for the MLP and the zoo's GPT --
  the loss, every whole gradient and the weights and optimizer state after 3 SGD-momentum / Adam
  steps equal one device's to ~1e-12 relative; each rank holds only its slice of every sharded
  parameter (the plan's ``Source`` layouts and the module's own tensors);
* the plumbing: ``hapc.synthesize`` derives with ``param_comm=True`` for it; a theory derived
  without parameter collectives is refused naming the fix;
* the memory model: each device is charged its share of the sharded parameters x 4 (weights,
  gradients, two Adam moments) plus the whole gathered weight it holds for the backward, and no
  gradient all-reduce for them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import assert_close, single_device, train

import hapc
from hapc import models
from hapc.api import synthesize_theory
from hapc.testing import cluster_of, run_distributed
from hapc.theory.graph import PARAM

F64 = torch.float64
TWO = cluster_of([5e9, 5e9])
THREE = cluster_of([5e9, 3e9, 2e9])
UNEVEN = [0.5, 0.3, 0.2]  # one per device (each is its own group), summing to 1


def _sharded_params(plan: Any) -> dict[str, int]:
    """The parameters the plan sources sharded: node name -> dim."""
    out = {}
    for ins in plan.instructions:
        if type(ins).__name__ == "Source" and ins.layout.is_sharded:
            out[plan.node_names[ins.ref]] = ins.layout.dim
    return out


def _job(rank: int, world: int, alias: str, mkw: dict, cluster: Any, ratios: Any, steps: int, opt: str) -> dict:
    torch.set_num_threads(1)
    model, inputs = models.load(alias, **mkw)
    full = {k: tuple(p.shape) for k, p in model.named_parameters()}
    module = hapc.compile(model, cluster, inputs, baseline="fsdp", ratios=ratios)
    # what this rank really holds: its slice of each sharded parameter
    local = {k: tuple(p.shape) for k, p in module.named_parameters()}
    loss = module(*inputs)
    loss.backward()
    grads = module.full_gradients()
    losses, optimizer = train(module, inputs, loss.detach().item(), steps, opt)
    return {
        "loss": losses[0],
        "grads": grads,
        "losses": losses,
        "state": module.full_state_dict(optimizer),
        "sharded": _sharded_params(module.plan),
        "collectives": sorted({(i.op, module.plan.node_names[i.ref]) for i in module.plan.collectives()}),
        "ratios": list(module.plan.device_ratios),
        "baseline": module.plan.baseline,
        "local": local,
        "full": full,
    }


CASES = [
    # (alias, model kwargs, cluster, processes, ratios, optimizer)
    ("mlp", {"dtype": F64}, TWO, 2, None, "sgd"),
    ("mlp", {"dtype": F64}, THREE, 3, UNEVEN, "adam"),
    ("gpt", {"dtype": F64}, TWO, 2, None, "adam"),
    ("gpt", {"dtype": F64}, THREE, 3, UNEVEN, "sgd"),
]


@pytest.mark.parametrize("alias,mkw,cluster,world,ratios,opt", CASES, ids=[f"{c[0]}-{c[3]}-{c[5]}" for c in CASES])
def test_fsdp_trains_like_one_device(alias, mkw, cluster, world, ratios, opt):
    steps = 3
    results = run_distributed(_job, world, alias, mkw, cluster, ratios, steps, opt, timeout=240)
    ref = single_device(alias, mkw, steps, opt)
    for rank, res in enumerate(results):
        assert res["baseline"] == "fsdp"
        assert_close(res["loss"], ref["loss"], F64, f"rank {rank} loss")
        assert_close(res["grads"], ref["grads"], F64, f"rank {rank} grad")
        assert_close(res["losses"], ref["losses"], F64, f"rank {rank} losses")
        assert_close(res["state"], ref["state"], F64, f"rank {rank} state")
        if ratios is not None:
            assert res["ratios"] == pytest.approx(ratios)
    first = results[0]
    # the plan shards every matmul weight and bias (LayerNorm's have no sharded layout: replicated)
    matmul = [k for k in first["full"] if "ln" not in k]
    sharded = first["sharded"]
    missing = [k for k in matmul if k.replace(".", "_") not in sharded]
    assert not missing, f"fsdp left parameters replicated: {missing}"
    assert all(d == 0 for k, d in sharded.items() if k.endswith("weight")), sharded
    # ... and gathers each one whole before use (its gradient is the gather's reduce-scatter)
    gathered = {name for op, name in first["collectives"] if op == "all_gather"}
    assert set(k.replace(".", "_") for k in matmul) <= gathered
    # every rank holds only its slice: the slices of a sharded parameter tile its dim 0
    for k in matmul:
        shapes = [r["local"][k] for r in results]
        assert sum(s[0] for s in shapes) == first["full"][k][0], (k, shapes)
        assert all(s[1:] == first["full"][k][1:] for s in shapes), (k, shapes)
        assert all(s[0] < first["full"][k][0] for s in shapes), (k, shapes)


def test_fsdp_derives_param_comm_and_refuses_a_theory_without_it():
    model, inputs = models.load("mlp", dtype=F64)
    plan = hapc.synthesize(model, TWO, inputs, baseline="fsdp")
    assert plan.options["param_comm"] is True and _sharded_params(plan)
    theory = hapc.derive(hapc.trace(model, inputs))  # param_comm=False: no parameter can move
    with pytest.raises(hapc.HapcError, match=r"param_comm=True"):
        synthesize_theory(theory, TWO, baseline="fsdp")


def test_fsdp_memory_charges_shards_plus_gathered_weights():
    """dp-ev holds every parameter whole (x4: weight, gradient, two Adam moments); fsdp holds a
    ``1/m`` shard of each sharded one (x4) plus its gathered copy (x1), and syncs no gradient of it."""
    model, inputs = models.load("gpt", dtype=F64)
    graph = hapc.trace(model, inputs)
    theory = hapc.derive(graph, param_comm=True)
    cluster = cluster_of([5e9] * 4)
    fsdp = synthesize_theory(theory, cluster, baseline="fsdp")
    dp = synthesize_theory(theory, cluster, baseline="dp-ev")
    sharded = set(_sharded_params(fsdp))
    nbytes = sum(n.meta.nbytes for n in graph if n.kind == PARAM and n.name in sharded)
    whole = sum(n.meta.nbytes for n in graph if n.kind == PARAM)
    assert nbytes > 0.9 * whole  # all but LayerNorm's
    for got, want in zip(fsdp.predicted["memory"], dp.predicted["memory"]):
        # the same activations; parameters 4P -> 4P/4 + P
        assert want - got == pytest.approx(4 * nbytes - (4 * nbytes / 4 + nbytes), rel=1e-9)
    # only the replicated (LayerNorm) parameters' gradients are all-reduced
    assert 0 < fsdp.predicted["gradients"] < dp.predicted["gradients"] * (whole - nbytes) / whole * 1.01
