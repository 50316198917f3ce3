"""Plan quality on HAP's testbed under one cost model (HAP §7.2-7.4, Figs. 13, 14, 15).

For VGG19, ViT, BERT-Base and BERT-MoE (HAP Table 1; ``models`` builds them on the meta device)
on ``hap-testbed:N`` (N = 8, 16, 32, 64: 16 V100 first, then P100) this prices, by the stage cost
model of HAP §3.2 (``t(Q, B) = sum_stages comm_i(B) + max_j comp_ij(B_j)``):

* hapc: the planner's choice (:func:`hapc.planner.choose_plan`, issue 14): the least predicted step
  time of the two columns below and of data-parallel replicas of a pipeline (``pipeline xR``, each
  replica count and layout that tiles the cluster), the pipeline's micro-batch count chosen by cost
  among the batch's divisors (``[B micro]``); the cell names the kind;
* spmd: HAP alone -- the synthesized program with LP-balanced ratios (A*/DP alternating with the LP);
* pipeline: HARP alone -- stages over sub-meshes of the groups and hosts (HARP DP, 8 micro-batches),
  each stage an SPMD program on its sub-mesh;
* Megatron-3D: TP of degree t inside a host x pipeline stages (HARP DP) x R data-parallel replicas,
  8 micro-batches, degrees searched over what tiles the cluster; each stage the Megatron TP program
  on its t devices (:func:`megatron_3d`);
* DP-EV / DP-CP: data parallelism, even / compute-proportional ratios;
* TP: Megatron tensor parallelism with even shards (column- then row-parallel linears);
* FSDP: ZeRO-3 data parallelism, even ratios (``baseline="fsdp"``, :mod:`hapc.synth.baselines`):
  every parameter held sharded (weights, gradients, optimizer state: dim 0 where it has a unit per
  GPU), all-gathered before use and its gradient reduce-scattered; priced on a theory derived with
  ``param_comm=True`` (hapc's own columns are not: its default search does not shard parameters,
  so a cell where FSDP beats hapc is reported as a loss). hapc's runtime keeps a gathered weight
  for the backward instead of gathering it again, and the cost model charges it so (one all-gather
  forward, one reduce-scatter backward; the gathered weight in memory until the backward);
* EP: GShard expert parallelism (DP elsewhere), experts padded to a multiple of the device count
  with each expert keeping the real model's capacity (DeepSpeed-MoE's requirement, HAP §7.6).

Weak scaling as in HAP §7.1: 64 samples per GPU (32 for BERT-MoE), BERT-MoE with one expert per
GPU. The homogeneous subset (HAP §7.3: 32 P100, ``hap-homogeneous``) repeats the comparison. The
ablation (HAP §7.4, Fig. 15) maps HAP's components onto hapc's options:

* DP-EV   -- no HAP component;
* +Q      -- the program synthesizer, ratios fixed to even, padded collectives only, no SFB;
* +B      -- plus the load balancer (the ratio LP), still padded only, no SFB;
* +C      -- plus the communication optimisations of HAP §4.4 (padded *or* grouped collectives,
             sufficient-factor broadcasting): hapc as shipped.

Efficiency = (model flops / cluster peak flops) / predicted time (``Plan.efficiency``; the same
ideal time for a pipeline's time of the same global batch).

    python benchmarks/plan_quality.py [--quick] [--json out.json]
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _cli
import torch
from rich.console import Console

import hapc
from hapc import models
from hapc.api import synthesize_theory
from hapc.cluster import Cluster
from hapc.errors import HapcError
from hapc.planner import ideal_seconds
from hapc.synth.baselines import expert_parameters, needs_param_comm

HERE = Path(__file__).resolve().parent
SIZES = (8, 16, 32, 64)
METHODS = ("hapc", "spmd", "pipeline", "megatron-3d", "dp-ev", "dp-cp", "tp", "fsdp", "ep")
#: seconds the FSDP column may take per cell (see :func:`bounded`); beyond it the cell is n/a
FSDP_SECONDS = 120.0
NUM_MICRO = 8  # micro-batches of the HARP and Megatron-3D columns (hapc searches the count; 64 or 32 samples per GPU)
ABLATION = ("DP-EV", "+Q", "+B", "+C")
Factory = Callable[..., tuple[torch.nn.Module, Any]]


def paper_models(quick: bool) -> dict[str, Callable[[int], tuple[Factory, dict[str, Any]]]]:
    """name -> (m devices -> (factory, keyword arguments)); BERT-MoE's factory takes ``experts``."""
    if quick:  # tiny shapes, a dense model and the MoE one: the smoke run
        return {
            "VGG19": lambda m: (models.vgg, {"size": "tiny", "batch": 2 * m, "device": "meta"}),
            "BERT-MoE": lambda m: (models.bert, {"size": "tiny", "experts": m, "batch": 2 * m, "device": "meta"}),
        }
    return {
        "VGG19": lambda m: (models.vgg, {"size": "vgg19", "batch": 64 * m, "device": "meta"}),
        "ViT": lambda m: (models.vit, {"size": "base", "layers": 8, "batch": 64 * m, "device": "meta"}),
        "BERT-Base": lambda m: (models.bert, {"size": "base", "batch": 64 * m, "device": "meta"}),
        "BERT-MoE": lambda m: (models.bert, {"size": "base", "experts": m, "batch": 32 * m, "device": "meta"}),
    }


