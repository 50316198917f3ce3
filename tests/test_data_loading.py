"""Data as DDP users load it (issue 13): ``DistributedSampler`` shares under an uneven plan.

Each rank iterates its own ``DistributedSampler`` (``batch / world`` rows per step, strided
indices); the plan's ratios are uneven, so the module all-gathers the shares into the global batch
and splits it by its ratios. Losses and weights after every step equal single-device training on
the union of the ranks' rows (float64).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hapc
from hapc import models
from hapc.testing import run_distributed

ROWS, PER_RANK, STEPS = 36, 2, 3


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(
        torch.randn(ROWS, 24, generator=g, dtype=torch.float64), torch.randint(0, 10, (ROWS,), generator=g)
    )


def _job(rank: int, world: int, cluster: str) -> dict:
    model, example = models.load("mlp", batch=PER_RANK * world, dtype=torch.float64)
    module = hapc.compile(model, cluster, example)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    loader = DataLoader(_data(), batch_size=PER_RANK, sampler=DistributedSampler(_data(), world, rank, shuffle=False))
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        opt.zero_grad()
        loss = module(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": module.full_state_dict(), "ratios": module.plan.device_ratios}


def _reference(world: int) -> dict:
    model, _ = models.load("mlp", batch=PER_RANK * world, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    shares = [list(DistributedSampler(data, world, r, shuffle=False)) for r in range(world)]
    losses = []
    for step in range(STEPS):
        rows = [i for r in range(world) for i in shares[r][step * PER_RANK : (step + 1) * PER_RANK]]
        x, y = data[rows]
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": model.state_dict()}


def test_distributed_sampler_shares_under_an_uneven_plan():
    world = 3
    ref = _reference(world)
    results = run_distributed(_job, world, "local-cpu:3")
    assert len(set(results[0]["ratios"])) > 1  # the plan's shares are not the sampler's
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-12)
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-10, atol=1e-12)


# -- another batch size: the partial last batch, evaluation batches (issue 13, acceptance 3) ------------

FEATURES, CLASSES, EPOCH_ROWS, EVAL_ROWS = 24, 10, 13, 5


class _Net(torch.nn.Module):
    """Returns the loss and the logits (which come back whole)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.drop = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        logits = self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


