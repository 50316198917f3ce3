"""The sharding-ratio LP (HAP §5) and the alternating loop."""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from randgraph import random_clusters, random_models
from torch import nn

import hapc
from hapc.balance.lp import solve_ratios
from hapc.cluster import Cluster
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, program_cost, synthesize_program


def _grid(model: CostModel, steps: int):
    """Every ratio vector on a grid over the simplex sum_t count_t * B_t = 1."""
    counts = model.counts
    if len(counts) == 1:
        yield (1.0 / counts[0],)
        return
    for head in itertools.product(range(steps + 1), repeat=len(counts) - 1):
        shares = [h / steps for h in head]
        rest = 1.0 - sum(shares)
        if rest < -1e-12:
            continue
        yield tuple(s / c for s, c in zip([*shares, max(rest, 0.0)], counts))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mi=random_models(max_ops=3), cluster=random_clusters(2, 3), tight=st.booleans())
def test_lp_is_at_least_as_good_as_a_dense_grid(mi, cluster, tight):
    model, inputs = mi
    theory = hapc.derive(hapc.trace(model, inputs))
    cm = CostModel(cluster)
    space = SynthSpace(theory, cm.m)
    res = synthesize_program(space, cm, cm.proportional_ratios())
    costs = [[theory.triples[k].cost for k in part] for part in res.parts]
    if tight:  # squeeze the fastest type's memory below its proportional need
        need = [sum(m) for m in zip(*[cm.memory(p, cm.proportional_ratios()) for p in costs])]
        fast = max(range(len(cm.types)), key=lambda t: cm.types[t].flops)
        cap = need[fast] * 0.9 if need[fast] else 1.0
        groups = []
        for g in cluster.to_dict()["group"]:
            g = dict(g)
            if g["name"] == cm.types[fast].name:
                g["memory"] = max(cap, 1.0)
            groups.append(g)
        cluster = Cluster.from_dict({**cluster.to_dict(), "group": groups})
        cm = CostModel(cluster)
    try:
        lp = solve_ratios(cm, costs)
    except hapc.InfeasibleError:
        return  # memory too tight for any ratios: nothing to compare
    at_lp = program_cost(theory, cm, res.parts, lp.ratios)
    assert math.isclose(lp.objective, at_lp, rel_tol=1e-7, abs_tol=1e-12)
    steps = 400 if len(cm.types) == 2 else 60
    best = math.inf
    for r in _grid(cm, steps):
        mem = [sum(x) for x in zip(*[cm.memory(p, r) for p in costs])]
        if all(m <= t.memory * (1 + 1e-9) for m, t in zip(mem, cm.types)):
            best = min(best, program_cost(theory, cm, res.parts, r))
    assert at_lp <= best * (1 + 1e-6) + 1e-12, (at_lp, best)


def _mlp(width: int, batch: int, layers: int = 2):
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.sum()

    return MLP(), (torch.randn(batch, width),)


def _cluster(bandwidth: str, fast=2e12, slow=1e12):
    return Cluster.from_dict(
        {
            "name": "two-kinds",
            "group": [
                {"name": "fast", "devices": 2, "devices_per_host": 2, "flops": fast, "memory": "64 GB"},
                {"name": "slow", "devices": 2, "devices_per_host": 2, "flops": slow, "memory": "64 GB"},
            ],
            "links": {
                "intra_host": {"bandwidth": bandwidth, "latency": "5 us"},
                "inter_host": {"bandwidth": bandwidth, "latency": "5 us"},
            },
        }
    )


