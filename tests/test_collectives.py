"""The uneven collectives on real gloo processes: values and adjoints (HAP §2.5.1, DESIGN §3).

Every rank builds the same global tensors from one seed, so it knows what every other rank holds
and can compute the expected result and the expected gradient of ``L = sum_r <y_r, c_r>`` (each
rank weighs its output by its own ``c_r``) without communicating.
"""

from __future__ import annotations

import pytest
import torch

import hapc.collectives as C
from hapc.balance.rounding import bounds
from hapc.testing import run_distributed

SIZES = [[3], [3, 5], [5, 2, 1], [4, 1, 3, 2]]


def _data(shape, world, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(world)]


def _take(x, dim, sizes, r):
    lo, hi = bounds(sizes)[r]
    return x.narrow(dim, lo, hi - lo)


def _gather_job(rank, world, sizes, dim, variant):
    shape = [6, 4, 3]
    shape[dim] = sum(sizes)
    full = _data(shape, 1)[0]
    cs = _data(shape, world, seed=1)
    x = _take(full, dim, sizes, rank).clone().requires_grad_()
    y = C.all_gather(x, dim, sizes, None, variant)
    (y * cs[rank]).sum().backward()
    torch.testing.assert_close(y, full)
    torch.testing.assert_close(x.grad, _take(sum(cs), dim, sizes, rank))
    return True


def _scatter_job(rank, world, sizes, dim, variant):
    shape = [6, 4, 3]
    shape[dim] = sum(sizes)
    parts = _data(shape, world)
    cs = [_take(c, dim, sizes, r) for r, c in enumerate(_data(shape, world, seed=1))]
    x = parts[rank].clone().requires_grad_()
    y = C.reduce_scatter(x, dim, sizes, None, variant)
    (y * cs[rank]).sum().backward()
    torch.testing.assert_close(y, _take(sum(parts), dim, sizes, rank))
    torch.testing.assert_close(x.grad, torch.cat(cs, dim))
    return True


def _reduce_job(rank, world):
    parts = _data([5, 3], world)
    cs = _data([5, 3], world, seed=1)
    x = parts[rank].clone().requires_grad_()
    y = C.all_reduce(x)
    (y * cs[rank]).sum().backward()
    torch.testing.assert_close(y, sum(parts))
    torch.testing.assert_close(x.grad, sum(cs))
    return True


def _a2a_job(rank, world, src_sizes, dst_sizes, src_dim, dst_dim):
    shape = [7, 5, 3]
    shape[src_dim] = sum(src_sizes)
    shape[dst_dim] = sum(dst_sizes)
    full = _data(shape, 1)[0]
    c_full = _data(shape, 1, seed=1)[0]
    x = _take(full, src_dim, src_sizes, rank).clone().requires_grad_()
    y = C.all_to_all(x, src_dim, dst_dim, src_sizes, dst_sizes)
    (y * _take(c_full, dst_dim, dst_sizes, rank)).sum().backward()
    torch.testing.assert_close(y, _take(full, dst_dim, dst_sizes, rank))
    torch.testing.assert_close(x.grad, _take(c_full, src_dim, src_sizes, rank))
    return True


def _sfb_job(rank, world, sizes):
    x_full = _data([sum(sizes), 6], 1)[0]
    w0 = _data([4, 6], 1, seed=2)[0]
    c_full = _data([sum(sizes), 4], 1, seed=1)[0]
    x = _take(x_full, 0, sizes, rank).clone().requires_grad_()
    w = w0.clone().requires_grad_()
    y = C.sfb_linear(x, w, sizes, 0)
    (y * _take(c_full, 0, sizes, rank)).sum().backward()
    torch.testing.assert_close(y, x_full[bounds(sizes)[rank][0] : bounds(sizes)[rank][1]] @ w0.t())
    torch.testing.assert_close(w.grad, c_full.t() @ x_full)  # whole on every rank: no all-reduce needed
    torch.testing.assert_close(x.grad, _take(c_full, 0, sizes, rank) @ w0)
    return True


