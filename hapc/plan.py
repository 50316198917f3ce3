"""A synthesized plan: the distributed program, the ratios, and what they are predicted to cost.

A plan is plain data and serialises to versioned JSON (never pickle): the program as instructions
(each a small JSON object), ratios per device type and per device, the segments, and the
predicted time. It records fingerprints of the reference graph and of the cluster, so a plan
loaded against another model or cluster is refused with a message saying which differs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlanError
from .theory.instructions import Collective, Compute, Instruction, Loss, Source, instruction_from_json

PLAN_VERSION = 1


@dataclass
class PlanStage:
    """A stage of the predicted timeline (for printing): seconds of collective and compute."""

    segment: int
    direction: str
    comm: float
    comp: tuple[float, ...]

    @property
    def time(self) -> float:
        return self.comm + max(self.comp, default=0.0)


@dataclass
class Plan:
    """The result of :func:`hapc.synthesize`.

    Attributes:
        program: per segment, the triples in order; each triple a list of instructions.
        ratios: sharding ratio of one device of each type (``sum count * ratio = 1``).
        device_ratios: one ratio per (virtual) device in rank order.
        predicted: ``{"time", "comm", "comp", "gradients", "memory"...}`` in seconds / bytes.
    """

    program: list[list[list[Instruction]]]
    ratios: list[float]
    device_types: list[dict[str, Any]]
    device_ratios: list[float]
    graph_fingerprint: str
    cluster_fingerprint: str
    cluster_name: str
    predicted: dict[str, Any]
    stages: list[PlanStage] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    baseline: str | None = None
    total_flops: float = 0.0
    peak_flops: float = 0.0
    rounds: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    node_names: dict[int, str] = field(default_factory=dict)
    version: int = PLAN_VERSION

    # -- queries ---------------------------------------------------------------------------------
    @property
    def instructions(self) -> list[Instruction]:
        return [i for seg in self.program for triple in seg for i in triple]

    @property
    def time(self) -> float:
        return float(self.predicted["time"])

    @property
    def efficiency(self) -> float:
        """(total flops / sum of device flops) / predicted time: 1.0 is the physical limit."""
        if not self.peak_flops or not self.time:
            return 0.0
        return (self.total_flops / self.peak_flops) / self.time

    def collectives(self) -> list[Collective]:
        return [i for i in self.instructions if isinstance(i, Collective)]

    def sfb_sites(self) -> list[Compute]:
        return [i for i in self.instructions if isinstance(i, Compute) and i.strategy_key.startswith("sfb:")]

    def layout_of(self, ref: int) -> list[str]:
        out = []
        for i in self.instructions:
            if i.ref == ref and isinstance(i, (Source, Compute)):
                out.append(repr(i.layout if isinstance(i, Source) else i.output))
            if i.ref == ref and isinstance(i, Collective):
                out.append(repr(i.dst))
        return out

    # -- serialisation ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": "hapc-plan",
            "version": self.version,
            "graph_fingerprint": self.graph_fingerprint,
            "cluster_fingerprint": self.cluster_fingerprint,
            "cluster_name": self.cluster_name,
            "baseline": self.baseline,
            "options": self.options,
            "device_types": self.device_types,
            "ratios": self.ratios,
            "device_ratios": self.device_ratios,
            "predicted": self.predicted,
            "stages": [[s.segment, s.direction, s.comm, list(s.comp)] for s in self.stages],
            "total_flops": self.total_flops,
            "peak_flops": self.peak_flops,
            "rounds": self.rounds,
            "timings": self.timings,
            "node_names": {str(k): v for k, v in self.node_names.items()},
            "program": [[[i.to_json() for i in triple] for triple in seg] for seg in self.program],
        }

    @staticmethod
    def from_json(data: Any) -> Plan:
        if not isinstance(data, dict) or data.get("format") != "hapc-plan":
            raise PlanError("not a hapc plan (no 'format': 'hapc-plan' field); was it written by Plan.save?")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(
                f"plan format version {version!r} is not supported (this hapc reads version {PLAN_VERSION}); "
                "re-run `hapc synth` to produce a new plan"
            )
        try:
            program = [[[instruction_from_json(i) for i in triple] for triple in seg] for seg in data["program"]]
            return Plan(
                program=program,
                ratios=[float(x) for x in data["ratios"]],
                device_types=list(data["device_types"]),
                device_ratios=[float(x) for x in data["device_ratios"]],
                graph_fingerprint=str(data["graph_fingerprint"]),
                cluster_fingerprint=str(data["cluster_fingerprint"]),
                cluster_name=str(data.get("cluster_name", "")),
                predicted=dict(data["predicted"]),
                stages=[
                    PlanStage(int(s[0]), str(s[1]), float(s[2]), tuple(float(x) for x in s[3]))
                    for s in data.get("stages", [])
                ],
                options=dict(data.get("options", {})),
                baseline=data.get("baseline"),
                total_flops=float(data.get("total_flops", 0.0)),
                peak_flops=float(data.get("peak_flops", 0.0)),
                rounds=list(data.get("rounds", [])),
                timings=dict(data.get("timings", {})),
                node_names={int(k): str(v) for k, v in data.get("node_names", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"corrupt plan: {type(exc).__name__}: {exc}; re-run `hapc synth` (or hapc.synthesize and "
                "Plan.save) to write it again"
            ) from exc

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (atomically: a temporary file renamed into place)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path, *, graph: Any = None, cluster: Any = None) -> Plan:
        """Read a plan; with ``graph`` / ``cluster`` given, refuse one made for others."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read plan {path}: {exc}") from exc
        except UnicodeDecodeError as exc:  # e.g. a pickle: plans are JSON text, never unpickled
            raise PlanError(
                f"plan {path} is not JSON text ({exc.reason} at byte {exc.start}); plans are JSON written by "
                "Plan.save -- re-run `hapc synth` (or hapc.synthesize and Plan.save) to write it again"
            ) from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(
                f"plan {path} is not valid JSON ({exc}); the file is corrupt or truncated -- re-run `hapc synth` "
                "(or hapc.synthesize and Plan.save) to write it again"
            ) from exc
        plan = Plan.from_json(data)
        plan.check(graph=graph, cluster=cluster, where=str(path))
        return plan

    def check(
        self, *, graph: Any = None, cluster: Any = None, world_size: int | None = None, where: str = "plan"
    ) -> None:
        """Raise :class:`PlanError` if this plan was made for another model, cluster or world size."""
        if graph is not None and graph.fingerprint() != self.graph_fingerprint:
            raise PlanError(
                f"{where} was synthesized for another model (graph {self.graph_fingerprint}, this model is "
                f"{graph.fingerprint()}): shapes, dtypes or ops differ -- re-run synthesis for this model"
            )
        if cluster is not None and cluster.fingerprint() != self.cluster_fingerprint:
            raise PlanError(
                f"{where} was synthesized for cluster {self.cluster_name!r} ({self.cluster_fingerprint}), not "
                f"{cluster.name!r} ({cluster.fingerprint()}) -- re-run synthesis for this cluster"
            )
        if world_size is not None and world_size != len(self.device_ratios):
            raise PlanError(
                f"{where} is for {len(self.device_ratios)} devices but the process group has {world_size}; "
                f"start {len(self.device_ratios)} processes (torchrun --nproc-per-node ...) or synthesize for this size"
            )

    # -- printing ---------------------------------------------------------------------------------
    def describe_program(self) -> list[str]:
        """One line per instruction, grouped by segment (each segment starts fresh stages), with
        layouts, and each segment's predicted forward / backward time split into collectives and
        compute."""
        lines = []
        names = self.node_names
        by_seg: dict[int, list[PlanStage]] = {}
        for st in self.stages:
            by_seg.setdefault(st.segment, []).append(st)
        for si, seg in enumerate(self.program):
            if not seg:
                continue
            times = []
            for d, short in (("forward", "fwd"), ("backward", "bwd"), ("gradients", "grad")):
                ss = [st for st in by_seg.get(si, []) if st.direction == d]
                comm = sum(st.comm for st in ss)
                comp = sum(max(st.comp, default=0.0) for st in ss)
                if comm or comp:
                    times.append(f"{short} {comm * 1e3:.3g}+{comp * 1e3:.3g} ms")
            lines.append(f"stage group {si}" + (f" [{'; '.join(times)} (comm+compute)]" if times else "") + ":")
            for triple in seg:
                for ins in triple:
                    lines.append("  " + _describe(ins, names.get(ins.ref, f"%{ins.ref}")))
        return lines

    def __str__(self) -> str:
        p = self.predicted
        head = f"Plan for {self.cluster_name}" + (f" (baseline {self.baseline})" if self.baseline else "")
        ratios = ", ".join(f"{t['name']}x{t['count']}: {r:.4g}" for t, r in zip(self.device_types, self.ratios))
        text = (
            f"{head}: predicted {p['time'] * 1e3:.4g} ms/iteration "
            f"(compute {p['comp'] * 1e3:.4g} ms, communication {p['comm'] * 1e3:.4g} ms, gradients "
            f"{p['gradients'] * 1e3:.4g} ms), efficiency {self.efficiency:.1%}; ratios per device [{ratios}]"
        )
        if p.get("kinds"):
            text += f"\n{kinds_line(p['kinds'])}"
        if p.get("proven_optimal") is False:
            text += (
                "\nnot proven optimal: the time limit stopped the program search; its program costs at most "
                f"{p.get('optimality_gap', float('nan')):.3g}x the optimum at the ratios it searched (raise "
                "time_limit, or leave it unset for the proven optimum)"
            )
        return text


