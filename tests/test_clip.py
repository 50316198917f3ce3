"""Gradient clipping is exact (issue 13 item 1): ``torch.nn.utils.clip_grad_norm_`` over a compiled
module's parameters returns the single-device total norm on every rank and scales every slice by
the same coefficient, when the plan shards parameters (forced TP, uneven fixed ratios, and the
default plan of a wide MLP), for norm types 2, 1 and inf; float64, 2 and 3 gloo processes. With
``torch.amp.GradScaler`` (float32), ranks skip exactly the steps one device skips, also when the
overflow lies in one rank's slice."""

from __future__ import annotations

import contextlib
import copy
import io
import math

import pytest
import torch
from harness import assert_close

import hapc
from hapc.codegen.grad_norm import GradNorms, ShardedGrad
from hapc.testing import cluster_of, run_distributed

try:
    from hapc import models
except ImportError:  # the model zoo before it moved under hapc
    import models

F64 = torch.float64
NORMS = (2.0, 1.0, math.inf)
MAX_NORM = 0.02  # below every norm of these runs (inf-norms 0.04 and up): every step clips
WIDE = {"widths": (32, 256, 256)}  # the default plan on local-cpu:2 shards its first two layers
CASES = {
    "mlp-default": ("mlp", WIDE, 2, "local-cpu:2", {}),
    "gpt-tp": ("gpt", {}, 2, cluster_of([3e9, 1e9]), {"baseline": "tp", "ratios": [0.6, 0.4]}),
    "gpt-tp3": ("gpt", {}, 3, cluster_of([5e9, 3e9, 2e9]), {"baseline": "tp", "ratios": [0.5, 0.3, 0.2]}),
    "mlp-ratios3": ("mlp", WIDE, 3, cluster_of([5e9, 3e9, 2e9]), {"ratios": [0.5, 0.3, 0.2]}),
}


def _plan(alias, mkw, cluster, options):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    plan = hapc.synthesize(model, cluster, inputs, **options)
    assert any(
        i.layout.is_sharded
        for i in plan.instructions
        if type(i).__name__ == "Source" and "weight" in plan.node_names[i.ref]
    ), "the plan shards parameters"
    return plan


def _steps(module, params, inputs, norm_type, clip, steps=3):
    """AdamW with clipping every step; the losses and the norms clipping returned."""
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(clip(params, norm_type)))
        opt.step()
    return losses, norms, opt


def _torch_clip(params, norm_type):
    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)


def _one_device(alias, mkw, norm_type, clip=_torch_clip):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    losses, norms, _ = _steps(model, list(model.parameters()), inputs, norm_type, clip)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clip_job(rank, world, alias, mkw, cluster, plan):
    out = {}
    for norm_type in NORMS:
        model, inputs = models.load(alias, dtype=F64, **mkw)
        m = hapc.compile(model, cluster, inputs, plan=plan)
        params = list(m.parameters())
        losses, norms, _ = _steps(m, params, inputs, norm_type, _torch_clip)
        sharded = sum(isinstance(p.grad, ShardedGrad) for p in params)
        assert sharded and all(type(p.grad) in (torch.Tensor, ShardedGrad) for p in params)
        out[norm_type] = (losses, norms, m.full_state_dict())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_clip_grad_norm_is_single_device(case):
    alias, mkw, world, cluster, options = CASES[case]
    plan = _plan(alias, mkw, cluster, options)
    results = run_distributed(_clip_job, world, alias, mkw, cluster, plan)
    for norm_type in NORMS:
        losses, norms, state = _one_device(alias, mkw, norm_type)
        assert all(n > MAX_NORM for n in norms), "every step clips"
        for rank, res in enumerate(results):
            got_losses, got_norms, got_state = res[norm_type]
            what = f"{case}, rank {rank}, norm {norm_type}"
            assert_close(got_norms, norms, F64, f"{what}: clip_grad_norm_'s total norm")
            assert_close(got_losses, losses, F64, f"{what}: losses")
            assert_close(got_state, state, F64, f"{what}: parameters")


# -- other ways in: foreach=False, get_total_norm, module.clip_grad_norm_, single norms, clip by value --


