"""HARP planner: layer construction, the DP against brute force, memory errors, balance (HARP §5)."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
import torch

import hapc
from hapc import models
from hapc.cluster import Group
from hapc.pipeline.dp import CostTable, GroupSpec, Links, Option, PipelineDP, delta
from hapc.pipeline.layers import build_layers, evaluate_by_layers
from hapc.pipeline.planner import PipelinePlan, PlanningError, plan_pipeline, solve
from hapc.pipeline.schedule import h1f1b_delta, h1f1b_warmup
from hapc.pipeline.stagecost import StageCoster, sub_cluster, submesh_sizes
from hapc.synth.cost import CostModel
from hapc.synth.synthesizer import SynthSpace, shardable_triples, synthesize_program
from hapc.theory import derive, trace
from hapc.theory.graph import OP

EPS = 0.1


# -- layers ------------------------------------------------------------------------------------
def _graph(name: str, **kw):
    model, inputs = getattr(models, name)("tiny", **kw) if kw else models.load(name)
    g = trace(model, inputs)
    names = [n.name for n in g.inputs]
    return g, dict(zip(names, inputs if isinstance(inputs, (tuple, list)) else [inputs]))


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_layers_cover_ops_and_liveness_is_exact(name):
    g, inputs = _graph(name)
    layers = build_layers(g)
    ops = [n.index for n in g if n.kind == OP]
    assert [x for layer in layers for x in layer.nodes] == ops  # every op once, in index order
    for layer in layers:  # the definition: produced at or before the layer, used after it
        end = layer.last
        want = [x for x in ops if x <= end and any(u > end for u in g[x].users)]
        assert layer.live_out == want
        assert layer.out_bytes == sum(g[x].meta.nbytes for x in want)
        assert set(layer.params) == {o for x in layer.nodes for o in g[x].operands if g[o].kind in ("param", "buffer")}
    assert layers[-1].live_out == []
    # carrying only live_out (and the model inputs) across each cut reproduces the loss
    torch.testing.assert_close(evaluate_by_layers(g, layers, inputs), g.run(inputs), rtol=0, atol=0)
    # and carrying less breaks it
    cut = next(layer for layer in layers if layer.live_out)
    broken = [
        layer if layer is not cut else type(layer)(**{**layer.__dict__, "live_out": layer.live_out[1:]})
        for layer in layers
    ]
    with pytest.raises(KeyError, match="not live"):
        evaluate_by_layers(g, broken, inputs)


def test_gpt_blocks_are_repeated_layers():
    for n_blocks in (2, 4):
        model, inputs = models.gpt("small") if n_blocks == 4 else models.gpt("tiny")
        layers = build_layers(trace(model, inputs))
        assert len(layers) == 3 * n_blocks + 2  # embedding, 3 per block, head (HARP's 146 for 48)
        block = [layer.signature for layer in layers[1:-1]]
        assert block == block[:3] * n_blocks  # n blocks -> n equal signatures per block layer
        assert len(set(block[:3])) == 3 and layers[0].signature not in block


# -- the DP against brute force ------------------------------------------------------------------
def _random_instance(rng: random.Random):
    L = rng.randint(1, 6)
    ngroups = rng.randint(1, 2)
    groups, options = [], []
    for k in range(ngroups):
        devices = rng.randint(1, 4)
        dph = rng.choice([1, 2, 4])
        gr = Group(f"g{k}", devices, 1.0, 1.0, dph)
        groups.append(GroupSpec(gr.name, devices, min(dph, devices), rng.uniform(2.0, 12.0), rng.uniform(1, 3)))
        options += [Option(k, n) for n in submesh_sizes(gr)]
    O = len(options)
    fwd = np.array([[rng.uniform(0.1, 1.0) / opt.size**0.7 for _ in range(L)] for opt in options])
    table = CostTable(
        options,
        fwd,
        fwd * rng.uniform(1.5, 2.5),
        np.array([[rng.uniform(0, 0.5) for _ in range(L)] for _ in range(O)]),
        np.array([[rng.uniform(0.1, 3.0) / opt.size for _ in range(L)] for opt in options]),
        np.array([[rng.uniform(0.05, 1.5) / opt.size for _ in range(L)] for opt in options]),
        np.array([rng.uniform(0.0, 3.0) for _ in range(L)]),
    )
    links = Links(
        (rng.uniform(5, 50), rng.uniform(0, 0.01)),
        (rng.uniform(1, 10), rng.uniform(0, 0.05)),
        tuple((rng.uniform(0.5, 5), rng.uniform(0, 0.2)) for _ in range(ngroups - 1)),
    )
    return table, groups, links, rng.randint(1, 8)


def _tilings(groups):
    """Every way to tile each group's devices, in order, with placeable sub-meshes."""

    def tile(k, s):
        g = groups[k]
        if s == g.devices:
            yield []
            return
        for n in sorted({1, 2, 4, g.devices_per_host} | {m * g.devices_per_host for m in range(2, 5)}):
            if s + n > g.devices:
                continue
            if n <= g.devices_per_host:
                ok = s // g.devices_per_host == (s + n - 1) // g.devices_per_host
            else:
                ok = n % g.devices_per_host == 0 and s % g.devices_per_host == 0
            if ok:
                for rest in tile(k, s + n):
                    yield [(k, s, n), *rest]

    per_group = [list(tile(k, 0)) for k in range(len(groups))]
    for combo in itertools.product(*per_group):
        yield [m for part in combo for m in part]


