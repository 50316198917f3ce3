"""Mixed precision (issue 14): ``precision="bf16"`` planned (``hapc.theory.precision``, the cost
model at ``flops_bf16``) and run (the compiled module's forward under ``torch.autocast``).

The runtime checks compare hapc on 2-3 gloo processes at uneven ratios with single-device
``torch.autocast("cpu", torch.bfloat16)`` training of the same fp32 model: the loss, every
parameter's gradient and three SGD steps (losses and parameters). Exact agreement is impossible --
see :data:`TOL` for the bound and why -- so each check also asserts that the run is *not* fp32
training (its gradients differ from single-device fp32 ones by more than fp32 rounding could), which
is what a runtime that forgot autocast would produce and still pass the bf16 bound with.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from harness import two_groups

import hapc
from hapc import models
from hapc.cli import main
from hapc.cluster import Cluster
from hapc.errors import HapcError
from hapc.plan import Plan
from hapc.testing import run_distributed
from hapc.theory import derive, trace
from hapc.theory.instructions import Source

BF16 = torch.bfloat16
#: The bf16 bound, relative to a tensor kind's scale (the largest |value| among all gradients, or all
#: parameters): bf16 keeps 8 significant bits, so one rounding moves a value by at most 2^-9 of
#: itself. Single-device autocast rounds each matmul output once; hapc's program rounds differently
#: in a few places per layer -- a sharded contraction rounds each rank's partial sum and the bf16
#: all-reduce rounds their sum again, and a row-parallel Linear adds its bias after that rounding (in
#: fp32) where F.linear rounds after it -- each a rounding of up to 2^-9 of the largest term of that
#: output. Through the tiny models' 2-4 layers, the backward and 3 SGD steps these compound to a few
#: 2^-8: the runs below measure <= ~1.3 * 2^-8 of the scale; 4 * 2^-8 (1.6 %) leaves room. A
#: gradient that is zero in exact arithmetic (the attention key bias: softmax ignores it) is pure
#: rounding noise of the scale's size, hence the absolute bound on the scale, not on each tensor.
TOL = 4 * 2**-8
#: fp32 rounding noise is ~1e-7 of the scale and hapc's float32 runs agree to 1e-6; bf16 autocast
#: moves gradients by ~2^-8 of the scale (measured 3e-3). A "bf16" run closer than this to fp32
#: training did not run under autocast.
NOT_FP32 = 2**-12


def _cluster(flops: list[float], bandwidth: str = "2 GB/s", bf16: float = 1.0, latency: str = "50 us") -> Cluster:
    """One device per group (each its own ratio), ``flops_bf16 = bf16 x flops``."""
    link = {"bandwidth": bandwidth, "latency": latency}
    return Cluster.from_dict(
        {
            "name": "bf16-test",
            "group": [
                {
                    "name": f"d{i}",
                    "devices": 1,
                    "devices_per_host": 1,
                    "flops": f,
                    "flops_bf16": f * bf16,
                    "memory": "4 GiB",
                }
                for i, f in enumerate(flops)
            ],
            "links": {"intra_host": link, "inter_host": link},
        }
    )


def _param_layouts(plan: Plan) -> set[str]:
    th = plan._theory  # type: ignore[attr-defined]
    return {str(i.layout) for i in plan.instructions if isinstance(i, Source) and th.graph[i.ref].kind == "param"}


def _train(module: Any, inputs: Any, user_autocast: bool, steps: int = 3) -> dict[str, Any]:
    """Loss and gradients of the first step, then ``steps`` SGD steps (losses); backward outside autocast."""
    ctx = torch.autocast("cpu", dtype=BF16) if user_autocast else torch.autocast("cpu", enabled=False)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        with ctx:
            loss = module(*inputs)
        loss.backward()
        if grads is None:
            grads = (
                module.full_gradients()
                if hasattr(module, "full_gradients")
                else {k: p.grad.detach().clone() for k, p in module.named_parameters()}
            )
        losses.append(float(loss.detach()))
        opt.step()
    state = module.full_state_dict() if hasattr(module, "full_state_dict") else module.state_dict()
    return {"losses": losses, "grads": grads, "state": {k: v.detach().clone() for k, v in state.items()}}


def _job(rank: int, world: int, alias: str, mkw: dict, cluster: Cluster, plan: Any, user_autocast: bool) -> dict:
    torch.set_num_threads(1)
    model, inputs = models.load(alias, **mkw)
    if plan is None:  # planned here, by rank 0, for bf16
        module = hapc.compile(model, cluster, inputs, pipeline=False, precision="bf16")
        assert module.plan.options["precision"] == "bf16"
    else:
        module = hapc.compile(model, cluster, inputs, plan=plan)  # a saved plan: precision travels in its JSON
    return _train(module, inputs, user_autocast)


def _single(alias: str, mkw: dict, autocast: bool) -> dict:
    model, inputs = models.load(alias, **mkw)
    return _train(model, inputs, autocast)


def _scale(tensors: dict[str, torch.Tensor]) -> float:
    return max(float(t.abs().max()) for t in tensors.values() if t.is_floating_point())


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference of any tensor, relative to the scale of ``want``."""
    assert set(got) == set(want)
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want) / _scale(want)


