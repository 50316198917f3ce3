"""Tied weights across pipeline stages: which stages share one, and what summing its gradient costs.

A weight read by layers of several stages (GPT-2's token embedding, read again by its output
layer in the last stage; ALBERT's one layer, shared by every layer) is held as a copy by each of
those stages, and each copy's backward gives the gradient of that stage's uses only. One device
accumulates all of them into one ``.grad``, so after a step's last backward the runtime sums them
(:meth:`hapc.pipeline.runtime.PipelineModule._sum_tied`): one all-reduce of the weight's whole
gradient over the ranks of the sharing stages. That all-reduce runs once per step, after the first
stage's last backward -- the end of the step -- so it adds to the step time

    T_tied = sum over tied weights w of  alpha_AR(n_w) + beta_AR(n_w) * bytes(w)

with ``n_w`` the devices of the stages sharing ``w`` and the all-reduce's alpha-beta over the
slowest link a ring over their groups crosses (:meth:`hapc.cluster.Cluster.bottleneck`,
:func:`hapc.cluster.derived_alpha_beta`). The pipeline planner adds it to a plan's Eq. 12 time
after its DP (:func:`hapc.pipeline.planner.plan_pipeline`); the DP itself does not see it, so a
plan is optimal for Eq. 12 and then priced honestly, not optimal for the sum (its cuts could move
the sharing stages onto faster links: not searched).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cluster import Cluster, derived_alpha_beta
from ..theory.graph import PARAM
from .layers import Layer


def shared_weights(graph: Any, layers: Sequence[Layer], spans: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """Parameter node -> the stages (indices into ``spans``, layer ranges ``lo..hi-1``) whose layers
    read it, for every parameter read by more than one stage."""
    users: dict[int, list[int]] = {}
    for k, (lo, hi) in enumerate(spans):
        for i in sorted({p for layer in layers[lo:hi] for p in layer.params}):
            if graph[i].kind == PARAM:
                users.setdefault(i, []).append(k)
    return {i: ks for i, ks in users.items() if len(ks) > 1}


def tied_sync_seconds(graph: Any, layers: Sequence[Layer], stages: Sequence[Any], cluster: Cluster) -> float:
    """``T_tied`` of a plan's ``stages`` (each with ``lo``, ``hi``, ``group`` and ``devices``) on
    ``cluster`` (a replica's, for a plan with replicas: each replica sums its own copies)."""
    total = 0.0
    for i, ks in shared_weights(graph, layers, [(s.lo, s.hi) for s in stages]).items():
        meta = graph[i].meta
        nbytes = meta.numel * meta.dtype.itemsize
        devices = sum(len(stages[k].devices) for k in ks)
        link = cluster.bottleneck(sorted({stages[k].group for k in ks}))
        total += derived_alpha_beta("all_reduce", devices, link).time(nbytes)
    return total
