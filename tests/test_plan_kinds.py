"""Plan-kind selection (issue 14, first bullet): HAP SPMD or a HARP pipeline, by predicted step time.

The planner (:mod:`hapc.planner`) prices each kind for the same global batch and takes the least;
``pipeline=True/False`` (``hapc synth --kind``) override it; kinds that cannot run are reported, not
raised; the pipeline runtime plans its stages through the planner, not the façade (no import cycle).
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hapc
from hapc.cli import main
from hapc.cluster import Cluster
from hapc.errors import InfeasibleError
from hapc.pipeline import PipelinePlan
from hapc.plan import Plan
from hapc.planner import KINDS, choose_plan
from hapc.testing import run_distributed
from models import load

ROOT = Path(__file__).resolve().parents[1]


def groups(between: str = "100 MB/s", memory: str = "8 GiB", per_group: int = 2) -> Cluster:
    """Two groups (20 and 10 TFLOP/s) with fast links inside and ``between`` across: HARP's setting
    in miniature when ``between`` is slow."""
    link = {"bandwidth": "10 GB/s", "latency": "20 us"}
    names = ("fast", "slow")
    return Cluster.from_dict(
        {
            "name": f"two-groups-{between.replace(' ', '')}",
            "group": [
                {"name": g, "devices": per_group, "devices_per_host": per_group, "flops": f, "memory": memory}
                for g, f in zip(names, ("20 TFLOPS", "10 TFLOPS"))
            ],
            "links": {
                "intra_host": link,
                "inter_host": link,
                "between": [{"groups": list(p), "bandwidth": between, "latency": "100 us"} for p in [names]],
            },
        }
    )


# The tests of the kind choice fix the micro-batch count (``num_micro=MICRO``, an override): the
# kinds are priced as with the searched count, in a quarter of the time (the search prices 8, 4, 2
# and 1 micro-batches). The searched default is checked by test_the_micro_batch_count_is_chosen_by_cost
# (exhaustively), test_compile_follows_the_planner_and_the_overrides, test_one_training_loop_serves_every_plan_kind,
# test_synth_lists_the_kinds_considered and tests/test_stagecost_cache.py.
MICRO = 8


def _times(choice) -> dict[str, float]:
    return {k.kind: k.time for k in choice.kinds}


def _check_argmin(choice) -> None:
    """The chosen entry is the least predicted time (ties: the first listed -- SPMD, then the plain
    pipeline, then fewer replicas); ``choice.kind`` is its plan kind ("pipeline xR" is a pipeline)."""
    times = _times(choice)
    best = min(times, key=times.get)  # the first of equal minima, in the order priced
    chosen = [k for k in choice.kinds if k.status == "chosen"]
    assert len(chosen) == 1 and chosen[0].kind == best and chosen[0].plan_kind == choice.kind
    assert choice.kind in KINDS and choice.time == times[best] and math.isfinite(choice.time)


@pytest.mark.parametrize(
    ("between", "want"),
    [("100 MB/s", "pipeline"), ("10 GB/s", "spmd")],
)
def test_the_cheaper_kind_is_chosen(between, want):
    """The same model and devices: across a slow link the pipeline (one activation transfer per
    micro-batch) beats SPMD (collectives and the gradient all-reduce cross it); across a fast one
    SPMD wins. Both are priced (finite) each time, and the choice is their argmin."""
    model, inputs = load("gpt", batch=8)
    choice = choose_plan(model, groups(between), inputs, num_micro=MICRO)
    times = _times(choice)
    # every kind priced (a segmented plan may be pruned unpriced: its boundaries' latency alone is no better)
    assert all(math.isfinite(k.time) for k in choice.kinds if k.status != "pruned"), choice.describe()
    assert math.isfinite(times["spmd"]) and math.isfinite(times["pipeline"]), choice.describe()
    _check_argmin(choice)
    assert choice.kind == want, choice.describe()
    assert isinstance(choice.plan, PipelinePlan if want == "pipeline" else Plan)
    # the plan itself records what was considered (its printout says so)
    recorded = choice.plan.kinds if want == "pipeline" else choice.plan.predicted["kinds"]
    assert {k["kind"]: k["time"] for k in recorded if k["status"] != "pruned"} == pytest.approx(
        {k.kind: k.time for k in choice.kinds if k.status != "pruned"}
    )
    assert [k["kind"] for k in recorded] == list(times)
    text = choice.plan.describe() if want == "pipeline" else str(choice.plan)
    assert "plan kinds (predicted step time): spmd" in text and "pipeline" in text and "(chosen)" in text


def test_every_priced_kind_has_an_efficiency_over_the_same_ideal_time():
    """Efficiency = (the step's model flops / the cluster's peak flop/s) / predicted time, for the
    pipeline kinds as for SPMD (``Plan.efficiency``): one ideal time, so efficiencies rank as times."""
    model, inputs = load("gpt", batch=8)
    choice = choose_plan(model, groups("100 MB/s"), inputs, num_micro=MICRO)
    spmd = choose_plan(model, groups("100 MB/s"), inputs, kinds=("spmd",)).plan
    ideal = spmd.efficiency * spmd.time
    priced = [k for k in choice.kinds if math.isfinite(k.time)]
    assert len(priced) >= 2 and ideal > 0
    for k in priced:
        assert k.efficiency == pytest.approx(ideal / k.time, rel=1e-9), k.kind
    assert next(k for k in priced if k.kind == "spmd").efficiency == pytest.approx(spmd.efficiency, rel=1e-9)
    assert f"{priced[0].efficiency:.1%}" in choice.plan.describe()  # the pipeline printout shows it
    for k in choice.kinds:
        if not math.isfinite(k.time):
            assert k.efficiency == 0.0


def test_the_two_predictions_are_for_the_same_batch():
    """The pipeline's Eq. 12 time is for ``num_micro`` micro-batches of ``batch / num_micro`` rows:
    twice the batch (and micro-batch) costs more than the link latencies alone (which stay), as
    SPMD's time grows with the batch too -- neither is priced per micro-batch or per sample."""
    model, small = load("mlp", batch=8)
    _, big = load("mlp", batch=16)
    t1, t2 = (_times(choose_plan(model, groups("1 MB/s"), x, num_micro=8)) for x in (small, big))
    assert 1.4 < t2["pipeline"] / t1["pipeline"] < 2.1, (t1, t2)
    assert 1.4 < t2["spmd"] / t1["spmd"] < 2.1, (t1, t2)