def check_bf16(results: list[dict], alias: str, mkw: dict) -> None:
    """Every rank's run equals single-device bf16 autocast training within :data:`TOL`, and is
    farther than :data:`NOT_FP32` from single-device fp32 training."""
    bf16, fp32 = _single(alias, mkw, True), _single(alias, mkw, False)
    params = {k: v for k, v in bf16["state"].items() if v.is_floating_point()}
    for rank, res in enumerate(results):
        for a, b in zip(res["losses"], bf16["losses"]):
            assert abs(a - b) <= TOL * abs(b), f"rank {rank}: losses {res['losses']} vs autocast {bf16['losses']}"
        assert _worst(res["grads"], bf16["grads"]) <= TOL, f"rank {rank}: gradients beyond bf16 rounding"
        got = {k: res["state"][k] for k in params}
        assert _worst(got, params) <= TOL, f"rank {rank}: parameters after 3 steps beyond bf16 rounding"
        assert _worst(res["grads"], fp32["grads"]) > NOT_FP32, f"rank {rank} trained in fp32, not under autocast"


CASES = [
    # data parallel at ratios 0.6 / 0.4
    ("gpt-dp2", "gpt", [3e9, 2e9], "2 GB/s", {"baseline": "dp-cp"}, lambda p: _param_layouts(p) == {"R"}),
    # a slow link: the optimum shards weights (tensor-parallel pieces, bf16 partial sums all-reduced)
    ("gpt-sharded3", "gpt", [5e9, 3e9, 2e9], "10 MB/s", {}, lambda p: _param_layouts(p) != {"R"}),
    # fixed uneven ratios 0.5 / 0.3 / 0.2 on a slow link: sharded weights at uneven shards
    (
        "mlp-ratios3",
        "mlp",
        [5e9, 3e9, 2e9],
        "10 MB/s",
        {"ratios": (0.5, 0.3, 0.2)},
        lambda p: _param_layouts(p) != {"R"},
    ),
]


@pytest.mark.parametrize(("name", "alias", "flops", "bw", "synth", "expect"), CASES, ids=[c[0] for c in CASES])
def test_bf16_plans_train_like_single_device_autocast(tmp_path, name, alias, flops, bw, synth, expect):
    """hapc.compile of a ``precision="bf16"`` plan runs its forward under autocast by itself."""
    cluster = _cluster(flops, bw)
    model, inputs = models.load(alias)
    plan = hapc.synthesize(model, cluster, inputs, precision="bf16", **synth)
    assert expect(plan), f"{name}: the plan does not exercise what it is for:\n{plan}"
    assert len(set(plan.device_ratios)) > 1, plan.device_ratios  # uneven shares
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["options"]["precision"] == "bf16"
    results = run_distributed(_job, len(flops), alias, {}, cluster, str(path), False, timeout=300)
    check_bf16(results, alias, {})


