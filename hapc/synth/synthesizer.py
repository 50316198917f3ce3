"""Program synthesis for fixed ratios: segment searches joined by a dynamic program (HAP §4, §5.2).

``Q(B) = argmin_Q t(Q, B)`` (HAP Eq. 1). The graph's computed nodes are split into *segments*
(consecutive in topological order); each segment starts fresh stages, as HAP's segments do
(§5.2), so a program's cost is the sum of its segments' costs. The state between two segments is
what crosses the cut: the live properties of tensors computed before and needed after, and the
exclusive tokens still relevant. A dynamic program over the segments keeps, for every such state,
the cheapest way to reach it; each transition is a search over the segment's triples
(:class:`~hapc.synth.search.SegmentSearch`), cached across segments with equal signatures (the
repeated blocks of HARP §5.1). Within the segmented cost model the result is optimal.

**Branch and bound.** The tables hold the product of the layouts of every tensor alive at a
segment end (q, k, v, the residual and the rotary halves inside attention: over a million states
in tiny Llama). A first pass keeps only the :data:`BEAM` cheapest states per table and so finds a
complete program of cost ``U`` quickly; the exact pass then drops every state whose cost plus a
lower bound on the segments still to come exceeds ``U`` (each remaining node costs at least its
cheapest defining triple alone, :meth:`_Synth.segment_bound`), and asks each segment search only
for exits within that budget (:meth:`~hapc.synth.search.SegmentSearch.explore`). Nothing that
could be cheaper than ``U`` is dropped, so the optimum is unchanged (tiny Llama 50 s -> 1 s on 2
CPU ranks; ``tests/test_synth_optimality.py`` checks it against exhaustive enumeration with the
poorest first pass).

**Deepening the bound.** The beam keeps the cheapest *prefixes*, and where communication
dominates (hap-testbed) the optimum pays early -- a gradient all-reduce at the embedding -- for
what later segments need, so ``U`` can be 50x the optimum and the exact pass keeps nearly every
state. Before it, exact passes run with the bound ``L * g, L * g^2, ...`` (``L`` the lower bound of
the whole program, ``g`` = :data:`GROWTH`), as IDA* deepens its threshold: a pass that finds a
program has found the optimum (every state that could lead to a program within its bound was
kept); one that finds none proves the optimum dearer and costs little, as its bound prunes hard.
Tiny T5 on ``hap-testbed:8``: 82 s -> 4 s, the same program.

**Skipping the deepening.** Where the first pass already found the optimum (the usual case on
homogeneous sub-meshes: every stage cost of ``hapc synth`` ViT-24 on hap-testbed), the deepening
passes below ``U`` all come back empty and the pass at ``U`` only confirms it. So one exact pass at
``U`` runs first, capped at :data:`DIRECT_FACTOR` times the DP states stepped so far: where it
completes without a cheaper program, ``U`` is proven optimal and the first pass's program is
returned -- what the deepening passes and the pass at ``U`` return then. Where it finds a
cheaper one or hits its cap, the segment caches are restored and the deepening passes run as
before, so the program returned (among equally cheap ones too) never depends on the attempt.

**A time limit (off by default).** The exact passes may still take long where the lower bound is
far below the optimum (T5-small at its published size: the bound sees compute only, the optimum
is mostly communication), and a single segment's search can explode (tiny Swin's first segment,
4556 triples; DenseNet's ``cat`` of k feature maps): even the first pass and the data-parallel
incumbent then run for minutes. With a ``deadline`` the search is *anytime*: every search checks
the clock (each segment A* before every expansion), and when it passes the cheapest complete
program found so far -- the data-parallel incumbent, a first pass of widening beam, an exact
pass -- is returned marked unproven, with the interval the optimum is known to lie in
(``[floor, cost]``; ``floor`` is the largest bound an exact pass came back empty from); if none
is complete, the all-replicated program (:func:`fallback_program`), which needs no search.

**Static data** (masks, position ids, rotary tables: buffers and what they alone compute, without
gradient) is replicated only (:func:`~hapc.theory.triples.static_data`); its nodes are segments of
their own, computed once and carried in the state in their one layout, instead of being
re-created inside every consumer.

Segmentation (``segments=``):

``"node"`` (default)
    one computed node per segment. Fast (the search per transition is tiny), and for the
    programs HAP produces it prices what the paper's stage model prices: cutting a stage only
    splits ``max_t (a_t + b_t)`` into ``max_t a_t + max_t b_t``, equal whenever ``a`` and ``b`` peak on
    the same device type -- true for replicated work (slowest device) and for sharded work with
    ratios between compute-proportional and even. ``benchmarks/synth_time.py`` measures the gap.
``"blocks"``
    cut only where a single tensor crosses (between transformer blocks); stages span whole blocks.
``"none"``
    one segment: HAP's A* over the whole program (exact for the unsegmented stage model; slow
    beyond small graphs).
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..errors import InfeasibleError
from ..theory.graph import OP
from ..theory.instructions import Collective, Compute
from ..theory.props import DONE, Prop
from ..theory.triples import Theory, static_data
from .cost import CostModel, Vec
from .search import OutOfTime, Progress, SearchStats, SegmentSearch
from .segments import find_cuts, source_like

SEGMENTATIONS = ("node", "blocks", "none")
#: states kept per table by the first (upper-bound) pass of :func:`synthesize_program`
BEAM = 64
#: factor between the bounds of successive exact passes (see "Deepening the bound" above)
GROWTH = 2.0
_DEBUG = False


@dataclass
class Segment:
    index: int
    anchors: list[int]  # the computed nodes of this segment
    triples: list[int] = field(default_factory=list)  # theory indices, in theory order
    needed_after: dict[int, frozenset] = field(default_factory=dict)  # tensor -> layouts needed later
    tokens_after: frozenset = frozenset()  # tokens that still matter after this segment
    local_needed: dict[int, frozenset] = field(default_factory=dict)  # ... restricted to this segment's tensors
    local_tokens: frozenset = frozenset()
    signature: int = -1  # interned structural signature
    labels: dict[int, tuple] = field(default_factory=dict)  # ref -> canonical label (see _labels)
    refs_of: dict[tuple, int] = field(default_factory=dict)  # canonical label -> ref


@dataclass
class SynthResult:
    """The best program for fixed ratios, per segment."""

    parts: list[list[int]]  # per segment: theory triple indices, in program order
    cost: float
    segment_costs: list[float]
    stats: SearchStats = field(default_factory=SearchStats)
    searches: int = 0
    bounds: list[float] = field(default_factory=list)  # the bound of each exact pass, in order
    #: False when ``deadline`` stopped the exact passes: ``cost`` is then the best program found,
    #: and the optimum lies in ``[floor, cost]``
    proven: bool = True
    floor: float = 0.0  # a proven lower bound on the optimum (``cost`` when proven)

    @property
    def triples(self) -> list[int]:
        return [t for p in self.parts for t in p]


class _Bits:
    """Global bit numbering of properties and tokens, so DP states are two integers."""

    def __init__(self) -> None:
        self.prop: dict[Prop, int] = {}
        self.tok: dict[tuple, int] = {}
        self.prop_of: dict[int, Prop] = {}
        self.tok_of: dict[int, tuple] = {}

    def p(self, prop: Prop) -> int:
        b = self.prop.get(prop)
        if b is None:
            b = self.prop[prop] = 1 << len(self.prop)
            self.prop_of[b] = prop
        return b

    def t(self, tok: tuple) -> int:
        b = self.tok.get(tok)
        if b is None:
            b = self.tok[tok] = 1 << len(self.tok)
            self.tok_of[b] = tok
        return b

    def props(self, mask: int) -> list[Prop]:
        return _decode(mask, self.prop_of)

    def toks(self, mask: int) -> list[tuple]:
        return _decode(mask, self.tok_of)


def _decode(mask: int, table: dict[int, Any]) -> list[Any]:
    """The entries of ``table`` (keyed by single bits) whose bits are set in ``mask``, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(table[low])
        mask ^= low
    return out