def _brute_force(table, groups, links, B, recompute="never"):
    """The least Eq. 12 over every tiling, cut and choice of recomputing stages (``recompute``:
    "never", "always" every stage, "auto" any subset): a recomputing stage takes ``t + fwd`` and
    needs ``mem_p + N in + mem_a`` with ``in`` the bytes entering it (0 for the first stage)."""
    L = table.num_layers
    best = math.inf
    for meshes in _tilings(groups):
        S = len(meshes)
        if S > L:
            continue
        flags = {"never": [(False,) * S], "always": [(True,) * S]}.get(recompute)
        for cuts in itertools.combinations(range(1, L), S - 1):
            for rc in flags or itertools.product((False, True), repeat=S):
                best = min(best, _brute_value(table, groups, links, B, meshes, [0, *cuts, L], rc))
    return best


def _brute_value(table, groups, links, B, meshes, bounds, rc):
    """Eq. 12 of one plan at its least feasible t_max (inf: none)."""
    opt_index = {(o.group, o.size): i for i, o in enumerate(table.options)}
    per_mb = table.fwd + table.bwd + table.sync / B
    ok = np.ones(table.fwd.shape, dtype=bool) if table.recomputable is None else table.recomputable
    S = len(meshes)
    t, c, mp, ma = [], [], [], []
    for s, (k, start, n) in enumerate(meshes):
        o = opt_index[(k, n)]
        lo, hi = bounds[s], bounds[s + 1]
        if rc[s] and not ok[o, lo:hi].all():
            return math.inf
        t.append(sum(per_mb[o, lo:hi]) + (sum(table.fwd[o, lo:hi]) if rc[s] else 0.0))
        mp.append(sum(table.mem_param[o, lo:hi]))
        act = sum(table.mem_act[o, lo:hi])
        inb = table.out_bytes[lo - 1] if lo > 0 else 0.0
        inb += table.keep[o, lo:hi].sum() if table.keep is not None else 0.0
        ma.append((inb, act) if rc[s] else (act, 0.0))  # (per in-flight micro-batch, once)
        if s == S - 1:
            c.append(0.0)
            continue
        g = groups[k]
        if start + n == g.devices:
            bw, lat = links.between[k]
        elif start // g.devices_per_host == (start + n) // g.devices_per_host:
            bw, lat = links.intra_host
        else:
            bw, lat = links.inter_host
        c.append(lat + table.out_bytes[hi - 1] / bw)
    up = math.inf
    taus = {max(t)} | {
        float(np.nextafter(np.nextafter(x, up), up)) for ci in c if ci > 0 for x in (ci, 2 * ci, ci / EPS)
    }
    for tau in sorted(x for x in taus if x >= max(t)):
        if any(ci > tau for ci in c):
            continue
        N = [1]
        for ci in reversed(c[:-1]):
            N.append(N[-1] + int(delta(ci, tau, EPS)))
        N = N[::-1]
        mem = [groups[k].memory for k, _, _ in meshes]
        if all(p + min(n, B) * a + once <= m for p, (a, once), n, m in zip(mp, ma, N, mem)):
            return sum(t) + 2 * sum(c) + (B - 1) * tau
    return math.inf


def test_dp_equals_brute_force_on_random_instances():
    rng = random.Random(6)
    feasible = infeasible = memory_bound = 0
    for _ in range(150):
        table, groups, links, B = _random_instance(rng)
        want = _brute_force(table, groups, links, B)
        dp = PipelineDP(table, groups, links, B, EPS, recompute="never")
        sol = dp.solve()
        if not math.isfinite(want):
            assert sol is None
            infeasible += 1
            continue
        feasible += 1
        assert sol is not None
        assert sol.value == pytest.approx(want, rel=1e-9)
        # the reported plan is what it claims: Eq. 12 at its t_max, stages and links within t_max
        st = sol.stages
        assert sol.value == pytest.approx(sum(s.time + 2 * s.comm for s in st) + (B - 1) * sol.t_max, rel=1e-12)
        assert all(s.time <= sol.t_max and s.comm <= sol.t_max for s in st)
        assert [s.lo for s in st] == [0] + [s.hi for s in st[:-1]] and st[-1].hi == table.num_layers
        memory_bound += any(math.isfinite(s.nmax) and s.nmax < B for s in st)
    assert feasible >= 20 and infeasible >= 3 and memory_bound >= 3  # the instances exercise all cases


