"""When the loss's all-reduce starts (``hapc.collectives.LossChannel``), and the token count of a
mean loss computed from the whole batch: however the ranks differ in when they read the loss,
every rank gets the global value and the single-device gradients, and nothing hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from harness import assert_close, one_device_grads, small_buckets

import hapc
from hapc import models
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
THREE = cluster_of([5e9, 3e9, 2e9])


def _reference(alias: str, batches: int = 2):
    """Per batch (the same batch, after an SGD step each): loss and gradients on one device."""
    model, inputs = models.load(alias, dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(batches):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        out.append((loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}))
        opt.step()
    return out


def _pattern(rank, world, alias, pattern, sync):
    """Two SGD steps; ``pattern`` says what each rank does between forward and backward."""
    model, inputs = models.load(alias, dtype=F64)
    m = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp", loss_sync=sync)
    if pattern.endswith("many-buckets"):
        assert len(m._buckets) > 5
    assert (m._channel is not None) == (sync == "lazy"), "gloo runs the lazy loss channel unless told not to"
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    out, early = [], []
    for _ in range(2):
        opt.zero_grad()
        if pattern == "eval-first":  # a forward no backward follows, read on rank 0 only
            probe = m(*inputs)
            if rank == 0:
                early.append(probe.item())
        loss = m(*inputs)
        if pattern.startswith("rank0-reads-early") and rank == 0:
            early.append(loss.item())  # before backward, on one rank only
        if pattern == "late-peer":
            if rank == 0:
                early.append(loss.item())  # waits for the peers to start it (their deadline)
            else:
                time.sleep(0.5)
        if pattern == "barrier-between":  # read on one rank, then a collective outside the module
            if rank == 0:
                early.append(loss.item())
            dist.barrier()
        loss.backward()
        out.append((loss.item(), m.full_gradients()))
        opt.step()
    return out, early


@pytest.mark.parametrize(
    "pattern, sync",
    [
        ("rank0-reads-early", "lazy"),
        ("rank0-reads-early", "eager"),
        ("rank0-reads-early, many-buckets", "lazy"),
        ("eval-first", "lazy"),
        ("late-peer", "lazy"),
        ("barrier-between", "lazy"),
    ],
)
def test_ranks_that_read_the_loss_at_different_times_agree(pattern, sync, monkeypatch):
    if pattern.endswith("many-buckets"):  # buckets launched mid-backward
        small_buckets(monkeypatch)
    ref = _reference("gpt")
    results = run_distributed(_pattern, 3, "gpt", pattern, sync, timeout=60)
    for rank, (out, early) in enumerate(results):
        for (loss, grads), (want_loss, want_grads) in zip(out, ref):
            assert_close(loss, want_loss, F64, f"rank {rank} loss")
            assert_close(grads, want_grads, F64, f"rank {rank} grads")
        if rank == 0 and pattern.startswith("rank0-reads-early"):
            assert early == pytest.approx([r[0] for r in ref], rel=1e-12)
        if rank == 0 and pattern == "eval-first":  # the probe of step 1 runs on the stepped weights
            assert early == pytest.approx([r[0] for r in ref], rel=1e-12)
        if rank == 0 and pattern in ("late-peer", "barrier-between"):
            assert early == pytest.approx([r[0] for r in ref], rel=1e-12)


def _several(rank, world, sync):
    """Two forwards before one backward, a no-grad forward, and accumulation under no_sync."""
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp", loss_sync=sync)
    (m(*inputs) + 2 * m(*inputs)).backward()
    grads = m.full_gradients()
    with torch.no_grad():
        value = m(*inputs)
    m.zero_grad(set_to_none=True)
    with m.no_sync():
        first = m(*inputs)
        first.backward()
    second = m(*inputs)
    second.backward()
    return grads, value.item(), first.item(), second.item(), m.full_gradients()


@pytest.mark.parametrize("sync", ["lazy", "eager"])
def test_several_forwards_no_grad_and_no_sync(sync):
    model, inputs = models.load("gpt", dtype=F64)
    loss = model(*inputs)
    (3 * loss).backward()
    three = {k: p.grad.clone() for k, p in model.named_parameters()}
    want = {k: 2 * g / 3 for k, g in three.items()}  # two backwards of the loss, accumulated
    for grads, value, first, second, accumulated in run_distributed(_several, 3, sync):
        assert_close(grads, three, F64, "grads of loss + 2 loss")
        for v in (value, first, second):
            assert v == pytest.approx(loss.item(), rel=1e-12)
        assert_close(accumulated, want, F64, "no_sync accumulation")


def _mixed(rank, world):
    from hapc.balance.rounding import bounds

    model, (x, y) = models.load("mlp", dtype=F64)
    m = hapc.compile(model, THREE, (x, y), plan=None, baseline="dp-cp")
    ref = next(n.index for n in m.theory.graph.inputs if n.name == "x")
    lo, hi = bounds(m.theory.local_sizes(ref, 0, m.plan.device_ratios))[rank]
    first = m(x, y) if rank == 0 else m(x[lo:hi], y[lo:hi])  # rank 0 the whole batch, the others shares
    first.backward()
    return first.item(), m._whole_batch, m.full_gradients()


def test_ranks_given_different_kinds_of_batch_agree_to_all_reduce_counts():
    ref_loss, want = one_device_grads("mlp", dtype=F64)
    for value, whole, grads in run_distributed(_mixed, 3):
        assert whole is False
        assert value == pytest.approx(ref_loss, rel=1e-12)
        assert_close(grads, want, F64, "grads")


def _program(rank, world):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp")
    m(*inputs).backward()
    counts = [n for n in m.program.graph.nodes if n.target is hapc.collectives.all_reduce_start]
    return m.code, [n.kwargs["known"].target for n in counts], m._whole_batch, dist.get_world_size(m.group)


def test_token_counts_come_from_the_whole_batch_as_an_argument():
    for code, known, whole, size in run_distributed(_program, 3):
        assert known == ["cross_entropy_count_global"]
        assert "def forward(self, idx, targets, cross_entropy_count_global=None):" in code
        assert "known=cross_entropy_count_global" in code
        assert whole is True and size == 3  # the module's own group, all ranks


def _tensor_parallel_early_read(rank, world):
    model, inputs = models.load("gpt", dtype=F64)
    # the SPMD program (over links this slow the planner may price a pipeline cheaper)
    m = hapc.compile(model, cluster_of([5e9, 3e9, 2e9], bandwidth="10 MB/s"), inputs, pipeline=False)
    loss = m(*inputs)
    if rank == 0:
        loss.item()  # before backward, on one rank: the loss goes before the backward's collectives
    loss.backward()
    return m._backward_communicates, loss.item(), m.full_gradients()


def test_a_backward_that_communicates_starts_the_loss_all_reduce_first():
    ref_loss, want = one_device_grads("gpt", dtype=F64)
    for communicates, value, grads in run_distributed(_tensor_parallel_early_read, 3):
        assert communicates, "on a slow link the plan shards weights: its backward communicates"
        assert value == pytest.approx(ref_loss, rel=1e-12)
        assert_close(grads, want, F64, "grads")


def _two_modules(rank, world):
    """Loss of module A read on rank 0 only, then module B's step, then A's backward."""
    model, inputs = models.load("gpt", dtype=F64)
    a = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp")
    b = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp")
    la = a(*inputs)
    if rank == 0:
        la.item()
    lb = b(*inputs)
    lb.backward()
    la.backward()
    return la.item(), lb.item(), a.full_gradients(), b.full_gradients()


def test_a_loss_read_early_does_not_wait_on_another_module():
    ref_loss, want = one_device_grads("gpt", dtype=F64)
    for la, lb, ga, gb in run_distributed(_two_modules, 3, timeout=60):
        assert la == pytest.approx(ref_loss, rel=1e-12) and lb == pytest.approx(ref_loss, rel=1e-12)
        assert_close(ga, want, F64, "module A grads")
        assert_close(gb, want, F64, "module B grads")


def _twice(rank, world):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp")
    loss = m(*inputs)
    loss.backward(retain_graph=True)
    loss.backward()  # no forward in between: the first backward's summed gradients are kept aside
    return m.full_gradients()


@pytest.mark.parametrize("buckets", ["one", "many"])
def test_a_second_backward_of_one_forward_accumulates_once(buckets, monkeypatch):
    if buckets == "many":
        small_buckets(monkeypatch)
    model, inputs = models.load("gpt", dtype=F64)
    loss = model(*inputs)
    loss.backward(retain_graph=True)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for grads in run_distributed(_twice, 3):
        assert_close(grads, want, F64, "grads of two backwards")


def _own_batches(rank, world):
    model, (x, y) = models.load("mlp", dtype=F64)
    m = hapc.compile(model, THREE, (x, y), plan=None, baseline="dp-cp")
    _, (xr, yr) = models.load("mlp", dtype=F64, seed=10 + rank)  # every rank a different whole batch
    loss = m(xr, yr)
    loss.backward()
    return loss.item(), m._whole_batch, m.full_gradients(), m.plan.device_ratios


def test_ranks_given_different_whole_batches_all_reduce_their_counts():
    from hapc.balance.rounding import bounds

    results = run_distributed(_own_batches, 3)
    model, (x, y) = models.load("mlp", dtype=F64)
    graph = hapc.trace(model, (x, y))
    ref = next(n.index for n in graph.inputs if n.name == "x")
    sizes = hapc.derive(graph).local_sizes(ref, 0, results[0][3])
    rows = [models.load("mlp", dtype=F64, seed=10 + r)[1] for r in range(3)]
    xs = torch.cat([rows[r][0][lo:hi] for r, (lo, hi) in enumerate(bounds(sizes))])
    ys = torch.cat([rows[r][1][lo:hi] for r, (lo, hi) in enumerate(bounds(sizes))])
    loss = model(xs, ys)  # each rank's share of its own batch: the batch the ranks train on together
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for value, whole, grads, _ in results:
        assert whole is False, "different batches: counted by all-reduce"
        assert value == pytest.approx(loss.item(), rel=1e-12)
        assert_close(grads, want, F64, "grads")


def _probe(rank, world):
    model, inputs = models.load("gpt", dtype=F64)
    m = hapc.compile(model, THREE, inputs, plan=None, baseline="dp-cp")
    loss = m(*inputs)
    loss.backward(retain_graph=True)
    # a probe (gradient norm) by autograd.grad would return this rank's partial gradients of the
    # replicated parameters: refused (tests/test_backward_forms.py); .grad must be left as it was
    with pytest.raises(hapc.HapcError, match=r"torch\.autograd\.grad over parameters the plan replicates"):
        torch.autograd.grad(loss, list(m.parameters()))
    after_probe = m.full_gradients()
    m.zero_grad(set_to_none=True)
    m(*inputs).backward()
    return after_probe, m.full_gradients()


@pytest.mark.parametrize("buckets", ["one", "many"])
def test_autograd_grad_after_backward_leaves_the_gradients(buckets, monkeypatch):
    if buckets == "many":
        small_buckets(monkeypatch)
    _, want = one_device_grads("gpt", dtype=F64)
    for after_probe, next_step in run_distributed(_probe, 3):
        assert_close(after_probe, want, F64, "grads after the probe")
        assert_close(next_step, want, F64, "grads of the next step")


def _drift(rank, world):
    model, (x, y) = models.load("mlp", dtype=F64)
    m = hapc.compile(model, THREE, (x, y), plan=None, baseline="dp-cp")
    first = m(x, y)
    first.backward()  # the same whole batch everywhere: counted locally
    _, (xr, yr) = models.load("mlp", dtype=F64, seed=10 + rank)  # then every rank its own batch
    second = m(xr, yr)
    with pytest.raises(hapc.HapcError, match="different whole batches"):
        second.backward()
    with pytest.raises(hapc.HapcError, match="different whole batches"):
        second.item()  # every read says so, not only the first
    return m._whole_batch, first.item()


def test_ranks_whose_whole_batches_drift_apart_are_told():
    model, inputs = models.load("mlp", dtype=F64)
    want = model(*inputs).item()
    for whole, first in run_distributed(_drift, 3):
        assert whole is True and first == pytest.approx(want, rel=1e-12)


class _WithLogits(torch.nn.Module):
    """Returns ``(loss, logits)``: the program gathers the logits after its loss's ``global_value``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x, y):
        logits = self.fc(x)
        return torch.nn.functional.cross_entropy(logits, y), logits


