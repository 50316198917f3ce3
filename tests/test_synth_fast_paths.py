"""The synthesizer's and the pipeline DP's fast paths give what the general forms give, bit for bit.

* ``search.SINGLE_TYPE``: a segment search on one device type (every homogeneous sub-mesh a pipeline
  prices) keeps the open stages' compute as floats, not 1-tuples (:meth:`SegmentSearch._search1`).
  ``max`` of one value is that value and ``max(0, a - b)`` of one pair is computed the same way, so
  every score, every dominance test and so every state, expansion order and program is the general
  loop's: stage costs, programs and search statistics are compared exactly, with it on and off.
* ``search.MEMO_SUCCESSORS``: an expanded state's successors (the triples that apply and the
  states they leave) do not depend on the times, so they are memoised in the search structure that
  searches of one theory share: compared with and without the memo.
* ``_Synth.block_from`` maps a repeated block's cached exits once per search and keeps its programs
  relative to the block until the result is read (:func:`synthesizer._result`): the programs of a
  model of repeated blocks are checked against the plain DP over segments (no block reuse).
* :class:`~hapc.pipeline.dp.PipelineDP` builds its candidate index for every first layer at once
  and runs each ``t_max`` over one flat array: its index and its runs are compared with a
  layer-at-a-time reference built here from the same formulas (``_reference_rows``), and its trace
  of a run's optimum (which re-reads that run's rows) with the trace from the index alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from hapc import models
from hapc.cluster import Cluster
from hapc.pipeline.dp import INF, GroupSpec, PipelineDP
from hapc.pipeline.layers import build_layers
from hapc.pipeline.planner import cluster_links, cost_table, group_order
from hapc.pipeline.stagecost import StageCoster, submesh_sizes
from hapc.synth import search, synthesizer
from hapc.synth.cost import CostModel
from hapc.theory import derive, trace
from hapc.theory.instructions import Compute
from hapc.theory.props import DONE, Prop

FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep", "program_time")


def _theory(layers: int = 2, batch: int = 8):
    model, inputs = models.gpt("tiny", batch=batch, device="meta")
    return derive(trace(model, inputs), sfb=True, variants=("padded", "grouped"), param_comm=False, strict=False)


def _stage_costs(theory, cluster: str) -> dict:
    layers = build_layers(theory.graph, min_compute=2)
    cl = Cluster.load(cluster)
    coster = StageCoster(theory, layers, cl)
    out = {}
    for g in cl.groups:
        for n in submesh_sizes(g):
            lc = coster.layer_costs(g.name, n)
            out[(g.name, n)] = {f: np.asarray(getattr(lc, f)) for f in FIELDS}
    return out


@pytest.mark.parametrize("cluster", ["hap-testbed:16", "harp-setting2"])
def test_single_type_search_gives_the_general_loops_stage_costs(monkeypatch: pytest.MonkeyPatch, cluster: str):
    monkeypatch.setattr(search, "SINGLE_TYPE", True)
    fast = _stage_costs(_theory(), cluster)
    monkeypatch.setattr(search, "SINGLE_TYPE", False)
    general = _stage_costs(_theory(), cluster)
    assert fast.keys() == general.keys()
    for kind in fast:
        for f in FIELDS:
            assert np.array_equal(fast[kind][f], general[kind][f]), (kind, f)


def test_single_type_search_gives_the_same_programs_and_statistics(monkeypatch: pytest.MonkeyPatch):
    theory = _theory()
    model = CostModel(Cluster.load("hap-testbed:8"))
    assert len(model.types) == 1
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(search, "SINGLE_TYPE", flag)
        space = synthesizer.SynthSpace(theory, model.m, "node")
        results[flag] = synthesizer.synthesize_program(space, model, model.even_ratios())
    a, b = results[True], results[False]
    assert a.parts == b.parts and a.cost == b.cost and a.segment_costs == b.segment_costs
    for field in ("expanded", "generated", "pruned"):
        assert getattr(a.stats, field) == getattr(b.stats, field)
    assert a.searches == b.searches and a.bounds == b.bounds


@pytest.mark.parametrize("cluster", ["hap-testbed:8", "harp-setting2"])
def test_memoised_successors_give_the_same_programs_and_statistics(monkeypatch: pytest.MonkeyPatch, cluster: str):
    """``search.MEMO_SUCCESSORS``: each expanded state's successors are a function of the search's
    structure alone, shared by every search of that structure; with and without the memo, one
    device type (the float loop) and two (the general loop), every kind of a pipeline (the memo
    shared across their times) and an SPMD synthesis give the same programs and statistics."""
    results = {}
    for flag in (True, False):
        monkeypatch.setattr(search, "MEMO_SUCCESSORS", flag)
        theory = _theory()
        model = CostModel(Cluster.load(cluster))
        space = synthesizer.SynthSpace(theory, model.m, "node")
        spmd = synthesizer.synthesize_program(space, model, model.even_ratios())
        results[flag] = (_stage_costs(theory, cluster), spmd)
    (fast, a), (plain, b) = results[True], results[False]
    for kind in fast:
        for f in FIELDS:
            assert np.array_equal(fast[kind][f], plain[kind][f]), (kind, f)
    assert a.parts == b.parts and a.cost == b.cost and a.bounds == b.bounds
    for field in ("expanded", "generated", "pruned"):
        assert getattr(a.stats, field) == getattr(b.stats, field)


def test_shardable_triples_once_per_theory_match_the_definition():
    theory = _theory()
    for m in (1, 2, 3, 4, 8, 16, 64):
        want = set()
        for k, t in enumerate(theory.triples):
            props = list(t.pre) + list(t.post)
            for ins in t.instrs:
                if isinstance(ins, Compute):
                    props += [Prop(o, lay) for o, lay in zip(theory.graph[ins.ref].operands, ins.inputs)]
            if all(not p.layout.is_sharded or theory.atoms(p.ref, p.layout.dim) >= m for p in props if p != DONE):
                want.add(k)
        assert synthesizer.shardable_triples(theory, m) == want


def test_repeated_blocks_map_back_to_the_plain_dps_program():
    """Four identical layers: the blocks' programs, kept relative to their block, map back to the
    program (and segment costs) the DP finds with every segment stepped in the table."""
    theory = _theory()
    model = CostModel(Cluster.load("hap-testbed:8"))
    space = synthesizer.SynthSpace(theory, model.m, "node")
    ratios = model.even_ratios()
    reused = synthesizer._Synth(space, model, ratios, None)
    assert reused.repeated  # the layers are repeated blocks
    plain = synthesizer._Synth(space, model, ratios, None)
    plain.repeated = set()  # every block run segment by segment
    got = [synthesizer._result(space, run, run.solve(), [], True, 0.0) for run in (reused, plain)]
    assert got[0].cost == pytest.approx(got[1].cost, rel=1e-12)  # (summed block by block: rounding)
    assert got[0].parts == got[1].parts
    assert got[0].segment_costs == pytest.approx(got[1].segment_costs, rel=1e-12)
    assert synthesizer.program_cost(theory, model, got[0].parts, ratios) == pytest.approx(got[0].cost, rel=1e-12)


def _reference_rows(dp: PipelineDP, i: int, o: int, mem: float) -> list[tuple]:
    """The rows of first layer ``i`` on option ``o``, one layer at a time (the DP's former form)."""
    L = dp.L
    js = np.arange(i, L)
    mp = dp.Pp[o, js + 1] - dp.Pp[o, i]
    ma = dp.Pa[o, js + 1] - dp.Pa[o, i]
    t = dp.Pt[o, js + 1] - dp.Pt[o, i]
    with np.errstate(divide="ignore", invalid="ignore"):
        plain = np.where(ma > 0, np.floor((mem - mp) / np.where(ma > 0, ma, 1)), INF)
    plain = np.where(plain >= dp.cap, INF, plain)
    fits = mp + ma <= mem
    plain = np.where(fits, plain, 0.0)
    out = []
    if dp.recompute != "always" and fits.any():
        last = int(np.flatnonzero(fits)[-1]) + 1
        out.append((js[:last], t[:last], plain[:last], 0))
    if dp.recompute == "never":
        return out
    ok = (dp.Pbad[o, js + 1] - dp.Pbad[o, i]) == 0
    inb = dp.inb[i] + dp.Pk[o, js + 1] - dp.Pk[o, i]
    room = mem - mp - ma
    with np.errstate(divide="ignore", invalid="ignore"):
        nr = np.where(inb > 0, np.floor(room / np.where(inb > 0, inb, 1)), np.where(room >= 0, INF, 0.0))
    nr = np.where(room >= inb, nr, 0.0)
    nr = np.where(nr >= dp.cap, INF, nr)
    keep = ok & (nr >= 1)
    if dp.recompute == "auto":
        keep &= nr > plain
    if keep.any():
        tr = t + dp.Pf[o, js + 1] - dp.Pf[o, i]
        out.append((js[keep], tr[keep], nr[keep], 1))
    return out


def _reference_index(dp: PipelineDP) -> list[dict[str, np.ndarray]]:
    """Per first layer, the rows ordered by start device, then option, row kind, link and last layer."""
    tb, L = dp.table, dp.L
    out = []
    for i in range(L):
        rows = []
        for o, opt in enumerate(tb.options):
            for js, t, nmax, rc in _reference_rows(dp, i, o, dp.groups[opt.group].memory):
                for s in dp.placements(opt.group, opt.size):
                    name, bw, lat = dp._link(opt.group, s, opt.size)
                    p = dp.offsets[opt.group] + s
                    for j, tt, nm in zip(js, t, nmax):
                        if (name == "end") != (j == L - 1):
                            continue
                        c = 0.0 if name == "end" else lat + tb.out_bytes[j] / bw
                        rows.append((p, o, rc, j, tt, c, nm, dp.link_names.index(name)))
        rows.sort(key=lambda r: r[:4])
        out.append(rows)
    return out


def _reference_run(dp: PipelineDP, tau: float) -> np.ndarray:
    """:meth:`PipelineDP.run` one layer at a time: each layer's usable rows filtered and valued
    apart (:meth:`PipelineDP._values`), then the least per start device."""
    K, L, D = dp.K, dp.L, dp.D
    dp.Kr = min(K, dp.reach(tau) + 1)
    G = np.full((L + 1, D + 1, K + 2), INF)
    G[L, D, 1:] = 0.0
    bs = np.arange(dp.Kr + 1)
    for i in range(L - 1, -1, -1):
        a = dp.index[i]
        rows = np.flatnonzero(a["tc_max"] <= tau)
        if not len(rows):
            continue
        vals = dp._values(a, rows, tau, G, bs)
        p = a["p"].take(rows)
        starts = np.flatnonzero(np.concatenate(([True], p[1:] != p[:-1])))
        G[i, p[starts].astype(int), 1 : dp.Kr + 2] = np.minimum.reduceat(vals, starts, axis=0)
    return G


@pytest.mark.parametrize("recompute", ["auto", "never", "always"])
@pytest.mark.parametrize("memory", [1.0, 3e-5, 1e-5])
def test_dp_index_and_runs_match_the_layer_at_a_time_form(recompute: str, memory: float):
    """``memory``: the devices' memory scaled down until it binds (finite warm-up bounds, recomputing
    rows, at 1e-5 a dearer plan)."""
    theory = _theory(batch=4)
    layers = build_layers(theory.graph, min_compute=1)
    cl = Cluster.load("harp-setting2")
    names = group_order(cl)
    table = cost_table(StageCoster(theory, layers, cl), layers, names)
    by = {g.name: g for g in cl.groups}
    groups = [
        GroupSpec(n, by[n].devices, min(by[n].devices_per_host, by[n].devices), by[n].memory * memory, by[n].flops)
        for n in names
    ]
    dp = PipelineDP(table, groups, cluster_links(cl, names), 8, 0.1, recompute)
    ref = _reference_index(dp)
    for i, rows in enumerate(ref):
        a = dp.index[i]
        got = list(zip(a["p"], a["o"], a["rc"], a["ni"] - 1, a["t"], a["c"], a["nmax"], a["link"]))
        assert [tuple(map(float, r)) for r in got] == [tuple(map(float, r)) for r in rows], i
    if memory < 1.0:
        assert dp.K > 1  # memory binds: finite warm-up bounds
    if recompute != "never":
        assert any(a["rc"].any() for a in dp.index) == (recompute == "always" or memory < 1.0)
    cands = dp.candidates()
    for tau in cands[:: max(1, len(cands) // 25)]:
        got = dp.run(float(tau))
        if np.isfinite(got[0, 0, dp.Kr + 1]):
            # the trace reads the last run's rows; a copy of G is traced from the index alone
            assert dp.trace(got, float(tau)) == dp.trace(got.copy(), float(tau))
        assert np.array_equal(got, _reference_run(dp, float(tau)))
    assert dp.solve() is not None