def test_dp_with_recomputation_equals_brute_force():
    """Recomputation as a per-stage choice: "auto" (the DP picks per stage), "always", the layers
    where it is not allowed (``recomputable``) and bytes kept besides a stage's input (``keep``:
    collective outputs) against brute force over every subset."""
    rng = random.Random(11)
    helped = rescued = chosen = masked = kept = 0
    for n in range(150):
        table, groups, links, B = _random_instance(rng)
        table.mem_act = table.mem_act * rng.uniform(1.0, 4.0)  # memory binds more often
        table.out_bytes = table.out_bytes * rng.choice([0.05, 0.3, 1.0])  # stage inputs smaller than activations
        if n % 2 == 0:
            L = table.num_layers
            table.recomputable = np.array([[rng.random() < 0.85 for _ in range(L)] for _ in table.options])
        if n % 3 == 1:
            kr = random.Random(n)  # (its own draws: the other instances stay as they were)
            table.keep = np.array([[kr.uniform(0.0, 0.3) for _ in range(table.num_layers)] for _ in table.options])
        never = _brute_force(table, groups, links, B, "never")
        for mode in ("auto", "always"):
            want = _brute_force(table, groups, links, B, mode)
            sol = PipelineDP(table, groups, links, B, EPS, recompute=mode).solve()
            if not math.isfinite(want):
                assert sol is None
                continue
            assert sol is not None
            assert sol.value == pytest.approx(want, rel=1e-9)
            st = sol.stages
            assert sol.value == pytest.approx(sum(s.time + 2 * s.comm for s in st) + (B - 1) * sol.t_max, rel=1e-12)
            for s in st:  # a recomputing stage's time is t + fwd, and it only recomputes where allowed
                o, rng_ = s.option, slice(s.lo, s.hi)
                base = (table.fwd + table.bwd + table.sync / B)[o, rng_].sum()
                assert s.time == pytest.approx(base + (table.fwd[o, rng_].sum() if s.recompute else 0.0), rel=1e-12)
                if s.recompute and table.recomputable is not None:
                    assert table.recomputable[o, rng_].all()
            if mode == "always":
                assert all(s.recompute for s in st)
                continue
            assert want <= never
            chosen += any(s.recompute for s in st)
            helped += math.isfinite(never) and want < never * (1 - 1e-9)
            rescued += not math.isfinite(never)
            masked += table.recomputable is not None and any(s.recompute for s in st)
            kept += table.keep is not None and any(s.recompute for s in st)
    # (10, 5, 15, 7, 4) when written
    assert helped >= 6 and rescued >= 3 and chosen >= helped + rescued and masked >= 4 and kept >= 2


def test_recomputation_that_buys_exactly_the_one_more_micro_batch_needed():
    """Three one-device groups, a layer each, H-1F1B holding 3, 2, 1 micro-batches: the middle stage
    fits one micro-batch's activations but needs two in flight; recomputing keeps its input (0.5)
    per micro-batch instead and fits exactly two -- one more than without, the least that helps."""
    options = [Option(k, 1) for k in range(3)]
    one = np.ones((3, 3))
    table = CostTable(options, one * 0.1, one * 0.2, one * 0.0, one * 1.0, one * 1.2, np.array([0.5, 0.5, 0.5]))
    groups = [GroupSpec(f"g{k}", 1, 1, 3.3, 1.0) for k in range(3)]
    links = Links((1e9, 0.0), (1e9, 0.0), ((1e9, 0.0), (1e9, 0.0)))
    assert PipelineDP(table, groups, links, 4, EPS, recompute="never").solve() is None
    sol = PipelineDP(table, groups, links, 4, EPS).solve()
    assert sol is not None and sol.warmups == [3, 2, 1]
    assert [s.recompute for s in sol.stages] == [True, True, False]  # the first: 3 in flight need it too
    assert [s.nmax for s in sol.stages][:2] == [math.inf, 2]  # its input is the batch; 0.5 kept twice in 1.1
    assert sol.value == pytest.approx(_brute_force(table, groups, links, 4, "auto"), rel=1e-12)


def test_delta_is_the_schedule_modules_eq2():
    rng = random.Random(1)
    for _ in range(500):
        t = rng.uniform(0.1, 10)
        c = rng.choice([0.0, rng.uniform(0, t)])
        assert int(delta(c, t, EPS)) == h1f1b_delta(c, t, EPS)


