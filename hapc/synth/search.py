"""A* program search over one segment (HAP §4.3, Fig. 10), exact for the stage cost model.

State of a partial program ``Q``:

* ``live`` -- its properties minus the *dead* ones (HAP §4.5 (3): a property is dead when every
  triple needing it adds nothing new, so dropping it loses no continuation);
* ``tokens`` -- exclusive resources used (a tensor communicated, a node computed, a parameter
  sourced);
* ``closed`` -- the time of its finished stages; ``fopen`` / ``bopen`` -- per-device-type compute
  of the open forward / backward stage.

``cost(Q) = closed + max(fopen) + max(bopen)`` never decreases as triples are appended.

**Heuristic.** Every node of the segment not yet computed must still be computed by some triple;
``lb_t(n)`` is the least compute any triple defining ``n`` puts on device type ``t``. Future stages
cost at least the compute still due on the busiest device, so
``score = closed + max_t(fopen_t + Rf_t) + max_t(bopen_t + Rb_t)`` (``R`` summing ``lb`` over the
nodes still due) never overestimates: A* is exact (HAP's own code used zero).

**Pruning (all exact).**

* *Dominance.* Among programs with the same ``(live, tokens)``, ``Q1`` dominates ``Q2`` when
  ``closed1 + max(0, max_t(fopen1 - fopen2)_t) + max(0, max_t(bopen1 - bopen2)_t) <= closed2``: for any
  continuation ``Q1`` then ends no later (equal property sets are the paper's deduplication).
* *Canonical stage order.* Two adjacent triples without collectives commute (a stage's time is a
  max of sums), so such runs are generated in increasing node order only.
* *Useful triples only.* A triple whose postcondition adds nothing that stays alive is never
  appended (Fig. 10 line 7); removing it from a program never raises its cost.

Two drivers share the loop: :meth:`SegmentSearch.run` settles named goals (a layout of the tensor
leaving a segment, or the loss) with A*'s early stop; :meth:`SegmentSearch.explore` enumerates
every non-dominated way to finish a small segment, keyed by the state it leaves behind, for the
dynamic program over segments (``hapc.synth.synthesizer``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ..theory.instructions import Compute
from ..theory.props import DONE, Prop
from ..theory.triples import Theory, Triple
from .cost import TripleTime

#: share the time-independent structure of equal searches (and its memos) across the searches of a
#: theory (:meth:`SegmentSearch.__init__`); False: each search builds its own
SHARE_STRUCTURE = True
#: one device type (a homogeneous sub-mesh): search with floats, not 1-tuples (:meth:`SegmentSearch._search1`;
#: the same floats, states and programs); False: the general loop for every type count
SINGLE_TYPE = True
#: memoise each expanded state's successors in the shared search structure (:meth:`SegmentSearch._successors`;
#: exact: they do not depend on the times); False: computed at every expansion
MEMO_SUCCESSORS = True


@dataclass
class SearchStats:
    expanded: int = 0
    generated: int = 0
    pruned: int = 0
    seconds: float = 0.0

    def add(self, other: SearchStats) -> None:
        self.expanded += other.expanded
        self.generated += other.generated
        self.pruned += other.pruned
        self.seconds += other.seconds


@dataclass
class Found:
    """Best program reaching one goal: its triples (theory indices, in order), cost, end state."""

    cost: float
    triples: list[int]
    live: frozenset[Prop] = frozenset()
    tokens: frozenset[tuple] = frozenset()


Progress = Callable[[SearchStats, float], None]


class OutOfTime(Exception):
    """A search's deadline passed before it finished (:attr:`SegmentSearch.deadline`); nothing it
    found is returned, so no partial answer is ever cached or mistaken for a complete one."""


class SegmentSearch:
    """The search over one segment's triples, with times for fixed ratios.

    Args:
        theory: the theory the triples come from.
        triples: theory indices of the triples this search may use; ``times`` their times.
        start: properties holding at the start; ``start_tokens`` tokens already used.
        protected: properties never dropped (they are needed after the segment).
        nodes: the op nodes this segment must compute (for the heuristic and termination).
        ntypes: number of device types.
        deadline: a :func:`time.monotonic` value past which the search raises :class:`OutOfTime`
            (looked at before every expansion); None: no limit.
    """

    def __init__(
        self,
        theory: Theory,
        triples: Sequence[int],
        times: Sequence[TripleTime],
        start: frozenset[Prop],
        protected: frozenset[Prop],
        nodes: Sequence[int],
        ntypes: int,
        start_tokens: frozenset[tuple] = frozenset(),
        progress: Progress | None = None,
        deadline: float | None = None,
    ):
        self.theory, self.ids, self.ntypes, self.progress = theory, list(triples), ntypes, progress
        self.deadline = deadline
        self.times = list(times)
        self.stats = SearchStats()
        # the structure (bit numbering, masks, consumers, what is dead) depends on the triples, the
        # start, the protected properties, the nodes and the start tokens, not on the times: shared
        # by every search of the same theory with equal ones (the sub-mesh sizes of a pipeline)
        skeletons = theory.__dict__.setdefault("_search_skeletons", {}) if SHARE_STRUCTURE else {}
        key = (tuple(self.ids), start, protected, tuple(nodes), start_tokens)
        skel = skeletons.get(key)
        if skel is None:
            skel = skeletons[key] = self._structure(start, protected, nodes, start_tokens)
        self._shared_bits = True
        (self.bits, self.tok_bits, self.pre, self.post, self.tok, self.key, self.defines, self.prop_of,
         self.tok_of, self.start, self.start_tokens, self.protected, self.consumers, self.free, self._reach,
         self.nodes, self.node_bit, self.all_nodes, self.prop_cover, self._alive_memo, self._cover_memo,
         self._cand_memo, self._trans_memos) = skel  # fmt: skip
        self.pure = [not (tt.has_fwd_comm or tt.has_bwd_comm) for tt in self.times]
        self._heuristic_tables()

    def _structure(
        self, start: frozenset[Prop], protected: frozenset[Prop], nodes: Sequence[int], start_tokens: frozenset[tuple]
    ) -> tuple:
        """The time-independent part of a search (see :meth:`__init__`), as a tuple."""
        theory = self.theory
        self._shared_bits = False
        self.bits: dict[Prop, int] = {}
        self.tok_bits: dict[tuple, int] = {}
        for p in start | protected:
            self._bit(p)
        for tok in start_tokens:
            self._tok(tok)
        pre, post, toks, key, defines = [], [], [], [], []
        for tid in self.ids:
            t: Triple = theory.triples[tid]
            pre.append(self._mask(t.pre))
            post.append(self._mask(t.post))
            tm = 0
            for tok in t.tokens:
                tm |= self._tok(tok)
            toks.append(tm)
            last = t.instrs[-1]
            key.append(last.ref)
            defines.append(last.ref if isinstance(last, Compute) else -1)
        prop_of = {b: p for p, b in self.bits.items()}
        tok_of = {b: t for t, b in self.tok_bits.items()}
        start_mask = self._mask(start)
        start_toks = sum(self.tok_bits[t] for t in start_tokens)
        protected_mask = self._mask(protected) | self.bits.get(DONE, 0)
        consumers: dict[int, list[int]] = {}
        free: list[int] = []
        for k, pm in enumerate(pre):
            if not pm:
                free.append(k)
            m = pm
            while m:
                low = m & -m
                consumers.setdefault(low, []).append(k)
                m ^= low
        reach: dict[int, tuple[int, int]] = {}  # prop bit -> (posts, tokens) of its consumers
        for low, cs in consumers.items():
            rp = rt = 0
            for c in cs:
                rp |= post[c]
                rt |= toks[c]
            reach[low] = (rp, rt)
        node_bit = {n: 1 << k for k, n in enumerate(nodes)}
        g = theory.graph
        # a property covers the segment's nodes it descends from, through every node the segment's
        # triples compute (not only its anchors): a value made from an anchor by a non-anchor node
        # of the segment (T5's position bias: add -> embedding -> permute -> where, one segment)
        # proves the anchor computed once the anchor's own value is dead
        made = {ins.ref for tid in self.ids for ins in theory.triples[tid].instrs if isinstance(ins, Compute)}
        anc: dict[int, int] = {}
        for n in sorted(made | set(nodes)):
            m = node_bit.get(n, 0)
            for o in g[n].operands:
                m |= anc.get(o, 0)
            anc[n] = m
        all_nodes = sum(node_bit.values())
        prop_cover = {b: anc.get(p.ref, 0) if p != DONE else all_nodes for p, b in self.bits.items()}
        # memos of pure functions of the structure: _drop_dead's per-bit verdicts, covered(live),
        # the candidate triples of a live set
        alive_memo: dict[tuple[int, int, int], bool] = {}
        cover_memo: dict[int, int] = {}
        cand_memo: dict[int, list[int]] = {}
        # per protected mask, the successors of an expanded (live, tokens, ever) (_search1)
        trans_memos: dict[int, dict[tuple[int, int, int], list[tuple]]] = {}
        return (self.bits, self.tok_bits, pre, post, toks, key, defines, prop_of, tok_of, start_mask, start_toks,
                protected_mask, consumers, free, reach, list(nodes), node_bit, all_nodes, prop_cover, alive_memo,
                cover_memo, cand_memo, trans_memos)  # fmt: skip

    # -- bits ------------------------------------------------------------------------------------
    def _bit(self, p: Prop) -> int:
        if p not in self.bits:
            if self._shared_bits:  # a new property after construction (a goal of run): this search's own
                self.bits, self._shared_bits = dict(self.bits), False
            self.bits[p] = 1 << len(self.bits)
        return self.bits[p]

    def _tok(self, t: tuple) -> int:
        if t not in self.tok_bits:
            self.tok_bits[t] = 1 << len(self.tok_bits)
        return self.tok_bits[t]

    def _mask(self, props) -> int:
        m = 0
        for p in props:
            m |= self._bit(p)
        return m

    def props(self, mask: int) -> frozenset[Prop]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self.prop_of[low])
            mask ^= low
        return frozenset(out)

    def tokens(self, mask: int) -> frozenset[tuple]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self.tok_of[low])
            mask ^= low
        return frozenset(out)

    # -- heuristic -----------------------------------------------------------------------------
    def _heuristic_tables(self) -> None:
        zero = (0.0,) * self.ntypes
        lbf: dict[int, tuple] = {}
        lbb: dict[int, tuple] = {}
        for k, n in enumerate(self.defines):
            if n in self.node_bit:
                tt = self.times[k]
                lbf[n] = tt.fwd_comp if n not in lbf else tuple(map(min, lbf[n], tt.fwd_comp))
                lbb[n] = tt.bwd_comp if n not in lbb else tuple(map(min, lbb[n], tt.bwd_comp))
        self.lbf = {n: lbf.get(n, zero) for n in self.nodes}
        self.lbb = {n: lbb.get(n, zero) for n in self.nodes}
        self._rem_cache: dict[int, tuple[tuple, tuple]] = {}
        self._rem_live: dict[int, tuple[tuple, tuple]] = {}

    def covered(self, live: int) -> int:
        c = self._cover_memo.get(live)
        if c is not None:
            return c
        c = 0
        m = live
        while m:
            low = m & -m
            c |= self.prop_cover.get(low, 0)
            m ^= low
        self._cover_memo[live] = c
        return c

    def _remaining(self, live: int) -> tuple[tuple, tuple]:
        hit = self._rem_live.get(live)
        if hit is not None:
            return hit
        due = self.all_nodes & ~self.covered(live)
        hit = self._rem_cache.get(due)
        if hit is None:
            rf = [0.0] * self.ntypes
            rb = [0.0] * self.ntypes
            for n in self.nodes:
                if due & self.node_bit[n]:
                    for t in range(self.ntypes):
                        rf[t] += self.lbf[n][t]
                        rb[t] += self.lbb[n][t]
            hit = self._rem_cache[due] = (tuple(rf), tuple(rb))
        self._rem_live[live] = hit
        return hit

    def _drop_dead(self, live: int, ever: int, used: int) -> int:
        m = live & ~self.protected
        memo, reach = self._alive_memo, self._reach
        while m:
            low = m & -m
            m ^= low
            # whether a consumer of ``low`` can still add something: depends on ``ever`` and
            # ``used`` only through the bits its consumers produce and take (memoised on those)
            rp, rt = reach.get(low, (0, 0))
            key = (low, ever & rp, used & rt)
            alive = memo.get(key)
            if alive is None:
                alive = memo[key] = any(
                    (self.post[c] & ~ever) and not (self.tok[c] & used) for c in self.consumers.get(low, ())
                )
            if not alive:
                live &= ~low
        return live

    # -- the loop ---------------------------------------------------------------------------------
    def _successors(self, trans: dict | None, live: int, tokens: int, ever: int) -> list[tuple[int, int, int, int]]:
        """The triples that apply to a state and add something that stays alive, in candidate
        order, each with the state it leaves: ``(k, live', tokens', ever')``. A pure function of
        ``(live, tokens, ever)``, the structure and the protected mask (not of the times), so it is
        memoised in ``trans`` (the structure's, per protected mask; :data:`MEMO_SUCCESSORS`) and
        shared by every search of that structure -- the sub-mesh kinds of a pipeline search the same
        segments under other times. The caller applies the canonical-order test (it depends on the
        state's last pure triple) and prices each successor."""
        if trans is not None:
            hit = trans.get((live, tokens, ever))
            if hit is not None:
                return hit
        ordered = self._cand_memo.get(live)
        if ordered is None:
            cand = set(self.free)
            m = live
            while m:
                low = m & -m
                cand.update(self.consumers.get(low, ()))
                m ^= low
            ordered = self._cand_memo[live] = sorted(cand)
        pre, post, tok = self.pre, self.post, self.tok
        succ = []
        for k in ordered:
            pk = post[k]
            if pre[k] & ~live or tok[k] & tokens or not (pk & ~ever):
                continue
            new_ever = ever | pk
            new_tok = tokens | tok[k]
            new_live = self._drop_dead(live | pk, new_ever, new_tok)
            if not (new_live & pk & ~live):
                continue  # everything it adds is dead on arrival: a useless triple
            succ.append((k, new_live, new_tok, new_ever))
        if trans is not None:
            trans[(live, tokens, ever)] = succ
        return succ

    def _search(self, on_state: Callable[[int, tuple], None], done: Callable[[float], bool]) -> list[tuple]:
        """Best-first over partial programs; ``on_state`` sees every kept state, ``done(score)``
        says when the smallest open score can no longer matter."""
        if self.ntypes == 1 and SINGLE_TYPE:
            return self._search1(on_state, done)
        t0 = time.perf_counter()
        zero = (0.0,) * self.ntypes
        # record: (live, tokens, ever, closed, fopen, bopen, last_pure, parent, triple)
        nodes: list[tuple] = []
        dead: set[int] = set()
        best: dict[tuple[int, int, int], list[int]] = {}
        heap: list[tuple[float, int]] = []

        def push(rec: tuple) -> None:
            live, tokens, _, closed, fo, bo, lp, _, _ = rec
            key = (live, tokens, lp)
            bucket = best.get(key)
            if bucket is not None:
                for other in bucket:
                    o = nodes[other]
                    if closed >= o[3] + _over(o[4], fo) + _over(o[5], bo):
                        self.stats.pruned += 1
                        return
                keep = []
                for other in bucket:
                    o = nodes[other]
                    if o[3] >= closed + _over(fo, o[4]) + _over(bo, o[5]):
                        dead.add(other)
                        self.stats.pruned += 1
                    else:
                        keep.append(other)
                bucket[:] = keep
            else:
                bucket = best[key] = []
            idx = len(nodes)
            nodes.append(rec)
            bucket.append(idx)
            rf, rb = self._remaining(live)
            score = closed + max(a + b for a, b in zip(fo, rf)) + max(a + b for a, b in zip(bo, rb))
            heapq.heappush(heap, (score, idx))
            self.stats.generated += 1
            on_state(idx, rec)

        start = self._drop_dead(self.start, self.start, self.start_tokens)
        push((start, self.start_tokens, self.start, 0.0, zero, zero, -1, -1, -1))
        next_report = t0 + 2.0
        deadline = self.deadline
        trans = self._trans_memos.setdefault(self.protected, {}) if MEMO_SUCCESSORS else None
        while heap:
            score, idx = heapq.heappop(heap)
            if done(score):
                break
            if idx in dead:
                continue
            self.stats.expanded += 1
            if deadline is not None and time.monotonic() > deadline:
                self.stats.seconds += time.perf_counter() - t0
                raise OutOfTime
            live, tokens, ever, closed, fo, bo, lp, _, _ = nodes[idx]
            for k, new_live, new_tok, new_ever in self._successors(trans, live, tokens, ever):
                pure = self.pure[k]
                if pure and lp >= 0 and self.key[k] < lp:
                    continue  # canonical order inside a stage
                tt = self.times[k]
                c, f, b = closed + tt.grad, fo, bo
                if tt.has_fwd_comm:
                    c += max(f) + tt.fwd_comm
                    f = tt.fwd_comp
                else:
                    f = tuple(x + y for x, y in zip(f, tt.fwd_comp))
                if tt.has_bwd_comm:
                    c += max(b) + tt.bwd_comm
                    b = tt.bwd_comp
                else:
                    b = tuple(x + y for x, y in zip(b, tt.bwd_comp))
                push((new_live, new_tok, new_ever, c, f, b, self.key[k] if pure else -1, idx, k))
            if self.progress is not None and time.perf_counter() > next_report:
                next_report = time.perf_counter() + 2.0
                self.progress(self.stats, score)
        self.stats.seconds += time.perf_counter() - t0
        return nodes

    def _search1(self, on_state: Callable[[int, tuple], None], done: Callable[[float], bool]) -> list[tuple]:
        """:meth:`_search` for one device type (every homogeneous sub-mesh of the pipeline's stage
        costs): the open stages' per-type compute is one float, not a 1-tuple, so each step adds
        floats instead of building tuples. The same arithmetic in the same order -- ``max`` of one
        value is that value, ``_over`` of one pair is ``max(0, a - b)`` -- so the same floats, the
        same states, the same order of expansion and the same programs (records hold floats at
        positions 4 and 5, which :meth:`_cost` reads as such)."""
        t0 = time.perf_counter()
        stats = self.stats
        # record: (live, tokens, ever, closed, fopen, bopen, last_pure, parent, triple)
        nodes: list[tuple] = []
        dead: set[int] = set()
        best: dict[tuple[int, int, int], list[int]] = {}
        heap: list[tuple[float, int]] = []
        remaining = self._remaining
        heappush, heappop = heapq.heappush, heapq.heappop
        protected = self.protected
        key_of, pure_of = self.key, self.pure
        times = self.times
        grad = [tt.grad for tt in times]
        fcomm = [tt.fwd_comm if tt.has_fwd_comm else None for tt in times]
        bcomm = [tt.bwd_comm if tt.has_bwd_comm else None for tt in times]
        fcomp = [tt.fwd_comp[0] for tt in times]
        bcomp = [tt.bwd_comp[0] for tt in times]

        def push(rec: tuple) -> None:
            live, tokens, _, closed, fo, bo, lp, _, _ = rec
            key = (live, tokens, lp)
            bucket = best.get(key)
            if bucket is not None:
                for other in bucket:
                    o = nodes[other]
                    x, y = o[4] - fo, o[5] - bo
                    if closed >= o[3] + (x if x > 0.0 else 0.0) + (y if y > 0.0 else 0.0):
                        stats.pruned += 1
                        return
                keep = []
                for other in bucket:
                    o = nodes[other]
                    x, y = fo - o[4], bo - o[5]
                    if o[3] >= closed + (x if x > 0.0 else 0.0) + (y if y > 0.0 else 0.0):
                        dead.add(other)
                        stats.pruned += 1
                    else:
                        keep.append(other)
                bucket[:] = keep
            else:
                bucket = best[key] = []
            idx = len(nodes)
            nodes.append(rec)
            bucket.append(idx)
            rf, rb = remaining(live)
            heappush(heap, (closed + (fo + rf[0]) + (bo + rb[0]), idx))
            stats.generated += 1
            on_state(idx, rec)

        start = self._drop_dead(self.start, self.start, self.start_tokens)
        push((start, self.start_tokens, self.start, 0.0, 0.0, 0.0, -1, -1, -1))
        next_report = t0 + 2.0
        deadline, monotonic = self.deadline, time.monotonic
        trans = self._trans_memos.setdefault(protected, {}) if MEMO_SUCCESSORS else None
        progress = self.progress
        while heap:
            score, idx = heappop(heap)
            if done(score):
                break
            if idx in dead:
                continue
            stats.expanded += 1
            if deadline is not None and monotonic() > deadline:
                stats.seconds += time.perf_counter() - t0
                raise OutOfTime
            live, tokens, ever, closed, fo, bo, lp, _, _ = nodes[idx]
            succ = trans.get((live, tokens, ever)) if trans is not None else None
            if succ is None:
                succ = self._successors(trans, live, tokens, ever)
            for k, new_live, new_tok, new_ever in succ:
                pure = pure_of[k]
                if pure and lp >= 0 and key_of[k] < lp:
                    continue  # canonical order inside a stage
                c = closed + grad[k]
                x = fcomm[k]
                if x is not None:
                    c += fo + x
                    f = fcomp[k]
                else:
                    f = fo + fcomp[k]
                x = bcomm[k]
                if x is not None:
                    c += bo + x
                    b = bcomp[k]
                else:
                    b = bo + bcomp[k]
                push((new_live, new_tok, new_ever, c, f, b, key_of[k] if pure else -1, idx, k))
            if progress is not None and time.perf_counter() > next_report:
                next_report = time.perf_counter() + 2.0
                progress(stats, score)
        stats.seconds += time.perf_counter() - t0
        return nodes

    def _path(self, nodes: list, idx: int) -> list[int]:
        out = []
        while nodes[idx][7] >= 0:
            out.append(self.ids[nodes[idx][8]])
            idx = nodes[idx][7]
        return out[::-1]

    def _cost(self, rec: tuple) -> float:
        if self.ntypes == 1 and SINGLE_TYPE:  # _search1's records: the open stages' compute as floats
            return rec[3] + rec[4] + rec[5]
        return rec[3] + max(rec[4]) + max(rec[5])

    def run(self, goals: dict[str, frozenset[Prop]]) -> dict[str, Found]:
        """Optimal programs reaching each goal (A* with early termination)."""
        masks = {name: self._mask(ps) for name, ps in goals.items()}
        self.protected |= sum(masks.values())
        best = {name: (float("inf"), -1) for name in goals}

        def on_state(idx: int, rec: tuple) -> None:
            for name, gm in masks.items():
                if not (gm & ~rec[0]):
                    c = self._cost(rec)
                    if c < best[name][0] - 1e-15:
                        best[name] = (c, idx)

        def done(score: float) -> bool:
            return all(score >= c - 1e-15 for c, _ in best.values())

        nodes = self._search(on_state, done)
        return {name: Found(c, self._path(nodes, i)) for name, (c, i) in best.items() if i >= 0}

    def explore(
        self,
        exit_key: Callable[[frozenset[Prop], frozenset[tuple]], Hashable],
        budget: float = math.inf,
        count: int = 0,
    ) -> tuple[dict[Hashable, Found], float]:
        """Every way to finish the segment (all its nodes computed), cheapest per exit state.

        Returns the exits and the cost ``s`` up to which the answer is complete: every exit
        cheaper than ``s`` is there, at its least cost (``inf`` when the search ran out). The
        search stops early once the smallest open score exceeds ``budget`` (the caller needs
        nothing dearer), or, with ``count``, once ``count`` exits are found and none still open
        can be cheaper than the ``count``-th cheapest. Exits dearer than ``s`` are dropped: a
        cheaper way to them may still be unexplored (nothing left can end below ``s``).
        """
        best: dict[Hashable, tuple[float, int]] = {}
        keys: dict[tuple[int, int], Hashable] = {}
        stop = [math.inf]
        kth = [math.inf, False]  # the count-th cheapest exit cost, and whether ``best`` changed since

        def on_state(idx: int, rec: tuple) -> None:
            if self.all_nodes & ~self.covered(rec[0]):
                return
            k2 = (rec[0] & self.protected, rec[1])
            if k2 not in keys:
                keys[k2] = exit_key(self.props(k2[0]), self.tokens(k2[1]))
            key = keys[k2]
            c = self._cost(rec)
            if key not in best or c < best[key][0] - 1e-15:
                best[key] = (c, idx)
                kth[1] = True

        def done(score: float) -> bool:
            enough = score > budget
            if not enough and count and len(best) >= count:
                if kth[1]:  # re-ranked only when an exit was added or improved, not on every pop
                    kth[:] = [heapq.nsmallest(count, (c for c, _ in best.values()))[-1], False]
                enough = score >= kth[0]
            if enough:
                stop[0] = score
            return enough

        nodes = self._search(on_state, done)
        return (
            {
                key: Found(c, self._path(nodes, i), self.props(nodes[i][0] & self.protected), self.tokens(nodes[i][1]))
                for key, (c, i) in best.items()
                if c <= stop[0]
            },
            stop[0],
        )


def _over(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """``max(0, max_t(a_t - b_t))``."""
    d = 0.0
    for x, y in zip(a, b):
        if x - y > d:
            d = x - y
    return d
