"""Segment searches of one theory share their time-independent structure (``search.SHARE_STRUCTURE``).

A :class:`~hapc.synth.search.SegmentSearch` is built from its triples, its start properties and
tokens, the properties it must keep and the nodes it must compute; the bit numbering, the masks,
the consumers and the memos of what is dead, what a live set covers and which triples it enables
depend on nothing else (not on the times). The sub-mesh sizes of a pipeline's stage costs search
the same segments from the same entries under different times, so that structure is built once per
key and shared. A key missing a part (a shared start from another entry) would hand a search the
wrong structure: every stage cost is therefore compared, bit for bit, with searches that share
nothing, on sub-mesh kinds where sharing happens.
"""

from __future__ import annotations

import numpy as np
import pytest

from hapc import models
from hapc.cluster import Cluster
from hapc.pipeline.layers import build_layers
from hapc.pipeline.stagecost import StageCoster, submesh_sizes
from hapc.synth import search
from hapc.theory import derive, trace

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep", "program_time")


def _stage_costs(share: bool, monkeypatch: pytest.MonkeyPatch, cluster: str) -> tuple[dict, int, int]:
    """Layer costs of every sub-mesh kind, the searches built and the structures built."""
    monkeypatch.setattr(search, "SHARE_STRUCTURE", share)
    built = {"searches": 0, "structures": 0}
    init, structure = search.SegmentSearch.__init__, search.SegmentSearch._structure

    def counting_init(self, *args, **kwargs):
        built["searches"] += 1
        init(self, *args, **kwargs)

    def counting_structure(self, *args, **kwargs):
        built["structures"] += 1
        return structure(self, *args, **kwargs)

    monkeypatch.setattr(search.SegmentSearch, "__init__", counting_init)
    monkeypatch.setattr(search.SegmentSearch, "_structure", counting_structure)
    model, inputs = models.gpt("tiny", batch=8, device="meta")
    theory = derive(trace(model, inputs), sfb=True, variants=("padded", "grouped"), param_comm=False, strict=False)
    layers = build_layers(theory.graph, min_compute=2)
    cl = Cluster.load(cluster)
    coster = StageCoster(theory, layers, cl)
    out = {}
    for g in cl.groups:
        for n in submesh_sizes(g):
            lc = coster.layer_costs(g.name, n)
            out[(g.name, n)] = {f: np.asarray(getattr(lc, f)) for f in FIELDS}
    return out, built["searches"], built["structures"]


@pytest.mark.parametrize("cluster", ["hap-testbed:16", "harp-setting2"])
def test_shared_structure_gives_the_same_stage_costs(monkeypatch: pytest.MonkeyPatch, cluster: str) -> None:
    shared, searches, structures = _stage_costs(True, monkeypatch, cluster)
    alone, searches_alone, structures_alone = _stage_costs(False, monkeypatch, cluster)
    assert structures_alone == searches_alone == searches  # the same searches, each built alone before
    assert structures < searches  # sharing happened (sub-mesh sizes search equal segments from equal entries)
    assert shared.keys() == alone.keys()
    for kind in shared:
        for f in FIELDS:
            assert np.array_equal(shared[kind][f], alone[kind][f]), (kind, f)
