"""Hoare triples and the theory of a model (HAP §4.2, §4.4, §4.5).

``derive(graph)`` builds, for a :class:`~hapc.theory.graph.RefGraph`, every triple
``{pre} instructions {post}`` a distributed program may use:

* **source** triples -- inputs, parameters and buffers, replicated or sharded on any dim;
* **computation** triples -- one per strategy of each node's rule, plus replicate-everything;
  for a linear layer whose weight has one use, also the SFB triple (HAP §4.4);
* **communication** triples -- for every tensor that may move between the layouts its producers
  and consumers use: all-gather (padded and grouped), reduce-scatter (padded and grouped),
  all-reduce, all-to-all, and the free local slice;
* the **loss** triples ``{loss | P} Loss {Done}`` and ``{loss | R} Loss {Done}``.

and then applies HAP §4.5's search-space optimisations:

1. triples with an empty precondition are *fused* into their consumers
   (``{Pre2 \\ Post1} I1; I2 {Post1 ∪ Post2}``), repeatedly, so sources appear right before their
   first use; a source used by a single node is always fused;
2. each tensor is communicated at most once and each input-dependent node computed once, in one
   layout (exclusive *tokens*); tensors that can be sourced in any layout (inputs, parameters,
   buffers) are not communicated at all unless ``param_comm=True`` (which adds ZeRO-3/FSDP-style
   all-gathered parameters), and a parameter is sourced in one layout;
3. ``consumers`` indexes, for every property, the triples that need it, so the search can drop
   properties no useful triple needs any more (``hapc.synth``).

Triples whose precondition can never hold, or whose postcondition nobody needs, are removed.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .._util import without_gc
from ..errors import UnsupportedOpError, UnsupportedOpWarning
from .cost import Comm, CostProfile, Linear
from .granularity import Granularity, Key
from .graph import BUFFER, INPUT, OP, PARAM, RefGraph, RefNode, map_refs
from .instructions import COLLECTIVES, Collective, Compute, Instruction, Loss, Source
from .props import DONE, PARTIAL, REPLICATED, Layout, Prop, shard
from .registry import OpView, Registry, default_registry
from .saved import saved_bytes
from .strategy import OUT, RNG, Strategy
from .trace import GATHERS, backward_work

#: Ops whose result aliases its input (no new activation memory).
VIEW_OPS = frozenset(
    {
        "view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose",
        "permute", "t", "movedim", "expand", "expand_as", "broadcast_to", "select", "narrow", "getitem",
        "detach", "alias", "view_as", "reshape_as", "ravel", "contiguous",
    }
)  # fmt: skip


def traffic(n: RefNode, s: Strategy, times: float = 1.0) -> Linear:
    """Memory traffic of ``n`` under strategy ``s`` (``times`` the forward's): each operand's bytes
    and the result's (``RefNode.mem_parts``) by its layout -- a sharded tensor's divided by the
    ratios, a replicated or partial one whole on every device. Data parallelism's ``linear``
    reads the whole weight on every device, however few rows it holds; a gather reads of a
    replicated table the rows it gathers, so that read follows the result's layout."""
    parts = n.mem_parts
    layouts = (*s.inputs, s.output)
    if len(parts) != len(layouts):  # a node built without them: the forward's split by the strategy
        return Linear.split(n.mem_bytes * times, s.is_scaled)
    if n.op in GATHERS and s.output.is_sharded:
        layouts = tuple(s.output if lay.is_replicated else lay for lay in s.inputs) + (s.output,)
    const = sum(b for b, lay in zip(parts, layouts) if not lay.is_sharded)
    return Linear(const * times, (sum(parts) - const) * times)


@dataclass(frozen=True, eq=False)
class Triple:
    """``{pre} instrs {post}`` with its cost profile and exclusivity tokens."""

    pre: frozenset[Prop]
    post: frozenset[Prop]
    instrs: tuple[Instruction, ...]
    cost: CostProfile
    tokens: frozenset[tuple[str, int]] = frozenset()
    complete: frozenset[int] = frozenset()  # parameters whose gradient this triple makes whole (SFB)

    @property
    def kind(self) -> str:
        """``source`` / ``compute`` / ``comm`` / ``loss`` of the last (defining) instruction."""
        last = self.instrs[-1]
        return {Source: "source", Compute: "compute", Collective: "comm", Loss: "loss"}[type(last)]

    def fuse_after(self, source: Triple) -> Triple:
        """``source`` (empty precondition) placed right before ``self``.

        A parameter whose gradient ``self`` completes (SFB) loses its gradient all-reduce.
        """
        src_cost = source.cost
        if any(isinstance(i, Source) and i.ref in self.complete for i in source.instrs):
            src_cost = replace(src_cost, grad_comm=())
        return Triple(
            self.pre - source.post,
            source.post | self.post,
            source.instrs + self.instrs,
            src_cost + self.cost,
            source.tokens | self.tokens,
            source.complete | self.complete,
        )


@dataclass
class Theory:
    """The background theory of one reference graph."""

    graph: RefGraph
    triples: list[Triple]
    strategies: dict[int, list[Strategy]]
    granularity: dict[Key, tuple[int, Key]]
    raw_counts: dict[str, int]
    unsupported: list[str] = field(default_factory=list)
    precision: str | None = None  # the forward's autocast (hapc.theory.precision); None: the model's dtype

    @functools.cached_property
    def consumers(self) -> dict[Prop, list[int]]:
        """Property -> indices of the triples needing it (what dead-property detection scans)."""
        out: dict[Prop, list[int]] = defaultdict(list)
        for i, t in enumerate(self.triples):
            for p in t.pre:
                out[p].append(i)
        return out

    @functools.cached_property
    def producers(self) -> dict[Prop, list[int]]:
        out: dict[Prop, list[int]] = defaultdict(list)
        for i, t in enumerate(self.triples):
            for p in t.post:
                out[p].append(i)
        return out

    # -- queries ---------------------------------------------------------------------------
    @property
    def props(self) -> list[Prop]:
        seen: dict[Prop, None] = {}
        for t in self.triples:
            seen.update(dict.fromkeys(t.pre))
            seen.update(dict.fromkeys(t.post))
        return list(seen)

    def strategy(self, ref: int, key: str) -> Strategy:
        for s in self.strategies.get(ref, []):
            if s.key() == key:
                return s
        raise KeyError(f"node %{ref} has no strategy {key!r}")

    def atoms(self, ref: int, dim: int) -> int:
        """How many indivisible units dim ``dim`` of node ``ref`` is cut into."""
        return self.granularity.get((ref, dim), (self.graph[ref].shape[dim], (ref, dim)))[0]

    def local_sizes(self, ref: int, dim: int, ratios: Sequence[float]) -> list[int]:
        """Per-device sizes of dim ``dim`` of node ``ref`` for the given ratios."""
        from ..balance.rounding import round_shares

        n = self.graph[ref].shape[dim]
        atoms = self.atoms(ref, dim)
        return [a * (n // atoms) for a in round_shares(atoms, ratios)]

    def counts(self) -> dict[str, int]:
        c: dict[str, int] = defaultdict(int)
        for t in self.triples:
            c[t.kind] += 1
        return {"triples": len(self.triples), **dict(c), "properties": len(self.props)}

    def fmt_prop(self, p: Prop) -> str:
        if p == DONE:
            return "Done"
        name = self.graph[p.ref].name
        lay = p.layout
        if lay.is_replicated:
            return f"Replicated({name})"
        if lay.is_partial:
            return f"Partial({name})"
        return f"Sharded({name}, {lay.dim})"

    def fmt_instr(self, ins: Instruction) -> str:
        name = self.graph[ins.ref].name
        if isinstance(ins, Compute):
            node = self.graph[ins.ref]
            label = ins.strategy_key.split(":", 1)[0]
            args = ", ".join(self.graph[o].name for o in node.operands)
            return f"{name} = {node.op}[{label}]({args})"
        if isinstance(ins, Source):
            node = self.graph[ins.ref]
            how = "" if ins.layout.is_replicated else f".shard({ins.layout.dim})"
            return f"{name} = {node.kind}{how}"
        return ins.describe(name)

    def fmt_triple(self, t: Triple) -> str:
        pre = ", ".join(sorted(self.fmt_prop(p) for p in t.pre))
        post = ", ".join(sorted(self.fmt_prop(p) for p in t.post))
        body = "; ".join(self.fmt_instr(i) for i in t.instrs)
        return f"{{{pre}}} {body} {{{post}}}"


@without_gc
def derive(
    graph: RefGraph,
    *,
    registry: Registry | None = None,
    strict: bool = False,
    sfb: bool = True,
    variants: Sequence[str] = ("padded", "grouped"),
    param_comm: bool = False,
    optimise: bool = True,
    precision: str | None = None,
) -> Theory:
    """The theory of ``graph``: all triples, optimised per HAP §4.5 (see module docstring).

    Args:
        strict: raise :class:`UnsupportedOpError` for an op without a rule (default: warn and
            replicate it).
        sfb: add sufficient-factor-broadcasting triples for single-use linear weights.
        variants: all-gather / reduce-scatter implementations to offer (``padded``, ``grouped``).
        param_comm: allow communicating parameters (all-gathered sharded weights, ZeRO-3 style).
        optimise: apply fusion and relevance pruning (off: the raw theory, for inspection).
        precision: ``"bf16"`` / ``"fp16"``: the forward runs under autocast to that dtype, with fp32
            master weights (:mod:`hapc.theory.precision`): the theory's graph is ``graph`` with the
            autocast dtypes (activation and communication bytes), and each parameter a matmul reads
            adds its half copy to the saved activations. ``None`` or ``"fp32"``: the model's dtype
            (and its own ``torch.autocast`` regions' dtypes, with or without ``precision``).
    """
    from .precision import autocast_dtype, autocast_graph, half_copies

    half = autocast_dtype(precision)
    if half is not None or any(getattr(n, "autocast", ()) for n in graph):  # or the model's own regions
        graph = autocast_graph(graph, half)
    b = _Builder(graph, registry or default_registry, strict, sfb, tuple(variants), param_comm)
    b.half_copies = half_copies(graph, half)
    theory = b.build(optimise)
    theory.precision = precision if half is not None else None
    return theory


# ----------------------------------------------------------------------------------------------


class _Builder:
    def __init__(self, graph: RefGraph, registry: Registry, strict: bool, sfb: bool, variants, param_comm):
        self.g, self.registry, self.strict, self.sfb = graph, registry, strict, sfb
        self.variants, self.param_comm = variants, param_comm
        self.strategies: dict[int, list[Strategy]] = {}
        self.gran = Granularity()
        self.static = _static_nodes(graph)
        self.param_free = _param_free_nodes(graph)
        self._strategy_cache: dict[tuple | None, list[Strategy]] = {}
        self.unsupported: list[str] = []
        self.half_copies: dict[int, int] = {}  # parameter -> bytes of its autocast copy (precision)
        self.saved = saved_bytes(graph, VIEW_OPS)  # what autograd keeps of each op for the backward

    # -- per-node strategies -------------------------------------------------------------------
    def node_strategies(self, n: RefNode) -> list[Strategy]:
        """Strategies of a node; nodes alike in every way a rule can see (op, shapes, constants,
        operand kinds and users) share one evaluation -- the repeated layers of a model."""
        if self._is_static_data(n):
            return self._node_strategies(n, static=True)
        key = self._strategy_key(n)
        hit = self._strategy_cache.get(key)
        if hit is None:
            hit = self._node_strategies(n)
            if not any(s.local is not None and ("stream", RNG) in s.local.kwargs for s in hit):
                self._strategy_cache[key] = hit  # a random op's calls name their node: not shared
        return hit

    def _is_static_data(self, n: RefNode) -> bool:
        """Computed from buffers and constants alone, without gradient (position ids, attention
        masks): every rank computes it whole. Sharding such a chain buys nothing, and fusing every
        sharding of every link into its consumers (HAP §4.5) multiplies strategies exponentially
        in the chain's length."""
        static = self.__dict__.setdefault("_static_data", {})
        if n.index not in static:
            g = self.g
            static[n.index] = n.kind == BUFFER or (
                n.kind == OP and not n.requires_grad and all(self._is_static_data(g[o]) for o in n.operands)
            )
        return static[n.index]

    def _strategy_key(self, n: RefNode) -> tuple | None:
        g = self.g
        try:
            args = map_refs((n.args, n.kwargs), lambda r: ("ref", r.index - n.index))
            ops = tuple((g[o].kind, g[o].meta, len(g[o].users), g[o].requires_grad) for o in n.operands)
            key = (
                n.op,
                n.target,
                n.meta,
                n.out_index,
                n.requires_grad,
                repr(args),
                ops,
            )
            hash(key)
            return key
        except TypeError:  # an unhashable constant: no sharing
            return ("node", n.index)

    def _node_strategies(self, n: RefNode, static: bool = False) -> list[Strategy]:
        """``static``: only the replicated strategy (the rule's own call where it has one), and no
        rule needed (see :meth:`_is_static_data`)."""
        from .sfb import sfb_strategies

        ops = n.operands
        rep = Strategy(tuple(REPLICATED for _ in ops), REPLICATED, scaled=False, name="replicate")
        rule = self.registry.get(n.op)
        found: list[Strategy] = []
        if rule is None:
            if not static:
                self.no_rule(n)
        else:
            found = rule.strategies(OpView(n, self.g))
        if self.sfb and not static:
            found += sfb_strategies(OpView(n, self.g), found)
        out, seen = [rep], {(rep.inputs, rep.output)}
        for s in found:
            if s.key() == rep.key() and s.local is not None:  # the rule's own replicated call (random ops)
                out[0] = s
                continue
            if (s.inputs, s.output) not in seen or s.name == "sfb":
                seen.add((s.inputs, s.output))
                out.append(s)
        return out[:1] if static else out

    def no_rule(self, n: RefNode) -> None:
        target = n.target if not n.is_method else f"torch.Tensor.{n.target}"
        shapes = [self.g[o].meta.shape for o in n.operands]
        msg = f"op {n.op!r} (node {n.name}, {n.source}) has no sharding rule: it runs replicated on every device. "
        msg += register_advice(target, shapes, n.meta.shape)
        if self.strict:
            raise UnsupportedOpError(msg)
        if n.op not in self.unsupported:
            self.unsupported.append(n.op)
            warnings.warn(msg, UnsupportedOpWarning, stacklevel=4)

    # -- triples -----------------------------------------------------------------------------
    def compute_triple(self, n: RefNode, s: Strategy) -> Triple:
        pre = frozenset(Prop(o, lay) for o, lay in zip(n.operands, s.inputs))
        scaled = s.is_scaled
        bwd_flops, bwd_bytes = backward_work(n, self.g.nodes)
        if s.flops is not None:
            fwd_f, bwd_f = s.flops
        else:
            fwd_f, bwd_f = Linear.split(n.flops, scaled), Linear.split(bwd_flops, scaled)
        # the result where the backward reads it (not a view's: views share their input's storage)
        act = Linear.split(self.saved[n.index], s.output.is_sharded) if n.index in self.saved else Linear()
        cost = CostProfile(
            fwd_flops=fwd_f,
            bwd_flops=bwd_f,
            fwd_bytes=traffic(n, s),
            bwd_bytes=traffic(n, s, bwd_bytes / n.mem_bytes if n.mem_bytes else 0.0),
            fwd_comm=s.fwd_comm,
            bwd_comm=s.bwd_comm if n.requires_grad else (),
            act_bytes=act,
        ) + self.hidden_params(n)
        ins = Compute(n.index, s.key(), s.inputs, s.output)
        complete = frozenset(n.operands[i] for i in s.grad_complete)
        # each input-dependent node is computed once, in one layout (static ones are re-created
        # wherever used, being fused into their consumers)
        tokens = frozenset() if n.index in self.static else frozenset({("compute", n.index)})
        return Triple(pre, frozenset({Prop(n.index, s.output)}), (ins,), cost, tokens, complete)

    def hidden_params(self, n: RefNode) -> CostProfile:
        """A leaf module's own parameters: replicated, gradients all-reduced."""
        import torch.nn as nn

        if not isinstance(n.target, nn.Module):
            return CostProfile()
        nbytes = sum(p.numel() * p.element_size() for p in n.target.parameters() if p.requires_grad)
        if not nbytes:
            return CostProfile()
        return CostProfile(param_bytes=Linear(nbytes, 0.0), grad_comm=(Comm("all_reduce", nbytes, "full"),))

    def source_triple(self, n: RefNode, lay: Layout) -> Triple:
        nbytes = n.meta.nbytes
        cost = CostProfile()
        if n.kind == PARAM:
            grad = (Comm("all_reduce", nbytes, "full"),) if lay.is_replicated else ()
            # autocast's half copy of the weight is saved for the backward, like an activation
            half = Linear.split(self.half_copies.get(n.index, 0), lay.is_sharded)
            cost = CostProfile(param_bytes=Linear.split(nbytes, lay.is_sharded), grad_comm=grad, act_bytes=half)
        tokens = frozenset({("src", n.index)}) if n.kind == PARAM else frozenset()
        return Triple(frozenset(), frozenset({Prop(n.index, lay)}), (Source(n.index, lay),), cost, tokens)

    def comm_triples(self, n: RefNode, have: set[Layout], want: set[Layout]) -> Iterable[Triple]:
        nbytes = n.meta.nbytes
        grad = n.requires_grad
        token = frozenset({("comm", n.index)})

        def make(op: str, src: Layout, dst: Layout, variant: str = "") -> Triple:
            fwd, bwd = COLLECTIVES[op][variant]
            scaling = {"padded": "max", "grouped": "each"}.get(variant, "full")
            if op == "all_to_all":
                scaling = "max"
            if op == "all_reduce" and not grad and n.index in self.param_free:
                # a value of the inputs alone (a mean loss's token count): the runtime computes its
                # sum from the whole batch when every rank has it, else starts the all-reduce at the
                # top of the program, hidden behind the forward (RankProgram._hoist_data_only); it
                # costs no time and synchronises nothing, so it opens no stage (HAP Fig. 6)
                cost = CostProfile()
            else:
                cost = CostProfile(
                    fwd_comm=(Comm(fwd, nbytes, scaling),) if fwd else (),
                    bwd_comm=(Comm(bwd, nbytes, scaling),) if bwd and grad else (),
                    act_bytes=Linear.split(nbytes, dst.is_sharded) if grad else Linear(),
                )
            ins = Collective(n.index, op, src, dst, variant)
            return Triple(frozenset({Prop(n.index, src)}), frozenset({Prop(n.index, dst)}), (ins,), cost, token)

        for src in sorted(have, key=repr):
            for dst in sorted(want - {src}, key=repr):
                if src.is_sharded and dst.is_replicated:
                    yield from (make("all_gather", src, dst, v) for v in self.variants)
                elif src.is_partial and dst.is_sharded:
                    yield from (make("reduce_scatter", src, dst, v) for v in self.variants)
                elif src.is_partial and dst.is_replicated:
                    yield make("all_reduce", src, dst)
                elif src.is_sharded and dst.is_sharded:
                    yield make("all_to_all", src, dst)
                elif src.is_replicated and dst.is_sharded:
                    yield make("slice", src, dst)

    def link(self, n: RefNode, s: Strategy) -> None:
        def key(which: int, dim: int) -> Key:
            ref = n.index if which == OUT else n.operands[which]
            self.gran.add((ref, dim), self.g[ref].shape[dim])
            return (ref, dim)

        for which, lay in [*enumerate(s.inputs), (OUT, s.output)]:
            if lay.is_sharded:
                key(which, lay.dim)
        for group in s.link_groups():
            keys = [key(w, d) for w, d in group]
            for k in keys[1:]:
                self.gran.link(keys[0], k)
        for which, dim, unit in s.units:
            k = key(which, dim)
            self.gran.add(k, self.g[k[0]].shape[dim], unit)

    # -- assembly -------------------------------------------------------------------------------
    def build(self, optimise: bool) -> Theory:
        g = self.g
        triples: list[Triple] = []
        wanted: dict[int, set[Layout]] = defaultdict(set)
        made: dict[int, set[Layout]] = defaultdict(set)
        for n in g:
            if n.kind == OP:
                self.strategies[n.index] = self.node_strategies(n)
                for s in self.strategies[n.index]:
                    self.link(n, s)
                    t = self.compute_triple(n, s)
                    triples.append(t)
                    made[n.index].add(s.output)
                    for o, lay in zip(n.operands, s.inputs):
                        wanted[o].add(lay)
        loss = g.loss.index
        # a scalar loss may end Partial (its value is all-reduced); a non-scalar output (a pipeline
        # stage's activations, sent on by one relay rank) must end whole on every rank
        ends = (PARTIAL, REPLICATED) if g.loss.meta.rank == 0 else (REPLICATED, shard(0))
        wanted[loss] |= set(ends)
        for lay in ends:
            triples.append(Triple(frozenset({Prop(loss, lay)}), frozenset({DONE}), (Loss(loss, lay),), CostProfile()))
        for n in g:
            if n.kind in (INPUT, PARAM, BUFFER):
                for lay in sorted(wanted[n.index], key=repr):
                    if not lay.is_partial:
                        triples.append(self.source_triple(n, lay))
                        made[n.index].add(lay)
        for n in g:
            movable = (n.kind == OP and n.operands) or (n.kind == PARAM and self.param_comm)
            if movable:
                triples.extend(self.comm_triples(n, made[n.index], wanted[n.index]))
        raw = defaultdict(int)
        for t in triples:
            raw[t.kind] += 1
        raw["total"] = len(triples)
        if optimise:
            triples = _prune(_fuse_sources(triples, g))
        return Theory(g, triples, self.strategies, self.gran.freeze(), dict(raw), self.unsupported)


#: the most source combinations fused into one consumer triple (HAP §4.5 (1)); beyond it both stay apart
FUSE_LIMIT = 64


def _fuse_sources(triples: list[Triple], g: RefGraph) -> list[Triple]:
    """HAP §4.5 (1): fuse every empty-precondition triple into its consumers, to a fixpoint.

    A consumer is also kept unfused for a property that may already be in the program by other
    means (its node has several users, or a non-source triple produces it). A fused triple whose
    precondition became empty is fused again only if it computes from parameters and constants
    alone (``w.t()``, a causal mask); one that reads model inputs (the first layer) stays a triple
    the search may place anywhere -- fusing whole input-fed chains would multiply strategies.
    A source is not fused into a consumer whose every result it already holds (a static op made
    again from a chain that made it): the source alone is never dearer and serves the same consumers.
    """
    static = _static_nodes(g)
    data = {i for i in static_data(g) if g[i].kind == OP}
    kept: dict[int, Triple] = {}  # sources left standalone where fusing them would blow up
    # ops on static *data* (position ids, rotary tables, masks: what buffers and constants alone
    # compute, without gradient) are replicated only, so each has one way to be computed: it stays
    # a plain triple (its buffers fused into it), computed once and kept, instead of being fused
    # into every consumer in every combination of the chain's paths (tiny Llama's rotary chain
    # became ~800 fused triples, T5's position buckets 7.9k). Never dearer: fused, it is only
    # recomputed.
    sources = [t for t in triples if not t.pre and t.instrs[-1].ref not in data]
    others = [t for t in triples if t.pre or t.instrs[-1].ref in data]
    for _ in range(len(g) + 1):
        others += [t for t in sources if t.instrs[-1].ref not in static and len(t.instrs) > 1]
        sources = [t for t in sources if t.instrs[-1].ref in static or len(t.instrs) == 1]
        if not sources:
            break
        by_prop: dict[Prop, list[Triple]] = defaultdict(list)
        for src in sources:
            for p in src.post:
                by_prop[p].append(src)
        elsewhere = {p for t in others for p in t.post}
        next_sources, next_others = [], []
        for t in others:
            sourceable = sorted((p for p in t.pre if p in by_prop), key=repr)
            if not sourceable:
                next_others.append(t)
                continue
            options: list[list[Triple | None]] = []
            for p in sourceable:
                opts: list[Triple | None] = list(by_prop[p])
                if len(g[p.ref].users) > 1 or p in elsewhere:
                    opts.append(None)
                options.append(opts)
            if math.prod(len(o) for o in options) > FUSE_LIMIT:
                # fusing every combination would multiply triples (static chains of embeddings of
                # position / token-type ids): keep the consumer and its sources apart, as plain
                # triples the search places -- the same programs, found by search
                next_others.append(t)
                kept.update((id(src), src) for opts in options for src in opts if src is not None)
                continue
            for choice in itertools.product(*options):
                fused, used, covered = t, set(), set()
                for src in choice:
                    if src is None or id(src) in used:
                        continue
                    if src.tokens & fused.tokens or src.post & covered:
                        break  # the same tensor sourced twice in one triple
                    if t.post <= src.post:
                        # nothing new (see the docstring). Unchecked, such chains grew every round:
                        # a tiny GPT reading its head weight's mean had 35k triples, not 1.3k
                        # (tests/test_source_fusion.py), DeBERTa 43k, not 26k
                        break
                    used.add(id(src))
                    covered |= src.post
                    fused = fused.fuse_after(src)
                else:
                    plain = fused.pre or fused.instrs[-1].ref in data
                    (next_others if plain else next_sources).append(fused)
        sources, others = next_sources, next_others
    out = others + [t for t in sources if DONE in t.post]
    present = {id(t) for t in out}
    return out + [t for k, t in kept.items() if k not in present]


def static_data(g: RefGraph) -> set[int]:
    """Buffers and the ops computed from them alone without gradient (position ids, rotary
    tables, causal masks): replicated on every rank (``_Builder._is_static_data``)."""
    data: set[int] = set()
    for n in g:
        if n.kind == BUFFER or (n.kind == OP and not n.requires_grad and all(o in data for o in n.operands)):
            data.add(n.index)
    return data


def _static_nodes(g: RefGraph) -> set[int]:
    """Nodes computed from parameters, buffers and constants only (no model input)."""
    static: set[int] = set()
    for n in g:
        if n.kind in (PARAM, BUFFER) or (n.kind == OP and all(o in static for o in n.operands)):
            static.add(n.index)
    return static


def _param_free_nodes(g: RefGraph) -> set[int]:
    """Nodes no parameter flows into: inputs, buffers, constants and what is computed from them."""
    free: set[int] = set()
    for n in g:
        if n.kind != PARAM and (n.kind != OP or all(o in free for o in n.operands)):
            free.add(n.index)
    return free


def _prune(triples: list[Triple]) -> list[Triple]:
    """Keep the triples that can fire (forward reachability from the empty program) and whose
    results lead to the loss (backward from ``Done``). One pass each reaches the fixpoint: every
    property a kept triple needs is needed, and its reachable producers are kept."""
    waiting: dict[Prop, list[int]] = defaultdict(list)
    missing = [len(t.pre) for t in triples]
    for k, t in enumerate(triples):
        for p in t.pre:
            waiting[p].append(k)
    fired = [False] * len(triples)
    produced: set[Prop] = set()
    queue = [k for k, n in enumerate(missing) if n == 0]
    while queue:
        k = queue.pop()
        if fired[k]:
            continue
        fired[k] = True
        for p in triples[k].post:
            if p not in produced:
                produced.add(p)
                for u in waiting[p]:
                    missing[u] -= 1
                    if missing[u] == 0:
                        queue.append(u)
    by_post: dict[Prop, list[int]] = defaultdict(list)
    for k, t in enumerate(triples):
        if fired[k]:
            for p in t.post:
                by_post[p].append(k)
    kept = [False] * len(triples)
    needed, stack = {DONE}, [DONE]
    while stack:
        p = stack.pop()
        for k in by_post[p]:
            if not kept[k]:
                kept[k] = True
                for q in triples[k].pre:
                    if q not in needed:
                        needed.add(q)
                        stack.append(q)
    return [t for k, t in enumerate(triples) if kept[k]]


def register_advice(target: Any, operands: Sequence[Sequence[int]], result: Sequence[int]) -> str:
    """The ``hapc.register_op`` lines the refusal of an op without a rule suggests, right for its
    tensor operands' shapes: the safe form (every dimension ``^``, never sharded: the op stays
    replicated, declared), and, where every operand broadcasts to the result, the elementwise form
    (valid only if the op *is* elementwise, which the shapes cannot tell: the user decides)."""
    name = _public_name(target)

    def label(j: int, k: int) -> str:  # a0 a1, b0 ... per operand; r0 r1 ... for the result
        return f"{chr(ord('a') + j)}{k}" if j < 17 else f"x{j}_{k}"

    safe = ", ".join(" ".join(f"{label(j, k)}^" for k in range(len(s))) for j, s in enumerate(operands))
    safe += " -> " + " ".join(f"r{k}^" for k in range(len(result)))
    count = f"{len(operands)} tensor operand{'s' if len(operands) != 1 else ''}"
    seen = ", ".join(str(tuple(s)) for s in operands)
    text = (
        f"Declare it with\n"
        f'    hapc.register_op({name}, "{safe.strip()}")\n'
        f"which keeps it replicated (every dimension marked ^ is never sharded) and is correct whatever the op "
        f"computes, for these ranks ({count}: {seen or 'none'} -> {tuple(result)}). "
    )

    def broadcasts(shape: Sequence[int]) -> bool:
        return len(shape) <= len(result) and all(
            a in (1, b) for a, b in zip(reversed(shape), reversed(result))
        )  # fmt: skip

    if operands and all(broadcasts(s) for s in operands):
        out = len(result)
        ew = ", ".join(" ".join(f"d{out - len(s) + k}" for k in range(len(s))) for s in operands)
        ew += " -> " + " ".join(f"d{k}" for k in range(out))
        text += (
            "If it is elementwise (each result element reads only the operand elements at its own "
            f"position, broadcasting), it may shard on every dimension:\n"
            f'    hapc.register_op({name}, "{ew.strip()}")\n'
        )
    return text + (
        "To let it shard otherwise, name a dimension the op treats independently (a batch dimension) alike in "
        "every operand that has it and in the result, without ^; a name missing from the result asserts the "
        "op sums over it (see `hapc rules` and the README)"
    )


def _public_name(target: Any) -> str:
    """How a user spells ``target``: ``torch.special.erfcx`` rather than its C name ``special_erfcx``."""
    import torch
    import torch.nn.functional

    if isinstance(target, str):
        return target
    if isinstance(target, torch.nn.Module):  # a leaf module: rules are registered for its class
        cls = type(target)
        if getattr(torch.nn, cls.__name__, None) is cls:
            return f"torch.nn.{cls.__name__}"
        return cls.__qualname__
    for prefix, mod in (
        ("F", torch.nn.functional),
        ("torch.special", torch.special),
        ("torch.linalg", torch.linalg),
        ("torch.fft", torch.fft),
        ("torch", torch),
    ):
        for name in dir(mod):
            if not name.startswith("_") and getattr(mod, name, None) is target:
                return f"{prefix}.{name}"
    return getattr(target, "__qualname__", None) or str(target)
