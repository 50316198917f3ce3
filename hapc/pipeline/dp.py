"""The HARP inter-op DP (HARP §5.2.2-5.2.4, Eq. 12-19), exact for its cost oracle.

A plan cuts the layer sequence ``l_0 .. l_{L-1}`` into stages ``s_1 .. s_S`` (contiguous, in order)
and places stage ``s`` on a sub-mesh of one device group; the groups are taken in a fixed order
and every device is used, so sub-meshes tile the ordered device list ``0 .. D-1``. With ``t_s``
the stage's time per micro-batch and ``c_s`` the one-way transfer to the next stage, HARP Eq. 12:

    T = Σ_s (t_s + 2 c_s) + (B - 1) · t_max,        t_max >= max_s t_s.

For a fixed ``t_max`` (Eq. 13-19) the first term is minimised by a DP over suffixes. State
``(i, p, b)``: layers ``i..L-1`` on devices ``p..D-1`` whose first stage runs at most ``b``
warm-up forwards (``b = ∞``: any). Transition: a first stage ``l_i..l_j`` on ``n`` devices starting at
``p`` with ``t <= t_max`` and ``c <= t_max`` (the H-1F1B condition), then the suffix
``(j+1, p+n)``. H-1F1B (Eq. 1-2, 17): the stage's warm-up is ``N = N' + δ(c, t_max)`` with ``N'``
the suffix's, and Eq. 18 requires ``mem_p + min(N, B)·mem_a <= mem_device``, i.e. ``N <= Nmax``
for the stage; so the suffix is looked up with bound ``min(b, Nmax) - δ``. Keeping ``b`` in the
state makes the memory constraint exact (HARP keeps one ``N`` per state, taken from the optimal
substructure, which can miss a feasible plan); ``b`` only ranges up to the largest finite
``Nmax`` any candidate has, bounds beyond that being unconstrained.

**Activation recomputation** (HARP fn. 2; Korthikanti et al. 2023's "full" level) is a per-stage
choice. A stage ``l_i..l_j`` that recomputes keeps, per in-flight micro-batch, only its input (the
activation entering it, ``in_i = out_bytes[i-1]``, ``0`` for the first stage whose inputs are the
batch, plus ``keep`` of its layers: what its program's collectives output, which are not run
again) and, during one micro-batch's backward, that micro-batch's full activations; its backward
runs the forward again. So its row has

    t_r = t + Σ fwd,        Eq. 18 as   mem_p + N·(in_i + Σ keep) + mem_a <= mem_device,

i.e. ``Nmax_r = floor((mem_device - mem_p - mem_a) / (in_i + Σ keep))``. It is one more candidate row of the
index (same layers, sub-mesh and link): the DP takes the cheaper feasible row as for any other
choice, so it stays exact. ``recompute="auto"`` adds the row only where it raises ``Nmax`` (a row
with more time and no more memory headroom is dominated in every state), ``"always"`` uses only
recomputing rows, ``"never"`` none. ``CostTable.recomputable`` (per option and layer) says where
recomputation may be planned at all: the planner leaves out layers whose program communicates in
its forward (recomputed collectives are not run; see :mod:`hapc.pipeline.recompute`).

``t_max`` is enumerated over the candidate stage times and the link thresholds where ``δ``
changes (``c``, ``2c``, ``c/ε``: raising ``t_max`` there can buy memory), with HARP's
bidirectional pruning (§5.2.4): binary search for the smallest feasible ``t_S``, no candidate above
``T(t_S)/B`` (since ``T(t) >= B·t``); then downwards, each solution at ``t`` whose stages peak at
``t' < t`` and stay feasible at ``t'`` is worth ``F(t) + (B-1)t'`` and every candidate in ``(t', t]``
is dominated, so the search jumps below ``t'``. The *sparse candidate index* is built once:
per first layer, every (sub-mesh, last layer) whose parameters and one micro-batch fit
(memory only grows with ``j``, so a prefix); each ``t_max`` filters it with vector compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

INF = math.inf
#: end the downward walk over ``t_max`` (:meth:`PipelineDP.solve`) once ``F(t) + (B - 1) t_lo``
#: reaches the best value found (exact; False: walk down to ``t_S`` as before), with ``t_lo`` the
#: least of ``t_S`` and :meth:`PipelineDP.lower_bound`, less :data:`ROUNDING`. ``F`` only grows as
#: ``t_max`` falls -- the plans feasible at ``t' < t`` are a subset of those at ``t`` (``t_s, c <= t'``
#: implies ``<= t``, and ``δ(c, t) <= δ(c, t')`` so warm-ups, hence memory, are no larger), and each
#: plan's ``Σ (t_s + 2 c_s)`` is summed in the same order whatever ``t_max`` is, so the float minimum
#: over the subset is no smaller -- and a plan's own ``t_max`` (:meth:`PipelineDP.own_t_max`) is at
#: least its slowest stage and link, so at least ``t_lo``: every value below ``t`` is
#: ``>= F(t) + (B - 1) t_lo``. A tie never replaced the best found (``value < best``), so the
#: solution is the one the whole walk returns.
STOP_WALK = True


@dataclass(frozen=True)
class Option:
    """A kind of sub-mesh: ``size`` devices of group ``group`` (index in the plan's order)."""

    group: int
    size: int


@dataclass
class CostTable:
    """Per-layer costs on each sub-mesh kind (rows follow ``options``); the DP's oracle.

    ``fwd``/``bwd``: seconds per micro-batch; ``sync``: the stage's once-per-step gradient
    synchronisation (charged as ``sync / B`` per micro-batch); ``mem_param``: bytes per device for
    parameters, gradients and optimizer state; ``mem_act``: bytes per device saved for backward per
    in-flight micro-batch; ``out_bytes[j]``: bytes crossing the cut after layer ``j`` (a recomputing
    stage starting at ``j + 1`` keeps them per in-flight micro-batch); ``recomputable``: where a
    stage may recompute (all its layers ``True``; ``None``: everywhere); ``keep``: bytes per device a
    recomputing stage keeps per in-flight micro-batch for each layer besides its input (``None``: 0)."""

    options: list[Option]
    fwd: np.ndarray
    bwd: np.ndarray
    sync: np.ndarray
    mem_param: np.ndarray
    mem_act: np.ndarray
    out_bytes: np.ndarray
    recomputable: np.ndarray | None = None
    keep: np.ndarray | None = None

    def in_bytes(self) -> np.ndarray:
        """Bytes a recomputing stage starting at layer ``i`` keeps per in-flight micro-batch."""
        return np.concatenate([[0.0], np.asarray(self.out_bytes[:-1], dtype=float)])

    @property
    def num_layers(self) -> int:
        return int(self.fwd.shape[1])


@dataclass(frozen=True)
class GroupSpec:
    """An ordered device group as the DP sees it."""

    name: str
    devices: int
    devices_per_host: int
    memory: float
    flops: float


@dataclass(frozen=True)
class Links:
    """``(bandwidth bytes/s, latency s)`` inside a host, between hosts of a group, and between
    consecutive groups (``between[k]``: group ``k`` to ``k+1``)."""

    intra_host: tuple[float, float]
    inter_host: tuple[float, float]
    between: tuple[tuple[float, float], ...]


@dataclass
class StageChoice:
    lo: int
    hi: int  # half-open layer range
    option: int
    start: int  # first device, global position in the ordered device list
    time: float
    comm: float  # one-way transfer to the next stage (0 for the last)
    link: str
    nmax: float  # most in-flight micro-batches memory allows (inf: unconstrained)
    recompute: bool = False  # the stage recomputes its activations in backward (time includes it)


@dataclass
class Solution:
    stages: list[StageChoice]
    t_max: float
    value: float  # Eq. 12 with t_max
    warmups: list[int]
    dp_runs: int
    candidates: int


def delta(c: np.ndarray | float, t_max: float, epsilon: float) -> np.ndarray:
    """HARP Eq. 2, vectorised (``c = 0`` -> 1, as :func:`hapc.pipeline.schedule.h1f1b_delta`)."""
    c = np.asarray(c, dtype=float)
    return np.where(c <= epsilon * t_max, 1, np.where(c <= t_max / 2, 2, 3))


#: the recomputation choices of :class:`PipelineDP`
RECOMPUTE = ("auto", "never", "always")


class PipelineDP:
    """The search for one cost table, device order, link set and micro-batch count."""

    def __init__(
        self,
        table: CostTable,
        groups: list[GroupSpec],
        links: Links,
        num_micro: int,
        epsilon: float,
        recompute: str = "auto",
    ):
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
        self.recompute = recompute
        self.table, self.groups, self.links = table, groups, links
        self.B, self.eps = int(num_micro), float(epsilon)
        L = self.L = table.num_layers
        self.offsets = np.cumsum([0] + [g.devices for g in groups]).tolist()
        D = self.D = self.offsets[-1]
        z = np.zeros((len(table.options), 1))
        self.per_mb = table.fwd + table.bwd + table.sync / self.B
        self.Pt = np.hstack([z, np.cumsum(self.per_mb, axis=1)])
        self.Pp = np.hstack([z, np.cumsum(table.mem_param, axis=1)])
        self.Pa = np.hstack([z, np.cumsum(table.mem_act, axis=1)])
        self.Pf = np.hstack([z, np.cumsum(table.fwd, axis=1)])
        bad = np.zeros_like(table.fwd) if table.recomputable is None else ~np.asarray(table.recomputable, dtype=bool)
        self.Pbad = np.hstack([z, np.cumsum(bad, axis=1)])  # layers that may not recompute, prefix counts
        self.inb = table.in_bytes()
        self.Pk = np.hstack([z, np.cumsum(np.zeros_like(table.fwd) if table.keep is None else table.keep, axis=1)])
        reach = 3 * min(D, L) - 2  # the largest warm-up count any plan has
        self.cap = min(self.B, reach)  # finite bounds >= cap are unconstrained
        self._build_index()
        self._slots: dict[int, np.ndarray] = {}  # per Kr: the slot of G each (delta, Nmax) class reads (_values)
        self.runs = 0

    # -- the sparse candidate index -----------------------------------------------------------
    def _link(self, k: int, s: int, n: int) -> tuple[str, float, float]:
        g = self.groups[k]
        if s + n == g.devices:
            if k + 1 == len(self.groups):
                return "end", 0.0, 0.0
            return "between", *self.links.between[k]
        dph = g.devices_per_host
        one_host = s // dph == (s + n) // dph
        return ("intra_host", *self.links.intra_host) if one_host else ("inter_host", *self.links.inter_host)

    def placements(self, k: int, n: int) -> list[int]:
        """Local starts where ``n`` devices of group ``k`` form a sub-mesh: inside one host, or
        whole aligned hosts (Alpa / HARP §5.2.2 sub-mesh shapes)."""
        g = self.groups[k]
        dph = g.devices_per_host
        out = []
        for s in range(g.devices - n + 1):
            if n <= dph and s // dph == (s + n - 1) // dph:
                out.append(s)
            elif n > dph and n % dph == 0 and s % dph == 0:
                out.append(s)
        return out

    def _build_index(self) -> None:
        """The sparse candidate index: per first layer ``i``, every usable transition as a row
        (``t``, ``c``, ``nmax``, next layer ``ni``, start ``p`` and next start ``np``, option ``o``,
        link id, recompute flag), ordered by ``(p, o, recompute, j)``; and the same rows as one flat
        array over every layer (:meth:`run`). Built for all layers at once: the rows of each option
        and row kind (:meth:`_row_pairs`) are crossed with the option's starts per link, then sorted
        by one integer key ``(i, p, o, rc, j)`` (unique per row)."""
        L, tb = self.L, self.table
        D = self.D
        links: list[str] = []
        place = []  # per option: [(link id, bandwidth, latency, global starts)], the end link last
        for o, opt in enumerate(tb.options):
            by_link: dict[str, tuple[float, float, list[int]]] = {}
            for s in self.placements(opt.group, opt.size):
                name, bw, lat = self._link(opt.group, s, opt.size)
                by_link.setdefault(name, (bw, lat, []))[2].append(self.offsets[opt.group] + s)
                if name not in links:
                    links.append(name)
            place.append((o, opt, [(links.index(n), bw, lat, np.array(st)) for n, (bw, lat, st) in by_link.items()]))
        end = links.index("end") if "end" in links else -1
        keys = ("i", "t", "c", "nmax", "ni", "np", "p", "o", "link", "rc")
        cols: dict[str, list] = {k: [] for k in keys}
        t_values: list[np.ndarray] = []
        c_values: list[np.ndarray] = []
        for o, opt, groups in place:
            for ii, js, t, nmax, rc in self._row_pairs(o, self.groups[opt.group].memory):
                for lk, bw, lat, starts in groups:
                    sel = js == L - 1 if lk == end else js < L - 1  # the last stage ends the model
                    if not sel.any():
                        continue
                    jj = js[sel]
                    c = np.zeros(len(jj)) if lk == end else lat + tb.out_bytes[jj] / bw
                    k = len(starts)
                    t_values.append(t[sel])  # (each row's t and c once, not once per start: candidates())
                    c_values.append(c)
                    cols["i"].append(np.tile(ii[sel], k))
                    cols["t"].append(np.tile(t[sel], k))
                    cols["c"].append(np.tile(c, k))
                    cols["nmax"].append(np.tile(nmax[sel], k))
                    cols["ni"].append(np.tile(jj + 1, k))
                    cols["p"].append(np.repeat(starts, len(jj)))
                    cols["np"].append(np.repeat(starts + opt.size, len(jj)))
                    cols["o"].append(np.full(len(jj) * k, o))
                    cols["link"].append(np.full(len(jj) * k, lk))
                    cols["rc"].append(np.full(len(jj) * k, rc))
        self._t_values = np.concatenate(t_values) if t_values else np.zeros(0)
        self._c_values = np.concatenate(c_values) if c_values else np.zeros(0)
        ints = ("i", "ni", "np", "p", "o", "link", "rc")
        flat = {
            k: np.concatenate(v) if v else np.zeros(0, dtype=np.int64 if k in ints else float) for k, v in cols.items()
        }
        n_opt = max(len(tb.options), 1)
        key = (((flat["i"] * (D + 1) + flat["p"]) * n_opt + flat["o"]) * 2 + flat["rc"]) * L + flat["ni"] - 1
        order = np.argsort(key, kind="stable")
        flat = {k: v[order] for k, v in flat.items()}
        fin = flat["nmax"][np.isfinite(flat["nmax"])]
        self.max_finite = int(fin.max()) if len(fin) else 0
        self.link_names = links
        kinds = {
            "inner": [k for k, n in enumerate(links) if n in ("intra_host", "inter_host")],
            "between": [k for k, n in enumerate(links) if n == "between"],
        }
        self._link_costs = {
            kind: np.unique(np.concatenate([flat["c"][np.isin(flat["link"], ks)], np.zeros(1)]))
            for kind, ks in kinds.items()
        }
        self.K = K = min(self.cap, self.max_finite + 1)  # finite bounds 0..K-1; index K is "any"
        # flat offsets of G[j+1, p', 0] and Nmax as a bound index
        flat["base"] = (flat["ni"] * (D + 1) + flat["np"]) * (K + 2)
        flat["nm"] = np.where(np.isfinite(flat["nmax"]), flat["nmax"], K).astype(np.int64)
        # per run, a row is usable where max(t, c) <= t_max (the same test as t <= t_max and
        # c <= t_max); t + 2c is what a transition adds, the same floats whatever t_max is
        flat["tc_max"] = np.maximum(flat["t"], flat["c"])
        flat["step"] = flat["t"] + 2 * flat["c"]
        flat["layer"] = flat.pop("i")
        # the rows of every first layer in one flat array (layer by layer), so a run filters and
        # indexes them with one call each, not one per layer (:meth:`run`); per layer, views of it
        self._flat = flat
        bounds = np.searchsorted(flat["layer"], np.arange(L + 1), side="left")
        self._layer_starts = bounds.tolist()  # each layer's first row in the flat index
        self.index: list[dict[str, np.ndarray]] = [
            {k: v[bounds[i] : bounds[i + 1]] for k, v in flat.items()} for i in range(L)
        ]

    def _row_pairs(self, o: int, mem: float) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]:
        """The stages on option ``o`` that fit one micro-batch, for every first layer at once:
        ``(first layers, last layers, times, Nmax, recompute)`` in order of ``(i, j)``, without
        recomputation and, where it is allowed and raises ``Nmax`` (``"auto"``) or always
        (``"always"``), with it. Per first layer ``i`` the plain rows run from ``j = i`` to the last
        ``j`` at which one micro-batch fits (memory grows with ``j``, so they are the ``j`` that fit;
        a ``j`` before it that does not, with rounding, has ``Nmax = 0``). Each entry is the
        elementwise float expression of the one-layer-at-a-time form on the pairs ``j >= i``."""
        L = self.L
        ii, jj = np.triu_indices(L)  # every (i, j) with j >= i, in order of i then j
        mp = self.Pp[o, jj + 1] - self.Pp[o, ii]
        ma = self.Pa[o, jj + 1] - self.Pa[o, ii]
        t = self.Pt[o, jj + 1] - self.Pt[o, ii]
        with np.errstate(divide="ignore", invalid="ignore"):
            plain = np.where(ma > 0, np.floor((mem - mp) / np.where(ma > 0, ma, 1)), INF)
        plain = np.where(plain >= self.cap, INF, plain)
        fits = mp + ma <= mem
        plain = np.where(fits, plain, 0.0)  # 0: not even one micro-batch fits
        out = []
        if self.recompute != "always":
            last = np.full(L, -1, dtype=np.int64)  # per first layer, the last j that fits (-1: none)
            np.maximum.at(last, ii[fits], jj[fits])
            sel = jj <= last[ii]
            if sel.any():
                out.append((ii[sel], jj[sel], t[sel], plain[sel], 0))
        if self.recompute == "never":
            return out
        ok = (self.Pbad[o, jj + 1] - self.Pbad[o, ii]) == 0
        inb = self.inb[ii] + self.Pk[o, jj + 1] - self.Pk[o, ii]  # kept per in-flight micro-batch
        room = mem - mp - ma
        with np.errstate(divide="ignore", invalid="ignore"):
            nr = np.where(inb > 0, np.floor(room / np.where(inb > 0, inb, 1)), np.where(room >= 0, INF, 0.0))
        nr = np.where(room >= inb, nr, 0.0)
        nr = np.where(nr >= self.cap, INF, nr)
        keep = ok & (nr >= 1)
        if self.recompute == "auto":
            keep &= nr > plain  # otherwise the plain row has less time and no less headroom
        if keep.any():
            tr = t + self.Pf[o, jj + 1] - self.Pf[o, ii]  # the backward runs the forward again
            out.append((ii[keep], jj[keep], tr[keep], nr[keep], 1))
        return out

    def candidates(self) -> np.ndarray:
        """Sorted distinct ``t_max`` candidates: stage times and the ``δ`` thresholds of links (the
        values of the index's rows, each taken once rather than once per start device: the same sets)."""
        parts = [self._t_values] if len(self._t_values) else []
        cs = np.unique(self._c_values)
        cs = cs[cs > 0]
        up = np.inf
        parts += [np.nextafter(np.nextafter(x, up), up) for x in (cs, 2 * cs, cs / self.eps)]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0)

    # -- one t_max ---------------------------------------------------------------------------
    def run(self, tau: float) -> np.ndarray:
        """The table of Eq. 13 for ``t_max = tau``: ``G[i, p, b + 1]`` holds ``G(i, p, b)``, and
        ``G[..., 0]`` is infinite (a bound below 0: no plan), which a transition whose warm-up
        exceeds the suffix's bound reads (:meth:`_values`).

        What does not depend on ``G`` -- which rows are usable at ``tau``, each row's ``δ`` and the
        slots of ``G`` it reads -- is computed for the rows of every layer at once (the flat index
        of :meth:`_build_index`); per layer only the gather from ``G``, the ``t + 2c`` added and the
        minimum per start device remain. The same floats as :meth:`_values` per layer: the same
        rows in the same order, the same additions, minima (exact) over the same groups."""
        self.runs += 1
        K, L, D = self.K, self.L, self.D
        self.Kr = min(K, self.reach(tau) + 1)  # bounds >= the largest warm-up at tau are "any"
        G = np.full((L + 1, D + 1, K + 2), INF)
        G[L, D, 1:] = 0.0
        fl = self._flat
        rows = np.flatnonzero(fl["tc_max"] <= tau)  # t <= tau and c <= tau
        if not len(rows):
            return G
        Kr = self.Kr
        slots = self._slot_table(Kr)
        d = delta(fl["c"].take(rows), tau, self.eps)
        nm = np.minimum(fl["nm"].take(rows), Kr)  # Nmax as a bound index (Kr: unconstrained)
        idx = slots[(d - 1) * (Kr + 1) + nm]
        idx += fl["base"].take(rows)[:, None]
        step = fl["step"].take(rows)[:, None]
        p = fl["p"].take(rows).astype(np.int64)
        layer = fl["layer"].take(rows)
        # per layer, the runs of equal start devices (rows are sorted by p within a layer)
        new = np.concatenate(([True], (p[1:] != p[:-1]) | (layer[1:] != layer[:-1])))
        starts = np.flatnonzero(new)
        bounds = np.searchsorted(layer, np.arange(L + 1), side="left")
        gbounds = np.searchsorted(starts, bounds, side="left")
        flatG = G.ravel()
        width = Kr + 2
        self._last_run = (G, rows, idx, step, p, bounds)  # what trace() re-reads of this run
        for i in range(L - 1, -1, -1):
            lo, hi = bounds[i], bounds[i + 1]
            if lo == hi:
                continue
            vals = flatG[idx[lo:hi]]
            vals += step[lo:hi]
            st = starts[gbounds[i] : gbounds[i + 1]]
            G[i, p[st], 1:width] = np.minimum.reduceat(vals, st - lo, axis=0)
        return G

    def _slot_table(self, K: int) -> np.ndarray:
        """The slot of ``G`` each (δ, Nmax) class reads at each bound ``b <= K`` (:meth:`_values`)."""
        slots = self._slots.get(K)
        if slots is None:
            bs = np.arange(K + 1)
            j = np.minimum(bs[None, :], np.arange(K + 1)[:, None])  # [Nmax, b]
            slots = np.concatenate([np.where(j >= K, K + 1, np.maximum(j - dd + 1, 0)) for dd in (1, 2, 3)])
            self._slots[K] = slots
        return slots

    def _values(self, a: dict, rows: np.ndarray, tau: float, G: np.ndarray, bs: np.ndarray) -> np.ndarray:
        """The values of the transitions ``rows`` (indices into ``a``) at every bound ``b <= Kr``:
        ``t + 2c`` plus the suffix's ``G`` at bound ``min(b, Nmax) - δ``."""
        K = self.Kr
        d = delta(a["c"].take(rows), tau, self.eps)
        nm = np.minimum(a["nm"].take(rows), K)  # Nmax as a bound index (K: unconstrained)
        # the slot of G each (delta, Nmax) class reads at each bound b, from one small table:
        # min(b, Nmax) - delta + 1, K + 1 where min(b, Nmax) >= K ("any"), 0 (infinite) below 0
        slots = self._slot_table(K)
        idx = slots[(d - 1) * (K + 1) + nm]
        idx += a["base"].take(rows)[:, None]
        vals = G.ravel()[idx]
        vals += a["step"].take(rows)[:, None]
        return vals

    def reach(self, tau: float) -> int:
        """The largest warm-up count any plan has at ``tau``: ``1 + Σ δ`` over at most
        ``min(D, L) - 1`` links, of which ``groups - 1`` cross groups."""
        dmax = {}
        for kind, cs in self._link_costs.items():  # the costliest link of each kind usable at tau
            k = int(np.searchsorted(cs, tau, side="right"))
            dmax[kind] = int(delta(cs[k - 1] if k else 0.0, tau, self.eps))
        nb = len(self.groups) - 1
        links = min(self.D, self.L) - 1
        return 1 + (links - nb) * dmax["inner"] + nb * max(dmax["inner"], dmax["between"])

    def trace(self, G: np.ndarray, tau: float) -> list[StageChoice]:
        """The stages of the optimum in ``G`` (re-derived transition by transition). Where ``G`` is
        the last :meth:`run`'s, each layer's usable rows and the slots they read are that run's (the
        same rows in the same order, the same floats: the same first least row), not found again."""
        i, p, b = 0, 0, self.Kr
        out = []
        last = getattr(self, "_last_run", None)
        mine = last is not None and last[0] is G
        flatG = G.ravel()
        while i < self.L:
            a = self.index[i]
            if mine:
                _, frows, fidx, fstep, fp, bounds = last
                lo, hi = bounds[i], bounds[i + 1]
                sel = lo + np.flatnonzero(fp[lo:hi] == p)
                vals = flatG[fidx[sel, b]] + fstep[sel, 0]
                r = int(frows[sel[int(np.argmin(vals))]]) - self._layer_starts[i]
            else:
                rows = np.flatnonzero((a["tc_max"] <= tau) & (a["p"] == p))
                bs = np.arange(self.Kr + 1)
                vals = self._values(a, rows, tau, G, bs)[:, b]
                k = int(np.argmin(vals))
                r = rows[k]
            d = int(delta(a["c"][r], tau, self.eps))
            nmax = a["nmax"][r]
            bound = min(b, int(nmax) if math.isfinite(nmax) and nmax < self.Kr else self.Kr)
            o = int(a["o"][r])
            out.append(
                StageChoice(
                    i,
                    int(a["ni"][r]),
                    o,
                    p,
                    float(a["t"][r]),
                    float(a["c"][r]),
                    self.link_names[int(a["link"][r])],
                    float(nmax),
                    bool(a["rc"][r]),
                )
            )
            i, p = int(a["ni"][r]), int(a["np"][r])
            b = self.Kr if bound >= self.Kr else bound - d
        return out

    # -- t_max enumeration -----------------------------------------------------------------------
    def warmups(self, stages: list[StageChoice], tau: float) -> list[int]:
        n = [1]
        for s in reversed(stages[:-1]):
            n.append(n[-1] + int(delta(s.comm, tau, self.eps)))
        return n[::-1]

    def feasible_at(self, stages: list[StageChoice], tau: float) -> bool:
        if any(s.time > tau or s.comm > tau for s in stages):
            return False
        return all(min(n, self.B) <= s.nmax for n, s in zip(self.warmups(stages, tau), stages))

    def lower_bound(self) -> float:
        """No plan has a smaller t_max: every layer runs somewhere (on its fastest sub-mesh), and
        each group boundary is crossed by a link after some layer (``c <= t_max``)."""
        return _t_max_floor(self.per_mb, self.table, self.links)

    def own_t_max(self, stages: list[StageChoice], cands: np.ndarray, tau: float) -> float:
        """The smallest candidate ``t <= tau`` at which a solution found at ``tau`` stays feasible:
        its value there, ``F(tau) + (B-1) t``, dominates every candidate in ``(t, tau]``."""
        base = max(max(s.time for s in stages), max(s.comm for s in stages))
        lo = int(np.searchsorted(cands, base, side="left"))
        hi = int(np.searchsorted(cands, tau, side="right"))
        up = np.inf
        mine = {max(s.time for s in stages)}
        for s in stages:
            if s.comm > 0:
                mine |= {float(np.nextafter(np.nextafter(x, up), up)) for x in (s.comm, 2 * s.comm, s.comm / self.eps)}
        for t in sorted(x for x in mine if x >= base and x <= tau) + [tau]:
            k = int(np.searchsorted(cands, t, side="left"))
            if lo <= k < hi and cands[k] == t and self.feasible_at(stages, t):
                return t
        return tau

    def solve(self) -> Solution | None:
        cands = self.candidates()
        if not len(cands):
            return None
        cache: dict[float, tuple[float, list[StageChoice] | None]] = {}

        def at(tau: float) -> tuple[float, list[StageChoice] | None]:
            if tau not in cache:
                G = self.run(tau)
                f = float(G[0, 0, self.Kr + 1])
                cache[tau] = (f, self.trace(G, tau) if math.isfinite(f) else None)
            return cache[tau]

        lo, hi = int(np.searchsorted(cands, self.lower_bound(), side="left")), len(cands) - 1
        if lo > hi or not math.isfinite(at(float(cands[hi]))[0]):
            return None
        step = 1  # gallop up from the lower bound, then bisect: the smallest feasible t_max
        while lo + step - 1 < hi:  # (feasibility grows with t_max; cands[hi] is feasible)
            probe = lo + step - 1
            if math.isfinite(at(float(cands[probe]))[0]):
                hi = probe
                break
            lo, step = probe + 1, step * 2
        while lo < hi:
            mid = (lo + hi) // 2
            if math.isfinite(at(float(cands[mid]))[0]):
                hi = mid
            else:
                lo = mid + 1
        t_s = float(cands[lo])
        f, stages = at(t_s)
        best = (f + (self.B - 1) * t_s, t_s, stages)
        k = int(np.searchsorted(cands, best[0] / self.B, side="right")) - 1
        # no plan's own t_max is below this (see STOP_WALK; t_S itself may be: lower_bound() is
        # summed otherwise than the index's prefix differences, and can exceed one by an ulp)
        floor = min(t_s, self.lower_bound()) * (1 - ROUNDING)
        while k > lo:
            tau = float(cands[k])
            f, stages = at(tau)
            assert stages is not None
            used = self.own_t_max(stages, cands, tau)
            value = f + (self.B - 1) * used
            nxt = int(np.searchsorted(cands, used, side="left")) - 1
            if value < best[0]:
                best = (value, used, stages)
            if STOP_WALK and f + (self.B - 1) * floor >= best[0]:
                break  # every candidate below tau is worth at least this (STOP_WALK's note)
            k = min(nxt, int(np.searchsorted(cands, best[0] / self.B, side="right")) - 1)
        value, tau, stages = best
        return Solution(stages, tau, value, self.warmups(stages, tau), self.runs, len(cands))