def _other_paths(params, norm_type):
    """The per-tensor path, get_total_norm, single-tensor norms, clip_grad_value_ (elementwise: exact
    on slices) and foreach=False. Single norms sorted: the module orders its parameters otherwise."""
    grads = [p.grad for p in params if p.grad is not None]
    out = {"total": float(torch.nn.utils.get_total_norm(grads, norm_type))}
    singles = {
        "vector_norm": [torch.linalg.vector_norm(g, norm_type) for g in grads],
        "torch.norm": [torch.norm(g, norm_type) for g in grads],
        "Tensor.norm": [g.norm(norm_type) for g in grads],
        "linalg.norm": [torch.linalg.norm(g) for g in grads],
    }
    out["stacked"] = float(torch.linalg.vector_norm(torch.stack(singles["vector_norm"]), norm_type))
    out.update({k: sorted(float(n) for n in v) for k, v in singles.items()})
    torch.nn.utils.clip_grad_value_(params, 0.02)
    out["foreach=False"] = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type, foreach=False))
    return out


def _paths_run(module, inputs):
    out = {}
    for norm_type in (2.0, math.inf):
        seen = []

        def clip(params, t, seen=seen):
            seen.append(_other_paths(params, t))
            return 0.0

        losses, _, _ = _steps(module, list(module.parameters()), inputs, norm_type, clip)
        out[norm_type] = (losses, seen)
    module.zero_grad()
    module(*inputs).backward()
    clip = getattr(module, "clip_grad_norm_", None)  # the convenience method, or torch's on one device
    if clip is None:
        out["method"] = float(torch.nn.utils.clip_grad_norm_(module.parameters(), MAX_NORM, norm_type=1.0))
    else:
        out["method"] = float(clip(MAX_NORM, norm_type=1.0))
    return out


def _other_paths_job(rank, world, alias, mkw, cluster, plan):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    return _paths_run(m, inputs), m.full_state_dict()


def _other_paths_one_device(alias, mkw):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    return _paths_run(model, inputs), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("case", ["gpt-tp3"])
def test_every_norm_path_and_clip_by_value(case):
    alias, mkw, world, cluster, options = CASES[case]
    plan = _plan(alias, mkw, cluster, options)
    want = _other_paths_one_device(alias, mkw)
    for rank, got in enumerate(run_distributed(_other_paths_job, world, alias, mkw, cluster, plan)):
        assert_close(got, want, F64, f"rank {rank}")


# -- accumulation, no_sync, zero_grad(set_to_none=False), slices that are empty ----------------------------------


def _accumulate(module, params, inputs, micro):
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-6)
    norms = []
    for step in range(3):
        opt.zero_grad(set_to_none=step == 0)  # later steps zero in place
        for k in range(micro):
            ctx = module.no_sync() if hasattr(module, "no_sync") and k < micro - 1 else contextlib.nullcontext()
            with ctx:
                module(*inputs).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        opt.step()
    return norms


def _accumulate_job(rank, world, alias, mkw, cluster, plan):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    m = hapc.compile(model, cluster, inputs, plan=plan)
    return _accumulate(m, list(m.parameters()), inputs, 2), m.full_state_dict()


def test_accumulation_no_sync_and_in_place_zeroing():
    """Two micro-batches per step (``no_sync`` on the first), gradients zeroed in place after the first step."""
    alias, mkw, cluster = "mlp", {"widths": (24, 64, 48), "classes": 4}, cluster_of([3e9, 1e9])
    plan = _plan(alias, mkw, cluster, {"baseline": "tp", "ratios": [0.6, 0.4]})
    model, inputs = models.load(alias, dtype=F64, **mkw)
    want_norms = _accumulate(model, list(model.parameters()), inputs, 2)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = run_distributed(_accumulate_job, 2, alias, mkw, cluster, plan)
    for rank, (norms, state) in enumerate(results):
        assert_close(norms, want_norms, F64, f"rank {rank}: norms")
        assert_close(state, want, F64, f"rank {rank}: parameters")