def _net(p: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return _Net(p).double()


def _epoch_data() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(
        torch.randn(EPOCH_ROWS, FEATURES, generator=g, dtype=torch.float64),
        torch.randint(0, CLASSES, (EPOCH_ROWS,), generator=g),
    )


def _example(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, FEATURES, dtype=torch.float64), torch.randint(0, CLASSES, (rows,))


def _odd_job(rank: int, world: int, cluster: str, options: dict) -> dict:
    import warnings

    model = _net()
    module = hapc.compile(model, cluster, _example(PER_RANK * world), **options)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    data = _epoch_data()
    # drop_last=False: the sampler pads to equal shares, and the epoch ends with a partial batch
    loader = DataLoader(data, batch_size=PER_RANK, sampler=DistributedSampler(data, world, rank, shuffle=False))
    losses, sizes = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in loader:
            opt.zero_grad()
            loss = module(x, y)["loss"]
            loss.backward()
            opt.step()
            losses.append(float(loss))
            sizes.append(len(x))
        module.eval()
        evals = []
        with torch.no_grad():  # every rank the same global batch, of another size
            for x, y in DataLoader(data, batch_size=EVAL_ROWS):
                out = module(x, y)
                evals.append((float(out["loss"]), out["logits"].clone()))
    odd_warnings = [w for w in caught if "replicated step" in str(w.message)]
    return {
        "losses": losses,
        "sizes": sizes,
        "evals": evals,
        "state": module.full_state_dict(),
        "warnings": len(odd_warnings),
        "sharded": any(
            lay.is_sharded for ref, lay in module._layouts.values() if module.theory.graph[ref].kind == "param"
        ),
    }


def _odd_reference(world: int) -> dict:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _epoch_data()
    shares = [list(DistributedSampler(data, world, r, shuffle=False)) for r in range(world)]
    losses = []
    for step in range(-(-len(shares[0]) // PER_RANK)):
        rows = [i for r in range(world) for i in shares[r][step * PER_RANK : (step + 1) * PER_RANK]]
        x, y = data[rows]
        opt.zero_grad()
        loss = model(x, y)["loss"]
        loss.backward()
        opt.step()
        losses.append(float(loss))
    model.eval()
    with torch.no_grad():
        outs = [model(x, y) for x, y in DataLoader(data, batch_size=EVAL_ROWS)]
    evals = [(float(o["loss"]), o["logits"]) for o in outs]
    return {"losses": losses, "evals": evals, "state": model.state_dict()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("plan", ["default", "tp", "export"])
def test_partial_last_batch_and_evaluation_batches(world: int, plan: str):
    """DistributedSampler(drop_last=False) over 13 rows: shares of 2, 2 (and 2), then a partial one
    of 1 row per rank (the sampler pads by repeating rows); then eval batches of 5 global rows.
    Losses, logits and weights equal one device on the same rows. ``export``: the model captured by
    torch.export (as many Hugging Face models are), whose capture at the partial batch's size calls
    the model -- stale by then, the module having trained its own copy -- past its guard."""
    options = {"baseline": "tp"} if plan == "tp" else {"capture": "export"} if plan == "export" else {}
    ref = _odd_reference(world)
    results = run_distributed(_odd_job, world, f"local-cpu:{world}", options)
    for r in results:
        assert r["sizes"][-1] < PER_RANK  # the partial batch ran
        assert r["warnings"] == 1  # said once
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-10)
        for (loss, logits), (want_loss, want_logits) in zip(r["evals"], ref["evals"], strict=True):
            assert loss == pytest.approx(want_loss, rel=1e-10)
            torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-12)
        for k, v in ref["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-9, atol=1e-12)
    if plan == "tp":
        assert results[0]["sharded"]


class _AttentionNet(torch.nn.Module):
    """Attention dropout (SDPA ``dropout_p``) and functional dropout."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(FEATURES // 4, 3 * 8)
        self.out = torch.nn.Linear(8 * 4, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        q, k, v = self.qkv(x.reshape(x.shape[0], 4, FEATURES // 4)).reshape(x.shape[0], 4, 3, 8).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0)
        h = torch.nn.functional.dropout(a.reshape(x.shape[0], 32), 0.3, self.training)
        logits = self.out(h)
        return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


def _dropout_model(kind: str) -> torch.nn.Module:
    if kind == "module":
        return _net(p=0.3)
    torch.manual_seed(0)
    return _AttentionNet().double()


def _dropout_job(rank: int, world: int, compiled_rows: int, rows: int, kind: str) -> dict:
    model = _dropout_model(kind)
    module = hapc.compile(model, f"local-cpu:{world}", _example(compiled_rows))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(rows, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (rows,), generator=g)
    losses = []
    for _ in range(2):  # two steps: the masks move with the stream's step
        module.zero_grad()
        out = module(x, y)
        out["loss"].backward()
        losses.append(float(out["loss"]))
    return {"losses": losses, "grads": module.full_gradients(), "logits": out["logits"].detach().clone()}


@pytest.mark.parametrize("kind", ["module", "functional-and-sdpa"])
def test_dropout_masks_of_another_batch_size_are_the_one_rank_programs(kind: str):
    """A batch of 4 rows on a module compiled for 6, on 2 and 3 ranks, draws the masks hapc's one-rank
    program compiled for 4 draws (by global index): losses, logits and gradients equal, bit for bit
    up to float64 summation order."""
    one = run_distributed(_dropout_job, 1, 4, 4, kind)[0]
    assert one["losses"][0] != one["losses"][1]  # it drops, and the masks move with the step
    for world in (2, 3):
        for r in run_distributed(_dropout_job, world, 6, 4, kind):
            assert r["losses"] == pytest.approx(one["losses"], rel=1e-12)
            torch.testing.assert_close(r["logits"], one["logits"], rtol=1e-12, atol=1e-14)
            for k, v in one["grads"].items():
                torch.testing.assert_close(r["grads"][k], v, rtol=1e-10, atol=1e-13)


def _uneven_shares_job(rank: int, world: int) -> dict:
    model = _net()
    module = hapc.compile(model, f"local-cpu:{world}", _example(PER_RANK * world))
    x, y = _epoch_data()[:]
    with torch.no_grad():
        module(x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK])  # even shares
    lo, hi = [(0, 1), (1, 1), (1, 4)][rank]  # 1, 0 and 3 rows: an empty share in the middle
    out = module(x[lo:hi], y[lo:hi])
    out["loss"].backward()
    return {"loss": float(out["loss"]), "grads": module.full_gradients(), "logits": out["logits"].detach().clone()}


def test_uneven_and_empty_shares_of_another_size():
    """Shares of 1, 0 and 3 rows (none the size of a share of the plan's batch: a rank given one
    would run the program) are all-gathered in rank order: the loss, logits and gradients of one
    device on those 4 rows."""
    x, y = _epoch_data()[:]
    model = _net()
    out = model(x[:4], y[:4])
    out["loss"].backward()
    for r in run_distributed(_uneven_shares_job, 3):
        assert r["loss"] == pytest.approx(float(out["loss"]), rel=1e-12)
        torch.testing.assert_close(r["logits"], out["logits"].detach(), rtol=1e-12, atol=1e-14)
        for k, p in model.named_parameters():
            torch.testing.assert_close(r["grads"][k], p.grad, rtol=1e-10, atol=1e-13)


def _refusal_job(rank: int, world: int) -> dict:
    model = _net()
    module = hapc.compile(model, f"local-cpu:{world}", _example(6))
    x, y = _epoch_data()[:]
    module(x[:6], y[:6])  # every rank the global batch
    errors = []
    for xs, ys in [
        (x[rank : rank + 4], y[rank : rank + 4]),  # another size, and different on every rank
        (x[:4], y[:3]),  # inputs disagree on the batch size
    ]:
        try:
            module(xs, ys)
            errors.append("accepted")
        except hapc.HapcError as exc:
            errors.append(str(exc))
    return {"errors": errors, "after": float(module(x[:6], y[:6])["loss"])}


def test_refusals_of_another_size_are_alike_on_every_rank():
    """Refused calls of another size raise the same HapcError on every rank (decided on gathered
    numbers, never a hang), and the module goes on exactly."""
    x, y = _epoch_data()[:]
    want = float(_net()(x[:6], y[:6])["loss"])
    results = run_distributed(_refusal_job, 3)
    for r in results:
        assert r["errors"] == results[0]["errors"]
        assert r["after"] == pytest.approx(want, rel=1e-12)
    different, sizes = results[0]["errors"]
    assert "different batches" in different and "same global batch" in different
    assert "input 'y' on rank 0 has a batch size (dim 0) other than the other inputs'" in sizes


class _BatchNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc2 = torch.nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return _BatchNormNet().double()


def _bn_job(rank: int, world: int, options: dict) -> dict:
    module = hapc.compile(_bn_net(), f"local-cpu:{world}", _example(6), **options)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = _epoch_data()[:]
    losses = []
    for lo, hi in [(0, 6), (6, 10), (10, 13)]:  # the plan's 6 rows, then 4 and 3
        opt.zero_grad()
        loss = module(x[lo:hi], y[lo:hi])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": module.full_state_dict()}


@pytest.mark.parametrize("plan", ["default", "tp"])
def test_batch_norm_statistics_of_another_batch_size(plan: str):
    """Batch norm in training on batches of another size: normalised by the whole batch's
    statistics, and the running statistics (and counter) move as on one device."""
    model = _bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _epoch_data()[:]
    want = []
    for lo, hi in [(0, 6), (6, 10), (10, 13)]:
        opt.zero_grad()
        loss = model(x[lo:hi], y[lo:hi])
        loss.backward()
        opt.step()
        want.append(float(loss))
    for r in run_distributed(_bn_job, 2, {"baseline": "tp"} if plan == "tp" else {}):
        assert r["losses"] == pytest.approx(want, rel=1e-10)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-9, atol=1e-12)


def _first_call_job(rank: int, world: int) -> dict:
    from hapc.testing import cluster_of

    model, (x, y) = models.load("mlp", batch=16, dtype=torch.float64)
    module = hapc.compile(model, cluster_of([5e9, 3e9, 2e9]), (x, y), baseline="dp-cp")
    ref = next(n.index for n in module.theory.graph.inputs if n.name == "x")
    sizes = module.theory.local_sizes(ref, 0, module.plan.device_ratios)
    module.eval()
    with torch.no_grad():
        loss = module(x[: sizes[1]], y[: sizes[1]])  # the first call: rank 1's share size, but the global batch
    return {"sizes": sizes, "loss": float(loss)}


def test_a_first_call_of_a_ranks_share_size_is_the_global_batch():
    """Every rank is given the same 5 rows, which is rank 1's share of the plan's 16 (8, 5, 3): the
    ranks agree on the first call that it is another batch size (rank 1 alone must not run the
    program on it as its share) and return one device's loss on the 5 rows."""
    model, (x, y) = models.load("mlp", batch=16, dtype=torch.float64)
    for r in run_distributed(_first_call_job, 3):
        assert len(set(r["sizes"])) == 3
        assert r["loss"] == pytest.approx(float(model(x[: r["sizes"][1]], y[: r["sizes"][1]])), rel=1e-12)


def _gpt_job(rank: int, world: int, options: dict) -> dict:
    model, (ids, targets) = models.load("gpt", batch=4, dtype=torch.float64)
    module = hapc.compile(model, f"local-cpu:{world}", (ids, targets), **options)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    losses = []
    for rows in (4, 3, 4):  # a partial batch between two of the plan's (positions, heads: literal shapes)
        batch = torch.randint(0, 97, (rows, 16), generator=g)
        opt.zero_grad()
        loss = module(batch, batch.roll(-1, 1))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "state": module.full_state_dict()}


@pytest.mark.parametrize("plan", ["default", "tp"])
def test_a_transformer_trains_through_a_partial_batch(plan: str):
    model, _ = models.load("gpt", batch=4, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    want = []
    for rows in (4, 3, 4):
        batch = torch.randint(0, 97, (rows, 16), generator=g)
        opt.zero_grad()
        loss = model(batch, batch.roll(-1, 1))
        loss.backward()
        opt.step()
        want.append(float(loss))
    for r in run_distributed(_gpt_job, 3, {"baseline": "tp"} if plan == "tp" else {}):
        assert r["losses"] == pytest.approx(want, rel=1e-10)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-8, atol=1e-10)