@dataclass
class _SegMasks:
    touched_props: int  # every property of a tensor this segment reads or produces
    touched_toks: int
    needed: int  # properties needed after this segment (and Done)
    toks_after: int
    must: tuple[int, ...] = ()  # per tensor no later segment produces: its needed layouts (one must hold)


#: chains (tensors made in no segment of their own) of at most this many connected nodes are
#: searched where they are read (:meth:`SynthSpace._assign`)
SMALL_CHAIN = 2


def _components(graph: Any, refs: set[int]) -> dict[int, int]:
    """Each of ``refs`` mapped to a representative of its connected component (edges: operands
    among ``refs``)."""
    parent = {r: r for r in refs}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for r in refs:
        for o in graph[r].operands:
            if o in parent:
                a, b = find(r), find(o)
                if a != b:
                    parent[a] = b
    return {r: find(r) for r in refs}


class SynthSpace:
    """Everything about a theory that does not depend on ratios: segments and allowed triples."""

    def __init__(self, theory: Theory, m: int, segments: str = "node", allowed: set[int] | None = None):
        if segments not in SEGMENTATIONS:
            raise ValueError(f"segments must be one of {SEGMENTATIONS}, got {segments!r}")
        self.theory, self.m, self.mode = theory, m, segments
        self.allowed = shardable_triples(theory, m) if allowed is None else allowed
        g = theory.graph
        # static data (masks, position tables) is computed once, by plain triples: its own segments
        sources = source_like(g) - static_data(g)
        anchors = [n.index for n in g if n.kind == OP and n.index not in sources]
        if segments == "node":
            groups = [[a] for a in anchors]
        elif segments == "none":
            groups = [anchors]
        else:
            cut_after = {pos for pos, _ in find_cuts(g)}
            groups, cur = [], []
            for a in anchors:
                cur.append(a)
                if a in cut_after and len(cur) >= 2:
                    groups.append(cur)
                    cur = []
            if cur:
                groups.append(cur)
        self.segments = [Segment(i, grp) for i, grp in enumerate(groups)]
        self._assign(anchors)
        self._needs()
        ids: dict[tuple, int] = {}  # structural signatures interned to small ints
        for s in self.segments:
            s.signature = ids.setdefault(self._signature(s), len(ids))
        # blocks: runs of segments between single-tensor cuts, searched once per distinct block
        cut_after = {pos for pos, _ in find_cuts(g)}
        self.blocks: list[list[int]] = [[]]
        for seg in self.segments:
            self.blocks[-1].append(seg.index)
            if seg.anchors[-1] in cut_after:
                self.blocks.append([])
        self.blocks = [b for b in self.blocks if b]
        # a block's labels name every tensor its segments touch; its signature says how each
        # segment's labels map onto them, so equal signatures mean isomorphic blocks
        self.block_signatures, self.block_labels, self.block_refs = [], [], []
        for b in self.blocks:
            segs = [self.segments[i] for i in b]
            refs = {r for sg in segs for r in sg.labels}
            lab = _labels(g, [a for sg in segs for a in sg.anchors], refs)
            key = tuple((sg.signature, tuple(sorted((v, lab[r]) for r, v in sg.labels.items()))) for sg in segs)
            self.block_signatures.append(ids.setdefault(("block", key), len(ids)))
            self.block_labels.append(lab)
            self.block_refs.append({v: r for r, v in lab.items()})

    def restricted(self, allowed: set[int]) -> SynthSpace:
        """The same segments over fewer triples (``allowed`` within this space's), cached per set."""
        cache = self.__dict__.setdefault("_restricted", {})
        key = frozenset(allowed)
        if key not in cache:
            cache[key] = SynthSpace(self.theory, self.m, self.mode, set(allowed))
        return cache[key]

    def _assign(self, anchors: list[int]) -> None:
        th = self.theory
        where = {a: s.index for s in self.segments for a in s.anchors}
        # a source-like tensor (a parameter chain, an input) can be made once what it reads is:
        # in the latest segment among its operands' (segment 0 for graph sources)
        ready: dict[int, int] = {}
        for n in th.graph:
            ready[n.index] = where.get(n.index, max((ready[o] for o in n.operands), default=0))
        users = defaultdict(set)  # tensor -> segments whose triples need it
        homes: dict[int, int] = {}
        chains = []  # triples making a tensor of no segment's: a parameter chain, static data
        for k in sorted(self.allowed):
            t = th.triples[k]
            last = t.instrs[-1]
            if isinstance(last, Collective):
                continue
            if last.ref not in where:
                chains.append(k)
                continue
            homes[k] = where[last.ref]
            for p in t.pre:
                users[p.ref].add(homes[k])
        # a small chain (Gemma's ``1.0 + norm.weight.float()``: at most SMALL_CHAIN connected
        # nodes) is searched in every segment that reads it, as a collective is. In the first
        # segment, where it can first be made, one search enumerated every such chain's layouts
        # together (tiny Gemma: 540 triples there, an exact pass past 10 minutes; now 1 s). A
        # larger one stays there: T5's position bias (embedding, permute, unsqueeze, where: 4
        # nodes) searched beside its reader's attention made that search run past 4 minutes (8.7 s
        # where it was). A measured trade-off on these models, not a rule: Swin's and DenseNet's
        # searches explode either way (issue note). Consumers first (graph order is topological):
        # a chain feeding another inherits its segments.
        chain_refs = {th.triples[k].instrs[-1].ref for k in chains}
        component = _components(th.graph, chain_refs)
        size = defaultdict(int)
        for r in chain_refs:
            size[component[r]] += 1
        chain_homes: dict[int, set[int]] = {}
        for k in sorted(chains, key=lambda k: -th.triples[k].instrs[-1].ref):
            t = th.triples[k]
            ref = t.instrs[-1].ref
            readers = users[ref] if size[component[ref]] <= SMALL_CHAIN else set()
            segs = set(readers) or {max((ready[p.ref] for p in t.pre), default=0)}
            chain_homes[k] = segs
            for p in t.pre:
                users[p.ref] |= segs
        for k in sorted(self.allowed):
            last = self.theory.triples[k].instrs[-1]
            if isinstance(last, Collective):
                # a tensor moves where it is used; with one node per segment every collective is a
                # stage of its own, so moving it right before its consumer costs the same
                segs = set(users[last.ref])
                if last.ref in where and self.mode != "node":
                    segs.add(where[last.ref])
                for s in segs:
                    self.segments[s].triples.append(k)
            elif k in chain_homes:
                for home in chain_homes[k]:
                    self.segments[home].triples.append(k)
            else:
                self.segments[homes[k]].triples.append(k)
        for s in self.segments:
            s.triples.sort()

    def _needs(self) -> None:
        """For each segment: the layouts of each tensor *crossing* its end that later segments need,
        and the tokens that still matter. Only tensors alive across a cut are recorded, so the
        work is proportional to the sum of the cut sizes, not quadratic in the graph."""
        th = self.theory
        uses: dict[int, dict[int, set]] = defaultdict(lambda: defaultdict(set))  # tensor -> seg -> layouts
        tok_uses: dict[tuple, set[int]] = defaultdict(set)
        first: dict[int, int] = {}
        refs_of: list[set[int]] = []
        pieces = _triple_pieces(th)
        for s in self.segments:
            si = s.index
            refs = set(s.anchors)
            for a in s.anchors:
                first.setdefault(a, si)
            for k in s.triples:
                pre, post, touched, _, toks, _ = pieces(k)
                for r, lay in pre:
                    uses[r][si].add(lay)
                    first.setdefault(r, si)  # (segments in order: the first seen is the least)
                for r in post:
                    first.setdefault(r, si)
                refs |= touched
                for tok in toks:
                    tok_uses[tok].add(si)
            refs_of.append(refs)
            s.needed_after, s.tokens_after = {}, frozenset()
        for x, by_seg in uses.items():
            segs = sorted(by_seg)
            suffix: set = set()
            later: dict[int, frozenset] = {}
            for seg in reversed(segs):
                later[seg] = frozenset(suffix)
                suffix |= by_seg[seg]
            start = first.get(x, segs[0])
            pos = 0
            need = frozenset(suffix)  # layouts needed from the start on
            for si in range(start, segs[-1]):
                while pos < len(segs) and segs[pos] <= si:
                    need = later[segs[pos]]
                    pos += 1
                if need:
                    self.segments[si].needed_after[x] = need
        tok_after: dict[int, set] = defaultdict(set)
        for tok, segs in tok_uses.items():
            for si in range(min(segs), max(segs)):
                tok_after[si].add(tok)
        for s in self.segments:
            s.tokens_after = frozenset(tok_after.get(s.index, ()))
            refs = refs_of[s.index]
            s.local_needed = {x: ls for x, ls in s.needed_after.items() if x in refs}
            s.local_tokens = frozenset(tok for tok in s.tokens_after if tok[1] in refs)

    def state_bits(self) -> tuple[_Bits, list[_SegMasks]]:
        """Bit numbering of every property / token a DP state can hold, and per-segment masks
        (ratio-independent, built once per space)."""
        if getattr(self, "_state_bits", None) is not None:
            return self._state_bits
        bits = _Bits()
        bits.p(DONE)
        by_ref: dict[int, int] = defaultdict(int)
        tok_by_ref: dict[int, int] = defaultdict(int)
        # the mask of a tensor's layouts, once per (tensor, layouts): the first loop numbers the
        # properties in the order it meets them (a repeat numbers nothing new), the later loops
        # only read numbers already given
        layout_masks: dict[tuple, int] = {}

        def mask(x: int, ls: frozenset) -> int:
            m = layout_masks.get((x, ls))
            if m is None:
                m = 0
                for lay in ls:
                    m |= bits.p(Prop(x, lay))
                layout_masks[(x, ls)] = m
            return m

        for s in self.segments:
            for x, ls in s.needed_after.items():
                by_ref[x] |= mask(x, ls)
            for tok in s.tokens_after:
                tok_by_ref[tok[1]] |= bits.t(tok)
        pieces = _triple_pieces(self.theory)
        made_last: dict[int, int] = {}  # tensor -> last segment with a triple producing it
        for seg in self.segments:
            for k in seg.triples:
                for r in pieces(k)[5]:  # (none for a collective: it needs the tensor already)
                    made_last[r] = seg.index
        masks = []
        for seg in self.segments:
            refs = set(seg.anchors)
            for k in seg.triples:
                refs |= pieces(k)[3]
            touched = ttoks = 0
            for r in refs:
                touched |= by_ref.get(r, 0)
                ttoks |= tok_by_ref.get(r, 0)
            needed = bits.p(DONE)
            for x, ls in seg.needed_after.items():
                needed |= mask(x, ls)
            after = 0
            for tok in seg.tokens_after:
                after |= bits.t(tok)
            must = []
            for x, ls in seg.needed_after.items():
                if made_last.get(x, -1) <= seg.index:
                    must.append(mask(x, ls))
            masks.append(_SegMasks(touched, ttoks, needed, after, tuple(must)))
        self._state_bits = (bits, masks)
        return self._state_bits

    def _signature(self, s: Segment) -> int:
        """Structure of a segment under its canonical labels: equal signatures, equal searches.
        (A segment's triples, costs, and what it must leave behind, as a tuple interned to an int
        per theory: equal ints, equal tuples; hashing the tuple again in every space cost more than
        building it.)"""
        th = self.theory
        # spaces of one theory for different device counts (a pipeline's sub-meshes) share most
        # segments: the signature is a function of what is in the key, computed once per theory
        memo = th.__dict__.setdefault("_segment_signatures", {})
        interned = th.__dict__.setdefault("_segment_signature_ids", {})
        key = (tuple(s.anchors), tuple(s.triples), frozenset(s.local_needed.items()), s.local_tokens)
        hit = memo.get(key)
        if hit is not None:
            sig, s.labels, s.refs_of = hit
            return sig
        flat = th.__dict__.setdefault("_signature_parts", {})
        costs = th.__dict__.setdefault("_signature_costs", {})
        refs = {DONE.ref}
        pieces = []
        for k in s.triples:
            piece = flat.get(k)
            if piece is None:
                # what a triple adds to a signature, but for its refs' labels: refs, layouts, the
                # instructions' other fields, its cost as an int interned per theory (equal ints,
                # equal costs: the same partition into signatures, without hashing a cost per segment)
                t = th.triples[k]
                piece = flat[k] = (
                    tuple((p.ref, p.layout) for p in t.pre),
                    tuple((p.ref, p.layout) for p in t.post),
                    tuple((type(i).__name__, i.ref, tuple(getattr(i, f) for f in i.__slots__ if f != "ref"))
                          for i in t.instrs),
                    tuple(t.tokens),
                    costs.setdefault(t.cost, len(costs)),
                    frozenset({p.ref for p in t.pre} | {p.ref for p in t.post} | {i.ref for i in t.instrs}
                              | {r for _, r in t.tokens}),
                )  # fmt: skip
            pieces.append(piece)
            refs |= piece[5]
        refs |= set(s.local_needed) | {r for _, r in s.local_tokens}
        lab = s.labels = _labels(self.theory.graph, s.anchors, refs)
        s.refs_of = {v: r for r, v in lab.items()}
        parts = []
        for pre, post, instrs, toks, cost, _ in pieces:
            parts.append(
                (
                    frozenset([(lab[r], lay) for r, lay in pre]),
                    frozenset([(lab[r], lay) for r, lay in post]),
                    tuple([(name, lab[r]) + rest for name, r, rest in instrs]),
                    frozenset([(a, lab[r]) for a, r in toks]),
                    cost,
                )
            )
        needed = frozenset((lab[x], ls) for x, ls in s.local_needed.items())
        tokens = frozenset((a, lab[r]) for a, r in s.local_tokens)
        structure = (len(s.anchors), tuple(parts), needed, tokens)
        sig = interned.setdefault(structure, len(interned))
        memo[key] = (sig, s.labels, s.refs_of)
        return sig