def _slices_job(rank, world, whole, cuts):
    """Norms of hand-made slices (rank r holds rows cuts[r]:cuts[r+1], possibly none) and of a
    gradient that is not sliced, by every norm function, against the whole tensors' norms."""
    group = torch.distributed.group.WORLD
    norms = GradNorms(group, len(whole))
    grads = []
    for slot, w in enumerate(whole):
        g = w[cuts[slot][rank] : cuts[slot][rank + 1]].clone()
        norms.mark(g, slot)
        grads.append(g)
    plain = torch.arange(5, dtype=F64)  # a replicated gradient rides along, unchanged
    out = {}
    for p in (2.0, 1.0, 3.0, math.inf, -math.inf, 0.0):
        out[p] = [
            [float(n) for n in torch._foreach_norm([*grads, plain], p)],
            [float(torch.linalg.vector_norm(g, p)) for g in grads],
            float(torch.nn.utils.get_total_norm([*grads, plain], p)),
        ]
    assert all(type(g) is ShardedGrad for g in grads)
    with pytest.raises(hapc.HapcError, match="matrix norm of a gradient the plan shards"):
        torch.linalg.norm(grads[2], ord=2)  # a slice's spectral norm is nobody's: refused
    with pytest.raises(hapc.HapcError, match="'nuc' norm"):
        grads[2].norm(p="nuc")
    buffer = io.BytesIO()
    torch.save(grads, buffer)  # a logger saving gradients gets plain tensors back, as copies do
    assert all(type(g) is torch.Tensor for g in [*torch.load(io.BytesIO(buffer.getvalue())), *copy.deepcopy(grads)])
    along = torch.linalg.vector_norm(grads[0], 2.0, dim=1)  # along a dim: the slice's rows, plain
    assert type(along) is torch.Tensor and along.shape == (grads[0].shape[0],)
    assert type(grads[0] * 2) is torch.Tensor and type(grads[0].view(-1)) is torch.Tensor  # nothing propagates
    return out


def test_norms_of_slices_including_an_empty_one():
    whole = [torch.randn(5, 3, dtype=F64), torch.randn(4, dtype=F64), torch.randn(2, 2, dtype=F64)]
    cuts = [[0, 5, 5], [0, 1, 4], [0, 0, 2]]  # rank 1's slice of the first, rank 0's of the last: empty
    plain = torch.arange(5, dtype=F64)
    for rank, got in enumerate(run_distributed(_slices_job, 2, whole, cuts)):
        for p, (foreach, single, total) in got.items():
            want = [float(torch.linalg.vector_norm(w, p)) for w in whole]
            assert foreach == pytest.approx([*want, float(torch.linalg.vector_norm(plain, p))], rel=1e-12)
            assert single == pytest.approx(want, rel=1e-12)
            whole_total = torch.nn.utils.get_total_norm([*whole, plain], p)
            assert total == pytest.approx(float(whole_total), rel=1e-12), f"rank {rank}, norm {p}"


# -- the test would catch a wrong norm ----------------------------------------------------------------------


def _planted_job(rank, world, alias, mkw, cluster, plan):
    model, inputs = models.load(alias, dtype=F64, **mkw)
    m = hapc.compile(model, cluster, inputs, plan=plan)

    def local_norm(params, norm_type):  # what every rank computed before: the norm of its own slices
        grads = [p.grad.as_subclass(torch.Tensor) for p in params if p.grad is not None]
        total = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type
        )
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
        return total

    losses, norms, _ = _steps(m, list(m.parameters()), inputs, 2.0, local_norm)
    return losses, norms, m.full_state_dict()


def test_a_per_rank_norm_would_fail():
    alias, mkw, world, cluster, options = CASES["gpt-tp"]
    plan = _plan(alias, mkw, cluster, options)
    _, norms, state = _one_device(alias, mkw, 2.0)
    for _, got_norms, got_state in run_distributed(_planted_job, world, alias, mkw, cluster, plan):
        with pytest.raises(AssertionError):
            assert_close(got_norms, norms, F64, "norms")
        with pytest.raises(AssertionError):
            assert_close(got_state, state, F64, "parameters")


# -- pipelines: every stage's gradients in one norm -----------------------------------------------------------


def _pipeline_job(rank, world, ranks, norm_type, foreach):
    from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
    from hapc.pipeline.stages import balanced_cuts
    from hapc.theory import trace

    torch.set_num_threads(1)
    model, inputs = models.load("gpt", batch=8, dtype=F64)
    graph = trace(model, micro_batches(inputs, 4, 8)[0])
    flops = [1e10, 6e9, 3e9, 8e9]
    clusters = [cluster_of([flops[r] for r in rs]) for rs in ranks]
    spec = PipelineSpec(balanced_cuts(graph, [1] * len(ranks)), ranks, clusters, list(range(len(ranks), 0, -1)), 4)
    pm = PipelineModule(model, inputs, spec)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-6)
    losses, norms = [], []
    for step in range(3):
        opt.zero_grad(set_to_none=step != 1)
        losses.append(float(pm.train_step(*inputs)))
        if foreach is None:
            norms.append(float(pm.clip_grad_norm_(MAX_NORM, norm_type)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(pm.parameters(), MAX_NORM, norm_type, foreach=foreach)))
        opt.step()
    return losses, norms, pm.full_state_dict()


