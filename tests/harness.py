"""The equivalence harness: run a plan on real gloo processes and compare with single-device.

``check_plan(alias, model_kwargs, cluster, plan, world)`` builds the same model (same seed) in
every process, compiles it under ``plan``, runs one forward/backward, gathers the loss and every
parameter's whole gradient, then takes a few optimizer steps and gathers the full state; the
parent does the same on one device and compares everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import hapc
from hapc import models
from hapc.testing import run_distributed

TOL = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-4, 1e-6)}


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    # Adam divides by sqrt(v) + eps: a gradient that is exactly zero in theory (an attention key
    # bias) but 1e-17 of rounding noise in practice becomes an update of ~lr with default eps, in
    # either run, differently. eps=1e-6 keeps that noise negligible in float64.
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, eps=1e-6)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train(module: Any, inputs: Any, first: float, steps: int, opt: str) -> tuple[list[float], Any]:
    """``steps`` optimizer steps on one batch; the first backward (loss ``first``) is done."""
    optimizer = make_optimizer(opt, module.parameters())
    losses = [first]
    optimizer.step()
    for _ in range(steps - 1):
        optimizer.zero_grad()
        loss = module(*inputs)
        loss.backward()
        losses.append(loss.detach().item())
        optimizer.step()
    return losses, optimizer


def pipeline_steps(pm: Any, inputs: Any, steps: int, opt: str = "sgd", first: Any = None) -> dict[str, Any]:
    """``steps`` optimizer steps of a pipelined module (``train_step``) on one batch: each step's
    loss, the first step's whole gradients and the final whole state. ``first``: a context manager
    the first step runs in (e.g. autograd hooks counting what it saves)."""
    optimizer = make_optimizer(opt, pm.parameters())
    with first if first is not None else contextlib.nullcontext():
        losses = [pm.train_step(*inputs).item()]
    grads = pm.full_gradients()
    for _ in range(steps - 1):
        optimizer.step()
        optimizer.zero_grad()
        losses.append(pm.train_step(*inputs).item())
    optimizer.step()
    return {"losses": losses, "grads": grads, "state": pm.full_state_dict()}


def one_device_steps(model: Any, inputs: Any, steps: int, opt: str = "sgd") -> dict[str, Any]:
    """The single-device reference of :func:`pipeline_steps`: losses, first gradients, final state."""
    optimizer = make_optimizer(opt, model.parameters())
    losses, grads = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        optimizer.step()
    return {"losses": losses, "grads": grads, "state": dict(model.state_dict())}


def sgd_steps(module: Any, inputs: Any, steps: int = 2, lr: float = 0.1, momentum: float = 0.0) -> list[float]:
    """``steps`` SGD steps on one batch (a fresh optimizer), the loss of each."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = module(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _distributed_job(rank: int, world: int, alias: str, mkw: dict, cluster: Any, plan: Any, steps: int, opt: str):
    model, inputs = models.load(alias, **mkw)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    loss = m(*inputs)
    loss.backward()
    first = (loss.detach().item(), m.full_gradients())
    losses, optimizer = train(m, inputs, first[0], steps, opt)
    return {"loss": first[0], "grads": first[1], "losses": losses, "state": m.full_state_dict(optimizer)}


def single_device(alias: str, mkw: dict, steps: int, opt: str) -> dict[str, Any]:
    model, inputs = models.load(alias, **mkw)
    loss = model(*inputs)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    losses, optimizer = train(model, inputs, loss.item(), steps, opt)
    return {
        "loss": loss.item(),
        "grads": grads,
        "losses": losses,
        "state": hapc.checkpoint.full_state(model, optimizer),
    }


def small_buckets(monkeypatch: Any, nbytes: int = 2048) -> None:
    """Gradient buckets of ``nbytes`` (a test model then has many, launched mid-backward); ranks
    forked afterwards inherit the patch."""
    import hapc.codegen.module

    monkeypatch.setattr(hapc.codegen.module, "BUCKET_BYTES", nbytes)
    monkeypatch.setattr(hapc.codegen.module, "FIRST_BUCKET_BYTES", nbytes)