def _triple_pieces(theory: Theory):
    """``pieces(k)``: what :meth:`SynthSpace._needs` and :meth:`SynthSpace.state_bits` read of triple
    ``k``, found once per theory (the spaces of a pipeline's sub-mesh sizes share the triples):
    ``(pre as (ref, layout) pairs in the precondition's order, post refs in the postcondition's order,
    refs of pre and post, refs of pre and tokens, its "comm"/"src" tokens, the refs it makes unless
    it is a collective)``."""
    memo = theory.__dict__.get("_space_pieces")
    if memo is None:
        memo = theory.__dict__["_space_pieces"] = {}
    triples = theory.triples

    def pieces(k: int) -> tuple:
        hit = memo.get(k)
        if hit is None:
            t = triples[k]
            pre_refs = frozenset(p.ref for p in t.pre)
            hit = memo[k] = (
                tuple((p.ref, p.layout) for p in t.pre),
                tuple(p.ref for p in t.post),
                pre_refs | frozenset(p.ref for p in t.post),
                pre_refs | frozenset(r for _, r in t.tokens),
                tuple(tok for tok in t.tokens if tok[0] in ("comm", "src")),
                () if isinstance(t.instrs[-1], Collective) else tuple(p.ref for p in t.post),
            )
        return hit

    return pieces