# -- the whole planner on real stage costs ---------------------------------------------------------
def _two_speed_cluster(memory="4 GiB", slow_flops=1e10):
    return hapc.Cluster.from_dict(
        {
            "name": "two-speed",
            "group": [
                {"name": "fast", "devices": 2, "devices_per_host": 2, "flops": 3e10, "memory": memory},
                {"name": "slow", "devices": 2, "devices_per_host": 2, "flops": slow_flops, "memory": memory},
            ],
            "links": {
                "intra_host": {"bandwidth": "20 GB/s", "latency": "5 us"},
                "inter_host": {"bandwidth": "10 GB/s", "latency": "10 us"},
                "between": [{"groups": ["fast", "slow"], "bandwidth": "5 GB/s", "latency": "20 us"}],
            },
        }
    )


def test_plan_balances_work_by_compute_and_round_trips():
    model, inputs = models.gpt("small", batch=8)
    cluster = _two_speed_cluster()
    plan = plan_pipeline(model, cluster, inputs, num_micro=8)
    layers = build_layers(trace(model, inputs))
    flops = [layer.flops_fwd + layer.flops_bwd for layer in layers]
    work = {"fast": 0.0, "slow": 0.0}
    count = {"fast": 0, "slow": 0}
    for s in plan.stages:
        work[s.group] += sum(flops[s.lo : s.hi])
        count[s.group] += s.hi - s.lo
    compute = {g.name: g.devices * g.flops for g in cluster.groups}
    per_unit = {k: work[k] / compute[k] for k in work}
    # HARP Table 1's lesson: the slow group gets fewer layers, and no more work per unit of compute
    assert count["slow"] < count["fast"]
    assert per_unit["slow"] <= per_unit["fast"]
    assert 0 < plan.eta <= 1
    # the plan covers the graph and its numbers are Eq. 12 / Eq. 1-2
    assert plan.stages[0].lo == 0 and plan.stages[-1].hi == len(layers)
    assert plan.cuts() == [layers[s.lo].first for s in plan.stages[1:]]
    assert plan.time == pytest.approx(sum(s.time + 2 * s.comm for s in plan.stages) + (plan.num_micro - 1) * plan.t_max)
    assert plan.warmups == h1f1b_warmup([plan.t_max] * len(plan.stages), [s.comm for s in plan.stages[:-1]])
    assert plan.group_order == ["slow", "fast"]  # equal memory, less compute: more memory per flop first
    again = PipelinePlan.from_json(json.loads(plan.dumps()))
    assert again == plan
    text = plan.describe()
    assert "[0, " in text and "eta" in text


def test_model_too_big_names_the_shortfall():
    model, inputs = models.gpt("small", batch=8)
    with pytest.raises(PlanningError, match=r"short by \d+\.\d+ GiB"):
        plan_pipeline(model, _two_speed_cluster(memory="100 KiB"), inputs, num_micro=4)


def test_stage_costs_are_synthesized_once_per_submesh_and_shared_spaces_are_exact():
    model, inputs = models.gpt("tiny")
    theory = derive(trace(model, inputs))
    layers = build_layers(theory.graph)
    coster = StageCoster(theory, layers, _two_speed_cluster())
    for m in (1, 2, 3, 4):
        assert coster.shardable(m) == frozenset(shardable_triples(theory, m))
    a = coster.layer_costs("fast", 2)
    b = coster.layer_costs("fast", 2)
    assert a is b and coster.syntheses == 1
    # a layer's costs are the synthesized program's, split by node: they add up to the program
    assert a.fwd.sum() + a.bwd.sum() + a.sync.sum() == pytest.approx(a.program_time, rel=1e-9)
    # one device reuses the two-device segment space: same optimum as its own space
    one = coster.layer_costs("slow", 1)
    model1 = CostModel(sub_cluster(coster.cluster, "slow", 1))
    own = synthesize_program(SynthSpace(theory, 1, "node", shardable_triples(theory, 1)), model1, (1.0,))
    assert one.program_time == pytest.approx(own.cost, rel=1e-12)
    # repeated blocks cost the same
    sig = [layer.signature for layer in layers]
    for i, j in itertools.combinations(range(len(layers)), 2):
        if sig[i] == sig[j]:
            assert a.fwd[i] == pytest.approx(a.fwd[j]) and a.mem_param[i] == a.mem_param[j]


def test_solve_reports_devices_and_memory():
    rng = random.Random(3)
    while True:
        table, groups, links, B = _random_instance(rng)
        try:
            plan = solve(table, groups, links, B, epsilon=EPS)
            break
        except PlanningError:
            continue
    used = {g.name: [] for g in groups}
    for s in plan.stages:
        used[s.group] += s.devices
        assert s.memory <= next(g.memory for g in groups if g.name == s.group) * (1 + 1e-12)
    assert all(sorted(v) == list(range(g.devices)) for g, v in zip(groups, used.values()))