def _short(err: Exception) -> str:
    msg = str(err).split(";")[0].split(": ", 1)[-1]
    return msg if len(msg) <= 90 else msg[:87] + "..."


class Pricer:
    """Prices programs for one traced model on one cluster, deriving each theory variant once."""

    def __init__(self, model: torch.nn.Module, inputs: Any, cluster: Cluster):
        self.graph = hapc.trace(model, inputs)
        self.cluster = cluster
        self.theories: dict[tuple, Any] = {}

    def __call__(
        self, *, baseline: str | None = None, ratios: list[float] | None = None, comm_opt: bool = True
    ) -> dict[str, Any]:
        variants = ("padded", "grouped") if comm_opt else ("padded",)
        param_comm = needs_param_comm(baseline)  # fsdp: a theory whose parameters may be gathered
        key = (comm_opt, param_comm)
        derived = 0.0
        if key not in self.theories:
            t0 = time.perf_counter()
            self.theories[key] = hapc.derive(self.graph, sfb=comm_opt, variants=variants, param_comm=param_comm)
            derived = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            plan = synthesize_theory(self.theories[key], self.cluster, baseline=baseline, ratios=ratios)
        except HapcError as e:
            return {"error": _short(e)}
        experts = expert_parameters(self.graph)
        return {
            "experts_sharded": bool(experts) and all(plan.layout_of(r)[:1] == ["S(0)"] for r in experts),
            "time": plan.time,
            "efficiency": plan.efficiency,
            "ratios": [round(r * c, 4) for r, c in zip(plan.ratios, (t["count"] for t in plan.device_types))],
            "comm": plan.predicted["comm"],
            "gradients": plan.predicted["gradients"],
            "memory": max(plan.predicted["memory"]),
            "seconds": time.perf_counter() - t0,  # synthesis
            "derive_seconds": derived,  # the theory, where this call derived it (0: shared with an earlier one)
        }