def test_an_infeasible_kind_is_reported_not_raised():
    """Devices too small for SPMD's replicated weights and whole-batch activations, but not for
    a pipeline's stages: SPMD is reported infeasible (with the memory shortfall), the pipeline runs."""
    model, inputs = load("gpt", batch=8)
    choice = choose_plan(model, groups("10 GB/s", memory="400 KiB"), inputs, num_micro=MICRO)
    spmd, pipe = choice.kinds[:2]  # then the pipeline's data-parallel replicas, where they fit
    assert spmd.status == "infeasible" and math.isinf(spmd.time) and "memory" in spmd.reason
    assert choice.kind == "pipeline" and pipe.status in ("chosen", "feasible") and math.isfinite(pipe.time)
    _check_argmin(choice)


def test_not_applicable_kinds_and_no_kind_left():
    model, inputs = load("mlp", batch=6)
    # an explicit micro-batch count is an override: one that does not divide the batch (6 rows into 8)
    # is refused, naming the fix; where no pipeline applies anyway it does not matter
    fix = r"8 equal micro-batches.*divides it \(1, 2, 3, 6\).*leave num_micro unset"
    with pytest.raises(hapc.HapcError, match=fix):
        choose_plan(model, groups(), inputs, num_micro=8)
    assert choose_plan(model, groups(), inputs, num_micro=8, kinds=("spmd",)).kind == "spmd"
    three = choose_plan(model, groups(), inputs, num_micro=3)
    piped = [k for k in three.kinds if k.plan_kind == "pipeline"]
    assert math.isfinite(piped[0].time) and {k.num_micro for k in piped} == {3}
    _check_argmin(three)
    # a baseline is an SPMD program: the pipeline is not priced
    base = choose_plan(model, groups(), inputs, num_micro=3, synth_options={"baseline": "dp-ev"})
    assert base.kind == "spmd" and base.kinds[1].status == "not applicable" and "baseline" in base.kinds[1].reason
    # nothing fits anywhere: one error naming every kind's reason
    with pytest.raises(InfeasibleError, match=r"spmd: infeasible.*pipeline: infeasible"):
        choose_plan(model, groups(memory="1 KiB"), inputs, num_micro=3)
    with pytest.raises(hapc.HapcError, match="unknown plan kind"):
        choose_plan(model, groups(), inputs, kinds=("megatron",))


