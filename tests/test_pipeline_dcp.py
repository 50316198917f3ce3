"""``torch.distributed.checkpoint`` without gathering on pipelines and per-segment ratios.

``module.sharded_state_dict()`` is how a hapc module hands DCP its tensors without a gather (each
rank its chunks, :mod:`hapc.codegen.dcp_shards`); pipelines and segmented modules had none (an
``AttributeError`` for a loop written against the SPMD module). A pipeline's is its stage's (each
rank saves its stage's chunks; the replicas' identical entries are written once), a segmented
module's every segment's. Checked in float64 on gloo processes: saved after two SGD steps, the
checkpoint loads on one process (whole tensors) and in place into a fresh module of another kind,
both equal to the saving module's state; a pipeline whose stages share a weight refuses, naming
the whole-tensor route.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import assert_close
from test_pipeline_keywords import _tied as tied_model

import hapc
from hapc import models
from hapc.errors import HapcError
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.stages import balanced_cuts
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

F64 = torch.float64


def _module(kind: str, seed: int = 0):
    model, inputs = models.load("gpt", batch=8, dtype=F64, seed=seed)
    if kind == "segmented":
        return hapc.compile(model, cluster_of([1e10, 4e9]), inputs, segmented=True), inputs
    if kind == "spmd":
        return hapc.compile(model, cluster_of([1e10, 4e9]), inputs, ratios=[0.7, 0.3]), inputs
    replicas = [[[0], [1]], [[2], [3]]] if kind == "replicas" else []
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 4,
                        replicas=replicas)  # fmt: skip
    return PipelineModule(model, inputs, spec), inputs


def _save(rank: int, world: int, kind: str, directory: str) -> dict:
    torch.set_num_threads(1)
    module, inputs = _module(kind)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        module.train_step(*inputs)
        optimizer.step()
    dcp.save(module.sharded_state_dict(), checkpoint_id=directory)
    return module.full_state_dict()


def _load(rank: int, world: int, kind: str, directory: str) -> dict:
    torch.set_num_threads(1)
    module, _ = _module(kind, seed=77)  # other initial weights
    sd = module.sharded_state_dict()
    dcp.load(sd, checkpoint_id=directory)  # in place
    return module.full_state_dict()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load on one process
@pytest.mark.parametrize("saved, loaded", [("pipeline", "spmd"), ("replicas", "pipeline"), ("segmented", "pipeline")])
def test_sharded_checkpoints_of_pipelines_and_segments_round_trip(saved, loaded, tmp_path):
    worlds = {"replicas": 4}
    state = run_distributed(_save, worlds.get(saved, 2), saved, str(tmp_path), timeout=240)[0]
    plain, _ = models.load("gpt", batch=8, dtype=F64, seed=5)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))  # whole tensors on one process, from the chunks
    assert_close(sd, state, F64, f"{saved}'s checkpoint on one process")
    for rank, got in enumerate(run_distributed(_load, worlds.get(loaded, 2), loaded, str(tmp_path), timeout=240)):
        assert_close(got, state, F64, f"rank {rank}: {saved}'s checkpoint into a {loaded} module in place")


def _tied_job(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    model, inputs = tied_model()  # head.weight = emb.weight, in the first and the last stage
    graph = trace(model, micro_batches(inputs, 2, 8)[0])
    spec = PipelineSpec(balanced_cuts(graph, [1, 1]), [[0], [1]], [cluster_of([1e10])] * 2, [2, 1], 2)
    pm = PipelineModule(model, inputs, spec)
    with pytest.raises(HapcError, match=r"share weight.*emb\.weight.*dcp\.save\(module\.state_dict\(\)") as caught:
        pm.sharded_state_dict()
    return str(caught.value)


def test_a_pipeline_sharing_a_weight_across_stages_refuses_chunked_checkpoints():
    """Each stage holds a copy of the tied weight: an in-place load into one copy would leave the
    other behind, silently. Refused on every rank alike, naming the whole-tensor route."""
    for message in run_distributed(_tied_job, 2, timeout=120):
        assert "module.load_state_dict(sd)" in message