def kinds_line(kinds: Sequence[dict[str, Any]]) -> str:
    """The plan kinds :func:`hapc.planner.choose_plan` priced, on one line: ``plan kinds: spmd
    1.29 ms, pipeline 1.08 ms (chosen)``; a kind not priced shows its status."""
    parts = []
    for k in kinds:
        if k.get("time") is None:
            parts.append(f"{k['kind']} {k['status']}")
        else:
            eff = f" ({k['efficiency']:.1%})" if k.get("efficiency") else ""
            chosen = " (chosen)" if k["status"] == "chosen" else ""
            parts.append(f"{k['kind']} {k['time'] * 1e3:.4g} ms{eff}{chosen}")
    return "plan kinds (predicted step time): " + ", ".join(parts)


def _describe(ins: Instruction, name: str) -> str:
    if isinstance(ins, Source):
        return f"{name} <- source {ins.layout!r}"
    if isinstance(ins, Compute):
        label = ins.strategy_key.split(":", 1)[0]
        ins_l = ", ".join(map(repr, ins.inputs))
        return f"{name} <- compute[{label}] ({ins_l}) -> {ins.output!r}"
    if isinstance(ins, Collective):
        variant = f" {ins.variant}" if ins.variant else ""
        return f"{name} <- {ins.op}{variant} {ins.src!r} -> {ins.dst!r}"
    if isinstance(ins, Loss):
        return f"loss {name} ({ins.layout!r})"
    return repr(ins)


def program_from_triples(theory: Any, parts: Sequence[Sequence[int]]) -> list[list[list[Instruction]]]:
    return [[list(theory.triples[k].instrs) for k in part] for part in parts]