# the GPT landscape (8 counts, each priced alone: ~25 s on CI) runs in `make test-slow`; the MLP's
# exercises the same search and exhaustive check in the default suite
@pytest.mark.parametrize(
    ("alias", "batch", "between"),
    [("mlp", 6, "100 MB/s"), pytest.param("gpt", 24, "1 GB/s", marks=pytest.mark.slow)],
)
def test_the_micro_batch_count_is_chosen_by_cost(alias, batch, between):
    """Without ``num_micro`` the planner prices micro-batch counts that divide the batch (6 rows: the
    old fixed 8 did not apply at all) and takes the cheapest: the choice equals the least time over
    every count priced on its own (an exhaustive check of the local search on these two landscapes,
    where the least over replica counts jumps between odd and even counts), and every entry priced
    is listed with its count."""
    from hapc.planner import micro_candidates

    model, inputs = load(alias, batch=batch)
    cluster = groups(between)
    choice = choose_plan(model, cluster, inputs, kinds=("pipeline",))
    _check_argmin(choice)
    counts = micro_candidates(batch, cluster.num_devices)
    assert counts == [d for d in range(1, min(batch, 16) + 1) if batch % d == 0]  # 4 devices: up to 4 x 4
    each = {B: choose_plan(model, cluster, inputs, kinds=("pipeline",), num_micro=B).time for B in counts}
    assert choice.time == pytest.approx(min(each.values()), rel=1e-12), (choice.describe(), each)
    priced = [k for k in choice.kinds if k.plan_kind == "pipeline"]
    assert all(f"[{k.num_micro} micro]" in k.kind for k in priced)
    chosen = choice.chosen
    assert choice.plan.num_micro * choice.plan.replicas == chosen.num_micro
    # the old fixed count is one of those priced, and never better than the choice
    if batch % 8 == 0:
        assert choice.time <= each[8]


def test_a_model_returning_more_than_its_loss_is_not_pipelined_by_the_choice():
    """The choice by cost must not change what the call returns: a pipeline hands back a model's
    other outputs concatenated over micro-batches, so one without a batch dimension (a scalar) only
    the SPMD module hands back. An explicit pipeline still plans. (Logits and other batch-major
    outputs do pipeline: tests/test_pipeline_outputs.py.)"""
    model, inputs = load("gpt", batch=8)
    plain = choose_plan(model, groups("100 MB/s"), inputs, num_micro=MICRO)
    assert plain.kind == "pipeline"  # the cluster where the loss-only model pipelines
    extra = choose_plan(_WithExtra(model), groups("100 MB/s"), inputs, num_micro=MICRO)
    assert extra.kind == "spmd" and extra.kinds[1].status == "not applicable"
    assert "dim 0" in extra.kinds[1].reason and "pipeline=True" in extra.kinds[1].reason
    forced = choose_plan(_WithExtra(model), groups("100 MB/s"), inputs, kinds=("pipeline",), num_micro=MICRO)
    assert forced.kind == "pipeline"


def test_only_the_requested_kinds_are_priced():
    model, inputs = load("gpt", batch=8)
    only = choose_plan(model, groups("100 MB/s"), inputs, kinds=("spmd",))
    assert only.kind == "spmd" and only.kinds[1].status == "overridden" and math.isinf(only.kinds[1].time)
    forced = choose_plan(model, groups("10 GB/s"), inputs, kinds=("pipeline",), num_micro=MICRO)
    assert forced.kind == "pipeline" and forced.kinds[0].status == "overridden"


# -- hapc.compile: the default follows the planner, pipeline=True/False override it -----------------