def bounded(fn: Callable[[], dict[str, Any]], seconds: float, what: str) -> dict[str, Any]:
    """``fn()`` in a forked child, given up after ``seconds`` (an ``{"error": ...}`` cell then).

    For the FSDP column: a theory derived with ``param_comm=True`` keeps parameter-only chains
    (VGG's ``bias.view(-1, 1, 1)`` after its all-gather) as standalone triples, and the synthesizer
    places every such chain in the first segment's search, which then enumerates every subset of
    them (VGG19 on ``hap-testbed:8``: minutes, gigabytes). The search's own ``time_limit`` is only
    checked between segments, so the bound is a process's."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send(fn())
        except Exception as e:  # the cell's error
            send.send({"error": _short(e)})

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()  # the child holds the only writer: its death reads as EOF here
    try:
        if recv.poll(seconds):
            return recv.recv()
        return {"error": f"{what}: synthesis not done in {seconds:.0f} s (parameter chains searched in one segment)"}
    except EOFError:
        proc.join(5)
        return {"error": f"{what}: the pricing process died (exit code {proc.exitcode}; out of memory?)"}
    finally:
        proc.kill()
        proc.join()
        recv.close()


def even_ratios(cluster: Cluster) -> list[float]:
    n = sum(t.count for t in cluster.device_types())
    return [1.0 / n] * len(cluster.device_types())


def padded_ep(factory: Factory, kw: dict[str, Any], m: int, cluster: Cluster) -> dict[str, Any]:
    """Expert parallelism with the experts padded to a multiple of ``m``; every expert keeps the
    per-expert capacity of the real model (dummy experts cost compute and all-to-all volume)."""
    experts = kw["experts"]
    padded = math.ceil(experts / m) * m
    model, inputs = factory(**kw)
    tokens = inputs[0].numel()
    capacity = max(1, math.ceil(1.25 * tokens * 2 / experts))
    model, inputs = factory(**{**kw, "experts": padded, "capacity": capacity})
    out = Pricer(model, inputs, cluster)(baseline="ep")
    out["experts"] = padded
    return out


def pipelines(
    model: torch.nn.Module, inputs: Any, cluster: Cluster, ideal: float, theory: Any = None
) -> tuple[dict, dict]:
    """The HARP pipeline alone (one replica, ``NUM_MICRO`` micro-batches) and the best pipeline the
    planner finds: replicas, and the micro-batch count searched among the batch's divisors
    (:func:`hapc.planner.search_micro`, which starts at ``NUM_MICRO`` when it divides the batch).
    ``theory``: the whole batch's, already derived (choose_plan then takes the model's flops from
    its graph instead of tracing the whole batch once more)."""
    t0 = time.perf_counter()
    try:
        choice = hapc.choose_plan(model, cluster, inputs, kinds=("pipeline",), theory=theory)
    except HapcError as e:
        return {"error": _short(e)}, {"error": _short(e)}
    seconds = time.perf_counter() - t0
    cells = {}
    for k in choice.kinds:
        if k.plan_kind == "pipeline" and math.isfinite(k.time):
            cells[k.kind] = {
                "time": k.time, "efficiency": ideal / k.time, "kind": k.kind, "seconds": seconds,
                "num_micro": k.num_micro, "replicas": k.replicas,
            }  # fmt: skip
    plain = next((k for k in choice.kinds if k.replicas == 1 and k.num_micro == NUM_MICRO), None)
    alone = cells.get(plain.kind) if plain else None
    if alone is None:
        alone = {"error": _short(Exception(plain.reason)) if plain else f"{NUM_MICRO} micro-batches not priced"}
    best = min(cells.values(), key=lambda c: c["time"]) if cells else alone
    return alone, best


def megatron_3d(model: torch.nn.Module, inputs: Any, cluster: Cluster, ideal: float) -> dict[str, Any]:
    """Megatron-3D under the same cost model: tensor parallelism of degree ``t`` inside a host
    (each stage one ``t``-device sub-mesh running the Megatron TP program, even shards), pipeline
    stages placed by the HARP DP (across hosts, and inside one where it pays), ``R``-way data
    parallel replicas (every count dividing ``NUM_MICRO`` and layout that tiles the cluster);
    ``NUM_MICRO`` micro-batches. The least over ``t`` (1, 2, 4 .. a host) x ``R`` x layout."""
    from hapc.pipeline import micro_batches, plan_pipeline
    from hapc.pipeline.replicas import layouts
    from hapc.planner import replica_counts

    t0 = time.perf_counter()
    batch = inputs[0].shape[0]
    if batch % NUM_MICRO:
        return {"error": f"the batch of {batch} does not split into {NUM_MICRO} micro-batches"}
    micro = micro_batches(tuple(inputs), NUM_MICRO, batch)[0]
    theory = hapc.derive(hapc.trace(model, micro), sfb=True, variants=("padded", "grouped"))
    per_host = min(min(g.devices_per_host, g.devices) for g in cluster.groups)
    degrees = [t for t in (1, 2, 4, 8, 16) if t <= per_host and per_host % t == 0]
    cache: dict[str, Any] = {}
    best, why = None, "no degree tiles the cluster"
    for t in degrees:
        for R in [1, *replica_counts(cluster, NUM_MICRO)]:
            for layout in layouts(cluster, R) if R > 1 else ["blocked"]:
                try:
                    plan = plan_pipeline(
                        model, cluster, micro, num_micro=NUM_MICRO, theory=theory, replicas=R, layout=layout,
                        cache=cache, sizes=[t], baseline="tp",
                    )  # fmt: skip
                except HapcError as e:
                    why = _short(e)
                    continue
                if best is None or plan.time < best[0].time:
                    best = (plan, t, R, layout)
    if best is None:
        return {"error": why}
    plan, t, R, layout = best
    return {
        "time": plan.time,
        "efficiency": ideal / plan.time,
        "kind": f"tp{t} x pp{len(plan.stages)} x dp{R}" + (f" ({layout})" if R > 1 else ""),
        "seconds": time.perf_counter() - t0,
    }


def compare(factory: Factory, kw: dict[str, Any], cluster: Cluster, m: int) -> dict[str, Any]:
    """hapc (the planner's choice), its components and every baseline for one model on one cluster."""
    model, inputs = factory(**kw)
    price = Pricer(model, inputs, cluster)
    ideal = ideal_seconds(price.graph, cluster)
    row = {"spmd": price()}
    if "time" in row["spmd"]:
        row["spmd"]["kind"] = "spmd"
    row["pipeline"], best_pipe = pipelines(model, inputs, cluster, ideal, price.theories.get((True, False)))
    row["hapc"] = min(
        (c for c in (row["spmd"], best_pipe) if "time" in c), key=lambda c: c["time"], default=row["spmd"]
    )
    row["megatron-3d"] = megatron_3d(model, inputs, cluster, ideal)
    row["dp-ev"], row["dp-cp"] = price(baseline="dp-ev"), price(baseline="dp-cp")
    row["tp"] = price(baseline="tp")
    row["fsdp"] = bounded(lambda: price(baseline="fsdp"), FSDP_SECONDS, "fsdp")
    row["ep"] = padded_ep(factory, kw, m, cluster) if kw.get("experts") else {"error": "no MoE layer"}
    return row


def ablation(factory: Factory, kw: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    price = Pricer(*factory(**kw), cluster)
    return {
        "DP-EV": price(baseline="dp-ev"),
        "+Q": price(ratios=even_ratios(cluster), comm_opt=False),
        "+B": price(comm_opt=False),
        "+C": price(),
    }


def verdict(row: dict[str, Any]) -> dict[str, Any]:
    """Best feasible baseline and hapc's speedup over it (> 1: hapc faster)."""
    base = {k: v["time"] for k, v in row.items() if k != "hapc" and "time" in v}
    out: dict[str, Any] = {"best": None, "speedup": None, "vs_dp_cp": None}
    if "time" not in row["hapc"]:
        out["status"] = f"hapc found no plan ({row['hapc']['error']})"
        return out
    h = row["hapc"]["time"]
    if base:
        best = min(base, key=base.get)
        out.update(best=best, speedup=base[best] / h)
    if "time" in row["dp-cp"]:
        out["vs_dp_cp"] = row["dp-cp"]["time"] / h
    losers = [k for k, t in base.items() if t < h * (1 - 1e-9)]
    out["status"] = "hapc >= every baseline" if not losers else "hapc LOSES to " + ", ".join(losers)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    zoo = paper_models(quick)
    sizes = (8,) if quick else SIZES
    result: dict[str, Any] = {"quick": quick, "heterogeneous": {}, "homogeneous": {}, "ablation": {}}
    for name, make in zoo.items():
        for m in sizes:
            cluster = Cluster.load(f"hap-testbed:{m}")
            factory, kw = make(m)
            row = compare(factory, kw, cluster, m)
            row["verdict"] = verdict(row)
            result["heterogeneous"][f"{name}@{m}"] = row
            result["ablation"][f"{name}@{m}"] = ablation(factory, kw, cluster)
        m = 32  # hap-homogeneous: 4 hosts x 8 P100
        factory, kw = make(m)
        row = compare(factory, kw, Cluster.load("hap-homogeneous"), m)
        row["verdict"] = verdict(row)
        result["homogeneous"][f"{name}@{m}"] = row
    vgg = result["heterogeneous"].get("VGG19@32")
    if vgg:
        result["goal_vgg19_32"] = vgg["verdict"]["vs_dp_cp"]
    if not quick:
        result["gpt13b"] = gpt13b_case()
    result["seconds"] = time.perf_counter() - t0
    return result


def gpt13b_case() -> dict[str, Any]:
    """Issue 14's own case: ``hapc synth gpt-1.3b --cluster hap-testbed:16`` (the planner's choice
    among every kind, as the command prints it), 2.9 % efficient when SPMD was the only kind."""
    model, inputs = models.load("gpt-1.3b")
    t = time.perf_counter()
    choice = hapc.choose_plan(model, Cluster.load("hap-testbed:16"), inputs)
    return {
        "seconds": time.perf_counter() - t,
        "chosen": choice.chosen.kind,
        "time": choice.time,
        "efficiency": choice.chosen.efficiency,
        "kinds": [k.to_json() for k in choice.kinds],
    }


# ---- reporting ---------------------------------------------------------------------------------
def _ms(cell: dict[str, Any], kind: bool = False) -> str:
    if "time" not in cell:
        return "n/a"
    return f"{cell['time'] * 1e3:.1f}" + (f" ({cell['kind']})" if kind and "kind" in cell else "")


def _comparison_table(rows: dict[str, Any], methods: tuple[str, ...]) -> list[str]:
    head = ["model @ GPUs", *[f"{m} (ms)" for m in methods], "best baseline", "hapc speedup", "vs DP-CP", "verdict"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict[str, str] = {}
    for key, row in rows.items():
        cells = []
        for meth in methods:
            c = row[meth]
            cells.append(_ms(c, kind=meth in ("hapc", "megatron-3d")))
            if "error" in c and c["error"] != "no MoE layer":
                notes.setdefault(f"{meth}: {c['error']}", key)
        v = row["verdict"]
        sp = f"{v['speedup']:.2f}x" if v["speedup"] else "-"
        cp = f"{v['vs_dp_cp']:.2f}x" if v["vs_dp_cp"] else "-"
        out.append(f"| {key} | " + " | ".join(cells) + f" | {v['best'] or '-'} | {sp} | {cp} | {v['status']} |")
    if notes:
        out += ["", "n/a (first case where each reason occurs):", ""]
        out += [f"* {where}: {why}" for why, where in notes.items()]
    return out


def _gpt13b_lines(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    priced = [k for k in case["kinds"] if k["status"] in ("chosen", "feasible")]
    best = {}
    for k in priced:  # the least time per plan kind (spmd, pipeline, segmented)
        kind = k["kind"].split()[0]
        if kind not in best or k["time"] < best[kind]["time"]:
            best[kind] = k
    others = ", ".join(f"{k['kind']} {k['time'] * 1e3:.0f} ms ({k['efficiency'] * 100:.1f}%)" for k in best.values())
    skipped = [k["kind"] + f" {k['status']}" for k in case["kinds"] if k["status"] not in ("chosen", "feasible")]
    return [
        "### GPT-1.3B on hap-testbed:16 (issue 14's case: `hapc synth gpt-1.3b --cluster hap-testbed:16`)",
        "",
        f"hapc chooses **{case['chosen']}**: {case['time'] * 1e3:.0f} ms per step, **{case['efficiency'] * 100:.1f}%** "
        f"of the ideal time (goal >= 25 %; 2.9 % when SPMD was the only kind). Best of each kind: {others}. "
        f"{len(case['kinds'])} candidates listed, {len(priced)} priced"
        + (f", {len(skipped)} pruned / not applicable" if skipped else "")
        + f"; planned in {case['seconds']:.1f} s.",
        "",
    ]


def _efficiency_table(rows: dict[str, Any], methods: tuple[str, ...]) -> list[str]:
    out = ["| model @ GPUs | " + " | ".join(methods) + " |", "|" + "---|" * (len(methods) + 1)]
    for key, row in rows.items():
        cells = [f"{row[m]['efficiency'] * 100:.1f}%" if "time" in row[m] else "n/a" for m in methods]
        out.append(f"| {key} | " + " | ".join(cells) + " |")
    medians = []
    for m in methods:
        effs = sorted(row[m]["efficiency"] for row in rows.values() if "time" in row[m])
        medians.append(f"{statistics.median(effs) * 100:.1f}%" if effs else "n/a")
    out.append("| median (cells with a plan) | " + " | ".join(medians) + " |")
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "### Plan quality on hap-testbed (HAP Fig. 13)",
        "",
        "Predicted per-iteration time (ms) under one cost model; 16 V100 then P100, 8 per host, 10.4 Gbps "
        "between hosts. TP is pure Megatron tensor parallelism over all GPUs (n/a where a dimension has fewer "
        "whole units than GPUs); FSDP is ZeRO-3 data parallelism (every parameter sharded, all-gathered before use, "
        "gradients reduce-scattered; even ratios), priced on a theory with parameter communication, which hapc's "
        "own search does not use; EP pads experts to a multiple of the GPU count. hapc is the planner's choice "
        "(its kind in brackets) among spmd (HAP alone), pipeline (HARP alone, 8 micro-batches) and R data-parallel "
        "replicas of a pipeline (pipeline xR, blocked: a replica on whole hosts; strided: on a share of every host), "
        "the pipeline's micro-batch count B chosen by cost among the batch's divisors ([B micro]). megatron-3d: TP of "
        "degree t inside a host x pipeline stages x R data-parallel replicas, 8 micro-batches, (t, R, layout) searched "
        "(its degrees in brackets).",
        "",
        *_comparison_table(result["heterogeneous"], METHODS),
        "",
    ]
    goal = result.get("goal_vgg19_32")
    if goal is not None:
        met = "met" if goal >= 2 else "MISSED"
        lines += [f"VGG19 at 32 GPUs: hapc is {goal:.2f}x DP-CP (goal >= 2x, HAP measured 2.41x): **{met}**.", ""]
    losses = [k for k, r in result["heterogeneous"].items() if "LOSES" in r["verdict"]["status"]]
    losses += [f"{k} (homogeneous)" for k, r in result["homogeneous"].items() if "LOSES" in r["verdict"]["status"]]
    worse = [
        f"{key} ({a} {row[a]['time'] * 1e3:.1f} ms -> {b} {row[b]['time'] * 1e3:.1f} ms)"
        for key, row in result["ablation"].items()
        for a, b in itertools.pairwise(ABLATION)
        if "time" in row[a] and "time" in row[b] and row[b]["time"] > row[a]["time"] * (1 + 1e-9)
    ]
    lines += [
        f"hapc loses to a baseline in: {', '.join(losses)}." if losses else "hapc >= every baseline everywhere.",
        "",
    ]
    if losses or worse:
        lines += [
            "Why hapc can lose: the A*/DP search is exact for given ratios when the best program fits in "
            "memory, but (1) when it does not, the synthesis/LP loop prices memory (a penalty that grows "
            "tenfold per retry, then bisected once between the last price that failed and the first that fit), "
            "which need not find the fastest program that fits; (2) the alternation of synthesis and the ratio "
            "LP (HAP Eq. 1-2, started from speed-proportional ratios) stops at a fixed point that depends on the "
            "search space; (3) FSDP is priced with sharded, gathered parameters (``param_comm=True``), which "
            "hapc's default search does not consider: where memory binds, FSDP's smaller footprint can beat it."
            + (f" Ablation cases where the larger space predicts a slower plan: {', '.join(worse)}." if worse else ""),
            "",
        ]
    lines += [
        "### Predicted efficiency (ideal time / predicted time)",
        "",
        *_efficiency_table(result["heterogeneous"], METHODS),
        "",
        *_gpt13b_lines(result.get("gpt13b")),
        "### Homogeneous subset: 32 P100 (HAP Fig. 14)",
        "",
        *_comparison_table(
            result["homogeneous"], ("hapc", "spmd", "pipeline", "megatron-3d", "dp-ev", "tp", "fsdp", "ep")
        ),
        "",
        "### Ablation (HAP Fig. 15): predicted ms, and throughput relative to DP-EV",
        "",
        "+Q: synthesized program, even ratios, padded collectives, no SFB; +B: + ratio LP; "
        "+C: + grouped collectives and SFB (full hapc). Where DP-EV does not fit in memory (BERT-MoE) "
        "the ratio is to the first column that does.",
        "",
        "| model @ GPUs | " + " | ".join(ABLATION) + " |",
        "|" + "---|" * (len(ABLATION) + 1),
    ]
    for key, row in result["ablation"].items():
        base = _ablation_base(row)
        cells = []
        for k in ABLATION:
            c = row[k]
            if "time" not in c:
                cells.append("n/a")
            else:
                cells.append(f"{c['time'] * 1e3:.1f}" + (f" ({base / c['time']:.2f}x)" if base else ""))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", f"({result['seconds']:.0f} s to compute.)", ""]
    return "\n".join(lines)


def _ablation_base(row: dict[str, Any]) -> float | None:
    """The time the ablation is relative to: the first column that has a plan (DP-EV normally)."""
    return next((row[k]["time"] for k in ABLATION if "time" in row[k]), None)


def plot(result: dict[str, Any], outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(k.split("@")[0] for k in result["heterogeneous"]))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4))
    for ax, name in zip(axes, names):
        keys = [k for k in result["heterogeneous"] if k.split("@")[0] == name]
        gpus = [k.split("@")[1] for k in keys]
        width = 0.8 / len(METHODS)
        for i, meth in enumerate(METHODS):
            ys = [result["heterogeneous"][k][meth].get("time", float("nan")) * 1e3 for k in keys]
            ax.bar([x + i * width for x in range(len(keys))], ys, width, label=meth)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], gpus)
        ax.set_title(name)
        ax.set_xlabel("GPUs")
        ax.set_yscale("log")
    axes[0].set_ylabel("predicted ms / iteration")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(METHODS), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    paths = [outdir / "plan_quality.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(result["ablation"])), 3.4))
    keys = list(result["ablation"])
    width = 0.8 / len(ABLATION)
    for i, k in enumerate(ABLATION):
        ys = []
        for key in keys:
            row = result["ablation"][key]
            base, c = _ablation_base(row), row[k].get("time")
            ys.append(base / c if base and c else float("nan"))
        ax.bar([x + i * width for x in range(len(keys))], ys, width, label=k)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], keys, rotation=60, fontsize=7)
    ax.set_ylabel("throughput / DP-EV (or first that fits)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(outdir / "ablation.png")
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    args = _cli.parse("tiny models, 8 GPUs only (the smoke run)")
    result = run(args.quick)
    Console(width=160).print(markdown(result))
    _cli.save("plan_quality", result, args)


if __name__ == "__main__":
    main()