def test_ratios_move_from_proportional_to_even_as_communication_dominates():
    """HAP Fig. 2: with a fixed model-parallel program, fast devices get their compute share when
    compute dominates and drift towards an even share as the network slows."""
    from hapc.balance.loop import balance
    from hapc.synth.baselines import restrict
    from hapc.synth.synthesizer import shardable_triples

    model, inputs = _mlp(width=256, batch=256)
    theory = hapc.derive(hapc.trace(model, inputs))
    shares = []
    for bw in ["1000 GB/s", "10 GB/s", "1 GB/s", "100 MB/s", "10 MB/s"]:
        cm = CostModel(_cluster(bw))
        tp = restrict(theory, "tp", cm.m) & shardable_triples(theory, cm.m)  # Megatron's program
        best = balance(SynthSpace(theory, cm.m, allowed=tp), cm)
        shares.append(best.ratios[0] / sum(best.ratios))  # the fast type's share of one fast+slow pair
    assert shares[0] == pytest.approx(2 / 3, abs=0.02)  # compute-proportional (2:1)
    assert shares[-1] == pytest.approx(1 / 2, abs=0.02)  # even
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(shares))  # monotone toward even


def test_wide_mlp_on_slow_network_gets_tensor_parallelism():
    model, inputs = _mlp(width=2048, batch=4)
    plan = hapc.synthesize(model, _cluster("100 MB/s"), inputs)
    weights = [plan.layout_of(n.index) for n in hapc.trace(model, inputs).params if n.meta.rank == 2]
    assert any(any(lay.startswith("S") for lay in ls) for ls in weights), weights


def test_narrow_mlp_on_fast_network_gets_data_parallelism():
    model, inputs = _mlp(width=16, batch=4096)
    plan = hapc.synthesize(model, _cluster("100 GB/s"), inputs)
    graph = hapc.trace(model, inputs)
    assert all(plan.layout_of(n.index) == ["R"] for n in graph.params)
    assert plan.layout_of(graph.inputs[0].index) == ["S(0)"]


def test_figure_11_toy_program():
    """HAP Fig. 11: x = Placeholder (batch-sharded, the example's only source rule), w = Parameter,
    e3 = MatMul(x, w), loss = Sum(e3). The search returns program 7: shard x, replicate w, multiply,
    sum into a Partial loss."""

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            return (x @ self.w).sum()

    model, inputs = Toy(), (torch.randn(512, 16),)
    theory = hapc.derive(hapc.trace(model, inputs), sfb=False)
    cm = CostModel(_cluster("1 GB/s"))
    from hapc.theory.instructions import Source

    x, w = theory.graph.inputs[0].index, theory.graph.params[0].index
    paper = {x: ["S(0)"], w: ["R", "S(1)"]}  # "we only consider partitioning e1 on dim 0 and e2 on dim 1"
    allowed = {
        k
        for k, t in enumerate(theory.triples)
        if all(repr(i.layout) in paper.get(i.ref, [repr(i.layout)]) for i in t.instrs if isinstance(i, Source))
    }
    res = synthesize_program(SynthSpace(theory, cm.m, "none", allowed), cm, cm.proportional_ratios())
    text = [theory.fmt_instr(i) for k in res.triples for i in theory.triples[k].instrs]
    assert sorted(text[:2]) == ["w = param", "x = input.shard(0)"]  # Placeholder-Shard(0), Parameter
    assert text[2:] == ["matmul = matmul[m](x, w)", "sum_1 = sum[d0](matmul)", "loss(sum_1: P)"], text


