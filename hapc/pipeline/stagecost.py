"""Stage costs from the SPMD synthesizer (DESIGN §6 step 2; HARP §5.1's profiler, replaced).

HARP profiles every distinct (stage, sub-mesh) pair on the GPUs with an intra-op planner limited
to homogeneous meshes. hapc prices it with its own synthesizer instead: a stage on ``n`` devices of
a group runs the SPMD program A* + DP finds for those ``n`` devices (HAP §4-5), under the cost
model of :mod:`hapc.synth.cost` on a sub-cluster of ``n`` devices (one host if ``n`` fits in
one, else ``n / devices_per_host`` whole hosts).

**Approach.** The synthesizer's node-segmented DP (``segments="node"``) prices a program as the
sum of its segments, one computed node each, and solves a repeated block once. So the whole
model is synthesized *once per sub-mesh kind* and each segment's triples are priced by
:meth:`~hapc.synth.cost.CostModel.breakdown`; a layer's cost is the sum over its nodes, and a
stage's (a layer range) the sum over its layers -- prefix sums, so every (layer range, sub-mesh)
pair is costed once, in O(1), and equal layers get equal costs. Each layer's program is the one
the whole-model optimum chose at that point; a stage synthesized on its own may enter in a
better layout (its input arrives through the inter-stage relay anyway), so the decomposed cost
is an upper bound of the stage's own optimum that equals it away from stage boundaries.

Per layer and sub-mesh kind (per device; homogeneous sub-meshes have equal shards):

* ``fwd`` / ``bwd``: the forward / backward stages' time per micro-batch (collectives + the
  slowest device's compute, HAP §3.2);
* ``sync``: the bucketed all-reduce of replicated weights' gradients, paid once per step (the
  planner charges ``sync / B`` per micro-batch);
* ``mem_param``: parameter bytes x ``memory_factor`` (4 = weights, gradients and two Adam moments,
  all in the parameter dtype; the synthesizer's convention);
* ``mem_act``: activation bytes saved for the backward of one micro-batch (what each in-flight
  micro-batch of H-1F1B holds, HARP Eq. 18);
* ``keep``: bytes per device a recomputing stage keeps for this layer per in-flight micro-batch
  besides its input: a recomputed stage never runs a collective again
  (:mod:`hapc.pipeline.recompute`), so each forward collective's output is kept -- the whole
  tensor for an all-gather, all-reduce, broadcast or reduce, ``1/m`` of it for a reduce-scatter or
  all-to-all -- plus one value of the collective's ``1/m`` size crossing it (the sharded residual
  stream of a Megatron-SP block), an estimate; 0 for a program with no forward collective.

Sub-meshes mixing groups (HAP ratios inside a stage) are not planned yet: HARP's DP places a
stage in one group, and so does :mod:`hapc.pipeline.planner`.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np

from ..cluster import Cluster, Group
from ..errors import HapcError
from ..synth.cost import CostModel, _launches
from ..synth.synthesizer import (
    _SCOPED_DEADLINE,
    SynthResult,
    SynthSpace,
    fallback_program,
    least_sharded_extents,
    replicated_triples,
    synthesize_program,
)
from ..theory.cost import PRIMITIVES, Comm
from ..theory.instructions import Compute
from ..theory.triples import Theory
from .layers import Layer

#: price a one-device sub-mesh by its all-replicated program, without a search (see layer_costs)
ONE_DEVICE_SHORTCUT = True
#: search the data-parallel incumbent in stage costs without a deadline too (see layer_costs)
INCUMBENT = False
#: processes that synthesize sub-mesh kinds side by side (:meth:`StageCoster.prefetch`, and the
#: planner's look-ahead process, :class:`Ahead`); 1: this one alone. The ``hapc`` command sets it to
#: 2 where the host has 2 cores or more (a fresh, short-lived process, where forking is safe);
#: library calls and tests keep 1.
WORKERS = 1
_FIELDS = ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep")
_LOWER_SCALARS = ("ref", "layer", "flops_c", "flops_r", "bytes_c", "bytes_r", "launches", "grad", "param_c",
                  "param_r", "act_c", "act_r")  # fmt: skip


def _kept_bytes(comm: Comm, m: int) -> float:
    """Bytes per device a recomputing stage keeps for one forward collective (see ``keep`` above)."""
    out = comm.nbytes / m if comm.primitive in ("reduce_scatter", "all_to_all") else comm.nbytes
    return out + comm.nbytes / m


def submesh_sizes(group: Group) -> list[int]:
    """Sub-mesh sizes of a group (Alpa / HARP §5.2.2): 1, 2, 4, .. up to a host, then whole hosts."""
    dph = min(group.devices_per_host, group.devices)
    sizes, n = [], 1
    while n < dph:
        sizes.append(n)
        n *= 2
    sizes.append(dph)
    sizes += [k * dph for k in range(2, group.devices // dph + 1)]
    return sorted(set(sizes))


def sub_cluster(cluster: Cluster, group: str, size: int) -> Cluster:
    """``size`` devices of ``group`` as a cluster of their own (one host, or whole hosts)."""
    g = next((x for x in cluster.groups if x.name == group), None)
    if g is None:
        raise HapcError(f"unknown group {group!r} (groups: {', '.join(x.name for x in cluster.groups)})")
    if not 1 <= size <= g.devices:
        raise HapcError(f"group {group!r} has {g.devices} devices, cannot form a sub-mesh of {size}")
    dph = min(g.devices_per_host, size)
    if size > dph and size % dph:
        raise HapcError(f"a sub-mesh of {size} devices spanning hosts of {dph} must take whole hosts")
    sub = dataclasses.replace(g, devices=size, devices_per_host=dph)
    return dataclasses.replace(
        cluster, name=f"{cluster.name}[{group}x{size}]", groups=(sub,), between=(), collectives=()
    )


def model_key(model: CostModel) -> tuple:
    """Every number :class:`~hapc.synth.cost.CostModel` prices a program with: device counts,
    per-type compute (inverse flop/s, inverse memory bandwidth, per-op overhead, a virtual
    device's inner all-reduce), memory, the alpha-beta of each collective primitive, the memory
    factor, the bucket size and the memory price. Two sub-meshes with equal keys give every triple
    the same times and memory, so the same segment space (it depends on the device count only)
    yields the same synthesized program and per-layer costs (the synthesis is deterministic): the
    stage-cost cache is keyed by this, not by a group's name or its devices per host, which reach
    the model only through the bottleneck link (one host: the intra-host link, else the
    inter-host link; :meth:`hapc.cluster.Cluster.bottleneck`)."""
    ab = tuple(sorted((p, a.alpha, a.beta) for p, a in model.ab.items()))
    memory = tuple(t.memory for t in model.types)
    return (
        model.counts, model.inv_flops, model.inv_mbw, model.op_time, model.inner, memory, ab,
        model.memory_factor, model.bucket_bytes, model.memory_price,
    )  # fmt: skip


@dataclasses.dataclass
class LayerCosts:
    """Per-layer costs of one sub-mesh kind (arrays over the layer list)."""

    fwd: np.ndarray
    bwd: np.ndarray
    sync: np.ndarray
    mem_param: np.ndarray
    mem_act: np.ndarray
    program_time: float  # the synthesized whole-model program's time (fwd + bwd + sync)
    keep: np.ndarray | None = None  # bytes kept per in-flight micro-batch when recomputed (collective outputs)


class StageCoster:
    """Costs of layer ranges on sub-meshes, memoised per sub-mesh kind: ``(group, size)`` up to
    what its cost model prices with (:func:`model_key`).

    The theory's segment space is shared by every sub-mesh size with the same shardable triples
    (it depends on nothing else), so a 146-layer GPT-39B is segmented once, not once per size.
    """

    def __init__(
        self,
        theory: Theory,
        layers: Sequence[Layer],
        cluster: Cluster,
        *,
        memory_factor: float = 4.0,
        cache: dict | None = None,
        baseline: str | None = None,
    ):
        """``cache``: a dict shared by costers of the same theory, layers and memory factor on
        clusters that differ only in how devices are cut into groups and hosts (the replicas of
        :mod:`hapc.pipeline.replicas`): segment spaces and per-sub-mesh costs are computed once.
        ``baseline``: restrict each stage's program to a baseline's triples on its sub-mesh
        (:func:`hapc.synth.baselines.restrict`; ``"tp"``: Megatron tensor parallelism, for the
        Megatron-3D baseline), even ratios as always on a homogeneous sub-mesh."""
        if cluster.virtual != "gpu":
            raise HapcError("pipeline planning needs virtual = 'gpu' clusters (one device per rank)")
        self.theory, self.layers, self.cluster = theory, list(layers), cluster
        self.memory_factor = memory_factor
        self._layer_of: dict[int, int] = {x: layer.index for layer in self.layers for x in layer.nodes}
        shared = cache if cache is not None else {}
        owner = (id(theory), len(self.layers), memory_factor, baseline)
        self.baseline = baseline
        if shared.setdefault("owner", owner) != owner:
            raise HapcError(
                "a stage-cost cache is shared only by costers of one theory, layer list, memory factor and baseline"
            )
        self._spaces: dict[frozenset, SynthSpace] = shared.setdefault("spaces", {})
        # keyed by what the sub-mesh's cost model prices with (:func:`model_key`), not by its name
        self._costs: dict[tuple, LayerCosts] = shared.setdefault("costs", {})
        self._shared = shared
        self.syntheses = 0

    @property
    def _atoms(self) -> np.ndarray | None:
        return self._shared.get("atoms")

    @_atoms.setter
    def _atoms(self, value: np.ndarray) -> None:
        self._shared["atoms"] = value

    def shardable(self, m: int) -> frozenset[int]:
        """:func:`~hapc.synth.synthesizer.shardable_triples` for ``m`` devices, from one pass that
        records each triple's smallest sharded extent (a triple is allowed while ``m`` <= it)."""
        if self._atoms is None:
            self._atoms = np.array(least_sharded_extents(self.theory), dtype=float)
        return frozenset(np.flatnonzero(self._atoms >= m).tolist())

    def _space(self, m: int) -> SynthSpace:
        # one device: every layout costs the same and the replicated program is in every space,
        # so the two-device space (a subset) finds the same optimum without a segmentation of its own
        allowed = self.shardable(max(m, 2))
        if self.baseline is not None and m > 1:
            from ..synth.baselines import restrict

            allowed = allowed & frozenset(restrict(self.theory, self.baseline, m))
        if allowed not in self._spaces:
            self._spaces[allowed] = SynthSpace(self.theory, m, "node", set(allowed))
        return self._spaces[allowed]

    def _split(self, space: SynthSpace, result: SynthResult, model: CostModel, ratios: tuple) -> dict[str, np.ndarray]:
        """Per-layer costs of ``result`` (a program of ``space``): each segment's triples priced by
        :meth:`~hapc.synth.cost.CostModel.breakdown` and added to its layer."""
        L = len(self.layers)
        out = {k: np.zeros(L) for k in ("fwd", "bwd", "sync", "mem_param", "mem_act", "keep")}
        th = self.theory.triples
        # segments of equal signature have the same triples, costs included, position by position
        # (SynthSpace._signature): a part is priced once per (signature, positions) -- once for
        # every repeated layer, not once per layer -- with the same floats
        # (a triple from outside the segment -- an incumbent of a restricted space -- keys it as it is)
        positions = space.__dict__.get("_positions")
        if positions is None:
            positions = [{t: k for k, t in enumerate(sg.triples)} for sg in space.segments]
            space.__dict__["_positions"] = positions
        memo: dict[tuple, tuple[float, ...]] = {}
        for seg, part in zip(space.segments, result.parts):
            li = self._layer_of.get(seg.anchors[0])
            if li is None:
                raise HapcError(f"node {seg.anchors[0]} is in no layer; build layers from the same graph")
            at = positions[seg.index]
            rel = tuple([at.get(k, -1) for k in part])
            key_p = (seg.signature, rel) if -1 not in rel else (-1, tuple(part))
            if key_p not in memo:
                costs = [th[k].cost for k in part]
                f = b = s = 0.0
                for st in model.breakdown(costs, ratios).stages:
                    if st.direction == "forward":
                        f += st.time
                    elif st.direction == "backward":
                        b += st.time
                    else:
                        s += st.comm
                r = ratios[0]
                mp = sum(c.param_bytes.at(r) for c in costs) * self.memory_factor
                ma = sum(c.act_bytes.at(r) for c in costs)
                kept = sum(_kept_bytes(x, model.m) for c in costs for x in c.fwd_comm) if model.m > 1 else 0.0
                memo[key_p] = (f, b, s, mp, ma, kept)
            f, b, s, mp, ma, kept = memo[key_p]
            out["keep"][li] += kept
            out["fwd"][li] += f
            out["bwd"][li] += b
            out["sync"][li] += s
            out["mem_param"][li] += mp
            out["mem_act"][li] += ma
        return out

    def _model(self, group: str, size: int) -> CostModel:
        return CostModel(
            sub_cluster(self.cluster, group, size),
            memory_factor=self.memory_factor,
            precision=getattr(self.theory, "precision", None),  # autocast: the groups' half-precision rates
        )

    def prefetch(self, kinds: Sequence[tuple[str, int]]) -> None:
        """Synthesize the sub-mesh kinds ``(group, size)`` not priced yet in :data:`WORKERS` (2)
        processes: every second one in a forked child, which sends its :class:`LayerCosts` back as
        ``.npz`` bytes through a pipe, the others here. Each synthesis is a function of its space and
        cost model alone, so the costs are bit for bit those of :meth:`layer_costs` in one process;
        a child that fails leaves its kinds to :meth:`layer_costs`. One-device kinds (no search)
        stay here. Nothing happens with ``WORKERS < 2`` or fewer than two kinds to synthesize."""
        if self._shared.get("ahead") is not None:
            # a look-ahead process synthesizes the kinds front to back (Ahead): this one takes them
            # back to front, and waits only for a kind that process has begun
            for group, size in reversed(list(kinds)):
                self.layer_costs(group, size)
            return
        todo, keys = [], set()
        for group, size in kinds:
            model = self._model(group, size)
            key = model_key(model)
            if key in self._costs or key in keys or (model.m == 1 and ONE_DEVICE_SHORTCUT):
                continue
            keys.add(key)
            todo.append((group, size, key))
        if WORKERS < 2 or len(todo) < 2 or not hasattr(os, "fork"):
            return
        theirs = todo[1::2]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its kinds, as arrays, then exit without the parent's teardown
            code = 1
            try:
                os.close(read)
                buf = io.BytesIO()
                arrays = {}
                for k, (group, size, _) in enumerate(theirs):
                    lc = self.layer_costs(group, size)
                    arrays |= {f"{k}_{f}": getattr(lc, f) for f in _FIELDS}
                    arrays[f"{k}_program_time"] = np.array(lc.program_time)
                np.savez(buf, **arrays)
                with os.fdopen(write, "wb") as f:
                    f.write(buf.getvalue())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        for group, size, _ in todo[0::2]:
            self.layer_costs(group, size)
        with os.fdopen(read, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            return  # layer_costs synthesizes them here when asked
        got = np.load(io.BytesIO(data))
        for k, (_, _, key) in enumerate(theirs):
            fields = {f: got[f"{k}_{f}"] for f in _FIELDS}
            self._costs[key] = LayerCosts(**fields, program_time=float(got[f"{k}_program_time"]))
            self.syntheses += 1

    def layer_costs(self, group: str, size: int) -> LayerCosts:
        """Synthesize the model on ``size`` devices of ``group`` (once per :func:`model_key`) and split
        it by layer. Sub-meshes whose cost models price alike share one synthesis: e.g. 8 devices
        over 2 hosts of 4 and over 4 hosts of 2 (both rings cross the inter-host link), or equal
        device types in two groups."""
        model = self._model(group, size)
        key = model_key(model)
        if key in self._costs:
            return self._costs[key]
        ahead = self._shared.get("ahead")
        if ahead is not None and not ahead.claim(key):  # the look-ahead process's: its result
            got = ahead.take(key)
            if got is not None:
                self._costs[key] = got
                self.syntheses += 1
                return got
        space = self._space(model.m)
        ratios = model.even_ratios()
        result = None
        if model.m == 1 and ONE_DEVICE_SHORTCUT:
            # one device: the all-replicated program is optimal (no collective, each op once at full
            # size, nothing a layout could save), so price it without a search; its segments are the
            # restricted space's (the same nodes). tests/test_stagecost_one_device.py pins this equal,
            # bit for bit, to the synthesized optimum's layer costs.
            result = fallback_program(space, model, ratios)
            if result is not None:
                space = space.restricted(space.allowed & replicated_triples(self.theory))
        if result is None:
            # without a deadline the data-parallel incumbent only bounds the exact passes (the
            # optimum is theirs either way) and, on these whole-model sub-mesh syntheses, costs more
            # than it saves (ViT-24 on hap-testbed: 120 syntheses, 210 s with it, 176 s without, the
            # same programs); under a time limit it bounds what the deadline returns, so it stays
            incumbent = INCUMBENT or _SCOPED_DEADLINE.get() is not None
            result = synthesize_program(space, model, ratios, incumbent=incumbent)
        self.syntheses += 1  # sub-mesh kinds priced
        out = self._split(space, result, model, ratios)
        lc = LayerCosts(**out, program_time=result.cost)
        self._costs[key] = lc
        return lc

    # -- lower bounds without a synthesis ---------------------------------------------------------
    def _lower_terms(self) -> dict[str, np.ndarray]:
        """Per *defining* triple (one whose last instruction computes a segment anchor of a layer:
        the node segmentation's one computed node per segment), the ratio-linear coefficients of
        its :meth:`~hapc.synth.cost.CostModel.triple_time` summed over both directions: per
        collective primitive the latency counts and byte totals, flops, memory bytes, operator
        launches, a virtual device's parameters, gradient bytes, parameter and activation bytes.
        Extracted once per theory (shared by the costers of one cache)."""
        terms = self._shared.get("lower_terms")
        if terms is not None:
            return terms
        from ..synth.segments import source_like
        from ..theory.graph import OP
        from ..theory.triples import static_data

        th = self.theory
        g = th.graph
        sources = source_like(g) - static_data(g)
        anchors = {n.index for n in g if n.kind == OP and n.index not in sources}
        prims = {p: i for i, p in enumerate(PRIMITIVES)}
        rows: list[int] = []
        cols: dict[str, list] = {k: [] for k in _LOWER_SCALARS}
        comm = {k: [] for k in ("a_one", "a_each", "b_max", "b_rest")}
        none = [0.0] * len(PRIMITIVES)  # (np.array copies it: one shared list for the triples without a collective)
        wanted = anchors & self._layer_of.keys()
        for k, t in enumerate(th.triples):
            last = t.instrs[-1]
            if type(last) is not Compute or last.ref not in wanted:
                continue
            c = t.cost
            if c.fwd_comm or c.bwd_comm:
                vec = {key: [0.0] * len(PRIMITIVES) for key in comm}
                for x in (*c.fwd_comm, *c.bwd_comm):
                    i = prims[x.primitive]
                    vec["a_each" if x.scaling == "each" else "a_one"][i] += 1.0
                    vec["b_max" if x.scaling == "max" else "b_rest"][i] += x.nbytes
                for key in comm:
                    comm[key].append(vec[key])
            else:
                for key in comm:
                    comm[key].append(none)
            cols["ref"].append(last.ref)
            cols["layer"].append(self._layer_of[last.ref])
            cols["flops_c"].append(c.fwd_flops.const + c.bwd_flops.const)
            cols["flops_r"].append(c.fwd_flops.per_ratio + c.bwd_flops.per_ratio)
            cols["bytes_c"].append(c.fwd_bytes.const + c.bwd_bytes.const)
            cols["bytes_r"].append(c.fwd_bytes.per_ratio + c.bwd_bytes.per_ratio)
            cols["launches"].append(_launches(c.fwd_flops, c.fwd_bytes) + _launches(c.bwd_flops, c.bwd_bytes))
            cols["grad"].append(sum(x.nbytes for x in c.grad_comm))
            cols["param_c"].append(c.param_bytes.const)
            cols["param_r"].append(c.param_bytes.per_ratio)
            cols["act_c"].append(c.act_bytes.const)
            cols["act_r"].append(c.act_bytes.per_ratio)
            rows.append(k)
        terms = {key: np.array(v, dtype=float) for key, v in cols.items()}
        terms |= {key: np.array(v, dtype=float).reshape(len(rows), len(PRIMITIVES)) for key, v in comm.items()}
        order = np.argsort(terms["ref"], kind="stable")
        terms = {key: v[order] for key, v in terms.items()}
        terms["triple"] = np.array(rows, dtype=np.int64)[order]
        refs = terms["ref"]
        terms["starts"] = np.flatnonzero(np.r_[True, refs[1:] != refs[:-1]]) if len(refs) else np.zeros(0, np.int64)
        self.shardable(2)  # the atoms below
        terms["atoms"] = np.asarray(self._atoms)[terms["triple"]] if len(refs) else np.zeros(0)
        self._shared["lower_terms"] = terms
        return terms

    def lower_costs(self, group: str, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per defining triple (:meth:`_lower_terms`) on ``size`` devices of ``group``, at the even
        ratios ``r = 1/m`` of :meth:`layer_costs`, without a synthesis: ``(w, g, p)`` with

        * ``w = fwd_comm + fwd_comp + bwd_comm + bwd_comp`` (:meth:`CostModel.triple_time`'s terms:
          ``alpha + beta nbytes r`` for a padded collective, ``m alpha + beta nbytes`` for a grouped
          one, ``alpha + beta nbytes`` else, none on one device; ``flops / F + bytes / bw +
          op_overhead`` per launch, plus a virtual device's inner all-reduce), ``inf`` for a triple
          the sub-mesh's space does not allow (a sharded extent below ``max(m, 2)``);
        * ``g``: its bucketed gradient all-reduce (plus the memory price, 0 unless set);
        * ``p``: its parameter bytes per device (what a replica's all-reduce sends).

        Why they bound :meth:`layer_costs`: on a homogeneous sub-mesh every stage's ``max_j comp_j``
        is its one type's ``comp``, so a segment's ``fwd + bwd`` (:meth:`_split`) is the sum of its
        triples' ``w`` and its ``sync`` the sum of their ``g``; every term is non-negative, and each
        segment (one computed node) holds the triple computing its node, whose ``w``, ``g`` and ``p``
        are at least the least over the node's allowed defining triples. Memoised per
        :func:`model_key`."""
        model = self._model(group, size)
        key = ("lower", model_key(model))
        hit = self._shared.get(key)
        if hit is not None:
            return hit
        tm = self._lower_terms()
        n = len(tm["triple"])
        if len(model.types) != 1 or not n:  # not a homogeneous sub-mesh: 0 bounds everything
            out = (np.zeros(n), np.zeros(n), np.zeros(n))
            self._shared[key] = out
            return out
        m = model.m
        r = model.even_ratios()[0]
        if m > 1:
            alpha = np.array([model.ab[p].alpha for p in PRIMITIVES])
            beta = np.array([model.ab[p].beta for p in PRIMITIVES])
            comm = (tm["a_one"] + m * tm["a_each"]) @ alpha + (tm["b_max"] * r + tm["b_rest"]) @ beta
            ar = model.ab["all_reduce"]
            grad = tm["grad"] * (ar.beta + ar.alpha / model.bucket_bytes)
        else:
            comm = grad = np.zeros(n)
        comp = (
            (tm["flops_c"] + tm["flops_r"] * r) * model.inv_flops[0]
            + (tm["bytes_c"] + tm["bytes_r"] * r) * model.inv_mbw[0]
            + tm["launches"] * model.op_time[0]
        )
        params = tm["param_c"] + tm["param_r"] * r
        if model.inner[0]:
            comp = comp + params * model.inner[0]
        if model.memory_price:
            mem = params * model.memory_factor + tm["act_c"] + tm["act_r"] * r
            grad = grad + model.memory_price * mem / model.types[0].memory
        w = np.where(tm["atoms"] >= max(m, 2), comm + comp, np.inf)
        out = (w, grad, params)
        self._shared[key] = out
        return out

    def lower_per_micro(self, group: str, size: int, num_micro: int, per_byte: float = 0.0) -> np.ndarray:
        """A lower bound, per layer, of :meth:`layer_costs`' ``fwd + bwd + (sync + extra) / B``
        (what :class:`~hapc.pipeline.dp.PipelineDP` charges per micro-batch) without a synthesis:
        per computed node the least ``w + (g + p per_byte) / B`` over its defining triples
        (:meth:`lower_costs`), summed over the layer's nodes. ``per_byte``: seconds per parameter
        byte of the all-reduce across data-parallel replicas (``extra`` of
        :func:`~hapc.pipeline.plan_pipeline`; 0 without replicas). A kind synthesized already (for
        another candidate of the same theory) gives its synthesized charge instead: still a lower
        bound (it is the charge), and a tighter one."""
        lc = self._costs.get(model_key(self._model(group, size)))
        if lc is not None:  # synthesized already (by another candidate): the charge itself, as the DP adds it
            return lc.fwd + lc.bwd + (lc.sync + lc.mem_param / self.memory_factor * per_byte) / num_micro
        tm = self._lower_terms()
        out = np.zeros(len(self.layers))
        if not len(tm["triple"]):
            return out
        w, g, p = self.lower_costs(group, size)
        v = w + (g + p * per_byte) / num_micro
        least = np.minimum.reduceat(v, tm["starts"])
        least = np.where(np.isfinite(least), least, 0.0)  # no allowed defining triple: bound 0
        return np.bincount(tm["layer"][tm["starts"]].astype(np.int64), weights=least, minlength=len(self.layers))

    def stage(self, lo: int, hi: int, group: str, size: int) -> dict[str, float]:
        """Time and memory of layers ``lo..hi-1`` on ``size`` devices of ``group``."""
        lc = self.layer_costs(group, size)
        return {k: float(getattr(lc, k)[lo:hi].sum()) for k in ("fwd", "bwd", "sync", "mem_param", "mem_act")}


def _pack(lc: LayerCosts) -> bytes:
    """``lc`` as ``.npz`` bytes (what a forked process sends back through a pipe)."""
    buf = io.BytesIO()
    np.savez(buf, **{f: getattr(lc, f) for f in _FIELDS}, program_time=np.array(lc.program_time))
    return buf.getvalue()


def _unpack(data: bytes) -> LayerCosts:
    got = np.load(io.BytesIO(data))
    return LayerCosts(**{f: got[f] for f in _FIELDS}, program_time=float(got["program_time"]))


class Ahead:
    """Sub-mesh kinds synthesized ahead of need by one forked process (:data:`WORKERS` >= 2).

    ``kinds``: ``(cluster, group, size)`` in the order the planner will price them (its candidates'
    kinds, candidate by candidate). The process synthesizes them front to back -- each with
    :meth:`StageCoster.layer_costs` of the cluster it comes from, on its own copy of ``cache`` -- and
    sends each :class:`LayerCosts` back as it finishes; it runs on while this process runs the
    pipeline DP, bounds a candidate or waits, which is where the second core idled with
    :meth:`StageCoster.prefetch` alone. A kind is taken by one process only: each claims it in a
    shared flag under a lock before synthesizing it (:meth:`claim`), and this one waits only for a
    kind the other has claimed (:meth:`take`). Results wait here until :meth:`StageCoster.layer_costs`
    asks for them, so the costs a candidate's synthesis-free bound sees
    (:meth:`StageCoster.lower_per_micro`) are those of one process, and kinds synthesized for a
    candidate that is then pruned are never seen at all. Each synthesis is a function of its space
    and cost model alone (as :meth:`StageCoster.prefetch` relies on), so every cost is bit for bit
    that of one process. Kinds of one device (no search) and kinds priced already are left out.
    :meth:`close` ends the process (its unfinished speculation is dropped)."""

    def __init__(
        self,
        theory: Theory,
        layers: Sequence[Layer],
        kinds: Sequence[tuple[Cluster, str, int]],
        cache: dict,
        *,
        memory_factor: float = 4.0,
        baseline: str | None = None,
    ):
        import multiprocessing

        self.items: list[tuple[Cluster, str, int]] = []
        self.index: dict[tuple, int] = {}
        costs = cache.get("costs", {})
        for sub, group, size in kinds:
            coster = StageCoster(theory, layers, sub, memory_factor=memory_factor, cache=cache, baseline=baseline)
            model = coster._model(group, size)
            key = model_key(model)
            if key in self.index or key in costs or (model.m == 1 and ONE_DEVICE_SHORTCUT):
                continue
            self.index[key] = len(self.items)
            self.items.append((sub, group, size))
        self.got: dict[int, LayerCosts] = {}
        self.pid = 0
        if not self.items:
            return
        self.flags = mmap.mmap(-1, len(self.items))  # 0: free, 1: the other process's, 2: this one's
        self.lock = multiprocessing.get_context("fork").Lock()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the look-ahead process: its kinds, then exit without the parent's teardown
            code = 1
            try:
                os.close(read)
                cache.pop("ahead", None)  # its own copy: synthesize, never wait
                with os.fdopen(write, "wb") as out:
                    for i, (sub, group, size) in enumerate(self.items):
                        with self.lock:
                            if self.flags[i]:
                                continue
                            self.flags[i] = 1
                        coster = StageCoster(
                            theory, layers, sub, memory_factor=memory_factor, cache=cache, baseline=baseline
                        )
                        data = _pack(coster.layer_costs(group, size))
                        out.write(struct.pack("<qq", i, len(data)) + data)
                        out.flush()
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self.pid = pid
        self.reader = os.fdopen(read, "rb")

    def claim(self, key: tuple) -> bool:
        """Whether the kind of ``key`` is this process's to synthesize (it claims it where nobody
        has); False: the look-ahead process has claimed it (:meth:`take` waits for it)."""
        i = self.index.get(key)
        if i is None or not self.pid:
            return True
        if not self.lock.acquire(timeout=60):  # (held for a flag's test only: the other process is gone)
            self.close()
            return True
        try:
            if self.flags[i] == 0:
                self.flags[i] = 2
            return self.flags[i] == 2
        finally:
            self.lock.release()

    def take(self, key: tuple) -> LayerCosts | None:
        """The look-ahead process's costs of ``key``, waiting for them; None where that process
        ended without them (the caller synthesizes the kind itself)."""
        i = self.index[key]
        while i not in self.got and self.pid:
            head = self.reader.read(16)
            if len(head) < 16:
                self.close()
                break
            j, n = struct.unpack("<qq", head)
            data = self.reader.read(n)
            if len(data) < n:
                self.close()
                break
            self.got[j] = _unpack(data)
        return self.got.pop(i, None)

    def close(self) -> None:
        """End the look-ahead process (whatever it is synthesizing is not needed)."""
        if not self.pid:
            return
        pid, self.pid = self.pid, 0
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        self.reader.close()