def one_device_grads(alias: str, **mkw: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient of one forward and backward on one device."""
    model, inputs = models.load(alias, **mkw)
    loss = model(*inputs)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def assert_close(got: Any, want: Any, dtype: torch.dtype, what: str) -> None:
    rtol, atol = TOL[dtype]
    if isinstance(want, dict):
        assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
        for k in want:
            assert_close(got[k], want[k], dtype, f"{what}.{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), f"{what}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, dtype, f"{what}[{i}]")
    elif torch.is_tensor(want):
        assert torch.is_tensor(got) and got.shape == want.shape, f"{what}: shape {getattr(got, 'shape', got)}"
        if not want.is_floating_point():
            assert torch.equal(got, want), f"{what} differs"
            return
        scale = float(want.abs().max()) if want.numel() else 0.0
        torch.testing.assert_close(
            got.to(want.dtype), want, rtol=rtol, atol=atol * max(scale, 1.0), msg=lambda m: f"{what}: {m}"
        )
    elif isinstance(want, float):
        assert abs(got - want) <= rtol * abs(want) + atol, f"{what}: {got} != {want}"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def check_plan(
    alias: str, mkw: dict, cluster: Any, plan: Any, world: int, *, steps: int = 3, opt: str = "sgd"
) -> list[dict[str, Any]]:
    """Run ``plan`` on ``world`` gloo processes and assert it matches single-device training."""
    dtype = mkw.get("dtype", torch.float32)
    results = run_distributed(_distributed_job, world, alias, mkw, cluster, plan, steps, opt)
    ref = single_device(alias, mkw, steps, opt)
    for rank, res in enumerate(results):
        assert_close(res["loss"], ref["loss"], dtype, f"rank {rank} loss")
        assert_close(res["grads"], ref["grads"], dtype, f"rank {rank} grad")
        assert_close(res["losses"], ref["losses"], dtype, f"rank {rank} losses")
        assert_close(res["state"], ref["state"], dtype, f"rank {rank} state")
    return results


def two_groups(name: str = "two-groups") -> Any:
    """Two one-device groups (20 and 10 TFLOPS) joined by a slow link (100 MB/s): the planner
    pipelines over them."""
    from hapc.cluster import Cluster

    link = {"bandwidth": "10 GB/s", "latency": "20 us"}
    return Cluster.from_dict(
        {
            "name": name,
            "group": [
                {"name": g, "devices": 1, "devices_per_host": 1, "flops": f, "memory": "8 GiB"}
                for g, f in (("fast", "20 TFLOPS"), ("slow", "10 TFLOPS"))
            ],
            "links": {
                "intra_host": link,
                "inter_host": link,
                "between": [{"groups": ["fast", "slow"], "bandwidth": "100 MB/s", "latency": "100 us"}],
            },
        }
    )


def strategy_results(theory: Any, node: Any, values: dict, ratios: Any) -> Iterator[tuple[Any, torch.Tensor]]:
    """Each strategy of ``node`` run per device by the simulator at ``ratios`` (3 devices) and
    combined into the whole result: ``(strategy, result)`` in the theory's order (replicate first)."""
    from hapc.theory import simulate

    ctx = simulate.SimContext(theory, node, ratios)
    ops = [values[o].detach() for o in node.operands]
    for s in theory.strategies[node.index]:
        parts = [
            simulate.instances(v, lay, simulate.split_sizes(theory, o, lay, ratios), 3)
            for v, lay, o in zip(ops, s.inputs, node.operands)
        ]
        yield s, simulate.combine(simulate.run_compute(ctx, s, parts), s.output)


def pipeline_spec(
    model: Any,
    inputs: Any,
    weights: list[float],
    ranks: list[list[int]],
    flops: list[float],
    warmups: list[int],
    num_micro: int,
    replicas: Any = None,
    memory: str = "4 GiB",
    recompute: Any = None,
) -> Any:
    """A pipeline of ``model`` cut by ``weights`` (``balanced_cuts`` of its micro-batch graph), stage
    ``k`` on ``ranks[k]`` at ``flops[rank]`` each (``memory`` per device on every stage after the
    first, whose devices hold 4 GiB), the batch in ``num_micro`` micro-batches."""
    from hapc.pipeline.runtime import PipelineSpec, micro_batches
    from hapc.pipeline.stages import balanced_cuts
    from hapc.testing import cluster_of
    from hapc.theory import trace

    rows = next(x.shape[0] for x in (inputs.values() if isinstance(inputs, dict) else inputs) if x.dim())
    graph = trace(model, micro_batches(inputs, num_micro, rows)[0])
    return PipelineSpec(
        cuts=balanced_cuts(graph, weights),
        ranks=ranks,
        clusters=[cluster_of([flops[r] for r in rs], memory=memory if k else "4 GiB") for k, rs in enumerate(ranks)],
        warmups=warmups,
        num_micro=num_micro,
        replicas=replicas or [],
        recompute=recompute or [],
    )