def _labels(graph, anchors: Sequence[int], refs: set[int]) -> dict[int, tuple]:
    """Canonical names for the tensors a segment (or block) touches, independent of where it sits.

    The ``i``-th computed node is ``("a", i)``; an operand of it not yet named is ``("o", i, j)``
    (``j``: operand position); the loss is ``("done",)``; anything else keeps its index
    ``("abs", ref)``. Two transformer layers then get equal labels although their nodes, their
    parameters (placed together at the graph's start by export) and the mask they share sit at
    unrelated indices. Renaming is a bijection, so a search solved for one segment maps onto every
    segment with an equal signature.
    """
    lab: dict[int, tuple] = {DONE.ref: ("done",)}
    for i, a in enumerate(anchors):
        lab[a] = ("a", i)
    for i, a in enumerate(anchors):
        for j, o in enumerate(graph[a].operands):
            lab.setdefault(o, ("o", i, j))
    for r in refs:
        lab.setdefault(r, ("abs", r))
    return lab


def shardable_triples(theory: Theory, m: int) -> set[int]:
    """Triples whose sharded dims are big enough for every one of ``m`` devices to hold a slice:
    those whose smallest sharded extent (:func:`least_sharded_extents`) is at least ``m``."""
    return {k for k, a in enumerate(least_sharded_extents(theory)) if a >= m}


def least_sharded_extents(theory: Theory) -> list[float]:
    """Each triple's smallest sharded extent, over its pre- and postconditions and its computes'
    operands (``inf`` with none sharded): found once per theory (a pipeline's stages, a segmented
    plan's segments and the stage costs of each sub-mesh size ask for several ``m``)."""
    least = theory.__dict__.get("_least_sharded_extent")
    if least is None:
        least = []
        for t in theory.triples:
            props = list(t.pre) + list(t.post)
            for ins in t.instrs:
                if isinstance(ins, Compute):
                    node = theory.graph[ins.ref]
                    props += [Prop(o, lay) for o, lay in zip(node.operands, ins.inputs)]
            sizes = [theory.atoms(p.ref, p.layout.dim) for p in props if p != DONE and p.layout.is_sharded]
            least.append(min(sizes, default=math.inf))
        theory.__dict__["_least_sharded_extent"] = least
    return least