class _WithExtra(torch.nn.Module):
    """A model returning ``(loss, a scalar the loss is computed from)``: the scalar has no batch
    dimension a pipeline could concatenate its micro-batches' values along."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = self.model(idx, targets) * 2
        return scaled / 2, scaled


def _compile_kinds(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name, cluster in (("slow", groups("100 MB/s", per_group=1)), ("fast", groups("10 GB/s", per_group=1))):
        for pipeline in (None, True, False):
            model, inputs = load("gpt", batch=8, dtype=torch.float64)
            m = hapc.compile(model, cluster, inputs, pipeline=pipeline)
            kinds = m.plan_kinds if hasattr(m, "plan_kinds") else m.plan.predicted.get("kinds")
            out[name, pipeline] = (type(m).__name__, kinds)
    # the same model returning a scalar besides its loss: only the SPMD module hands it back (a pipeline
    # would concatenate the micro-batches' values), so the planner is not asked to pick a pipeline
    model, inputs = load("gpt", batch=8, dtype=torch.float64)
    m = hapc.compile(_WithExtra(model), groups("100 MB/s", per_group=1), inputs)
    out["extra", None] = (type(m).__name__, m.plan.predicted.get("kinds"))
    return out


def test_compile_follows_the_planner_and_the_overrides():
    results = run_distributed(_compile_kinds, 2, timeout=300)
    assert results[0] == results[1]  # every rank compiled the same kind
    got = results[0]
    for name, want in (("slow", "pipeline"), ("fast", "spmd")):
        module, kinds = got[name, None]
        assert module == ("PipelineModule" if want == "pipeline" else "CompiledModule"), (name, kinds)
        # every entry priced but those pruned (an Eq. 12 lower bound no better than a pipeline priced)
        times = {k["kind"]: k["time"] for k in kinds if k["status"] != "pruned"}
        # the plan kind of the least entry ("pipeline [2 micro]": the count is searched by default)
        assert min(times, key=times.get).split()[0] == want and all(t is not None for t in times.values())
        assert got[name, True][0] == "PipelineModule"
        module, kinds = got[name, False]
        assert module == "CompiledModule" and [k["status"] for k in kinds] == ["chosen", "overridden", "overridden"]
    module, kinds = got["extra", None]  # on the cluster where the plain model pipelines
    statuses = [k["status"] for k in kinds]
    assert module == "CompiledModule" and statuses[:2] == ["chosen", "not applicable"], statuses
    assert "not applicable" not in statuses[2:]  # per-segment ratios hand a scalar back as SPMD does
    assert "dim 0" in kinds[1]["reason"] and "pipeline=True" in kinds[1]["reason"]


def _two_steps(model, inputs, ddp_style: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        if ddp_style:
            loss = model(*inputs)
            loss.backward()
        else:
            loss = model.train_step(*inputs)
        losses.append(float(loss))
        opt.step()
    return losses


def _one_loop(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name, between in (("slow", "100 MB/s"), ("fast", "10 GB/s")):
        for ddp_style in (False, True):
            model, inputs = load("gpt", batch=8, dtype=torch.float64)
            module = hapc.compile(model, groups(between, per_group=1), inputs)
            losses = _two_steps(module, inputs, ddp_style)
            got = {"kind": type(module).__name__, "losses": losses, "state": module.full_state_dict()}
            if ddp_style:  # then: an evaluation, and a backward of a scaled loss
                with torch.no_grad():
                    got["eval"] = float(module(*inputs))
                module.zero_grad()
                (3 * module(*inputs)).backward()
                got["grads"] = module.full_gradients()
            if ddp_style and name == "slow":  # the pipeline refuses what it cannot run exactly
                first, second = module(*inputs), module(*inputs)  # the first one's forwards are dropped
                with pytest.raises(hapc.HapcError) as accumulate:
                    (first + second).backward()
                with pytest.raises(hapc.HapcError) as seeds:
                    (module(*inputs) * (1 + rank)).backward()
                loss = module(*inputs)
                loss.backward(retain_graph=True)  # on one device a second backward adds the gradients again
                with pytest.raises(hapc.HapcError) as again:
                    loss.backward()
                got["refused"] = [str(accumulate.value), str(seeds.value), str(again.value)]
            out[name, ddp_style] = got
    return out


def test_one_training_loop_serves_every_plan_kind():
    """``loss = module.train_step(*batch)``, and DDP's ``loss = module(*batch); loss.backward()``,
    train whichever kind the planner chose -- a pipeline on the slow link, SPMD on the fast one --
    exactly as one device does (float64, 2 steps); then a no-grad evaluation and the gradients of
    ``3 * loss`` equal one device's."""
    results = run_distributed(_one_loop, 2, timeout=300)
    model, inputs = load("gpt", batch=8, dtype=torch.float64)
    want = _two_steps(model, inputs, True)
    state = model.state_dict()
    with torch.no_grad():
        evaluation = float(model(*inputs))
    model.zero_grad()
    (3 * model(*inputs)).backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    for r in results:
        for (name, ddp_style), got in r.items():
            what = f"{name}, {'module(*batch)' if ddp_style else 'train_step'}"
            assert got["kind"] == ("PipelineModule" if name == "slow" else "CompiledModule"), what
            assert got["losses"] == pytest.approx(want, rel=1e-10), what
            assert set(got["state"]) == set(state), what
            for k, v in state.items():
                torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=f"{what}: {k}")
            if ddp_style and name == "slow":
                accumulate, seeds, again = got["refused"]
                assert "followed by another forward" in accumulate and "one backward per forward" in accumulate
                assert "differs between the ranks (from 1 to 2)" in seeds
                assert "backpropagated already" in again and "retain_graph=True does not keep them" in again
            if ddp_style:
                assert got["eval"] == pytest.approx(evaluation, rel=1e-10), what
                for k, v in grads.items():
                    torch.testing.assert_close(got["grads"][k], v, rtol=1e-9, atol=1e-12, msg=f"{what}: grad {k}")


