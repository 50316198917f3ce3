"""Pipeline schedules (HARP §2.3, §4): warm-up counts, action lists, deadlock freedom, the simulator.

Oracles are independent of the code under test: Eq. 2 is checked against the bubble-free bound
of Eq. 10/27 in exact rational arithmetic, deadlock freedom by an abstract execution written
here (sends never block, receives block until the matching send was issued), the simulator
against HARP's closed forms (Lemma 2 / Eq. 8 for two stages, Eq. 12, App. B's round-trip bound).
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from hapc.errors import HapcError
from hapc.pipeline.schedule import (
    HARP_EPSILON,
    Action,
    ScheduleError,
    eager_1f1b_warmup,
    grid,
    h1f1b_warmup,
    one_f_one_b_warmup,
    policy_warmup,
    schedule,
    stage_actions,
)
from hapc.pipeline.simulate import chrome_trace, compare_policies, eq12_time, policy_table, simulate

# --------------------------------------------------------------------------- Eq. 1-2


def eq27_delta(c: float, t_max: float, eps: float) -> int:
    """Eq. 2 restated: inside the ε band 1, else the smallest integer δ >= 1 + 2c/t_max (Eq. 10/27)."""
    if Fraction(c) <= Fraction(eps) * Fraction(t_max):
        return 1
    return math.ceil(1 + 2 * Fraction(c) / Fraction(t_max))


fractions_of_tmax = st.one_of(
    st.sampled_from([0.0, HARP_EPSILON, 0.5, 1.0]),  # Eq. 2's band edges, hit exactly
    st.floats(0.0, 1.0, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(
    t_max=st.floats(1e-4, 1e4, allow_nan=False),
    others=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=7),
    fracs=st.lists(fractions_of_tmax, min_size=8, max_size=8),
    eps=st.sampled_from([HARP_EPSILON, 0.05, 0.25]),
    data=st.data(),
)
def test_h1f1b_warmup_follows_eq1_eq2(t_max, others, fracs, eps, data):
    times = [t_max * x for x in others]
    times.insert(data.draw(st.integers(0, len(times))), t_max)  # t_max is the maximum stage time
    S = len(times)
    comm = [min(t_max * f, t_max) for f in fracs[: S - 1]]
    n = h1f1b_warmup(times, comm, eps)
    deltas = [eq27_delta(c, t_max, eps) for c in comm]
    assert len(n) == S and n[-1] == 1
    for i in range(S):
        assert n[i] == 1 + sum(deltas[i:])  # Eq. 1
    assert all(d in (1, 2, 3) for d in deltas)


def test_h1f1b_band_edges_and_plain_1f1b():
    t = 3.0
    assert [h1f1b_warmup([t, t], [c])[0] - 1 for c in (0.0, 0.3, 0.30001, 1.5, 1.50001, 3.0)] == [1, 1, 2, 2, 3, 3]
    # c_i = 0 (outside Eq. 2's domain) and the ε band give δ = 1: exactly plain 1F1B's S - i
    for S in range(1, 8):
        assert h1f1b_warmup([1.0] * S, [0.0] * (S - 1)) == one_f_one_b_warmup(S) == list(range(S, 0, -1))
        assert h1f1b_warmup([1.0] * S, [0.1] * (S - 1)) == one_f_one_b_warmup(S)


def test_harp_case_study_5_2_1():
    # HARP §2.3.2 / Fig. 3(d): the Table 1 fine-grained plan (stage costs 1.13t, 1.10t, 1.10t), stage 1->2
    # over 5 Gbps Ethernet costing between (t_f+t_b)/2 and t_f+t_b, stage 2->3 over InfiniBand (negligible).
    t = [1.13, 1.10, 1.10]
    for slow in (0.5 * 1.13 + 1e-9, 0.8, 1.13):
        for fast in (0.0, 0.01, HARP_EPSILON * 1.13):
            assert h1f1b_warmup(t, [slow, fast]) == [5, 2, 1]
    assert eager_1f1b_warmup(3) == [5, 3, 1]  # Fig. 3(c)
    assert one_f_one_b_warmup(3) == [3, 2, 1]
    # HARP §6 (10B MoE, 8xV100e + 4xA100): [5, 4, 2, 1] = one mid-cost link between two cheap ones
    assert h1f1b_warmup([1.0] * 4, [0.05, 0.4, 0.0]) == [5, 4, 2, 1]


def test_warmup_errors_are_clear():
    with pytest.raises(ScheduleError, match="exceeds t_max"):
        h1f1b_warmup([1.0, 2.0], [2.5])
    assert h1f1b_warmup([1.0, 2.0], [2.5], clamp=True) == [4, 1]
    with pytest.raises(ValueError, match="need 2 link times"):  # ScheduleError is a ValueError too
        h1f1b_warmup([1.0, 1.0, 1.0], [0.1])
    with pytest.raises(HapcError, match=">= 0"):
        h1f1b_warmup([1.0, 1.0], [-0.1])
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        policy_warmup("gpipe", [1.0], [])
    with pytest.raises(ScheduleError, match="must not increase"):
        schedule([1, 2], 4)
    assert schedule([9, 9, 1], 2) == schedule([2, 2, 1], 2)  # capping by M may make counts equal


# --------------------------------------------------------------------------- action lists


def abstract_run(sched):
    """Execute the lists with non-blocking sends and blocking receives; returns the interleaving.

    Raises AssertionError naming the stuck actions when no stage can move (a deadlock).
    """
    S = len(sched)
    pc, sent, order = [0] * S, set(), []
    while any(pc[i] < len(sched[i]) for i in range(S)):
        moved = False
        for i in range(S):
            while pc[i] < len(sched[i]):
                a = sched[i][pc[i]]
                if a.kind == "RECV_ACT" and ("act", i - 1, a.micro) not in sent:
                    break
                if a.kind == "RECV_GRAD" and ("grad", i + 1, a.micro) not in sent:
                    break
                if a.kind == "SEND_ACT":
                    sent.add(("act", i, a.micro))
                if a.kind == "SEND_GRAD":
                    sent.add(("grad", i, a.micro))
                order.append(a)
                pc[i] += 1
                moved = True
        assert moved, f"deadlock at {[sched[i][pc[i]] for i in range(S) if pc[i] < len(sched[i])]}"
    return order


def check_lists(sched, warmups, M):
    S = len(sched)
    for i, acts in enumerate(sched):
        assert all(a.stage == i for a in acts)
        f = [a.micro for a in acts if a.kind == "F"]
        b = [a.micro for a in acts if a.kind == "B"]
        assert sorted(f) == list(range(M)) and sorted(b) == list(range(M))  # each exactly once
        pos = {(a.kind, a.micro): k for k, a in enumerate(acts)}
        live = peak = 0
        for a in acts:
            live += (a.kind == "F") - (a.kind == "B")
            peak = max(peak, live)
        assert peak <= min(warmups[i], M)  # in-flight activations never exceed the warm-up count
        assert peak == min(warmups[i], M)
        for m in range(M):
            assert pos[("F", m)] < pos[("B", m)]
            # messages wrap compute: receive right before, send right after, only towards existing stages
            assert (("RECV_ACT", m) in pos) == (i > 0) and (("SEND_ACT", m) in pos) == (i < S - 1)
            assert (("RECV_GRAD", m) in pos) == (i < S - 1) and (("SEND_GRAD", m) in pos) == (i > 0)
            if i > 0:
                assert pos[("RECV_ACT", m)] == pos[("F", m)] - 1 and pos[("SEND_GRAD", m)] == pos[("B", m)] + 1
            if i < S - 1:
                assert pos[("SEND_ACT", m)] == pos[("F", m)] + 1 and pos[("RECV_GRAD", m)] == pos[("B", m)] - 1


@settings(max_examples=300, deadline=None)
@given(
    S=st.integers(1, 6),
    M=st.integers(1, 12),
    policy=st.sampled_from(["h1f1b", "1f1b", "eager-1f1b"]),
    fracs=st.lists(st.floats(0.0, 1.0), min_size=5, max_size=5),
)
def test_schedules_are_complete_and_deadlock_free(S, M, policy, fracs):
    warmups = policy_warmup(policy, [1.0] * S, fracs[: S - 1])
    sched = schedule(warmups, M)
    check_lists(sched, warmups, M)
    order = abstract_run(sched)
    assert len(order) == sum(map(len, sched))
    # every message is sent exactly once and received exactly once, by the right peer
    sends = [(a.kind[5:], a.stage, a.peer, a.micro) for a in order if a.kind.startswith("SEND")]
    recvs = [(a.kind[5:], a.peer, a.stage, a.micro) for a in order if a.kind.startswith("RECV")]
    assert sorted(sends) == sorted(recvs) and len(set(sends)) == len(sends)
    # the simulator agrees: it runs every list to the end, and in-flight peaks are the (capped) warm-ups
    res = simulate(sched, [1.0] * S, [2.0] * S, [f * 3 for f in fracs[: S - 1]])
    assert res.peak_inflight == [min(w, M) for w in warmups]


def test_increasing_warmups_do_deadlock():
    # why schedule() refuses them: stage 0 waits for gradient 0, stage 1 for activation 1
    sched = [stage_actions(0, 2, 4, 1), stage_actions(1, 2, 4, 2)]
    with pytest.raises(AssertionError, match="deadlock"):
        abstract_run(sched)
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 at rG0@0, stage 1 at rA1@1"):
        simulate(sched, [1, 1], [1, 1], [0.5])


def test_stage_actions_small_case():
    acts = stage_actions(1, 3, 3, 2)
    assert [a.label for a in acts] == ("rA0 F0 sA0 rA1 F1 sA1 rG0 B0 sG0 rA2 F2 sA2 rG1 B1 sG1 rG2 B2 sG2".split())
    assert Action("SEND_ACT", 0, 1).peer == 2 and Action("RECV_ACT", 0, 1).peer == 0
    with pytest.raises(ScheduleError, match="unknown action kind"):
        Action("X", 0, 0)


# --------------------------------------------------------------------------- the grid


def test_grid_golden():
    assert grid(schedule([2, 1], 3)) == (
        "step    0  1  2  3  4  5  6  7\nstage 0 F0 F1 .  B0 F2 B1 .  B2\nstage 1 .  F0 B0 F1 B1 F2 B2 ."
    )


@pytest.mark.parametrize("policy", ["h1f1b", "1f1b", "eager-1f1b"])
@pytest.mark.parametrize("S,M", [(3, 8), (4, 6), (5, 12)])
def test_grid_matches_action_lists(policy, S, M):
    sched = schedule(policy_warmup(policy, [1.0] * S, [0.7] * (S - 1)), M)
    text = grid(sched, bwd_steps=2)
    rows = text.splitlines()[1:]
    assert len(rows) == S
    col: dict[tuple[str, int, int], int] = {}
    for i, row in enumerate(rows):
        cells = row.split()[2:]
        labels = [c for c in cells if c not in (".", "~")]
        assert labels == [a.label for a in sched[i] if a.is_compute]  # row = the stage's list, in order
        for t, c in enumerate(cells):
            if c not in (".", "~"):
                col[(c[0], int(c[1:]), i)] = t
                if c[0] == "B":
                    assert cells[t + 1] == "~"  # a backward spans bwd_steps=2 cells
    for m in range(M):
        for i in range(1, S):
            assert col[("F", m, i)] > col[("F", m, i - 1)]  # data dependencies hold in the picture
            assert col[("B", m, i - 1)] > col[("B", m, i)]


# --------------------------------------------------------------------------- the simulator


def test_simulator_two_stage_matches_harp_lemma2():
    # HARP Eq. 8: with stage 0 launching K forwards, a K-block lasts max{K(f+b), 2(f+b+c)} on both stages.
    rng = random.Random(0)
    for _ in range(60):
        f, b = rng.uniform(0.1, 1), rng.uniform(0.1, 2)
        c, K = rng.uniform(0, 1) * (f + b), rng.randint(1, 6)
        res = simulate(schedule([K, 1], 96), [f, f], [b, b], [c])
        expect = max(K * (f + b), 2 * (f + b + c)) / K
        for i in range(2):
            assert res.steady_period(i, block=K) == pytest.approx(expect, rel=1e-9)


def test_simulator_exact_small_timeline():
    # S=2, f=1, b=2, c=2.5 (> t_max/2, δ=3, N = [4, 1]): worked by hand, bubble-free, Eq. 12 exact.
    res = simulate(schedule([4, 1], 6), [1, 1], [2, 2], [2.5])
    stage1 = [(e.kind + str(e.micro), e.start) for e in res.compute_events(1)]
    assert stage1[:6] == [("F0", 3.5), ("B0", 4.5), ("F1", 6.5), ("B1", 7.5), ("F2", 9.5), ("B2", 10.5)]
    assert res.step_time == eq12_time([3, 3], [2.5], 6) == 8 + 3 * 6
    assert res.peak_inflight == [4, 1] and res.busy == [18, 18]
    assert res.bubble == pytest.approx([1 - 18 / 26] * 2)


def stage_case(S, tm, balanced, rng):
    """Forward and backward times per stage; the slowest stage takes about ``tm``."""
    if balanced:  # HARP §4.2.4 stretches every stage to t_max
        fwd = [tm * rng.uniform(0.2, 0.5) for _ in range(S)]
        return fwd, [tm - f for f in fwd]
    fwd = [rng.uniform(0.2, 1.0) for _ in range(S)]
    bwd = [rng.uniform(1, 2.5) * f for f in fwd]
    k = max(range(S), key=lambda i: fwd[i] + bwd[i])
    s = tm / (fwd[k] + bwd[k])
    return [x * s for x in fwd], [x * s for x in bwd]


link_fracs = st.lists(st.one_of(st.just(0.0), st.floats(HARP_EPSILON * 1.000001, 1.0)), min_size=5, max_size=5)


@settings(max_examples=40, deadline=None)
@given(S=st.integers(2, 6), fracs=link_fracs, seed=st.integers(0, 2**20), balanced=st.booleans())
def test_h1f1b_steady_phase_is_bubble_free(S, fracs, seed, balanced):
    # every c_i = 0 or in (ε t_max, t_max]: the steady phase runs at the bottleneck's pace, t_max per micro-batch
    rng = random.Random(seed)
    fwd, bwd = stage_case(S, rng.uniform(0.5, 3.0), balanced, rng)
    tm = max(f + b for f, b in zip(fwd, bwd))
    comm = [x * tm for x in fracs[: S - 1]]
    w = h1f1b_warmup([f + b for f, b in zip(fwd, bwd)], comm)
    res = simulate(schedule(w, 128), fwd, bwd, comm)
    for i in range(S):
        if fwd[i] + bwd[i] == tm:
            assert res.steady_period(i) == pytest.approx(tm, rel=1e-9)  # the bottleneck never idles
        else:  # a faster stage may still be catching up on the fill's backlog, never falling behind
            assert res.steady_period(i) <= tm * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(S=st.integers(2, 6), fracs=link_fracs, seed=st.integers(0, 2**20))
def test_h1f1b_step_time_matches_eq12(S, fracs, seed):
    rng = random.Random(seed)
    fwd, bwd = stage_case(S, rng.uniform(0.5, 3.0), True, rng)
    t = [f + b for f, b in zip(fwd, bwd)]
    tm = max(t)
    comm = [x * tm for x in fracs[: S - 1]]
    M = 512  # fill/drain transfers queued on slow links add up to ~4 t_max (S=6): 0.8% here, 1.5% at M=256
    h = simulate(schedule(h1f1b_warmup(t, comm), M), fwd, bwd, comm)
    eq12 = eq12_time(t, comm, M)
    # Eq. 12 is exact but for warm-up / cool-down transfers queueing on links slower than f or b
    assert eq12 * (1 - 1e-9) <= h.step_time <= 1.02 * eq12
    assert simulate(schedule(h1f1b_warmup(t, comm), 1), fwd, bwd, comm).step_time == pytest.approx(
        sum(t) + 2 * sum(comm)  # Eq. 12's first term: one micro-batch's round trip
    )
    # plain 1F1B on the same pipeline stalls on every costly link (HARP App. B, round trip γ=1 with δ=1)
    one = simulate(schedule(one_f_one_b_warmup(S), M), fwd, bwd, comm)
    stall = max([2 * c / (S - i) for i, c in enumerate(comm)])
    for i in range(S):
        assert one.steady_period(i, block=60) >= (tm + stall) * (1 - 1e-9)
    if stall > 0:
        assert one.step_time > h.step_time + (M // 2) * stall


def test_epsilon_band_costs_at_most_the_link_time():
    # Eq. 2's tolerance: a link with c <= ε t_max gets no extra launch, and stalls by c per micro-batch
    for c in (0.05, 0.1, 0.3):
        res = simulate(schedule(h1f1b_warmup([3.0, 3.0], [c]), 128), [1, 1], [2, 2], [c])
        assert res.steady_period(0, block=2) == pytest.approx(3.0 + c)
        strict = simulate(schedule(h1f1b_warmup([3.0, 3.0], [c], epsilon=0), 128), [1, 1], [2, 2], [c])
        assert strict.steady_period(0) == pytest.approx(3.0) and strict.peak_inflight == [3, 1]  # Eq. 10


def test_simulator_link_serialises_one_direction():
    # 3 activations leave stage 0 back to back; a link slower than the forward queues them
    res = simulate(schedule([3, 1], 3), [1.0, 1.0], [1.0, 1.0], [2.0])
    wire = [(e.start, e.end) for e in res.events if e.kind == "SEND_ACT"]
    assert wire == [(1.0, 3.0), (3.0, 5.0), (5.0, 7.0)]
    # gradients may take another time than activations (asymmetric link)
    one = simulate(schedule([1, 1], 1), [1.0, 1.0], [1.0, 1.0], [2.0], comm_bwd=[0.5])
    assert [(e.kind, e.start, e.end) for e in one.events if e.kind.startswith("SEND")] == [
        ("SEND_ACT", 1.0, 3.0),
        ("SEND_GRAD", 5.0, 5.5),
    ]
    assert one.step_time == 6.5


def test_simulator_errors():
    with pytest.raises(ScheduleError, match=r"comm .* needs 1 values"):
        simulate(schedule([2, 1], 2), [1, 1], [1, 1], [])
    bad = [[Action("F", 0, 0), Action("B", 1, 0)]]
    with pytest.raises(ScheduleError, match="backward without a pending forward"):
        simulate(bad, [1], [1], [])
    lonely = [[Action("F", 0, 0), Action("SEND_ACT", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ScheduleError, match="never received"):
        simulate(lonely, [1, 1], [1, 1], [0])


# --------------------------------------------------------------------------- trace and policy table


def test_chrome_trace(tmp_path):
    res = simulate(schedule([5, 2, 1], 6), [1, 1, 1], [2, 2, 2], [2.0, 0.1])
    path = tmp_path / "t.json"
    trace = chrome_trace(res, path)
    assert json.loads(path.read_text()) == trace
    ev = trace["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e.get("name") == "thread_name"}
    assert names == {
        (0, 0): "stage 0",
        (0, 1): "stage 1",
        (0, 2): "stage 2",
        (1, 0): "link 0->1",
        (1, 1): "link 1->0",
        (1, 2): "link 1->2",
        (1, 3): "link 2->1",
    }
    compute = [e for e in ev if e.get("cat") == "compute"]
    assert len(compute) == 3 * 2 * 6
    b0 = next(e for e in compute if e["name"] == "B0" and e["tid"] == 2)
    assert b0["ts"] == pytest.approx(5.1e6) and b0["dur"] == pytest.approx(2e6)  # seconds -> microseconds
    grads = [e for e in ev if e.get("cat") == "comm" and e["name"].startswith("grad")]
    assert {e["tid"] for e in grads} == {1, 3} and len(grads) == 12


def test_policy_table_side_by_side():
    # HARP §2.3.2 setting: Table 1's fine-grained plan, slow first link (c ≈ 0.8 t_max), fast second
    fwd, bwd, comm = [0.38, 0.37, 0.37], [0.75, 0.73, 0.73], [0.9, 0.01]
    runs = compare_policies(fwd, bwd, comm, 32)
    by = {r.policy: r for r in runs}
    assert [r.policy for r in runs] == ["h1f1b", "1f1b", "eager-1f1b"]
    assert by["h1f1b"].warmups == [5, 2, 1] and by["eager-1f1b"].warmups == [5, 3, 1]
    assert by["1f1b"].warmups == [3, 2, 1]
    h, one, eager = (by[p].result for p in ("h1f1b", "1f1b", "eager-1f1b"))
    assert h.step_time < eager.step_time < one.step_time
    assert h.peak_inflight == [5, 2, 1] and sum(h.peak_inflight) < sum(eager.peak_inflight)
    console = Console(record=True, width=120)
    console.print(policy_table(runs))
    text = console.export_text()
    assert "h1f1b" in text and "5 3 1" in text and f"{one.step_time / by['1f1b'].eq12:.3f}" in text


def test_cli_prints_policies_grid_and_trace(tmp_path, capsys):
    from hapc.pipeline.simulate import main

    trace = tmp_path / "h.json"
    args = ["--fwd", "1", "1", "1", "--bwd", "2", "2", "2", "--comm", "2.5", "0", "--micro", "6"]
    assert main([*args, "--grid", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "5 2 1" in out and "3 2 1" in out and "5 3 1" in out
    assert grid(schedule([5, 2, 1], 6)) in out
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["--fwd", "1", "1", "--bwd", "1", "1", "--comm", "5"]) == 2  # c > t_max: a clear error
    assert "exceeds t_max" in capsys.readouterr().out
