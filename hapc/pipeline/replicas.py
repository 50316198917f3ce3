"""Data-parallel replicas of a pipeline: the third dimension (issue 14; Megatron's DP x PP).

``R`` identical pipelines, each on ``1/R`` of every device group (the same stage structure on
each), each running ``M/R`` of the global batch's ``M`` micro-batches; once per step every stage's
gradients are summed across the ``R`` replicas of that stage (one process group per stage
position and device, :class:`hapc.pipeline.runtime.PipelineModule`). Each replica seeds its
micro-batches' losses with their weights in the *global* batch loss
(:func:`~hapc.pipeline.stages.loss_weighting`), so the sum over replicas is the single-device
gradient, and the batch loss is the sum of the replicas' parts.

**Layouts** (which devices a replica takes; ``n`` devices of a group, ``h`` to a host):

* ``"blocked"``: replica ``r`` holds devices ``[r n/R, (r+1) n/R)`` of each group -- whole hosts,
  or an aligned ``n/R``-device part of one host. A replica's pipeline crosses hosts only where the
  replica spans several; the replicas of a stage sit on different hosts (unless the group fits in
  one), so their all-reduce crosses the inter-host link.
* ``"strided"``: replica ``r`` holds the ``r``-th ``h/R`` devices of *every* host of each group
  (``R`` divides ``h``). Each replica spans all hosts (its pipeline crosses the inter-host link)
  while the replicas of a stage share a host: their all-reduce stays on the intra-host link --
  data parallelism inside hosts, the pipeline across them.

**Price.** The cross-replica all-reduce is one more once-per-step gradient synchronisation of a
stage, so it joins the stage cost table's ``sync`` column and is charged like the stage's own (HARP
Eq. 12 in :mod:`hapc.pipeline.dp`: ``sync / B`` per micro-batch, ``B = M/R``); the DP therefore
sees it when it chooses the cuts. Per layer and sub-mesh kind it is the bucketed ring all-reduce
the SPMD cost model charges for gradients (:meth:`hapc.synth.cost.CostModel.grad_time`, alpha-beta
derived from the link) of each device's parameter bytes (``mem_param / memory_factor``) over a
ring of the ``R`` peers: on the intra-host link when the peers share a host, else the inter-host
link. On the inter-host link the ``s`` devices of a stage on one host run ``s`` rings through that
host's one link at once, so the time is multiplied by ``s`` (the bandwidth is shared; inside a
host the links are taken as independent, as the SPMD model does). Not modelled: overlap of one
stage's all-reduce with other stages' backward (the charge is spread, not placed at the step's
end) and contention between different stages' all-reduces on one host's link.
"""

from __future__ import annotations

import dataclasses

from ..cluster import Cluster, Group, Link
from ..errors import HapcError
from ..synth.cost import CostModel
from ..theory.cost import Comm

LAYOUTS = ("blocked", "strided")


def _per_host(g: Group) -> int:
    return min(g.devices_per_host, g.devices)


def layouts(cluster: Cluster, replicas: int) -> list[str]:
    """The layouts in which ``replicas`` identical replicas tile ``cluster`` (empty: none)."""
    R = replicas
    if R < 2:
        return ["blocked"]
    out = []
    ok_blocked = True
    ok_strided = True
    one_host = True
    for g in cluster.groups:
        h = _per_host(g)
        if g.devices % R:
            return []
        n = g.devices // R
        ok_blocked &= (n % h == 0) if n >= h else (h % n == 0)
        ok_strided &= h % R == 0 and g.devices % h == 0
        one_host &= g.devices <= h
    if ok_blocked:
        out.append("blocked")
    if ok_strided and not one_host:  # on one host the two layouts are the same placement
        out.append("strided")
    return out


