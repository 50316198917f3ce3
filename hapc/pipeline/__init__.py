"""The outer layer: HARP-style pipelines over device groups, each stage an SPMD program (DESIGN §6).

* :mod:`~hapc.pipeline.layers` -- the fine layer sequence with repeated blocks (HARP §5.1);
* :mod:`~hapc.pipeline.stagecost` -- a stage's time and memory on a sub-mesh, from the SPMD synthesizer;
* :mod:`~hapc.pipeline.planner` / :mod:`~hapc.pipeline.dp` -- the HARP DP (Eq. 12-19);
* :mod:`~hapc.pipeline.schedule` -- H-1F1B / 1F1B / Eager-1F1B as per-stage action lists (Eq. 1-2);
* :mod:`~hapc.pipeline.simulate` -- a discrete-event replay and its Chrome trace;
* :mod:`~hapc.pipeline.stages` -- cutting the reference graph into stage graphs;
* :mod:`~hapc.pipeline.runtime` -- running the stages on process sub-groups;
* :mod:`~hapc.pipeline.replicas` -- data-parallel replicas of a pipeline (layouts, their price);
* :mod:`~hapc.pipeline.recompute` -- a stage recomputing its activations in backward.

:func:`compile_pipeline` puts them together under ``torchrun``: rank 0 plans, every rank receives
the plan as JSON, builds its stage's SPMD program and returns a :class:`PipelineModule`::

    pm = hapc.pipeline.compile_pipeline(model, "harp-setting1", batch, num_micro=8)
    loss = pm.train_step(*batch)      # forward + backward of every micro-batch (H-1F1B)
    optimizer.step()                  # over pm.parameters(): this rank's stage

Ranks map to devices in the order of the cluster file: the devices of its first group, then
those of the second, and so on.
"""

from __future__ import annotations

from typing import Any

import torch

from .._util import broadcast_json
from ..cluster import Cluster
from ..errors import HapcError
from .planner import PipelinePlan, plan_pipeline
from .replicas import replica_cluster, replica_devices
from .runtime import PipelineModule, PipelineSpec, batch_rows, micro_batches
from .schedule import POLICIES, eager_1f1b_warmup, one_f_one_b_warmup
from .stagecost import sub_cluster


def spec_from_plan(plan: PipelinePlan, cluster: Cluster, policy: str = "h1f1b") -> PipelineSpec:
    """The runtime's view of a planned pipeline: cuts, ranks, stage clusters, warm-up counts."""
    if policy not in POLICIES:
        raise HapcError(f"unknown schedule {policy!r}; one of {', '.join(POLICIES)}")
    if plan.cluster_name and plan.cluster_name != cluster.name:
        raise HapcError(
            f"the pipeline plan was made for cluster {plan.cluster_name!r}, not {cluster.name!r}; "
            "plan again for this one"
        )
    R = plan.replicas
    used = R * sum(len(s.devices) for s in plan.stages)
    if used != cluster.num_devices:
        raise HapcError(
            f"the pipeline plan uses {used} devices ({R} replica(s)) but cluster {cluster.name!r} has "
            f"{cluster.num_devices}; plan again for this cluster"
        )
    sub = replica_cluster(cluster, R, plan.layout)  # one replica's devices, numbered group by group
    where = replica_devices(cluster, R, plan.layout)  # replica-local device -> global rank
    offset, at = {}, 0
    for g in sub.groups:
        offset[g.name] = at
        at += g.devices
    S = len(plan.stages)
    reps = [[[where[r][offset[s.group] + d] for d in s.devices] for s in plan.stages] for r in range(R)]
    warm = {
        "h1f1b": list(plan.warmups),
        "1f1b": one_f_one_b_warmup(S),
        "eager-1f1b": eager_1f1b_warmup(S),
    }[policy]
    return PipelineSpec(
        cuts=[s.nodes[0] for s in plan.stages[1:]],
        ranks=reps[0],
        clusters=[sub_cluster(sub, s.group, len(s.devices)) for s in plan.stages],
        warmups=warm,
        num_micro=plan.num_micro * R,
        replicas=reps if R > 1 else [],
        recompute=[s.recompute for s in plan.stages] if any(s.recompute for s in plan.stages) else [],
    )


def compile_pipeline(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Any,
    plan: PipelinePlan | None = None,
    *,
    num_micro: int | None = 8,
    schedule: str = "h1f1b",
    emulate: dict[str, Any] | None = None,
    timeout: float | None = None,
    recompute: str = "auto",
    **options: Any,
) -> PipelineModule:
    """This rank's stage of ``model`` pipelined over ``cluster`` (planned here when not given).

    ``example_inputs`` is the global batch; it is split into ``num_micro`` equal micro-batches
    (``None``: the count the planner finds cheapest among the batch's divisors,
    :func:`hapc.planner.choose_plan`).
    ``schedule``: ``"h1f1b"`` (the plan's warm-up counts), ``"1f1b"`` or ``"eager-1f1b"``.
    ``timeout``: seconds after which a pipeline message or collective gives up and raises
    (default: the job's process-group timeout). ``recompute``: activation recomputation when
    planning here (``"auto"``: the planner chooses per stage, ``"never"``, ``"always"``; a given
    ``plan`` says its own). ``options`` go to each stage's SPMD synthesis (see :func:`hapc.compile`)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise HapcError("compile_pipeline runs inside a distributed job: start it with torchrun")
    cluster = Cluster.load(cluster) if not isinstance(cluster, Cluster) else cluster
    if cluster.num_devices != dist.get_world_size():
        raise HapcError(
            f"cluster {cluster.name!r} has {cluster.num_devices} devices but the job has "
            f"{dist.get_world_size()} processes; start one process per device"
        )
    inputs = dict(example_inputs) if isinstance(example_inputs, dict) else tuple(example_inputs)
    if plan is None:
        plan = _agree(model, cluster, inputs, num_micro, recompute, options.get("precision"))
    if timeout is not None and not timeout > 0:
        raise HapcError(f"timeout must be a positive number of seconds, got {timeout!r}")
    spec = spec_from_plan(plan, cluster, schedule)
    return PipelineModule(model, inputs, spec, emulate=emulate, timeout=timeout, **options)


def _agree(
    model: torch.nn.Module,
    cluster: Cluster,
    inputs: tuple | dict,
    num_micro: int | None,
    recompute: str = "auto",
    precision: str | None = None,
) -> PipelinePlan:
    """Rank 0 plans (the stage cuts priced at ``precision``, as the stages will run); everyone
    receives the plan as JSON."""

    def make() -> dict[str, Any]:
        if num_micro is None:
            from ..planner import choose_plan

            choice = choose_plan(
                model, cluster, inputs, kinds=("pipeline",), recompute=recompute,
                theory_options={"precision": precision} if precision is not None else None,
            )  # fmt: skip
            return choice.plan.to_json()
        batch = batch_rows(inputs)
        if batch is None:
            raise HapcError("no input has a batch dimension to split into micro-batches: a pipeline needs one")
        micro = micro_batches(inputs, num_micro, batch)[0]
        theory = None
        if precision is not None:
            from ..theory import derive, trace

            theory = derive(trace(model, micro), precision=precision)
        return plan_pipeline(model, cluster, micro, num_micro=num_micro, recompute=recompute, theory=theory).to_json()

    return PipelinePlan.from_json(broadcast_json(make))


__all__ = [
    "PipelineModule",
    "PipelinePlan",
    "PipelineSpec",
    "compile_pipeline",
    "micro_batches",
    "plan_pipeline",
    "spec_from_plan",
]