def test_grouped_collectives_win_only_when_ratios_are_skewed():
    """HAP Fig. 4: padded all-gather sends the largest shard from everyone; grouped broadcasts
    send each shard once. Even ratios favour padding; very skewed ones favour grouping."""

    class Gather(nn.Module):
        def forward(self, x):
            return (x * 2).softmax(0).sum()  # softmax over the batch needs all of it

    model, inputs = Gather(), (torch.randn(1024, 1024),)
    theory = hapc.derive(hapc.trace(model, inputs))
    cm = CostModel(
        Cluster.from_dict(
            {
                "name": "four",
                "group": [{"name": "g", "devices": 4, "devices_per_host": 4, "flops": 1e12, "memory": "16 GB"}],
                "links": {"intra_host": {"bandwidth": "10 GB/s", "latency": "1 us"}},
            }
        )
    )
    from hapc.theory.instructions import Collective, Source

    x = theory.graph.inputs[0].index
    allowed = {
        k
        for k, t in enumerate(theory.triples)
        if all(not (isinstance(i, Source) and i.ref == x and repr(i.layout) != "S(0)") for i in t.instrs)
    }  # the batch arrives sharded on dim 0, so the softmax over it needs an all-gather
    space = SynthSpace(theory, cm.m, "none", allowed)

    def variant(ratios):
        res = synthesize_program(space, cm, ratios)
        return [i.variant for k in res.triples for i in theory.triples[k].instrs if isinstance(i, Collective)]

    assert variant((0.25,)) == ["padded"]
    # one type only: emulate a skewed split with a mixed cluster instead
    cm2 = CostModel(
        Cluster.from_dict(
            {
                "name": "skewed",
                "group": [
                    {"name": "big", "devices": 1, "devices_per_host": 1, "flops": 1e12, "memory": "16 GB"},
                    {"name": "small", "devices": 3, "devices_per_host": 3, "flops": 1e12, "memory": "16 GB"},
                ],
                "links": {
                    "intra_host": {"bandwidth": "10 GB/s", "latency": "1 us"},
                    "inter_host": {"bandwidth": "10 GB/s", "latency": "1 us"},
                },
            }
        )
    )
    space2 = SynthSpace(theory, cm2.m, "none", allowed)
    res = synthesize_program(space2, cm2, (0.91, 0.03))
    assert [i.variant for k in res.triples for i in theory.triples[k].instrs if isinstance(i, Collective)] == [
        "grouped"
    ]
    res = synthesize_program(space2, cm2, (0.25, 0.25))
    assert [i.variant for k in res.triples for i in theory.triples[k].instrs if isinstance(i, Collective)] == ["padded"]


def test_model_too_big_for_memory_names_every_device():
    model, inputs = _mlp(width=1024, batch=8)
    tiny = Cluster.from_dict(
        {
            "name": "tiny",
            "group": [
                {"name": "a", "devices": 1, "devices_per_host": 1, "flops": 1e12, "memory": "1 MB"},
                {"name": "b", "devices": 1, "devices_per_host": 1, "flops": 1e12, "memory": "2 MB"},
            ],
        }
    )
    with pytest.raises(hapc.InfeasibleError) as err:
        hapc.synthesize(model, tiny, inputs)
    msg = str(err.value)
    assert "a: needs" in msg and "b: needs" in msg and "has" in msg


# -- issue 16: properties that kill the mutants benchmarks/mutants.toml plants in the LP and loop


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,  # the same cases every run (the mutation run must not kill by chance)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mi=random_models(max_ops=3), cluster=random_clusters(2, 4), data=st.data())
def test_lp_ratios_fit_every_device_types_memory(mi, cluster, data):
    """Each device type gets its own capacity (drawn between a tenth and twice its need at the
    proportional ratios); whatever the LP returns fits every type's memory."""
    model, inputs = mi
    theory = hapc.derive(hapc.trace(model, inputs))
    cm = CostModel(cluster)
    res = synthesize_program(SynthSpace(theory, cm.m), cm, cm.proportional_ratios())
    costs = [[theory.triples[k].cost for k in part] for part in res.parts]
    need = [sum(m) for m in zip(*[cm.memory(p, cm.proportional_ratios()) for p in costs])]
    groups = []
    for g, n in zip(cluster.to_dict()["group"], need):
        groups.append({**g, "memory": max(1.0, n * data.draw(st.floats(0.1, 2.0)))})
    cm = CostModel(Cluster.from_dict({**cluster.to_dict(), "group": groups}))
    try:
        lp = solve_ratios(cm, costs)
    except hapc.InfeasibleError:
        return
    mem = [sum(x) for x in zip(*[cm.memory(p, lp.ratios) for p in costs])]
    for t, (m, dt) in enumerate(zip(mem, cm.types)):
        assert m <= dt.memory * (1 + 1e-6) + 1e-6, (t, m, dt.memory, lp.ratios)