def _check(cluster: Cluster, replicas: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise HapcError(f"unknown replica layout {layout!r}; one of {', '.join(LAYOUTS)}")
    if replicas < 1:
        raise HapcError(f"replicas must be >= 1, got {replicas}")
    if replicas > 1 and layout not in layouts(cluster, replicas):
        sizes = ", ".join(f"{g.name} {g.devices} ({_per_host(g)} per host)" for g in cluster.groups)
        raise HapcError(
            f"{replicas} replicas do not tile cluster {cluster.name!r} in the {layout!r} layout (groups: {sizes}): "
            "every group's device count must divide by the replica count, and a replica must take whole hosts or "
            f"an aligned part of one (blocked) or the same share of every host (strided); layouts that fit: "
            f"{', '.join(layouts(cluster, replicas)) or 'none'}"
        )


def replica_cluster(cluster: Cluster, replicas: int, layout: str = "blocked") -> Cluster:
    """One replica's devices as a cluster of their own (same links, ``1/R`` of each group)."""
    _check(cluster, replicas, layout)
    if replicas == 1:
        return cluster
    groups = []
    for g in cluster.groups:
        n, h = g.devices // replicas, _per_host(g)
        per_host = h // replicas if layout == "strided" and g.devices > h else min(h, n)
        groups.append(dataclasses.replace(g, devices=n, devices_per_host=per_host))
    return dataclasses.replace(
        cluster, name=f"{cluster.name}/{replicas}{layout[0]}", groups=tuple(groups), collectives=()
    )


def replica_devices(cluster: Cluster, replicas: int, layout: str = "blocked") -> list[list[int]]:
    """``out[r][i]``: the global rank (cluster-file order) of device ``i`` of replica ``r``'s cluster
    (:func:`replica_cluster`, its devices group by group)."""
    _check(cluster, replicas, layout)
    out: list[list[int]] = [[] for _ in range(replicas)]
    at = 0
    for g in cluster.groups:
        n, h = g.devices // replicas, _per_host(g)
        for r in range(replicas):
            if layout == "strided" and g.devices > h:
                k = h // replicas
                out[r] += [at + (d // k) * h + r * k + d % k for d in range(n)]
            else:
                out[r] += [at + r * n + d for d in range(n)]
        at += g.devices
    return out


def peer_link(cluster: Cluster, replicas: int, layout: str, group: str) -> tuple[Link, bool]:
    """The link a ring over the ``R`` replicas of a device of ``group`` crosses, and whether it is
    the inter-host link (shared by the host's devices)."""
    g = next(x for x in cluster.groups if x.name == group)
    h = _per_host(g)
    if layout == "strided" or g.devices <= h:
        return (g.intra_host or cluster.intra_host), False
    return cluster.inter_host, True  # blocked over several hosts: the peers sit on different hosts


def sync_seconds_per_byte(cluster: Cluster, replicas: int, layout: str, group: str, size: int) -> float:
    """Seconds per gradient byte of one device of a ``size``-device stage in ``group`` to all-reduce
    it across the replicas: :meth:`CostModel.grad_time` on a ring of ``R`` devices over the peers'
    link, times the stage's devices on one host when that link is the host's inter-host link."""
    if replicas < 2:
        return 0.0
    link, shared = peer_link(cluster, replicas, layout, group)
    g = next(x for x in cluster.groups if x.name == group)
    ring = Cluster(
        name=f"{cluster.name}[{group} replicas]",
        groups=(dataclasses.replace(g, devices=replicas, devices_per_host=1, intra_host=None),),
        intra_host=link,
        inter_host=link,
    )
    per_byte = CostModel(ring).grad_time([Comm("all_reduce", 1.0, "full")])
    sub = replica_cluster(cluster, replicas, layout)
    per_host = min(size, next(x for x in sub.groups if x.name == group).devices_per_host)
    return per_byte * (per_host if shared else 1)


__all__ = ["LAYOUTS", "layouts", "peer_link", "replica_cluster", "replica_devices", "sync_seconds_per_byte"]