def test_user_autocast_around_an_fp32_plan():
    """A plan without precision, called inside the user's own ``torch.autocast("cpu", bf16)``: the
    program's ops run under it as the model's would (what AMP users write today)."""
    cluster = _cluster([3e9, 2e9])
    model, inputs = models.load("gpt")
    plan = hapc.synthesize(model, cluster, inputs, baseline="dp-cp")
    assert "precision" not in plan.options
    results = run_distributed(_job, 2, "gpt", {}, cluster, plan, True, timeout=300)
    check_bf16(results, "gpt", {})


def test_compile_plans_bf16_itself():
    """``hapc.compile(..., precision="bf16")`` without a plan: rank 0 plans for bf16 and every rank
    runs the plan under autocast."""
    results = run_distributed(_job, 2, "gpt", {}, _cluster([3e9, 2e9]), None, False, timeout=300)
    check_bf16(results, "gpt", {})


def _pipe_job(rank: int, world: int, cluster: Cluster) -> dict:
    torch.set_num_threads(1)
    model, inputs = models.load("gpt", batch=4)
    module = hapc.compile(model, cluster, inputs, pipeline=True, num_micro=2, precision="bf16")
    assert type(module).__name__ == "PipelineModule"
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for _ in range(3):
        opt.zero_grad()
        losses.append(float(module.train_step(*inputs)))
        grads = grads or module.full_gradients()
        opt.step()
    return {"losses": losses, "grads": grads, "state": module.full_state_dict()}


def test_bf16_pipeline_stages_run_under_autocast():
    """A two-stage pipeline with ``precision="bf16"``: each stage's program runs under autocast, the
    cut travels in the traced dtype; it trains like single-device autocast."""
    cluster = Cluster.from_dict(
        {**two_groups().to_dict(), "group": [{**g, "flops_bf16": g["flops"]} for g in two_groups().to_dict()["group"]]}
    )
    results = run_distributed(_pipe_job, 2, cluster, timeout=300)
    check_bf16(results, "gpt", {"batch": 4})


# -- planning --------------------------------------------------------------------------------------


def test_the_theory_carries_autocast_dtypes_and_fp32_master_weights():
    model, inputs = models.load("gpt", batch=8)
    graph = trace(model, inputs)
    full, half = derive(graph), derive(graph, precision="bf16")
    assert half.precision == "bf16" and full.precision is None
    assert graph.fingerprint() != half.graph.fingerprint()  # a plan for one is refused for the other
    linears = [n for n in half.graph if n.op == "linear"]
    assert linears and all(n.meta.dtype == BF16 for n in linears)
    assert all(graph[n.index].meta.dtype == torch.float32 for n in linears)  # the traced graph is untouched
    assert all(n.meta.dtype == torch.float32 for n in half.graph if n.op in ("cross_entropy", "layer_norm"))
    assert all(n.meta.dtype == torch.float32 for n in half.graph if n.kind == "param")
    # nn.Linear's bias add is fused back into F.linear by the program: bf16 too; the residual adds promote to fp32
    adds = [n for n in half.graph if n.op == "add"]
    biased = [n for n in adds if any(half.graph[o].op == "linear" for o in n.operands)]
    assert biased and all(n.meta.dtype == BF16 for n in biased)
    assert all(n.meta.dtype == torch.float32 for n in adds if n not in biased)

    def param_costs(th):  # the raw theory's source triples (unfused): a replicated parameter's own cost
        return {
            th.graph[t.instrs[0].ref].target: t.cost
            for t in th.triples
            if len(t.instrs) == 1 and isinstance(t.instrs[0], Source) and th.graph[t.instrs[0].ref].kind == "param"
            and str(t.instrs[0].layout) == "R"
        }  # fmt: skip

    a, b = param_costs(derive(graph, optimise=False)), param_costs(derive(graph, optimise=False, precision="bf16"))
    w, ln = "blocks.0.attn.q.weight", "blocks.0.ln1.weight"
    assert {w, ln} <= set(a) and {w, ln} <= set(b)
    # fp32 master weights: parameter bytes (x4 for weights, grads and Adam) and gradient all-reduce unchanged
    assert b[w].param_bytes == a[w].param_bytes and b[w].grad_comm == a[w].grad_comm
    # autocast's half copy of a matmul weight is saved for the backward: 2 bytes per element
    numel = next(n.meta.numel for n in graph.params if n.target == w)
    assert a[w].act_bytes.at(1.0) == 0 and b[w].act_bytes.at(1.0) == 2 * numel
    assert a[ln].act_bytes.at(1.0) == b[ln].act_bytes.at(1.0) == 0  # layer norm runs in fp32: no copy


