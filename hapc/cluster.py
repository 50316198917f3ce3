"""Cluster specifications: device groups, links, fitted collective costs (HAP §3, §6).

A cluster is plain data, loaded from TOML (or built in Python, or a named preset)::

    name = "two-kinds"
    [[group]]
    name = "a100"
    devices = 8                 # GPUs in this group
    devices_per_host = 4
    flops = "156 TFLOPS"        # sustained flop/s of one device for the model's dtype
    flops_bf16 = "156 TFLOPS"   # optional: the same under autocast to bf16 / fp16 (precision=)
    flops_fp16 = "156 TFLOPS"
    memory = "40 GiB"
    mem_bandwidth = "1.5 TB/s"  # optional: memory-bound ops are charged bytes / bandwidth
    op_overhead = "5 us"        # optional: framework work per operator launch (hapc profile)
    [[group]]
    name = "v100"
    devices = 4
    devices_per_host = 4
    flops = "62 TFLOPS"
    memory = "32 GiB"
    [links]
    intra_host = { bandwidth = "150 GB/s", latency = "5 us" }
    inter_host = { bandwidth = "25 GB/s", latency = "20 us" }
    between = [ { groups = ["a100", "v100"], bandwidth = "5 Gbps", latency = "100 us" } ]
    [collectives]               # optional alpha-beta fits (hapc profile writes them)
    all_gather = { alpha = 1e-4, beta = 2e-10 }

``flops_bf16`` / ``flops_fp16`` are what a plan made with ``precision="bf16"`` / ``"fp16"`` prices
compute at (matmuls run in the half dtype under autocast, :mod:`hapc.theory.precision`); planning
a precision for a cluster without its key is refused, naming the key. Without ``precision`` only
``flops`` is read, so the keys change nothing else.

Numbers may carry units of the field's kind (``Gbps``, ``GB/s``, ``TFLOPS``, ``GiB``, ``us``) or be
plain SI values (bytes, bytes/s, flop/s, seconds); a unit of another kind is an error. Files and
presets are also held to sanity ranges that catch a missing unit (:mod:`hapc.quantities`).

The synthesizer sees *device types* (one per group) with multiplicities: identical devices get
identical ratios at the optimum (the problem is convex and symmetric), so search and LP sizes do
not grow with the device count (HAP §7.8). ``virtual = "host"`` makes each host one virtual device
that runs data parallelism inside (HAP §3): ``devices_per_host`` times the flops, plus the internal
gradient all-reduce, charged as computation.

Collective costs follow the alpha-beta model ``t = alpha + beta * bytes``. Without fitted values they
are derived from the slowest link a ring over the devices crosses (ring all-gather / reduce-scatter:
``(m-1)`` steps of one shard; all-reduce: ``2(m-1)/m`` of the tensor; broadcast and reduce: one
pipelined pass).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ClusterError
from .quantities import BANDWIDTH, FLOPS, PER_BYTE, SIZE, TIME, Kind, check_range, parse_quantity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRIMITIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")


@dataclass(frozen=True)
class Link:
    """A class of connection: bandwidth in bytes/s, latency in seconds."""

    bandwidth: float
    latency: float = 0.0


@dataclass(frozen=True)
class Group:
    """``devices`` identical devices, ``devices_per_host`` to a host."""

    name: str
    devices: int
    flops: float
    memory: float
    devices_per_host: int = 1
    mem_bandwidth: float | None = None
    op_overhead: float | None = None  # seconds of framework work per operator launch (hapc profile)
    intra_host: Link | None = None  # this group's links inside a host, when not the cluster's
    flops_bf16: float | None = None  # sustained flop/s under autocast to bf16 (precision="bf16")
    flops_fp16: float | None = None  # ... to fp16

    @property
    def hosts(self) -> int:
        return math.ceil(self.devices / self.devices_per_host)

    def rate(self, precision: str | None = None) -> float:
        """Sustained flop/s for ``precision`` (None / ``"fp32"``: ``flops``, the model's dtype)."""
        if precision in (None, "fp32"):
            return self.flops
        if precision not in HALF_KEYS:
            raise ClusterError(f"unknown precision {precision!r}; one of 'fp32', {', '.join(map(repr, HALF_KEYS))}")
        value = getattr(self, HALF_KEYS[precision])
        if value is None:
            key = HALF_KEYS[precision]
            raise ClusterError(
                f"group {self.name!r} has no {key}: a {precision} plan needs its devices' sustained {precision} rate; "
                f'add `{key} = "... TFLOPS"` to its [[group]] (hapc/presets.py lists datasheet values), or plan '
                "without precision="
            )
        return value


@dataclass(frozen=True)
class AlphaBeta:
    """``time = alpha + beta * bytes`` for one collective primitive."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class DeviceType:
    """What the synthesizer sees: ``count`` identical (virtual) devices."""

    name: str
    count: int
    flops: float
    memory: float
    mem_bandwidth: float | None = None
    inner: int = 1  # physical devices inside one virtual device (data parallel)
    inner_link: Link | None = None
    op_overhead: float = 0.0  # seconds per operator launch, forward or backward


@dataclass(frozen=True)
class Cluster:
    """A heterogeneous cluster (immutable; :meth:`load` / :meth:`from_dict` validate)."""

    name: str
    groups: tuple[Group, ...]
    intra_host: Link
    inter_host: Link
    between: tuple[tuple[frozenset[str], Link], ...] = ()
    collectives: tuple[tuple[str, AlphaBeta], ...] = ()
    virtual: str = "gpu"
    notes: str = field(default="", compare=False)

    # -- construction -----------------------------------------------------------------------
    @staticmethod
    def load(source: str | Path | Mapping[str, Any]) -> Cluster:
        """A preset name (``hap-testbed``, ``local-cpu:3``...), a TOML file, or a dict.

        Files and presets are held to :mod:`hapc.quantities`' sanity ranges; a dict (or
        :meth:`from_dict`) only when ``check_ranges=True``, as tests scale clusters down to toy sizes."""
        if isinstance(source, Mapping):
            return Cluster.from_dict(source)
        text = str(source)
        from .presets import PRESETS, preset

        if text.split(":")[0] in PRESETS:
            return preset(text)
        path = Path(text)
        if not path.exists():
            raise ClusterError(
                f"cluster {text!r}: no such file and not a preset (presets: {', '.join(sorted(PRESETS))})"
            )
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ClusterError(f"cluster file {path}: not valid TOML: {exc}") from exc
        try:
            return Cluster.from_dict(data, check_ranges=True)
        except ClusterError as exc:
            raise ClusterError(f"cluster file {path}: {exc}") from exc

    @staticmethod
    def from_dict(data: Mapping[str, Any], *, check_ranges: bool = False) -> Cluster:
        """Validate and build; ``check_ranges``: also refuse magnitudes that look like a unit slip."""
        r = check_ranges
        _check_keys(data, {"name", "group", "links", "collectives", "virtual", "notes"}, "cluster")
        groups_data = data.get("group")
        if not groups_data:
            raise ClusterError("cluster: at least one [[group]] is required")
        groups = []
        for i, g in enumerate(groups_data):
            where = f"group {g.get('name', i)!r}"
            _check_keys(g, GROUP_KEYS, where)
            for req in ("name", "devices", "flops", "memory"):
                if req not in g:
                    raise ClusterError(f"{where}: missing field {req!r}")
            devices = g["devices"]
            if not isinstance(devices, int) or devices <= 0:
                raise ClusterError(f"{where}: devices must be a positive integer, got {devices!r}")
            dph = g.get("devices_per_host", 1)
            if not isinstance(dph, int) or dph <= 0:
                raise ClusterError(f"{where}: devices_per_host must be a positive integer, got {dph!r}")
            flops = _positive(g["flops"], f"{where}: flops", FLOPS, r)
            memory = _positive(g["memory"], f"{where}: memory", SIZE, r)
            mbw = (
                _positive(g["mem_bandwidth"], f"{where}: mem_bandwidth", BANDWIDTH, r) if "mem_bandwidth" in g else None
            )
            ovh = _non_negative(g["op_overhead"], f"{where}: op_overhead", TIME, r) if "op_overhead" in g else None
            own = _link(g["intra_host"], f"{where}: intra_host", r) if "intra_host" in g else None
            half = {k: _positive(g[k], f"{where}: {k}", FLOPS, r) for k in HALF_KEYS.values() if k in g}
            groups.append(Group(str(g["name"]), devices, flops, memory, dph, mbw, ovh, own, **half))
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ClusterError(f"cluster: group names must be unique, got {names}")
        links = data.get("links", {})
        _check_keys(links, {"intra_host", "inter_host", "between"}, "links")
        intra = _link(links.get("intra_host", {"bandwidth": "100 GB/s", "latency": "5 us"}), "links.intra_host", r)
        inter = _link(links.get("inter_host", {"bandwidth": "10 Gbps", "latency": "30 us"}), "links.inter_host", r)
        between = []
        for k, b in enumerate(links.get("between", [])):
            where = f"links.between[{k}]"
            _check_keys(b, {"groups", "bandwidth", "latency"}, where)
            gs = b.get("groups")
            if not isinstance(gs, (list, tuple)) or len(gs) != 2:
                raise ClusterError(f"{where}: groups must name two groups")
            for gname in gs:
                if gname not in names:
                    raise ClusterError(f"{where}: unknown group {gname!r} (groups: {', '.join(names)})")
            between.append((frozenset(gs), _link(b, where, r)))
        coll = []
        for prim, ab in data.get("collectives", {}).items():
            if prim not in PRIMITIVES:
                raise ClusterError(f"collectives: unknown primitive {prim!r} (one of {', '.join(PRIMITIVES)})")
            _check_keys(ab, {"alpha", "beta"}, f"collectives.{prim}")
            alpha = _non_negative(ab.get("alpha", 0.0), f"collectives.{prim}.alpha", TIME, r)
            beta = _non_negative(ab.get("beta", 0.0), f"collectives.{prim}.beta", PER_BYTE, r)
            coll.append((prim, AlphaBeta(alpha, beta)))
        virtual = data.get("virtual", "gpu")
        if virtual not in ("gpu", "host"):
            raise ClusterError(f"virtual must be 'gpu' or 'host', got {virtual!r}")
        return Cluster(
            str(data.get("name", "cluster")),
            tuple(groups),
            intra,
            inter,
            tuple(between),
            tuple(coll),
            virtual,
            str(data.get("notes", "")),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "virtual": self.virtual}
        out["group"] = [{k: v for k, v in asdict(g).items() if v is not None} for g in self.groups]
        out["links"] = {
            "intra_host": asdict(self.intra_host),
            "inter_host": asdict(self.inter_host),
            "between": [{"groups": sorted(gs), **asdict(link)} for gs, link in self.between],
        }
        if self.collectives:
            out["collectives"] = {p: asdict(ab) for p, ab in self.collectives}
        return out

    def to_toml(self) -> str:
        """The cluster as a TOML file :meth:`load` reads back."""
        d = self.to_dict()
        lines = [f"name = {json.dumps(d['name'])}", f"virtual = {json.dumps(d['virtual'])}"]
        if self.notes:
            lines.append(f"notes = {json.dumps(self.notes)}")
        lines.append("")
        for g in d["group"]:
            lines.append("[[group]]")
            for k, v in g.items():
                if isinstance(v, dict):  # a link: an inline table
                    v = "{ " + ", ".join(f"{a} = {b!r}" for a, b in v.items()) + " }"
                    lines.append(f"{k} = {v}")
                else:
                    lines.append(f"{k} = {json.dumps(v)}")
            lines.append("")
        lines.append("[links]")
        for k in ("intra_host", "inter_host"):
            lines.append(
                f"{k} = {{ bandwidth = {d['links'][k]['bandwidth']!r}, latency = {d['links'][k]['latency']!r} }}"
            )
        if d["links"]["between"]:
            items = ", ".join(
                f"{{ groups = {json.dumps(b['groups'])}, bandwidth = {b['bandwidth']!r}, latency = {b['latency']!r} }}"
                for b in d["links"]["between"]
            )
            lines.append(f"between = [ {items} ]")
        if "collectives" in d:
            lines += ["", "[collectives]"]
            lines += [
                f"{p} = {{ alpha = {ab['alpha']!r}, beta = {ab['beta']!r} }}" for p, ab in d["collectives"].items()
            ]
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_toml())

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        """Physical devices (ranks of a run)."""
        return sum(g.devices for g in self.groups)

    def device_types(self, precision: str | None = None) -> list[DeviceType]:
        """The (virtual) device types the synthesizer balances, one per group; ``precision``: their
        flop/s are that dtype's rate (:meth:`Group.rate`; ClusterError where a group lacks it)."""
        out = []
        for g in self.groups:
            ovh = g.op_overhead or 0.0
            flops = g.rate(precision)
            if self.virtual == "host":
                inner = g.devices_per_host
                out.append(
                    DeviceType(g.name, g.hosts, flops * inner, g.memory, g.mem_bandwidth, inner, self.intra_host, ovh)
                )
            else:
                out.append(DeviceType(g.name, g.devices, flops, g.memory, g.mem_bandwidth, op_overhead=ovh))
        return out

    def devices(self) -> list[str]:
        """One entry per (virtual) device: its type name, in rank order."""
        return [t.name for t in self.device_types() for _ in range(t.count)]

    def bottleneck(self, groups: Sequence[str] | None = None) -> Link:
        """The slowest link a ring over the devices of ``groups`` (default: all) crosses."""
        gs = [g for g in self.groups if groups is None or g.name in groups]
        one_host = sum(g.hosts for g in gs) == 1 and self.virtual == "gpu"
        # one host holds one group's devices: that group's own intra-host links, if it has them
        link = (gs[0].intra_host or self.intra_host) if one_host else self.inter_host
        names = {g.name for g in gs}
        for pair, between in self.between:
            if pair <= names and between.bandwidth < link.bandwidth:
                link = between
        return link

    def alpha_beta(self, primitive: str, groups: Sequence[str] | None = None) -> AlphaBeta:
        """alpha-beta of ``primitive`` over the devices of ``groups`` (fitted if the file has it)."""
        if primitive not in PRIMITIVES:
            raise ClusterError(f"unknown collective primitive {primitive!r}")
        fitted = dict(self.collectives)
        if groups is None and primitive in fitted:
            return fitted[primitive]
        m = sum(t.count for t in self.device_types() if groups is None or t.name in groups)
        return derived_alpha_beta(primitive, m, self.bottleneck(groups))

    def subset(self, groups: Sequence[str]) -> Cluster:
        """The cluster restricted to some groups (fitted collectives dropped: they were for all)."""
        unknown = [g for g in groups if g not in {x.name for x in self.groups}]
        if unknown:
            raise ClusterError(f"unknown group(s) {unknown}")
        gs = tuple(g for g in self.groups if g.name in groups)
        between = tuple((p, link) for p, link in self.between if p <= set(groups))
        return replace(self, name=f"{self.name}[{','.join(groups)}]", groups=gs, between=between, collectives=())

    def describe(self) -> str:
        parts = [
            f"{g.devices}x{g.name} ({g.flops / 1e12:.3g} TFLOP/s, {g.memory / 2**30:.3g} GiB)" for g in self.groups
        ]
        return f"{self.name}: " + " + ".join(parts)