# -- the layering: the pipeline runtime plans through hapc.planner, not the façade ------------------


def test_the_pipeline_runtime_does_not_import_the_facade():
    code = (
        "import sys\n"
        "import hapc.pipeline.runtime as r\n"
        "r._theory_options({'sfb': True})\n"  # runs the runtime's lazy planner imports
        "from hapc.planner import synthesize_theory\n"
        "print('hapc.api' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "False", out.stderr
    # and no module below the façade imports it, lazily or not
    for path in [ROOT / "hapc" / "planner.py", *(ROOT / "hapc" / "pipeline").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                name = "." * node.level + (node.module or "")
                assert not name.endswith("api") and name != "hapc.api", f"{path.name} imports {name}"


def test_synthesize_theory_is_still_importable_from_the_facade():
    from hapc import api, planner

    assert api.synthesize_theory is planner.synthesize_theory


# -- hapc synth ---------------------------------------------------------------------------------------


def test_cli_kinds_match_the_planner():
    from hapc.cli import KINDS as CLI_KINDS

    assert CLI_KINDS == KINDS


def test_synth_lists_the_kinds_considered(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["synth", "gpt", "--cluster", "local-cpu:3", "--arg", "batch=8"]) == 0
    out = capsys.readouterr().out
    assert "plan kinds considered" in out
    rows = {
        line.split()[1]: line for line in out.splitlines() if line.startswith("│ spmd") or line.startswith("│ pipeline")
    }
    assert set(rows) == {"spmd", "pipeline"} and "chosen" in rows["spmd"] and "feasible" in rows["pipeline"]
    assert main(["synth", "gpt", "--cluster", "local-cpu:3", "--arg", "batch=8", "--kind", "spmd"]) == 0
    assert "overridden" in capsys.readouterr().out
    # a cluster where the pipeline wins: the stage table follows the kinds
    path = tmp_path / "slow.toml"
    path.write_text(groups("100 MB/s").to_toml())
    trace = tmp_path / "trace.json"
    assert main(["synth", "gpt", "--cluster", str(path), "--arg", "batch=8", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "plan kinds considered" in out and "pipelined on" in out and "Eq. 12 step time" in out
    assert out.index("plan kinds considered") < out.index("pipelined on")
    assert trace.exists() and "traceEvents" in trace.read_text()
    # a planning command writes no file unless asked (--trace FILE); a fixed count prices faster
    assert main(["synth", "gpt", "--cluster", str(path), "--arg", "batch=8", "--micro", str(MICRO)]) == 0
    assert "--trace FILE" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.toml", "trace.json"]