def _slow_rank0_outputs(rank, world):
    """Rank 0 is held up between its loss and the gather of its logits past the loss's deadline,
    so its deadline thread starts the loss all-reduce there, while rank 1 goes straight on to the
    gather: every rank must still issue the two collectives in the same order."""
    from hapc.collectives import outputs

    torch.manual_seed(0)
    model, x, y = _WithLogits().double(), torch.randn(7, 6, dtype=F64), torch.randint(0, 5, (7,))
    m = hapc.compile(model, "local-cpu:2", (x, y), plan=None, baseline="dp-cp")
    real = outputs.gather_impl
    if rank == 0:

        def late(*args, **kwargs):
            time.sleep(0.3)  # six deadlines (DEADLINE_S = 50 ms)
            return real(*args, **kwargs)

        outputs.gather_impl = late
    out = []
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        loss, logits = m(x, y)
        loss.backward()
        out.append((loss.item(), logits.detach().clone(), m.full_gradients()))
    return out


def test_a_slow_rank_gathering_outputs_after_the_loss_keeps_the_collective_order():
    torch.manual_seed(0)
    model, x, y = _WithLogits().double(), torch.randn(7, 6, dtype=F64), torch.randint(0, 5, (7,))
    loss, logits = model(x, y)
    loss.backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    for out in run_distributed(_slow_rank0_outputs, 2, timeout=20):
        for value, got, grads in out:
            assert value == pytest.approx(loss.item(), rel=1e-12)
            assert_close(got, logits.detach(), F64, "logits")
            assert_close(grads, want, F64, "grads")