def test_qb_loop_returns_the_best_round(monkeypatch):
    """A round worse than an earlier one (its search restricted to Megatron's programs)
    must not replace the best pair: the loop returns the least-cost round it saw."""
    from hapc.balance import loop
    from hapc.synth.baselines import restrict
    from hapc.synth.synthesizer import shardable_triples

    model, inputs = _mlp(width=512, batch=64)
    theory = hapc.derive(hapc.trace(model, inputs))
    cm = CostModel(_cluster("100 GB/s"))
    tp = SynthSpace(theory, cm.m, allowed=restrict(theory, "tp", cm.m) & shardable_triples(theory, cm.m))
    real = loop._synthesize_at
    calls = []

    def scripted(space, model, ratios, price, progress, deadline=None):  # round 2: Megatron's programs only
        calls.append(ratios)
        return real(tp if len(calls) == 2 else space, model, ratios, price, progress, deadline)

    monkeypatch.setattr(loop, "_synthesize_at", scripted)
    best = loop.balance(SynthSpace(theory, cm.m), cm, rounds=3, initial=cm.even_ratios())
    costs = [r.cost for r in best.rounds]
    assert len(costs) >= 2 and max(costs) > min(costs) * (1 + 1e-6), costs  # a worse round happened
    assert best.cost == pytest.approx(min(costs), rel=1e-12)
    k = costs.index(min(costs))
    assert best.ratios == best.rounds[k].ratios_out
    assert best.cost == pytest.approx(program_cost(theory, cm, best.result.parts, best.ratios), rel=1e-9)


@pytest.mark.parametrize("rounds", [1, 4])
def test_tight_but_feasible_model_gets_a_plan(rounds):
    """Memory below what the fastest (replicated) program needs but above a sharded one's: the
    memory-price retry must find the sharded program (also when only one Q/B round is allowed)."""
    from hapc.balance.loop import balance

    model, inputs = _mlp(width=256, batch=16)  # parameters weigh: sharding them saves memory
    theory = hapc.derive(hapc.trace(model, inputs))
    roomy = CostModel(_cluster("100 GB/s"))
    free = balance(SynthSpace(theory, roomy.m), roomy)
    costs = [[theory.triples[k].cost for k in part] for part in free.result.parts]
    need = max(sum(m) for m in zip(*[roomy.memory(p, free.ratios) for p in costs]))
    groups = [{**g, "memory": need * 0.7} for g in _cluster("100 GB/s").to_dict()["group"]]
    cm = CostModel(Cluster.from_dict({**_cluster("100 GB/s").to_dict(), "group": groups}))
    best = balance(SynthSpace(theory, cm.m), cm, rounds=rounds)
    assert best.memory_price > 0
    costs = [[theory.triples[k].cost for k in part] for part in best.result.parts]
    mem = [sum(x) for x in zip(*[cm.memory(p, best.ratios) for p in costs])]
    assert all(m <= dt.memory * (1 + 1e-6) for m, dt in zip(mem, cm.types)), (mem, need)
    assert best.cost >= free.cost  # it pays for fitting


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(mi=random_models(max_ops=3), cluster=random_clusters(2, 5), data=st.data())
def test_lp_stages_price_every_triple_like_the_cost_model(mi, cluster, data):
    """The LP's linear stages and the search's cost model are two codings of one formula: on every
    triple of the theory (each collective, padded and grouped, and each computation), alone and as
    a program, at random ratios, they give the same time."""
    model, inputs = mi
    param_comm = data.draw(st.booleans())  # sharded parameters gathered inside a device group
    if data.draw(st.booleans()):  # each host one virtual device: its GPUs all-reduce gradients inside
        cluster = Cluster.from_dict({**cluster.to_dict(), "virtual": "host"})
    theory = hapc.derive(hapc.trace(model, inputs), variants=("padded", "grouped"), param_comm=param_comm)
    cm = CostModel(cluster)
    raw = [data.draw(st.floats(0.05, 1.0)) for _ in cm.types]
    total = sum(r * c for r, c in zip(raw, cm.counts))
    ratios = tuple(r / total for r in raw)
    costs = [t.cost for t in theory.triples]
    assert any(t.fwd_comm or t.bwd_comm for t in costs) or cm.m == 1
    for c in [[c] for c in costs] + [costs]:
        stages, grad = cm.linear_stages(c)
        linear = sum(s.time(ratios) for s in stages) + grad
        assert math.isclose(linear, cm.cost(c, ratios), rel_tol=1e-9, abs_tol=1e-15), c


