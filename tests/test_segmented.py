"""Per-segment sharding ratios (HAP §5.2, :mod:`hapc.segmented`; issue 14, acceptance 3).

Real gloo processes, float64, odd batch sizes: a model cut into 2 or 3 segments, each with its own
*forced* ratio vector (different between segments, so the all-to-all at the cut really moves rows
from one rank to another), trains three optimizer steps (SGD with momentum or Adam) equal to one
device: loss, every parameter's gradient, the final weights and optimizer state. A residual (the
first layer's output) crosses the cut beside the main activation; one model's next segment takes
the rows whole (the backward sums every rank's gradient of a row); dropout draws the masks of hapc's
one-rank run. The planner picks per-segment ratios where the cost model predicts them faster and
not where it does not; saved plans round-trip; options the runtime cannot honour are refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, make_optimizer
from torch import nn

import hapc
from hapc.cluster import Cluster
from hapc.errors import HapcError, PlanError
from hapc.planner import choose_plan
from hapc.segmented import Boundary, SegmentedModule, SegmentedPlan, plan_segmented, split
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

F64 = torch.float64
STEPS = 3


class Residual(nn.Module):
    """Two layers, then (after the cut) ``l3(b) + l5(a)``: ``a`` crosses the cut beside ``b``."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 10), nn.Linear(10, 10)
        self.l3, self.l5, self.l4 = nn.Linear(10, 12), nn.Linear(10, 12), nn.Linear(12, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.l1(x))
        b = self.drop(torch.tanh(self.l2(a)))
        c = self.l3(b) + self.l5(a)
        c = self.drop(c * torch.sigmoid(c))
        return F.mse_loss(self.l4(c).squeeze(-1), y)


