"""Per-theory memos of the synthesizer (planning time only): a segment's signature is computed
once per theory across the spaces of several device counts, and a segment's lower bound once per
signature. A theory that has served spaces of other device counts must synthesize exactly what a
fresh theory of the same model does."""

from __future__ import annotations

import pytest

from hapc.cluster import Cluster
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, shardable_triples, synthesize_program
from hapc.theory import derive, trace
from models import load


def _cluster(n: int) -> Cluster:
    link = {"bandwidth": "10 GB/s", "latency": "20 us"}
    return Cluster.from_dict(
        {
            "name": f"gpus-{n}",
            "group": [{"name": "gpu", "devices": n, "devices_per_host": n, "flops": "10 TFLOPS", "memory": "8 GiB"}],
            "links": {"intra_host": link, "inter_host": link},
        }
    )


def _program(theory, n: int):
    model = CostModel(_cluster(n))
    space = SynthSpace(theory, n, "node", shardable_triples(theory, n))
    result = synthesize_program(space, model, model.even_ratios())
    return result.cost, result.parts


@pytest.mark.parametrize("sizes", [(2, 8), (8, 2), (4, 2, 8)])
def test_a_theory_used_for_other_device_counts_synthesizes_as_a_fresh_one(sizes):
    # widths of 6 and 12: a dimension 8 devices cannot all hold a slice of, so the spaces of 2, 4
    # and 8 devices allow different triples for the same segments
    model, inputs = load("mlp", batch=16, widths=(12, 6, 12), classes=4)
    shared = derive(trace(model, inputs))
    for n in sizes:
        fresh = derive(trace(model, inputs))
        assert _program(shared, n) == _program(fresh, n), n
