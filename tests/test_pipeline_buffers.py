"""The pipeline runtime's receive buffers (issue 15): received output gradients land in a buffer
reused across micro-batches and steps, as activations do, and reusing it changes no result.

A stage receives one output gradient right before its backward of that micro-batch and gives the
buffer back once the backward has read it, so one buffer serves every micro-batch of every step
(never given back, every micro-batch would allocate its own: 12 buffers here). Checked: one buffer
in all, and two steps with it equal one device in float64.
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
    given: list[torch.Tensor] = []  # held, so that a new buffer never takes a freed one's id
    buffer = pm._buffer

    def tracked(shape, dtype, pool=None):
        out = buffer(shape, dtype, pool)
        if pool is pm._grad_pool:
            given.append(out)
        return out

    pm._buffer = tracked
    losses = [float(pm.train_step(*inputs)) for _ in range(2)]
    return {
        "losses": losses,
        "grads": pm.full_gradients(),
        "given": len(given),
        "distinct": len({id(t) for t in given}),
        "pool": len(pm._grad_pool),
    }


def test_gradient_receive_buffers_are_reused_and_training_equals_one_device():
    world = 3
    results = run_distributed(_job, world, timeout=240)
    model, inputs = models.load("gpt", batch=BATCH, dtype=torch.float64)
    loss = model(*inputs)
    loss.backward()
    grads = {k: 2 * p.grad for k, p in model.named_parameters()}  # two steps, no optimizer
    for rank, res in enumerate(results):
        assert_close(res["losses"], [loss.item()] * 2, torch.float64, f"rank {rank} losses")
        assert_close(res["grads"], grads, torch.float64, f"rank {rank} grads")
        if rank < world - 1:  # receives a gradient for each of its micro-batches, in one buffer
            assert res["given"] == 2 * MICRO, (rank, res)
            assert res["distinct"] == 1 and res["pool"] == 1, (rank, res)
        else:  # the last stage seeds its losses: it receives no gradient
            assert res["given"] == 0 and res["pool"] == 0, (rank, res)