def _t_max_floor(per_mb: np.ndarray, table: CostTable, links: Links) -> float:
    """:meth:`PipelineDP.lower_bound` for per-layer times ``per_mb`` (options x layers)."""
    L = table.num_layers
    lb = float(per_mb.min(axis=0).max()) if L else 0.0
    for bw, lat in links.between:
        lb = max(lb, lat + float(table.out_bytes[: L - 1].min(initial=np.inf)) / bw)
    return lb


#: the relative margin :func:`step_lower_bound` gives away to rounding (the DP adds prefix-sum
#: differences, the bound plain sums: the two may differ in the last bits)
ROUNDING = 1e-9


def step_lower_bound(table: CostTable, links: Links, num_micro: int) -> float:
    """A lower bound on Eq. 12 over every plan :class:`PipelineDP` can return for ``table``, in
    O(options x layers), without the DP's index or runs:

        T = Σ_s (t_s + 2 c_s) + (B - 1) t_max  >=  Σ_l min_o t_{o,l} + 2 Σ_k c_k + (B - 1) t_floor

    * ``Σ_s t_s``: every layer runs in one stage, on some sub-mesh kind ``o``, at no less than its
      least per-micro-batch time over the kinds ``min_o (fwd + bwd + sync / B)`` (a recomputing
      stage only adds its forward);
    * ``2 Σ c_s``: every device is used, so each boundary ``k`` between consecutive groups is crossed
      by one stage's transfer, at least the link's latency plus the smallest boundary's bytes over
      its bandwidth (the other ``c_s >= 0``);
    * ``t_max >= t_floor`` (:meth:`PipelineDP.lower_bound`: the slowest layer at its least, and every
      group boundary's least transfer).

    The pipeline planner skips the DP of a candidate whose bound is no better than a plan already
    priced (:func:`hapc.pipeline.plan_pipeline`'s ``above``); the margin :data:`ROUNDING` keeps
    the bound below the DP's own sums."""
    if table.num_layers == 0:
        return 0.0
    per_mb = table.fwd + table.bwd + table.sync / num_micro  # as PipelineDP
    crossings = 0.0
    for bw, lat in links.between:
        crossings += lat + float(table.out_bytes[: table.num_layers - 1].min(initial=np.inf)) / bw
    floor = _t_max_floor(per_mb, table, links)
    return (float(per_mb.min(axis=0).sum()) + 2 * crossings + (num_micro - 1) * floor) * (1 - ROUNDING)