def _plans(cluster: Cluster, **synth: Any) -> tuple[Plan, Plan]:
    model, inputs = models.load("gpt", batch=8)
    return (
        hapc.synthesize(model, cluster, inputs, **synth),
        hapc.synthesize(model, cluster, inputs, precision="bf16", **synth),
    )


def test_bf16_shrinks_predicted_communication_and_memory():
    """The same program kind at the same ratios: tensor parallelism's activation collectives move
    bf16 (the predicted communication falls), the gradient all-reduce stays fp32, and the activations
    held shrink more than the weights' half copies add."""
    fp32, bf16 = _plans(_cluster([1e10] * 2, latency="0 us"), baseline="tp")  # comm: bytes / bandwidth
    assert fp32.device_ratios == bf16.device_ratios
    # every collective of the TP plan moves a matmul's (bf16) output: measured exactly half the bytes
    assert bf16.predicted["comm"] <= 0.6 * fp32.predicted["comm"], (fp32.predicted, bf16.predicted)
    assert bf16.predicted["gradients"] == pytest.approx(fp32.predicted["gradients"])
    assert all(b < a for a, b in zip(fp32.predicted["memory"], bf16.predicted["memory"]))
    fp32, bf16 = _plans(_cluster([3e9, 2e9]), baseline="dp-cp")
    assert all(b < a for a, b in zip(fp32.predicted["memory"], bf16.predicted["memory"]))


def test_bf16_compute_is_priced_at_flops_bf16():
    """Data parallel at fixed ratios, no memory-bandwidth term: compute is flops / rate, so a cluster
    whose ``flops_bf16`` is 4x its ``flops`` predicts a quarter of the compute; ``"fp32"`` is the default."""
    cluster = _cluster([3e9, 2e9], bf16=4.0)
    fp32, bf16 = _plans(cluster, baseline="dp-cp")
    assert bf16.predicted["comp"] == pytest.approx(fp32.predicted["comp"] / 4, rel=1e-9)
    assert [t["flops"] for t in bf16.device_types] == [1.2e10, 8e9]
    model, inputs = models.load("gpt", batch=8)
    same = hapc.synthesize(model, cluster, inputs, baseline="dp-cp", precision="fp32")
    assert same.time == fp32.time and same.predicted["memory"] == fp32.predicted["memory"]


def test_a_cluster_without_the_rate_and_bad_values_are_refused():
    model, inputs = models.load("gpt", batch=8)
    bare = Cluster.from_dict({"group": [{"name": "g", "devices": 2, "flops": 1e10, "memory": "4 GiB"}]})
    with pytest.raises(HapcError, match="flops_bf16"):
        hapc.synthesize(model, bare, inputs, precision="bf16")
    for bad in ("bfloat16", "int8", 16):
        with pytest.raises(HapcError, match="precision"):
            hapc.synthesize(model, "local-cpu:2", inputs, precision=bad)
    with pytest.raises(HapcError, match="flops_fp16"):
        Cluster.from_dict({"group": [{"name": "g", "devices": 1, "flops": 1e10, "flops_fp16": -1, "memory": 1e9}]})