def test_lp_shifts_work_off_the_type_whose_memory_is_short():
    """Pinned case: the fast type has room to spare, the slow type 10 % less than the time-optimal
    ratios need; the LP moves work to the fast type, and each type is held to its own capacity."""
    model, inputs = _mlp(width=512, batch=64)  # activations dominate: memory grows with the ratio
    theory = hapc.derive(hapc.trace(model, inputs))
    roomy = CostModel(_cluster("100 GB/s"))
    res = synthesize_program(SynthSpace(theory, roomy.m), roomy, roomy.proportional_ratios())
    costs = [[theory.triples[k].cost for k in part] for part in res.parts]
    free = solve_ratios(roomy, costs)
    need = [sum(x) for x in zip(*[roomy.memory(p, free.ratios) for p in costs])]
    groups = _cluster("100 GB/s").to_dict()["group"]
    groups = [{**groups[0], "memory": need[0] * 4}, {**groups[1], "memory": need[1] * 0.9}]
    cm = CostModel(Cluster.from_dict({**_cluster("100 GB/s").to_dict(), "group": groups}))
    lp = solve_ratios(cm, costs)
    mem = [sum(x) for x in zip(*[cm.memory(p, lp.ratios) for p in costs])]
    assert mem[1] <= cm.types[1].memory * (1 + 1e-6) and mem[0] <= cm.types[0].memory * (1 + 1e-6), (mem, need)
    assert lp.ratios[1] < free.ratios[1] - 1e-6  # the slow type gave work away


def test_proportional_ratios_split_the_batch_by_speed():
    """HAP's B0: every device's share is proportional to its speed and the shares of all devices
    (``count`` of each type) add up to the whole batch."""
    cm = CostModel(
        Cluster.from_dict(
            {
                "name": "three-kinds",
                "group": [
                    {"name": "a", "devices": 3, "devices_per_host": 3, "flops": 4e12, "memory": "8 GB"},
                    {"name": "b", "devices": 1, "devices_per_host": 1, "flops": 2e12, "memory": "8 GB"},
                    {"name": "c", "devices": 2, "devices_per_host": 2, "flops": 1e12, "memory": "8 GB"},
                ],
            }
        )
    )
    r = cm.proportional_ratios()
    assert sum(c * x for c, x in zip(cm.counts, r)) == pytest.approx(1.0)
    assert r == pytest.approx((4 / 16, 2 / 16, 1 / 16))


def test_memory_counts_parameters_times_the_memory_factor():
    """A data-parallel program holds every parameter whole on every device: its memory is at
    least ``memory_factor`` (weights, gradients, optimizer state) times the parameter bytes."""
    from hapc.synth.baselines import restrict

    model, inputs = _mlp(width=256, batch=4)
    theory = hapc.derive(hapc.trace(model, inputs))
    cm = CostModel(_cluster("10 GB/s"))
    assert cm.memory_factor > 1
    dp = SynthSpace(theory, cm.m, allowed=restrict(theory, "dp-ev", cm.m))
    res = synthesize_program(dp, cm, cm.even_ratios())
    costs = [theory.triples[k].cost for part in res.parts for k in part]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for need in cm.memory(costs, cm.even_ratios()):
        assert need >= cm.memory_factor * weights * (1 - 1e-9), (need, weights)