def derived_alpha_beta(primitive: str, m: int, link: Link) -> AlphaBeta:
    """Ring / pipelined estimates for ``m`` devices over ``link`` (argument conventions in
    :mod:`hapc.theory.cost`: shard bytes for all-gather, reduce-scatter and all-to-all; the
    message for broadcast and reduce; the whole tensor for all-reduce)."""
    if m <= 1:
        return AlphaBeta(0.0, 0.0)
    bw, lat = link.bandwidth, link.latency
    if primitive in ("all_gather", "reduce_scatter"):
        return AlphaBeta((m - 1) * lat, (m - 1) / bw)
    if primitive == "all_reduce":
        return AlphaBeta(2 * (m - 1) * lat, 2 * (m - 1) / (m * bw))
    if primitive in ("broadcast", "reduce"):
        return AlphaBeta(math.ceil(math.log2(m)) * lat, 1 / bw)
    if primitive == "all_to_all":
        return AlphaBeta((m - 1) * lat, (m - 1) / bw)
    raise ClusterError(f"unknown collective primitive {primitive!r}")


#: precision -> the optional [[group]] key of its sustained rate
HALF_KEYS = {"bf16": "flops_bf16", "fp16": "flops_fp16"}
GROUP_KEYS = {
    "name", "devices", "flops", "memory", "devices_per_host", "mem_bandwidth", "op_overhead", "intra_host",
    *HALF_KEYS.values(),
}  # fmt: skip


def _check_keys(data: Any, allowed: set[str], where: str) -> None:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected a table, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive(value: Any, what: str, kind: Kind, ranges: bool) -> float:
    x = parse_quantity(value, what, kind)
    if not x > 0 or math.isinf(x):
        raise ClusterError(f"{what}: must be positive, got {value!r}")
    return check_range(x, value, what, kind) if ranges else x


def _non_negative(value: Any, what: str, kind: Kind, ranges: bool) -> float:
    x = parse_quantity(value, what, kind)
    if x < 0 or math.isnan(x) or math.isinf(x):
        raise ClusterError(f"{what}: must be zero or positive, got {value!r}")
    return check_range(x, value, what, kind) if ranges else x


def _link(data: Any, where: str, ranges: bool) -> Link:
    if not isinstance(data, Mapping):
        raise ClusterError(f"{where}: expected {{ bandwidth = ..., latency = ... }}")
    if "bandwidth" not in data:
        raise ClusterError(f"{where}: missing field 'bandwidth'")
    return Link(
        _positive(data["bandwidth"], f"{where}.bandwidth", BANDWIDTH, ranges),
        _non_negative(data.get("latency", 0.0), f"{where}.latency", TIME, ranges),
    )