class Whole(Residual):
    """The next segment starts with elementwise ops its program runs replicated: planned with
    ``rows_arrive_sharded=False`` it takes every row (the boundary then sends each rank all rows)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.l1(x))
        b = torch.tanh(self.l2(a))
        c = self.l3(torch.tanh(b) + a) + self.l5(b)
        return F.mse_loss(self.l4(c * torch.sigmoid(c)).squeeze(-1), y)


MODELS = {"residual": Residual, "whole": Whole}


def _make(name: str, batch: int = 9, p: float = 0.0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = MODELS[name](p).double()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 6, dtype=F64, generator=g), torch.randn(batch, dtype=F64, generator=g))


def _cuts(graph, names: list[str]) -> list[int]:
    index = {n.name: n.index for n in graph}
    return [index[n] for n in names]


def _plan(name: str, world: int, cut_at: list[str], ratios: list[list[float]], p: float = 0.0) -> SegmentedPlan:
    model, inputs = _make(name, p=p)
    graph = trace(model, inputs)
    cluster = cluster_of([1e10, 5e9, 3e9][:world])
    # "whole": the next program may source the rows in any layout (it takes them whole)
    plan = plan_segmented(graph, cluster, _cuts(graph, cut_at), ratios=ratios, rows_arrive_sharded=name != "whole")
    return SegmentedPlan.from_json(plan.to_json())  # as it travels and is saved: JSON


def _job(rank: int, world: int, name: str, plan: SegmentedPlan, opt: str, ddp: bool, p: float) -> dict:
    torch.set_num_threads(1)
    model, inputs = _make(name, p=p)
    module = hapc.compile(model, cluster_of([1e10, 5e9, 3e9][:world]), inputs, plan=plan)
    assert isinstance(module, SegmentedModule)
    optimizer = make_optimizer(opt, module.parameters())
    losses, grads, norm = [], None, None
    for _ in range(STEPS):
        optimizer.zero_grad()
        if ddp:  # DDP's loop: loss = module(*batch); loss.backward()
            loss = module(*inputs)
            loss.backward()
        else:
            loss = module.train_step(*inputs)
        losses.append(float(loss.detach()))
        if grads is None:
            grads = module.full_gradients()
            norm = float(module.clip_grad_norm_(1e9))  # the whole model's norm (nothing clipped)
        optimizer.step()
    module.eval()
    with torch.no_grad():  # evaluation: the forwards alone
        evaluated = float(module(*inputs))
    return {
        "losses": losses,
        "grads": grads,
        "norm": norm,
        "eval": evaluated,
        "state": module.full_state_dict(optimizer),
        "boundaries": [b.to_json() for b in module.boundaries],
    }


def _one_device(name: str, opt: str, p: float = 0.0) -> dict:
    model, inputs = _make(name, p=p)
    optimizer = make_optimizer(opt, model.parameters())
    losses, grads, norm = [], None, None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {k: q.grad.clone() for k, q in model.named_parameters()}
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        optimizer.step()
    model.eval()
    with torch.no_grad():
        evaluated = model(*inputs).item()
    return {
        "losses": losses,
        "grads": grads,
        "norm": norm,
        "eval": evaluated,
        "state": hapc.checkpoint.full_state(model, optimizer),
    }


CASES = [
    # model, ranks, cuts (first op of each later segment), forced ratios per segment, optimizer, DDP loop
    ("residual", 2, ["linear_2"], [[0.7, 0.3], [0.2, 0.8]], "sgd", False),
    ("residual", 3, ["linear_2"], [[0.5, 0.3, 0.2], [0.1, 0.3, 0.6]], "adam", True),
    ("residual", 3, ["linear_1", "linear_2"], [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1], [0.3, 0.5, 0.2]], "adam", False),
    ("whole", 3, ["tanh_1"], [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]], "sgd", True),
]


@pytest.mark.parametrize(
    "name,world,cut_at,ratios,opt,ddp", CASES, ids=[f"{c[0]}-{c[1]}-{len(c[3])}seg" for c in CASES]
)
def test_per_segment_ratios_equal_one_device(name, world, cut_at, ratios, opt, ddp):
    plan = _plan(name, world, cut_at, ratios)
    assert [p.ratios for p in plan.plans] == [pytest.approx(r) for r in ratios]
    results = run_distributed(_job, world, name, plan, opt, ddp, 0.0, timeout=180)
    ref = _one_device(name, opt)
    for b in results[0]["boundaries"]:  # the all-to-all really re-shards: rows change ranks
        bnd = Boundary(**b)
        assert bnd.held is not None and bnd.held != bnd.need
        assert any(bnd.overlap(r, q) for r in range(world) for q in range(world) if r != q)
    if name == "whole":
        assert results[0]["boundaries"][0]["need"] is None  # every rank took every row: gradients summed
    else:
        assert all(b["need"] is not None for b in results[0]["boundaries"])
    for rank, res in enumerate(results):
        assert_close(res["losses"], ref["losses"], F64, f"rank {rank} losses")
        assert_close(res["grads"], ref["grads"], F64, f"rank {rank} grads")
        assert_close(res["norm"], ref["norm"], F64, f"rank {rank} gradient norm")
        assert_close(res["eval"], ref["eval"], F64, f"rank {rank} eval loss")
        assert_close(res["state"], ref["state"], F64, f"rank {rank} state")


def _one_rank(rank: int, world: int, p: float) -> dict:
    """hapc's own one-rank run: the dropout masks every plan of hapc draws (seed, step, op, index)."""
    torch.set_num_threads(1)
    model, inputs = _make("residual", p=p)
    module = hapc.compile(model, cluster_of([1e10]), inputs)
    optimizer = make_optimizer("sgd", module.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(float(module.train_step(*inputs)))
        optimizer.step()
    return {"losses": losses, "state": module.full_state_dict(optimizer)}


def test_dropout_draws_the_masks_of_one_rank():
    p = 0.3
    plan = _plan("residual", 2, ["linear_2"], [[0.7, 0.3], [0.2, 0.8]], p=p)
    got = run_distributed(_job, 2, "residual", plan, "sgd", False, p, timeout=180)
    ref = run_distributed(_one_rank, 1, p)[0]
    no_drop = _one_device("residual", "sgd")
    assert abs(ref["losses"][0] - no_drop["losses"][0]) > 1e-3  # the masks drop something
    for rank, res in enumerate(got):
        assert_close(res["losses"], ref["losses"], F64, f"rank {rank} losses")
        assert_close(res["state"], ref["state"], F64, f"rank {rank} state")


def _forced(rank: int, world: int, path: str) -> dict:
    torch.set_num_threads(1)
    model, inputs = _make("residual")
    cluster = cluster_of([1e10, 4e9])
    module = hapc.compile(model, cluster, inputs, segmented=True)
    if rank == 0:
        module.plan.save(path)
    loss = float(module.train_step(*inputs))
    out: dict = {"loss": loss, "grads": module.full_gradients(), "cuts": module.plan.cuts}
    again = hapc.compile(_make("residual")[0], cluster, inputs, plan=path)  # the saved file
    assert isinstance(again, SegmentedModule) and again.plan.cuts == module.plan.cuts
    with pytest.raises(HapcError, match="global batch"):  # a rank's share is refused, naming the fix
        module.train_step(*(x[:4] for x in inputs))
    return out


def test_forced_kind_compiles_saves_and_loads(tmp_path):
    path = str(tmp_path / "seg.json")
    got = run_distributed(_forced, 2, path, timeout=180)
    ref = _one_device("residual", "sgd")
    loss, grads = ref["losses"][0], ref["grads"]
    for rank, res in enumerate(got):
        assert_close(res["loss"], loss, F64, f"rank {rank} loss")
        assert_close(res["grads"], grads, F64, f"rank {rank} grads")
    plan = SegmentedPlan.load(path)
    assert len(plan.plans) >= 2 and plan.cuts == got[0]["cuts"]
    data = plan.to_json()
    with pytest.raises(PlanError, match="version"):
        SegmentedPlan.from_json({**data, "version": 99})
    with pytest.raises(PlanError, match="not a segmented plan"):
        SegmentedPlan.from_json(plan.plans[0].to_json())
    model, inputs = _make("residual", batch=8)
    with pytest.raises(PlanError, match="another model"):
        plan.check(graph=trace(model, inputs))


# -- the planner -------------------------------------------------------------------------------------
class TwoPhase(nn.Module):
    """A compute-bound head (512-wide matmuls) and a memory-bound tail (elementwise over 2048-wide rows)."""

    def __init__(self, d: int = 512, w: int = 2048):
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, w), nn.Linear(w, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = self.l2(torch.relu(self.l1(x)))
        h = self.l3(a)
        for _ in range(6):
            h = h * torch.sigmoid(h) + 0.5 * h
        return F.mse_loss(self.l4(h).squeeze(-1), y)


def _mixed(bw_a: str, bw_b: str) -> Cluster:
    """Device a: 40 TFLOPS; device b: 10 TFLOPS; memory bandwidths as given; 100 GB/s links."""
    link = {"bandwidth": "100 GB/s", "latency": "5 us"}
    group = [
        {"name": n, "devices": 1, "devices_per_host": 1, "flops": f, "mem_bandwidth": bw, "memory": "16 GiB"}
        for n, f, bw in (("a", "40 TFLOPS", bw_a), ("b", "10 TFLOPS", bw_b))
    ]
    return Cluster.from_dict({"name": "mixed", "group": group, "links": {"intra_host": link, "inter_host": link}})


def _two_phase():
    torch.manual_seed(0)
    return TwoPhase(), (torch.randn(4096, 512), torch.randn(4096))


def test_the_planner_picks_per_segment_ratios_where_they_pay():
    """Device a computes 4x faster but reads memory 8x slower than b (200 vs 1600 GB/s). One ratio
    vector for the whole model: SPMD 5.81 ms (a 0.111, b 0.889: the memory-bound tail dominates).
    Cut by flops into 2 segments: the matmul head balanced by flops (a 0.692, b 0.308) 2.16 ms, the
    tail by bandwidth (a 0.111, b 0.889) 2.35 ms, the rows' all-to-all forward and backward 0.40 ms:
    4.91 ms, 15 % faster -- the planner picks it (the pipeline: 21.7 ms)."""
    model, inputs = _two_phase()
    choice = choose_plan(model, _mixed("200 GB/s", "1600 GB/s"), inputs)
    assert choice.kind == "segmented" and isinstance(choice.plan, SegmentedPlan)
    spmd = next(k for k in choice.kinds if k.kind == "spmd")
    assert choice.time < 0.9 * spmd.time
    ratios = [p.ratios[0] for p in choice.plan.plans]
    assert max(ratios) - min(ratios) > 0.3  # the segments' ratios differ
    assert choice.time == pytest.approx(choice.plan.time)
    assert any(b["forward"] > 0 for b in choice.plan.boundaries)
    assert choice.plan.kinds and "segmented" in choice.describe()


def test_per_segment_ratios_are_not_picked_where_they_do_not_pay():
    """Device a is 4x faster than b in flops *and* memory bandwidth (800 vs 200 GB/s): every segment's
    best ratios are the whole model's (a 0.8, b 0.2), so a cut adds its all-to-all and nothing
    else: SPMD 5.29 ms, 2 segments 5.43 ms (cut by flops) and 5.57 ms (by op count) -- SPMD is chosen,
    and 3 segments are not priced (no 2-segment cut paid; priced anyway, they were 5.85 ms)."""
    model, inputs = _two_phase()
    choice = choose_plan(model, _mixed("800 GB/s", "200 GB/s"), inputs)
    assert choice.kind == "spmd"
    segs = [k for k in choice.kinds if k.plan_kind == "segmented"]
    assert len(segs) == 2 and all(k.status == "feasible" and k.time > choice.time for k in segs)


def test_one_device_group_leaves_the_kind_out():
    model, inputs = _make("residual")
    choice = choose_plan(model, cluster_of([1e10, 1e10], name="same").subset(["d0"]), inputs)
    seg = next(k for k in choice.kinds if k.kind == "segmented")
    assert seg.status == "not applicable" and "one device group" in seg.reason
    choice = choose_plan(model, cluster_of([1e10, 5e9]), inputs, synth_options={"ratios": [0.5, 0.5]})
    seg = next(k for k in choice.kinds if k.kind == "segmented")
    assert seg.status == "not applicable" and "ratios" in seg.reason


# -- refusals -----------------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(torch.tanh(self.l(x))).pow(2).mean()


def test_a_weight_shared_across_a_cut_is_refused():
    g = trace(Tied(), (torch.randn(5, 8),))
    cut = next(n.index for n in g if n.name == "linear_1")
    with pytest.raises(HapcError, match="read by segments 1 and 2"):
        split(g, [cut])


def _refusals(rank: int, world: int) -> list[str]:
    model, inputs = _make("residual")
    cluster = cluster_of([1e10, 5e9])
    out = []
    for kwargs in ({"ratios": [0.6, 0.4]}, {"outputs": "local"}, {"pipeline": True}, {"num_micro": 3}):
        try:
            hapc.compile(model, cluster, inputs, segmented=True, **kwargs)
        except HapcError as exc:
            out.append(str(exc))
    loss = hapc.compile(model, cluster, inputs, plan=_plan("residual", 2, ["linear_2"], [[0.7, 0.3], [0.2, 0.8]]))(
        *inputs
    )
    try:
        (loss * (rank + 1)).backward()  # a seed that differs between the ranks
    except HapcError as exc:
        out.append(str(exc))
    return out


def test_options_the_runtime_cannot_honour_are_refused():
    msgs = run_distributed(_refusals, 2, timeout=120)[0]
    assert len(msgs) == 5
    assert "differs between the ranks" in msgs[4]
    assert "planned per segment" in msgs[0]
    assert "outputs=" in msgs[1] and "another plan kind" in msgs[1]
    assert "two plan kinds" in msgs[2]
    assert "num_micro=" in msgs[3]


def test_boundary_prices_what_moves():
    """Rows 0-5 on rank 0, 6-8 on rank 1; the next segment takes 0-1 and 2-8: rank 0 sends 4 rows,
    receives none, so one all-to-all of 4 rows x 20 float64 = 640 bytes, ``alpha + beta V / (m-1)``."""
    from hapc.synth.cost import CostModel

    b = Boundary(rows=9, features=20, itemsize=8, held=[6, 3], need=[2, 7])
    model = CostModel(cluster_of([1e10, 5e9], bandwidth="1 GB/s", latency="10 us"))
    fwd, bwd = b.seconds(model)
    assert fwd == bwd == pytest.approx(10e-6 + 640 / 1e9)
    assert b.overlap(0, 1) == 4 and b.overlap(1, 0) == 0 and b.overlap(1, 1) == 3
    whole = Boundary(rows=9, features=20, itemsize=8, held=None, need=[2, 7])
    assert whole.seconds(model)[0] == 0.0 and math.isfinite(whole.seconds(model)[1])


def test_the_segments_memory_adds_up_on_every_device():
    """Every segment lives on every device: a cluster each segment fits alone, but not all of them
    together, has no segmented plan (InfeasibleError naming why), as the planner then reports."""
    from hapc.errors import InfeasibleError

    model, inputs = _make("residual", batch=64)
    graph = trace(model, inputs)
    cuts = _cuts(graph, ["linear_2"])
    roomy = plan_segmented(graph, cluster_of([1e10, 5e9]), cuts)
    per = [max(p.predicted["memory"]) for p in roomy.plans]
    assert max(per) * 1.05 < sum(per)
    tight = cluster_of([1e10, 5e9], memory=f"{int(max(per) * 1.05)} B")
    with pytest.raises(InfeasibleError, match="live on every device"):
        plan_segmented(graph, tight, cuts)


def _small_two_phase() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoPhase(32, 128).double()
    g = torch.Generator().manual_seed(2)
    return model, (torch.randn(33, 32, dtype=F64, generator=g), torch.randn(33, dtype=F64, generator=g))


def _small_mixed() -> Cluster:
    """Device a: 4 GFLOPS and 5 GB/s; b: 1 GFLOPS and 40 GB/s (a CPU-sized version of ``_mixed``)."""
    link = {"bandwidth": "10 GB/s", "latency": "1 us"}
    group = [
        {"name": n, "devices": 1, "devices_per_host": 1, "flops": f, "mem_bandwidth": bw, "memory": "16 GiB"}
        for n, f, bw in (("a", "4 GFLOPS", "5 GB/s"), ("b", "1 GFLOPS", "40 GB/s"))
    ]
    return Cluster.from_dict({"name": "mixed-small", "group": group, "links": {"intra_host": link, "inter_host": link}})


def _default(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = _small_two_phase()
    module = hapc.compile(model, _small_mixed(), inputs)  # the planner's choice, nothing forced
    optimizer = make_optimizer("sgd", module.parameters())
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(float(module.train_step(*inputs)))
        optimizer.step()
    kinds = {k["kind"]: k["time"] for k in module.plan_kinds if k["time"] is not None}
    return {"type": type(module).__name__, "kinds": kinds, "losses": losses, "state": module.full_state_dict()}


def test_compile_runs_the_planner_s_per_segment_ratios():
    """SPMD 0.952 ms (ratios a 0.767, b 0.233), 2 segments cut by flops 0.43 ms (the head's ratios
    a 0.783, the elementwise tail's a 0.1): hapc.compile picks the segmented plan by itself and
    trains it exactly (2 ranks, batch 33, 3 SGD steps)."""
    got = run_distributed(_default, 2, timeout=240)
    model, inputs = _small_two_phase()
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    for rank, res in enumerate(got):
        assert res["type"] == "SegmentedModule", res["kinds"]
        assert min(res["kinds"], key=res["kinds"].get).startswith("segmented")
        assert_close(res["losses"], losses, F64, f"rank {rank} losses")
        assert_close(res["state"], dict(model.state_dict()), F64, f"rank {rank} state")


def _accumulate(rank: int, world: int, plan: SegmentedPlan) -> dict:
    torch.set_num_threads(1)
    model, inputs = _make("residual")
    module = hapc.compile(model, cluster_of([1e10, 5e9]), inputs, plan=plan)
    with module.no_sync():  # gradient accumulation as with DDP: the second backward sums both
        module(*inputs).backward()
    (0.5 * module(*inputs)).backward()
    return module.full_gradients()


def test_gradient_accumulation_under_no_sync():
    plan = _plan("residual", 2, ["linear_2"], [[0.7, 0.3], [0.2, 0.8]])
    got = run_distributed(_accumulate, 2, plan, timeout=120)
    model, inputs = _make("residual")
    model(*inputs).backward()
    (0.5 * model(*inputs)).backward()
    want = {k: q.grad for k, q in model.named_parameters()}
    for rank, grads in enumerate(got):
        assert_close(grads, want, F64, f"rank {rank} accumulated grads")


def test_a_segment_takes_its_rows_sharded_by_default():
    """By default a segment's program sources its incoming rows sharded (as the all-to-all delivers
    them); one that wants them whole all-gathers them itself, priced in its own synthesis."""
    model, inputs = _make("whole")
    graph = trace(model, inputs)
    cluster, cuts = cluster_of([1e10, 5e9, 3e9]), _cuts(graph, ["tanh_1"])
    ratios = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
    free = plan_segmented(graph, cluster, cuts, ratios=ratios, rows_arrive_sharded=False)
    rows = plan_segmented(graph, cluster, cuts, ratios=ratios)
    assert free.boundaries[0]["need"] is None and rows.boundaries[0]["need"] is not None
    assert rows.boundaries[0]["forward"] < free.boundaries[0]["forward"]
