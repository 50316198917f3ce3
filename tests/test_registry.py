"""The rule registry: annotations, rule functions, unsupported ops, and what the theory builds."""

import warnings

import pytest
import torch
from torch import nn

import hapc
from hapc import REPLICATED, Strategy, shard
from hapc.errors import RuleError, UnsupportedOpError, UnsupportedOpWarning
from hapc.theory.annotation import parse_annotation
from hapc.theory.instructions import Collective, Source


def mystery(x):
    return x.sin() * 2


class Mystery(nn.Module):
    def forward(self, x):
        return mystery(x).sum()


def test_unknown_op_warns_by_default_and_stays_replicated():
    leaf = hapc.custom_op()(mystery)  # a leaf the tracer must not enter, but with no rule

    class M(nn.Module):
        def forward(self, x):
            return leaf(x).sum()

    graph = hapc.trace(M(), (torch.randn(4, 3),))
    with pytest.warns(UnsupportedOpWarning, match="hapc.register_op"):
        theory = hapc.derive(graph)
    node = next(n for n in graph if n.op.endswith("mystery"))
    assert [s.name for s in theory.strategies[node.index]] == ["replicate"]


def test_unknown_op_under_strict_names_op_node_and_fix():
    leaf = hapc.custom_op()(mystery)

    class M(nn.Module):
        def forward(self, x):
            return leaf(x).sum()

    graph = hapc.trace(M(), (torch.randn(4, 3),))
    with pytest.raises(UnsupportedOpError) as err:
        hapc.derive(graph, strict=True)
    msg = str(err.value)
    assert "mystery" in msg and "node mystery" in msg and "test_registry.py" in msg
    assert "hapc.register_op(" in msg and '"d0 d1 -> d0 d1"' in msg


def test_one_line_custom_op_is_traced_as_one_node_and_sound():
    @hapc.custom_op("b s h, f h -> b s f", linear="each")
    def scaled_proj(x, w):
        return (x @ w.t()) * 0.5

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))

        def forward(self, x):
            return scaled_proj(x, self.w).sum()

    x = torch.randn(3, 5, 4, dtype=torch.float64)
    graph = hapc.trace(M(), (x,))
    node = next(n for n in graph if n.op.endswith("scaled_proj"))
    theory = hapc.derive(graph)
    names = {s.name: (s.inputs, s.output) for s in theory.strategies[node.index]}
    assert names["h"] == ((shard(2), shard(1)), hapc.PARTIAL)  # contraction -> Partial
    assert names["f"] == ((REPLICATED, shard(0)), shard(2))
    assert not hapc.verify(theory, {"x": x}, [[0.5, 0.3, 0.2], [0.1, 0.9]])


def test_rule_function_and_an_unsound_rule_is_caught():
    @hapc.custom_op()
    def row_cumsum(x):
        return x.cumsum(1)

    @hapc.register_rule(row_cumsum, doc="rows shard; columns would be wrong")
    def _(op):
        yield Strategy((shard(0),), shard(0))
        yield Strategy((shard(1),), shard(1))  # unsound on purpose: cumsum runs along dim 1

    class M(nn.Module):
        def forward(self, x):
            return row_cumsum(x).sum()

    x = torch.randn(4, 6, dtype=torch.float64)
    theory = hapc.derive(hapc.trace(M(), (x,)))
    failures = hapc.verify(theory, {"x": x}, [[0.5, 0.5]])
    assert failures  # the S(1) strategy is caught ...
    assert all("Sharded(x, 1)" in f.triple for f in failures)  # ... and only it


def test_bad_annotations_are_rule_errors():
    for bad in ["a b -> c -> d", "a b, c$ -> a", "... ... -> a"]:
        with pytest.raises(RuleError):
            parse_annotation(bad)
    with pytest.raises(RuleError, match="lists 1 operands, node has 2"):

        @hapc.custom_op("a b -> a b")
        def two(x, y):
            return x + y

        class M(nn.Module):
            def forward(self, x):
                return two(x, x).sum()

        hapc.derive(hapc.trace(M(), (torch.randn(2, 3),)))


def test_theory_optimisations_hold():
    """HAP §4.5: sources fused into consumers, one communication per tensor, params never moved."""
    from hapc import models

    model, inputs = models.load("gpt")
    graph = hapc.trace(model, inputs)
    raw, opt = hapc.derive(graph, optimise=False), hapc.derive(graph)
    assert raw.raw_counts["source"] > 0 and opt.counts().get("source", 0) == 0
    params = {n.index for n in graph.params}
    for t in opt.triples:
        comms = [i for i in t.instrs if isinstance(i, Collective)]
        for c in comms:
            assert ("comm", c.ref) in t.tokens and c.ref not in params
        srcs = [i.ref for i in t.instrs if isinstance(i, Source)]
        assert len(srcs) == len(set(srcs))
    # a single-use weight only ever appears fused with its consumer
    w = graph.by_name("head_weight").index
    assert not any(p.ref == w for t in opt.triples for p in t.pre)


def test_sfb_triple_replaces_the_weight_all_reduce():
    from hapc import models

    model, inputs = models.load("mlp")
    theory = hapc.derive(hapc.trace(model, inputs))
    sfb = [t for t in theory.triples if any("sfb" in getattr(i, "strategy_key", "") for i in t.instrs)]
    assert sfb
    for t in sfb:
        assert [c.primitive for c in t.cost.bwd_comm] == ["all_gather", "all_gather"]
        assert t.complete  # the weight's gradient is whole: no all-reduce for it
    dp = [t for t in theory.triples if any(getattr(i, "strategy_key", "").startswith("d0:S(0),R") for i in t.instrs)]
    assert any(c.primitive == "all_reduce" for t in dp for c in t.cost.grad_comm)


def test_heads_are_never_split():
    """A reshape into heads links the projection's output dim to whole heads (granularity)."""
    from hapc import models

    model, inputs = models.load("transformer")
    graph = hapc.trace(model, inputs)
    theory = hapc.derive(graph)
    q = graph.by_name("blocks_0_attn_q_weight").index  # [32, 32]: 4 heads of 8
    assert theory.atoms(q, 0) == 4
    assert theory.local_sizes(q, 0, [0.5, 0.3, 0.2]) == [16, 8, 8]


def test_rules_table_lists_many_ops():
    rows = hapc.theory.default_registry.table()
    assert len(rows) >= 45
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {"linear", "conv2d", "embedding", "scaled_dot_product_attention", "batch_norm"} <= {
            r["op"] for r in rows
        }


def test_rules_cover_what_library_models_emit():
    """Issue 12: the ops transformers / torchvision / timm models and MoE routers emit have rules."""
    emitted = {
        "addmm", "baddbmm", "diff", "repeat_interleave", "hardsigmoid", "cumsum", "masked_fill", "where", "topk",
        "scatter", "scatter_add", "gather", "index_select", "index_add", "index_put", "triu", "tril", "rms_norm",
        "new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "one_hot", "histc", "repeat",
    }  # fmt: skip
    assert not sorted(emitted - set(hapc.theory.default_registry.names()))