@pytest.mark.parametrize(
    "ranks, norm_type, foreach",
    [([[0, 1], [2]], 2.0, None), ([[0], [1, 2], [3]], math.inf, False), ([[0], [1, 2], [3]], 1.0, True)],
)
def test_pipeline_clips_by_the_norm_over_every_stage(ranks, norm_type, foreach):
    losses, norms, state = _one_device("gpt", {"batch": 8}, norm_type)
    assert all(n > MAX_NORM for n in norms)
    world = sum(map(len, ranks))
    for rank, (got_losses, got_norms, got_state) in enumerate(
        run_distributed(_pipeline_job, world, ranks, norm_type, foreach, timeout=240)
    ):
        assert_close(got_norms, norms, F64, f"rank {rank}: norms")
        assert_close(got_losses, losses, F64, f"rank {rank}: losses")
        assert_close(got_state, state, F64, f"rank {rank}: parameters")


# -- GradScaler: the inf/NaN check of unscale_ is the whole gradients' --------------------------------------------


class _Overflow(torch.nn.Module):
    """Float32; hidden unit 0 is read 1000x more strongly, so its gradients (row 0 of ``a.weight``,
    ``a.bias[0]``) are by far the largest: a loss scale can overflow them alone -- in one rank's slice."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 64), torch.nn.Linear(64, 6)
        with torch.no_grad():  # unit 0: always active, tiny (the outputs barely change), read 1000x more
            self.a.weight[0] *= 1e-6
            self.a.bias[0] = 1e-3
            self.b.weight[:, 0] *= 1000

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def _overflow_case():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model = _Overflow()
    model(x).backward()
    a, bias = model.a.weight.grad.abs(), model.a.bias.grad.abs()
    hi = max(float(a[0].max()), float(bias[0]))  # hidden unit 0's gradients: in the first rank's slices
    lo = max(float(a[1:].max()), float(bias[1:].max()), float(model.b.weight.grad.abs().max()))
    lo = max(lo, float(model.b.bias.grad.abs().max()))
    assert hi > 100 * lo, "unit 0's gradients dominate"
    torch.manual_seed(0)
    return x, _Overflow(), 3.0e38 / math.sqrt(hi * lo)  # overflows unit 0's gradients only


def _scaler_steps(module, x, scale):
    """The AMP recipe: scale, backward, unscale_, clip, step, update; per step the loss, the scale and
    whether this rank's own gradients held an inf before unscale_."""
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, backoff_factor=1e-3)  # one skipped step
    out = []
    for _ in range(3):
        opt.zero_grad()
        loss = module(x)
        scaler.scale(loss).backward()
        local_inf = any(not torch.isfinite(p.grad.as_subclass(torch.Tensor)).all() for p in module.parameters())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        scaler.step(opt)
        out.append((float(loss.detach()), scaler.get_scale(), local_inf))
        scaler.update()
    return out


def _scaler_job(rank, world, cluster, plan, scale):
    x, model, _ = _overflow_case()
    m = hapc.compile(model, cluster, (x,), plan=plan)
    return _scaler_steps(m, x, scale), m.full_state_dict()


@pytest.mark.parametrize("world", [2, 3])
def test_grad_scaler_skips_the_steps_one_device_skips(world):
    cluster = cluster_of([5e9, 3e9, 2e9][:world])
    x, model, scale = _overflow_case()
    ratios = [0.5, 0.3, 0.2] if world == 3 else [0.6, 0.4]
    plan = hapc.synthesize(model, cluster, (x,), baseline="tp", ratios=ratios)
    assert "S(0)" in str(next(i.layout for i in plan.instructions if plan.node_names[i.ref] == "a_weight"))
    want = _scaler_steps(model, x, scale)
    assert want[0][2] and not want[1][2], "one device: the first step overflows (skipped), the second does not"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    results = run_distributed(_scaler_job, world, cluster, plan, scale)
    assert len({r[0][0][2] for r in results}) == 2, "the overflow is in one rank's slice only"
    for rank, (got, got_state) in enumerate(results):
        assert [g[1] for g in got] == [w[1] for w in want], f"rank {rank}: the scales (the same steps skipped)"
        assert_close([g[0] for g in got], [w[0] for w in want], torch.float32, f"rank {rank}: losses")
        assert_close(got_state, state, torch.float32, f"rank {rank}: parameters")