def _sync_bn_job(rank, world, sizes):
    x_full = _data([sum(sizes), 3, 4, 4], 1)[0]
    c_full = _data([sum(sizes), 3, 4, 4], 1, seed=1)[0]
    weight, bias = torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)
    ref_x = x_full.clone().requires_grad_()
    ref_w, ref_b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rm_ref, rv_ref = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    ref = torch.nn.functional.batch_norm(ref_x, rm_ref, rv_ref, ref_w, ref_b, True, 0.1, 1e-5)
    (ref * c_full).sum().backward()
    x = _take(x_full, 0, sizes, rank).clone().requires_grad_()
    w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    y = C.sync_batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    (y * _take(c_full, 0, sizes, rank)).sum().backward()
    torch.testing.assert_close(y, _take(ref, 0, sizes, rank).detach())
    torch.testing.assert_close(x.grad, _take(ref_x.grad, 0, sizes, rank))
    torch.testing.assert_close(C.all_reduce(w.grad.clone()), ref_w.grad)  # Partial: summed over ranks
    torch.testing.assert_close(rm, rm_ref)
    torch.testing.assert_close(rv, rv_ref)
    return True


def _gather_scatter_reduce_job(rank, world, sizes):
    for variant in ("padded", "grouped"):
        for dim in (0, 1):
            _gather_job(rank, world, sizes, dim, variant)
            _scatter_job(rank, world, sizes, dim, variant)
    return _reduce_job(rank, world)


@pytest.mark.parametrize("sizes", SIZES, ids=[str(s) for s in SIZES])
def test_all_gather_reduce_scatter_all_reduce(sizes):
    """Padded and grouped variants, on dims 0 and 1, 1-4 ranks with uneven shards."""
    assert all(run_distributed(_gather_scatter_reduce_job, len(sizes), sizes))


@pytest.mark.parametrize(
    "src, dst, src_dim, dst_dim",
    [
        ([2, 3, 2], [1, 1, 3], 0, 1),  # S(0) -> S(1)
        ([1, 4], [3, 2], 1, 0),  # S(1) -> S(0)
        ([4, 1, 2], [2, 3, 2], 0, 0),  # re-split of one dim with new ratios
        ([2, 1, 1, 1], [1, 2, 1, 1], 1, 2),
    ],
)
def test_all_to_all(src, dst, src_dim, dst_dim):
    assert all(run_distributed(_a2a_job, len(src), src, dst, src_dim, dst_dim))


@pytest.mark.parametrize("sizes", [[3, 5], [5, 2, 1]])
def test_sufficient_factor_broadcasting(sizes):
    assert all(run_distributed(_sfb_job, len(sizes), sizes))


@pytest.mark.parametrize("sizes", [[2, 5], [3, 1, 2]])
def test_sync_batch_norm(sizes):
    assert all(run_distributed(_sync_bn_job, len(sizes), sizes))


def _shape_error_job(rank, world):
    x = torch.zeros(4 if rank == 0 else 2, 3)
    C.all_gather(x, 0, [3, 2])


def test_wrong_shard_size_is_an_error():
    with pytest.raises(Exception, match="local shard has 4 on dim 0, expected 3"):
        run_distributed(_shape_error_job, 2, timeout=20)


def _global_loss_job(rank, world):
    x = torch.tensor(float(rank + 1), dtype=torch.float64, requires_grad=True)
    out = {"item": C.global_value(x * 2).item()}  # read before backward: waits for the value
    loss = C.global_value(x * 3)
    loss.backward()  # backward first: the all-reduce overlaps with it
    out["grad"], out["after_backward"] = x.grad.item(), loss.item()
    out["float"], out["format"] = float(C.global_value(x * 1)), f"{C.global_value(x * 1):.1f}"
    doubled = C.global_value(x * 1) * 2
    out["op"] = (type(doubled) is torch.Tensor, doubled.item())
    out["stack"] = torch.stack([C.global_value(x * 1), C.global_value(x * 1)]).tolist()
    return out


def test_global_loss_value_is_the_sum_and_its_gradient_the_summand():
    world = 3
    total = sum(range(1, world + 1))
    for r in run_distributed(_global_loss_job, world):
        assert r["item"] == 2 * total and r["after_backward"] == 3 * total
        assert r["grad"] == 3.0  # this rank's summand only: the partial-gradient convention
        assert r["float"] == total and r["format"] == f"{total:.1f}"
        assert r["op"] == (True, 2 * total)  # results of operations are plain tensors
        assert r["stack"] == [total, total]
