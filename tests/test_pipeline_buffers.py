"""Training through the pipeline runtime's received output gradients (issue 15) equals one device.

Received output gradients landed in a buffer reused across micro-batches and steps; they now land
in a new one each (autograd may keep a received gradient as a parameter's ``.grad``:
tests/test_pipeline_grad_buffers.py). Checked here: two steps over three stages equal one device
in float64.
"""

from __future__ import annotations

import torch
from harness import assert_close

from hapc import models
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.stages import balanced_cuts
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

BATCH, MICRO = 12, 6


def _job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = models.load("gpt", batch=BATCH, dtype=torch.float64)
    graph = trace(model, micro_batches(inputs, MICRO, BATCH)[0])
    spec = PipelineSpec(
        cuts=balanced_cuts(graph, [1] * world),
        ranks=[[k] for k in range(world)],
        clusters=[cluster_of([1e10]) for _ in range(world)],
        warmups=[world - k for k in range(world)],
        num_micro=MICRO,
    )
    pm = PipelineModule(model, inputs, spec)
    losses = [float(pm.train_step(*inputs)) for _ in range(2)]
    return {"losses": losses, "grads": pm.full_gradients()}


def test_training_with_received_gradients_equals_one_device():
    """Three stages, six micro-batches, two steps without an optimizer: losses and accumulated
    gradients equal one device's. (Gradient receive buffers were reused across micro-batches; they
    are new each time now, since autograd may keep one as a parameter's .grad:
    tests/test_pipeline_grad_buffers.py.)"""
    world = 3
    results = run_distributed(_job, world, timeout=240)
    model, inputs = models.load("gpt", batch=BATCH, dtype=torch.float64)
    loss = model(*inputs)
    loss.backward()
    grads = {k: 2 * p.grad for k, p in model.named_parameters()}  # two steps, no optimizer
    for rank, res in enumerate(results):
        assert_close(res["losses"], [loss.item()] * 2, torch.float64, f"rank {rank} losses")
        assert_close(res["grads"], grads, torch.float64, f"rank {rank} grads")