class _Synth:
    """One synthesis run: caches of triple times, segment searches and block transfer tables.

    DP states are ``(live, tokens)`` bitmasks over all properties / tokens of the theory.
    """

    def __init__(self, space: SynthSpace, model: CostModel, ratios: Vec, progress: Progress | None):
        self.space, self.model, self.ratios, self.progress = space, model, ratios, progress
        self.th = space.theory
        self.times: dict[int, object] = {}
        self.seg_cache: dict[tuple, dict] = {}  # (signature, relative entry) -> exits
        self.exit_cache: dict[tuple, list] = {}  # (segment, entry masks) -> exits as masks
        self.block_cache: dict[tuple, dict] = {}
        # block_from's per-block masks, entry labels and mapped exits (pure functions of the space,
        # the bit numbering and the cached search they map; never stale: keyed by that search)
        self._block_info: dict[int, tuple] = {}
        self._block_rel: dict[tuple, tuple] = {}
        self._block_exits: dict[tuple, tuple] = {}
        self.reps: dict[int, Segment] = {}
        self.stats = SearchStats()
        self.searches = 0
        self.bits, self.masks = space.state_bits()
        counts = defaultdict(int)
        for sig in space.block_signatures:
            counts[sig] += 1
        self.repeated = {sig for sig, c in counts.items() if c > 1}
        # branch and bound: ``upper`` is the cost of a complete program already found, ``suffix[i]``
        # a lower bound on what segments ``i..`` cost from any state; a state whose cost plus
        # the bound of what follows exceeds ``upper`` leads to nothing cheaper and is dropped
        self.upper = math.inf
        self.beam = 0  # > 0: keep only that many cheapest states per table (the first pass)
        self.dead_end = -1  # the last segment some states could not get past
        self.deadline: float | None = None  # time.monotonic() at which every search gives up (OutOfTime)
        self.work = 0  # DP states stepped across a segment (the tables' sizes, summed), in every pass
        self.cap: float = math.inf  # a pass that steps more states than this stops (_TooMuch)
        # segments with equal signatures have equal triples and costs (what lets their searches be
        # shared), so equal bounds, bit for bit: each is computed once, on its first segment
        by_signature: dict[int, float] = {}
        lbs = []
        for seg in space.segments:
            if seg.signature not in by_signature:
                by_signature[seg.signature] = self.segment_bound(seg)
            lbs.append(by_signature[seg.signature])
        self.suffix = [0.0] * (len(lbs) + 1)
        for i in range(len(lbs) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + lbs[i]

    def time_of(self, k: int):
        if k not in self.times:
            self.times[k] = self.model.triple_time(self.th.triples[k].cost, self.ratios)
        return self.times[k]

    def segment_bound(self, seg: Segment) -> float:
        """A lower bound on the cost of any way through ``seg``, from any entry state.

        Each node of a segment is computed only there (non-source nodes are never fused into other
        triples), by a triple whose last instruction computes it, and a program costs at least any
        one of its triples alone (stage times are maxima of sums; collectives, gradient and memory
        terms add). One node: the cheapest defining triple's whole time. Several: the per-type
        least compute, summed over the nodes, on the busiest type, forward and backward."""
        nt = len(self.model.types)
        lbf: dict[int, list[float]] = {}
        lbb: dict[int, list[float]] = {}
        alone: dict[int, float] = {}
        anchors = set(seg.anchors)
        for k in seg.triples:
            last = self.th.triples[k].instrs[-1]
            if not isinstance(last, Compute) or last.ref not in anchors:
                continue
            tt = self.time_of(k)
            n = last.ref
            whole = tt.grad + tt.fwd_comm + tt.bwd_comm + max(tt.fwd_comp, default=0.0) + max(tt.bwd_comp, default=0.0)
            alone[n] = min(alone.get(n, math.inf), whole)
            lbf[n] = [min(a, b) for a, b in zip(lbf.get(n, [math.inf] * nt), tt.fwd_comp)]
            lbb[n] = [min(a, b) for a, b in zip(lbb.get(n, [math.inf] * nt), tt.bwd_comp)]
        if len(seg.anchors) == 1:
            return alone.get(seg.anchors[0], 0.0)
        if not lbf:
            return 0.0
        return max(map(sum, zip(*lbf.values()))) + max(map(sum, zip(*lbb.values())))

    def _bounded(self, nxt: dict, after: int, offset: float) -> dict:
        """``nxt`` without the states that cannot beat ``upper`` (and, in the first pass, beyond
        the beam). ``offset``: the cost already paid before ``nxt``'s costs started counting."""
        if self.upper < math.inf:
            limit = self.upper * (1 + 1e-9) + 1e-15 - offset - self.suffix[after]
            nxt = {st: v for st, v in nxt.items() if v[0] <= limit}
        if self.beam and len(nxt) > self.beam:
            keep = sorted(nxt.items(), key=lambda kv: kv[1][0])[: self.beam]
            nxt = dict(keep)
        return nxt

    def segment_exits(self, seg: Segment, enter: int, toks: int, budget: float = math.inf) -> list:
        """Ways through ``seg`` from entry masks: ``[(live, tokens, cost, program), ...]``: every
        exit that costs at most ``budget`` (and, in the first pass, the ``beam`` cheapest); dearer
        ones may be left out."""
        key = (seg.index, enter, toks)
        hit = self.exit_cache.get(key)
        if hit is not None and _covers(hit, budget, self.beam):
            return hit[2]
        th, bits = self.th, self.bits
        rep = self.reps.setdefault(seg.signature, seg)
        lab, ref = seg.labels, seg.refs_of
        rel_enter = frozenset((lab[p.ref], p.layout) for p in bits.props(enter))
        rel_tokens = frozenset((a, lab[r]) for a, r in bits.toks(toks))
        skey = (seg.signature, rel_enter, rel_tokens)
        found = self.seg_cache.get(skey)
        if found is None or not _covers(found, budget, self.beam):
            exits, complete = _explore(
                th,
                rep,
                rel_enter,
                rel_tokens,
                self.time_of,
                self.model,
                self.progress,
                self.stats,
                budget,
                self.beam,
                self.deadline,
            )
            found = self.seg_cache[skey] = (complete, self.beam, exits)
            self.searches += 1
        pos = {t: k for k, t in enumerate(rep.triples)}
        out = []
        for rel_state, (c, rel_prog) in found[2].items():
            live, tk = _absolute_state(bits, ref, rel_state)
            out.append((live, tk, c, [seg.triples[pos[t]] for t in rel_prog]))
        self.exit_cache[key] = (found[0], found[1], out)
        return out

    def step(
        self, seg: Segment, table: dict[tuple[int, int], tuple], offset: float = 0.0, whole: bool = True
    ) -> dict[tuple[int, int], tuple]:
        """The DP across one segment: ``(live, tokens) -> (cost, back pointer)``. ``whole``: the
        states hold everything live (not only what a repeated block touches), so a state missing
        a tensor that is needed later and made by no later segment can be dropped."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _OutOfTime
        self.work += len(table)
        if self.work > self.cap:
            raise _TooMuch
        mk = self.masks[seg.index]
        nxt: dict[tuple[int, int], tuple] = {}
        tp, tt, needed, after = mk.touched_props, mk.touched_toks, mk.needed, mk.toks_after
        must = mk.must if whole else ()
        # each state's budget: upper (1 + 1e-9) + 1e-15 - offset - cost - suffix, evaluated left to
        # right as one expression would be (the same floats), its state-independent head hoisted
        head = self.upper * (1 + 1e-9) + 1e-15 - offset
        tail = self.suffix[seg.index + 1]
        cache, index, beam = self.exit_cache, seg.index, self.beam
        not_tp, not_tt = ~tp, ~tt
        get = nxt.get
        deadline, countdown = self.deadline, 2048  # a table of 10^5 states takes seconds: checked within
        for (live, tokens), (cost, back) in table.items():
            countdown -= 1
            if not countdown:
                countdown = 2048
                if deadline is not None and time.monotonic() > deadline:
                    raise _OutOfTime
            passing = live & not_tp & needed
            kept = tokens & not_tt & after
            enter, toks = live & tp, tokens & tt
            hit = cache.get((index, enter, toks))  # segment_exits' own cache, looked up here (no call)
            # _covers(hit, budget, beam), inline; the budget is computed only where it is asked
            if hit is not None and (hit[0] == math.inf or (hit[1] >= beam if beam else head - cost - tail < hit[0])):
                exits = hit[2]
            else:
                exits = self.segment_exits(seg, enter, toks, head - cost - tail)
            for ex_live, ex_tok, c, prog in exits:
                ns = ((ex_live & needed) | passing, (ex_tok & after) | kept)
                if must:
                    lv = ns[0]
                    if not all(lv & m for m in must):
                        continue  # a tensor needed later, held in no layout, made by no later segment
                total = cost + c
                old = get(ns)
                if old is None or total < old[0] - 1e-15:
                    nxt[ns] = (total, (back, index, prog, c))
        if not nxt and table:
            self.dead_end = max(self.dead_end, seg.index)
        return self._bounded(nxt, seg.index + 1, offset)

    def run_block(self, b: int, table: dict, offset: float = 0.0, whole: bool = True) -> dict:
        """The DP across block ``b`` for a whole table of entry states."""
        for i in self.space.blocks[b]:
            table = self.step(self.space.segments[i], table, offset, whole)
            if not table:
                break
        return table

    def solve(self, required: bool = True) -> tuple[float, Any] | None:
        """The DP over every block: the cheapest complete program as ``(cost, back pointer)``;
        ``None`` when ``upper`` pruned every state (nothing beats the program already found)."""
        sp = self.space
        table: dict[tuple[int, int], tuple] = {(0, 0): (0.0, None)}
        for b in range(len(sp.blocks)):
            if sp.block_signatures[b] in self.repeated:
                nxt: dict[tuple[int, int], tuple] = {}
                must = self.masks[sp.blocks[b][-1]].must
                for state, (cost, back) in table.items():
                    for ex, (c, progs) in self.block_from(b, state, cost).items():
                        if must and not all(ex[0] & m for m in must):
                            continue
                        total = cost + c
                        old = nxt.get(ex)
                        if old is None or total < old[0] - 1e-15:
                            nxt[ex] = (total, (back, -1, progs, c))
                table = self._bounded(nxt, sp.blocks[b][-1] + 1, 0.0)
            else:
                table = self.run_block(b, table)
            if not table:
                if required:
                    raise self._infeasible()
                return None
            _prune_dominated(table, self.bits, self.deadline)
        done = self.bits.p(DONE)
        finals = [(c, back) for (lv, _), (c, back) in table.items() if lv & done]
        if not finals:
            if required:
                raise InfeasibleError("no complete program: the loss is never produced")
            return None
        return min(finals, key=lambda x: x[0])

    def _infeasible(self) -> InfeasibleError:
        seg = self.space.segments[max(self.dead_end, 0)]
        return InfeasibleError(
            f"no program gets past segment {seg.index} (nodes {seg.anchors[0]}..{seg.anchors[-1]}); "
            "every op has a replicate triple, so the allowed triples were restricted too far"
        )

    def block_from(self, b: int, state: tuple[int, int], offset: float = 0.0) -> dict:
        """Exits of a repeated block from one entry state, cached under the block's labels.

        Only the part of ``state`` the block touches is searched; the rest passes through (kept
        when needed after the block), so blocks that differ only in what flows past them share
        one search. ``offset`` is the entry state's cost: exits that cannot beat ``upper`` from
        there are dropped, so a cached search serves entries at that cost or more.

        Returns ``{(live, tokens): (cost, (b, programs))}`` with ``programs`` relative to the block
        (``(segment offset, positions in that segment's triples, segment cost)``), mapped to theory
        indices only for the program returned (:func:`_result`), not for every exit of every call.
        The exits' masks under this block's tensors are computed once per cached search and block."""
        sp, bits = self.space, self.bits
        info = self._block_info.get(b)
        if info is None:
            segs = [sp.segments[i] for i in sp.blocks[b]]
            touched = toks_touched = 0
            for sg in segs:
                touched |= self.masks[sg.index].touched_props
                toks_touched |= self.masks[sg.index].touched_toks
            end = self.masks[segs[-1].index]
            info = self._block_info[b] = (touched, toks_touched, end.needed, end.toks_after, segs)
        touched, toks_touched, end_needed, end_toks, segs = info
        live_in, tok_in = state[0] & touched, state[1] & toks_touched
        lab, ref = sp.block_labels[b], sp.block_refs[b]
        rkey = (b, live_in, tok_in)
        rel = self._block_rel.get(rkey)
        if rel is None:
            rel = self._block_rel[rkey] = (
                frozenset((lab[p.ref], p.layout) for p in bits.props(live_in)),
                frozenset((a, lab[r]) for a, r in bits.toks(tok_in)),
            )
        key = (sp.block_signatures[b], rel)
        hit = self.block_cache.get(key)
        if hit is None or hit[0] > offset:
            table = self.run_block(b, {(live_in, tok_in): (0.0, None)}, offset, whole=False)
            here = {sg.index: {t: k for k, t in enumerate(sg.triples)} for sg in segs}
            out = {}
            for (lv, tk), (c, back) in table.items():
                progs = []
                while back is not None:
                    back, si, prog, sc = back
                    progs.append((si - segs[0].index, [here[si][t] for t in prog], sc))
                rel_st = (
                    frozenset((lab[p.ref], p.layout) for p in bits.props(lv)),
                    frozenset((a, lab[r]) for a, r in bits.toks(tk)),
                )
                out[rel_st] = (c, progs[::-1])
            self.block_cache[key] = hit = (offset if self.upper < math.inf else -math.inf, out)
        mapped = self._block_exits.get((b, key))
        if mapped is None or mapped[0] is not hit:
            exits = []
            for rel_state, (c, progs) in hit[1].items():
                lv, tk = _absolute_state(bits, ref, rel_state)
                exits.append((lv, tk, (c, (b, progs))))
            mapped = self._block_exits[(b, key)] = (hit, exits)
        p0, p1 = state[0] & ~touched & end_needed, state[1] & ~toks_touched & end_toks
        return {(lv | p0, tk | p1): val for lv, tk, val in mapped[1]}


_OutOfTime = OutOfTime  # the deadline of :func:`synthesize_program` passed (in any of its searches)


class _TooMuch(Exception):
    """A pass of :func:`synthesize_program` stepped more DP states than its ``cap`` allowed."""


#: the direct pass at ``U`` (see :func:`synthesize_program`) may step this many times the first
#: pass's DP states (but at least :data:`DIRECT_FLOOR`) before it gives way to the deepening passes
DIRECT_FACTOR = 4.0
DIRECT_FLOOR = 20_000
#: try the direct pass at all (False: the deepening passes alone, as before)
DIRECT = True

_SEED = object()  # the back pointer of a whole incumbent program (data-parallel, or the fallback)
_SCOPED_DEADLINE: ContextVar[float | None] = ContextVar("hapc_synth_deadline", default=None)


@contextmanager
def searches_until(deadline: float | None) -> Iterator[None]:
    """Every :func:`synthesize_program` called inside without a ``deadline`` of its own stops at
    ``deadline``: how a caller that cannot pass one down is bounded (the pipeline planner prices
    stages through :mod:`hapc.pipeline.stagecost`). None: no limit."""
    token = _SCOPED_DEADLINE.set(deadline)
    try:
        yield
    finally:
        _SCOPED_DEADLINE.reset(token)


def data_parallel_program(
    space: SynthSpace,
    model: CostModel,
    ratios: Vec,
    progress: Progress | None = None,
    deadline: float | None = None,
) -> SynthResult | None:
    """The best program of ``space`` that keeps parameters replicated and activations split by
    batch (the triples :func:`~hapc.synth.baselines.restrict` allows DP-EV), at ``ratios``; None
    where data parallelism cannot compute the loss. An upper bound for :func:`synthesize_program`.

    ``deadline``: a :func:`time.monotonic` value; once it passes, the best data-parallel program
    found by then (``proven=False``), or None where none is complete yet."""
    from .baselines import restrict

    # the triples DP-EV allows depend on the theory and the device count only: found once per pair
    # (a pipeline plan prices many sub-meshes of one stage theory, each with its incumbent)
    known = space.theory.__dict__.setdefault("_dp_ev_triples", {})
    if space.m not in known:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # restrict's note that DP is priced as an upper bound
                known[space.m] = frozenset(restrict(space.theory, "dp-ev", space.m))
        except InfeasibleError:
            known[space.m] = None
    if known[space.m] is None:
        return None
    try:
        sub = space.restricted(space.allowed & known[space.m])
        return synthesize_program(sub, model, ratios, progress, deadline=deadline, incumbent=False, fallback=False)
    except (InfeasibleError, OutOfTime):
        return None


def replicated_triples(theory: Theory) -> frozenset[int]:
    """The triples of the all-replicated program: every tensor whole on every device, no
    collective (each device runs the whole step on the whole batch, as one device would)."""
    known = theory.__dict__.get("_replicated_triples")
    if known is None:
        known = theory.__dict__["_replicated_triples"] = frozenset(
            k
            for k, t in enumerate(theory.triples)
            if not any(isinstance(ins, Collective) for ins in t.instrs)
            and all(p == DONE or p.layout.is_replicated for p in t.pre | t.post)
        )
    return known


def fallback_program(space: SynthSpace, model: CostModel, ratios: Vec) -> SynthResult | None:
    """A valid program of ``space`` found without a search that can explode: the all-replicated
    one (:func:`replicated_triples`; one triple per node, so every segment search is a single
    path), through the first pass alone (beam 1, no exact passes; ``proven=False``). Returned by
    :func:`synthesize_program` when its deadline passes before any search completed a program
    (which reports its own lower bound as ``floor``; here it is 0: nothing is proven about
    ``space``'s optimum). None where ``space`` does not allow it (a baseline's restricted triples)."""
    sub = space.restricted(space.allowed & replicated_triples(space.theory))
    # beam 1 can keep a dead end (tiny HF BEiT: the cheapest state after segment 0 cannot go on);
    # the plain DP over this space (one triple per op) is small, and finds the program then
    for beam in (1, 0):
        run = _Synth(sub, model, ratios, None)
        run.beam = beam
        try:
            found = run.solve()
        except InfeasibleError:
            continue
        return _result(sub, run, found, [], False, 0.0)
    return None


def synthesize_program(
    space: SynthSpace,
    model: CostModel,
    ratios: Vec,
    progress: Progress | None = None,
    beam: int = BEAM,
    deadline: float | None = None,
    incumbent: bool = True,
    fallback: bool = True,
) -> SynthResult:
    """The optimal program for ``ratios`` (HAP Eq. 1) within ``space``'s segmented cost model.

    A block (the segments between two single-tensor cuts) that occurs several times -- a
    transformer layer -- is solved once per entry state and reused; others run in the table.

    Branch and bound keeps the tables small without giving up optimality: a first pass keeps only
    the ``beam`` cheapest states of every table, which finds a complete program of cost ``U``
    quickly; exact passes then drop every state whose cost plus a lower bound on the remaining
    segments (:meth:`_Synth.segment_bound`) exceeds their bound -- no program through it can be
    cheaper -- with bounds growing by :data:`GROWTH` from the lower bound of the whole program
    up to ``U``. The first exact pass that finds a program returns the optimum (the first pass's
    program when nothing beats it). ``beam=0`` skips the first pass and the deepening (the plain
    DP).

    ``incumbent``: where the first pass's ``U`` is far above the lower bound (more than two
    deepening passes away), or a ``deadline`` is set, the best *data-parallel* program
    (:func:`data_parallel_program`, a search over a much smaller space) is priced too, and the
    cheaper of the two bounds the exact passes. The beam keeps the cheapest prefixes and so misses
    programs that pay early (the gradient all-reduce of the embedding); on T5-small at its
    published size on hap-testbed:8 the first pass's program costs 190 ms against data
    parallelism's 84 ms. Any complete program is a valid bound, so the optimum is unchanged.

    ``deadline`` (a :func:`time.monotonic` value; off by default) makes the search *anytime*: it
    bounds every search run here -- the data-parallel incumbent, the first pass, the exact passes,
    and each segment's A* inside them (:class:`~hapc.synth.search.OutOfTime`). With a deadline
    the incumbent is searched first, within half the time left, then first passes of widening
    beams (1, 4, 16, ... ``beam``: a narrow one is cheap) and the exact passes within the rest.
    Once it passes, the cheapest complete program found so far is returned with ``proven=False``
    and ``floor`` = the largest bound an exact pass proved the optimum above (or the whole
    program's lower bound): the optimum lies in ``[floor, cost]``. When no search completed a
    program by then, the all-replicated program (:func:`fallback_program`: one path, nothing to
    search) is returned (``fallback=False``: :class:`~hapc.synth.search.OutOfTime` is raised
    instead). It comes back within the deadline plus one expansion of a segment search plus the
    fallback's pass (measured on tiny Swin and DenseNet-121: at most 0.25 s past it). Where
    ``space`` rules the fallback out (a baseline's triples) and nothing was found, the exact
    passes run on without the deadline: a program is always returned. Without a ``deadline``,
    the one of an enclosing :func:`searches_until` applies.
    """
    if deadline is None:
        deadline = _SCOPED_DEADLINE.get()
    run = _Synth(space, model, ratios, progress)
    best = None
    seed = None
    if beam and incumbent and deadline is not None:
        # the incumbent first, in half the time left: it rarely explodes, and bounds what the
        # deadline returns (the first pass alone can be far poorer, and may not finish)
        share = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
        seed = data_parallel_program(space, model, ratios, progress, deadline=share)
        if seed is not None:
            best = (seed.cost, _SEED)
    run.deadline = deadline
    if beam:
        first = None
        # with a deadline, widen the beam (1, 4, 16, ... beam): a narrow first pass is cheap and
        # soon gives a program (tiny Swin: beam 1 in 0.3 s, beam 64 past 30 s)
        for width in [beam] if deadline is None else _widths(beam):
            run.beam, run.block_cache = width, {}
            try:
                got = run.solve()
            except InfeasibleError:
                continue
            except OutOfTime:
                break
            if first is None or got[0] < first[0]:
                first = got
        run.beam = 0
        if first is not None and (best is None or first[0] < best[0]):
            best = first
        far = first is None or first[0] > run.suffix[0] * GROWTH**2
        if incumbent and deadline is None and far:
            seed = data_parallel_program(space, model, ratios, progress)
            if seed is not None and (best is None or seed.cost < best[0]):
                best = (seed.cost, _SEED)
    if best is None and deadline is not None and fallback:
        seed = fallback_program(space, model, ratios)
        if seed is not None:
            best = (seed.cost, _SEED)
    found, bounds = None, []
    floor, proven = run.suffix[0], True
    if best is None and fallback:
        run.deadline = None  # never return without a program
    first_work = run.work
    deepens = best is not None and 0 < run.suffix[0] * GROWTH < best[0] / GROWTH**0.5  # passes below U
    if beam and DIRECT and deadline is None and deepens and _direct(run, best[0]):
        # the direct pass at U proved nothing cheaper than U exists: every deepening pass (bounds
        # below U) would have found nothing, and the pass at U nothing cheaper, so U's program is
        # what the passes below return (see "Skipping the deepening" in the module docstring)
        bounds.append(best[0])
        beam = 0  # no exact pass left to run
        found = None
        first_work = -1
    try:
        if beam:
            # deepen the bound from the lower bound towards U (or, when the beam died out, up to
            # 2^20 times the lower bound): the first pass that finds a program has the optimum
            # (nothing within its bound was dropped)
            ceiling = best[0] if best is not None else run.suffix[0] * 2.0**20
            bound = run.suffix[0] * GROWTH
            # a pass whose bound is within sqrt(GROWTH) of U costs about what the pass at U does and,
            # when it fails, is paid twice: go to U (GPT-2 124M on hap-testbed:8: 5.8 -> 4.6 s)
            near = ceiling / GROWTH**0.5 if best is not None else ceiling
            while found is None and 0 < bound < near:
                run.upper, run.block_cache = bound, {}  # a block searched under a lower bound pruned more
                bounds.append(bound)
                found = run.solve(required=False)
                if found is None:
                    floor = bound  # nothing within this bound: the optimum costs more
                bound *= GROWTH
            run.upper = best[0] if best is not None else math.inf
        if found is None and first_work >= 0:
            run.block_cache = {}
            bounds.append(run.upper)
            found = run.solve(required=best is None)
    except OutOfTime:
        found, proven = None, False
    finally:
        run.deadline = None
    if found is not None and (best is None or found[0] < best[0]):
        best = found
    if best is None:  # fallback=False: out of time with nothing complete
        raise OutOfTime
    if best[1] is _SEED:
        assert seed is not None
        floor = best[0] if proven else floor
        return SynthResult(seed.parts, best[0], seed.segment_costs, run.stats, run.searches, bounds, proven, floor)
    return _result(space, run, best, bounds, proven, best[0] if proven else floor)


def _direct(run: _Synth, upper: float) -> bool:
    """One exact pass at ``upper`` (the first pass's cost ``U``), capped at :data:`DIRECT_FACTOR`
    times the DP states the run has stepped so far: True where it completed and found no program
    cheaper than ``upper``, i.e. ``U`` is the optimum. Otherwise (a cheaper program, or the cap
    hit) the run's segment caches are put back as they were, so the deepening passes that follow
    run exactly as they would have without it (the same caches, the same tie-breaks)."""
    saved = (dict(run.seg_cache), dict(run.exit_cache), run.searches)
    run.upper, run.block_cache = upper, {}
    run.cap = run.work + max(DIRECT_FLOOR, DIRECT_FACTOR * run.work)
    try:
        got = run.solve(required=False)
        if got is None or got[0] >= upper:
            return True
    except _TooMuch:
        pass
    finally:
        run.cap = math.inf
    run.seg_cache, run.exit_cache, run.searches = saved
    run.upper, run.block_cache = math.inf, {}
    return False


def _widths(beam: int) -> list[int]:
    """The beams of the first passes under a deadline: 1, 4, 16, ... below ``beam``, then ``beam``."""
    out, w = [], 1
    while w < beam:
        out.append(w)
        w *= 4
    return out + [beam]


def _result(space: SynthSpace, run: _Synth, best: tuple, bounds: list, proven: bool, floor: float) -> SynthResult:
    """The program of ``best`` (``(cost, back pointer)`` of ``run``'s tables) as a result."""
    total, back = best
    parts: list[list[int]] = [[] for _ in space.segments]
    seg_costs = [0.0] * len(space.segments)
    while back is not None:
        back, si, prog, c = back
        if si >= 0:
            parts[si], seg_costs[si] = prog, c
        else:  # a whole repeated block: its programs relative to it (_Synth.block_from)
            b, progs = prog
            block = space.blocks[b]
            for off, p, sc in progs:
                sj = block[off]
                parts[sj], seg_costs[sj] = [space.segments[sj].triples[i] for i in p], sc
    return SynthResult(parts, total, seg_costs, run.stats, run.searches, bounds, proven, floor)


def _absolute_state(bits: _Bits, ref: Any, rel_state: tuple) -> tuple[int, int]:
    """A cached search's exit, ``(properties, tokens)`` over labels relative to its segment or
    block, as this occurrence's state bits (``ref``: label -> this occurrence's node)."""
    rel_live, rel_toks = rel_state
    live = 0
    for r, lay in rel_live:
        live |= bits.p(Prop(ref[r], lay))
    tk = 0
    for a, r in rel_toks:
        tk |= bits.t((a, ref[r]))
    return live, tk


def _prune_dominated(states: dict[tuple[int, int], tuple], bits: _Bits, deadline: float | None = None) -> None:
    """Drop a state when another with the same tokens and tensors holds a superset of properties
    at no higher cost: every continuation of the first works from the second, no slower.

    A strict superset holds more properties (the states of a group differ: same tokens, distinct
    property sets), so a state is checked only against kept states of higher popcount -- where
    every tensor is held in one layout (equal-cost layouts tie: ALBERT's shared layers left
    12 096 such states in one group, 4.9 s pairwise) no pair is compared at all. Past
    ``deadline`` it raises :class:`OutOfTime`, as every step of the DP does."""
    groups: dict[tuple, list[tuple[tuple[int, int], float]]] = defaultdict(list)
    for st, val in states.items():
        refs = frozenset(p.ref for p in bits.props(st[0]))
        groups[(st[1], refs)].append((st, val[0]))
    checks = 0
    for members in groups.values():
        if len(members) < 2:
            continue
        members.sort(key=lambda x: x[1])
        kept: dict[int, list[tuple[int, float]]] = defaultdict(list)  # popcount -> (live, cost)
        for st, c in members:
            live = st[0]
            n = live.bit_count()
            above = [k for k in kept if k > n]
            if any((k & live) == live and kc <= c for q in above for k, kc in kept[q]):
                del states[st]
            else:
                kept[n].append((live, c))
            checks += 1
            if deadline is not None and not checks % 1024 and time.monotonic() > deadline:
                raise _OutOfTime


def _covers(cached: tuple, budget: float, count: int) -> bool:
    """Whether a cached search ``(complete up to, count it was asked for, exits)`` answers a query
    for every exit up to ``budget`` (``count`` > 0: the ``count`` cheapest)."""
    complete, asked, _ = cached
    if complete == math.inf:
        return True
    return asked >= count if count else budget < complete


def _explore(
    th,
    rep: Segment,
    rel_enter,
    rel_tokens,
    time_of,
    model,
    progress,
    stats,
    budget: float,
    count: int,
    deadline: float | None = None,
) -> tuple[dict, float]:
    """The exits of ``rep``'s search from a relative entry, and the cost up to which they are
    complete (:meth:`SegmentSearch.explore`); :class:`OutOfTime` past ``deadline``."""
    lab, ref = rep.labels, rep.refs_of
    enter = frozenset(Prop(ref[r], lay) for r, lay in rel_enter)
    tokens = frozenset((a, ref[r]) for a, r in rel_tokens)
    protected = frozenset(Prop(x, lay) for x, ls in rep.local_needed.items() for lay in ls) | frozenset({DONE})
    trip = list(rep.triples)
    search = SegmentSearch(
        th,
        trip,
        [time_of(k) for k in trip],
        enter,
        protected,
        rep.anchors,
        len(model.types),
        tokens,
        progress,
        deadline,
    )

    def exit_key(live: frozenset[Prop], toks: frozenset) -> tuple:
        return (
            frozenset((lab[p.ref], p.layout) for p in live),
            frozenset((a, lab[r]) for a, r in toks if (a, r) in rep.local_tokens),
        )

    if not rep.local_needed and not rep.local_tokens:
        # nothing to leave behind but the loss: plain A* with its early stop (HAP Fig. 10)
        try:
            found = search.run({"done": frozenset({DONE})})
        finally:
            stats.add(search.stats)
        done = found.get("done")
        key = (frozenset({(lab[DONE.ref], DONE.layout)}), frozenset())
        return ({key: (done.cost, done.triples)} if done else {}), math.inf
    try:
        found, complete = search.explore(exit_key, budget, count)
    finally:
        stats.add(search.stats)
    return {key: (f.cost, f.triples) for key, f in found.items()}, complete


def program_cost(theory: Theory, model: CostModel, parts: Sequence[Sequence[int]], ratios: Vec) -> float:
    """``t(Q, B)`` of a program given per segment (each segment starts fresh stages, HAP §5.2)."""
    return sum(model.cost([theory.triples[k].cost for k in part], ratios) for part in parts)