def test_the_rates_round_trip_and_leave_fp32_alone(tmp_path):
    """``flops_bf16`` / ``flops_fp16`` are read, validated, saved and fingerprinted like the other
    keys; presets give datasheet values; without precision nothing reads them."""
    text = (
        'name = "c"\n[[group]]\nname = "a100"\ndevices = 2\nflops = "156 TFLOPS"\nflops_bf16 = "150 TFLOPS"\n'
        'memory = "40 GiB"\n'
    )
    (tmp_path / "c.toml").write_text(text)
    c = Cluster.load(tmp_path / "c.toml")
    assert c.groups[0].flops_bf16 == 150e12 and c.groups[0].flops_fp16 is None
    (tmp_path / "d.toml").write_text(c.to_toml())
    d = Cluster.load(tmp_path / "d.toml")
    assert d == c and d.fingerprint() == c.fingerprint()
    plain = Cluster.from_dict({k: v for k, v in c.to_dict().items()} | {"group": [
        {k: v for k, v in g.items() if k != "flops_bf16"} for g in c.to_dict()["group"]]})  # fmt: skip
    assert plain.fingerprint() != c.fingerprint()
    assert [t.flops for t in c.device_types()] == [t.flops for t in plain.device_types()] == [156e12]
    with pytest.raises(HapcError, match="unknown precision 'bf32'"):
        Cluster.load("hap-testbed:16").groups[0].rate("bf32")
    a100 = next(g for g in Cluster.load("harp-setting1").groups if g.name == "a100")
    assert a100.flops == a100.flops_bf16 == a100.flops_fp16 == 156e12  # fp16 / bf16 tensor cores alike
    v100 = Cluster.load("hap-testbed:16").groups[0]
    assert (v100.flops, v100.flops_fp16, v100.flops_bf16) == (14e12, 62e12, 14e12)  # no bf16 units on Volta


def test_cli_synth_precision(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["synth", "gpt", "--cluster", "local-cpu:2", "--kind", "spmd", "--precision", "bf16",
                 "--json", str(out)]) == 0  # fmt: skip
    assert "in bf16" in capsys.readouterr().out
    assert Plan.load(out).options["precision"] == "bf16"
    with pytest.raises(SystemExit):
        main(["synth", "gpt", "--cluster", "local-cpu:2", "--precision", "int8"])


class _Regions(torch.nn.Module):
    """A model with its own autocast regions: a bf16 one, and an fp32 island inside it (as Llama
    keeps its rotary embeddings in fp32)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):
                h = self.b(h.float())
            h = self.c(h)
        return torch.nn.functional.mse_loss(h.float(), y)


def test_the_models_own_autocast_regions_are_priced_in_their_dtypes():
    """The innermost torch.autocast around an op decides its dtype, with or without precision=."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    graph = trace(_Regions(), (x, y))
    for precision in (None, "bf16"):
        th = derive(graph, precision=precision)
        lin = [n.meta.dtype for n in th.graph if n.op == "linear"]
        assert lin == [BF16, torch.float32, BF16], (precision, lin)


def _agreed_times(rank: int, world: int, cluster: Cluster, num_micro: int | None) -> list[float]:
    from hapc.pipeline import _agree

    model, inputs = models.load("gpt", batch=4)
    return [_agree(model, cluster, tuple(inputs), num_micro, precision=p).time for p in (None, "bf16")]


@pytest.mark.parametrize("num_micro", [2, None])
def test_a_pipelined_compile_prices_its_cuts_at_the_precision_it_runs(num_micro):
    """``hapc.compile(pipeline=True, precision="bf16")`` plans the stage cuts itself (rank 0, then
    broadcast): they are priced at the groups' bf16 rate, as the stages run -- on a cluster whose bf16
    rate is 4x its fp32 one the planned step is much shorter (it was priced at fp32 before)."""
    base = two_groups().to_dict()  # at 1e-4 of its flop rates, compute dominates the step
    slow = [{**g, "flops": g["flops"] * 1e-4, "flops_bf16": 4e-4 * g["flops"]} for g in base["group"]]
    cluster = Cluster.from_dict({**base, "group": slow})
    fp32, bf16 = run_distributed(_agreed_times, 1, cluster, num_micro, timeout=300)[0]
    assert bf16 < 0.6 * fp32, (fp32, bf16)
