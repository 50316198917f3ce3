"""Issue 13 "Randomness": dropout, ``F.dropout``, ``nn.Dropout`` and SDPA's ``dropout_p`` draw
rank-consistent masks (seed, step, op, global element index; :mod:`hapc.theory.rules.random`).

BERT- and GPT-like models with dropout 0.1 in all three forms train three steps on 2, 3 and 4
gloo processes under data-parallel, Megatron tensor-parallel and uneven-ratio plans, and must end
with the losses and weights of hapc's own one-rank run (float64, rtol 1e-12); the masks have the
requested keep rate; a sharded tensor's mask is the slice of the whole tensor's; ``p = 0``,
``training=False`` and eval mode are identities; other random ops are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import strategy_results
from torch import nn

import hapc
import hapc.ops as hops
from hapc.errors import DistributedRunError, HapcError
from hapc.testing import cluster_of, run_distributed
from hapc.theory.instructions import Compute
from hapc.theory.trace import trace
from hapc.theory.triples import derive

F64 = torch.float64
P = 0.1


# -- the models: dropout as a module, as a function and inside attention ----------------------------
class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool, p: float):
        super().__init__()
        self.heads, self.causal, self.p = heads, causal, p
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(p)  # residual dropout (a module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (f(x).view(b, t, self.heads, h // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        p = self.p if self.training else 0.0  # attention dropout (SDPA's dropout_p), as HF writes it
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.drop(self.out(y.transpose(1, 2).reshape(b, t, h)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool, p: float):
        super().__init__()
        self.p = p
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, causal, p)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        h = F.dropout(F.gelu(self.up(self.ln2(x))), self.p, training=self.training)  # functional
        return x + self.down(h)


class LM(nn.Module):
    """GPT-like (causal) or BERT-like (bidirectional) with embedding, attention, residual and MLP dropout."""

    def __init__(self, causal: bool, p: float = P, vocab: int = 53, hidden: int = 32, heads: int = 4, seq: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(hidden, heads, causal, p) for _ in range(2))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(b * t, -1), targets.view(b * t))


def build(kind: str, p: float = P) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = LM(causal=kind == "gpt", p=p).to(F64)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 53, (4, 8), generator=g)
    return model, (idx, torch.randint(0, 53, (4, 8), generator=g))


# -- N ranks == one rank ------------------------------------------------------------------------------
def _train(rank: int, world: int, kind: str, cluster: Any, plan: Any, steps: int = 3) -> dict[str, Any]:
    model, inputs = build(kind)
    torch.manual_seed(1234)  # the seed the masks derive from (rank 0's, broadcast)
    module = hapc.compile(model, cluster, inputs, plan=plan)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        losses.append(loss.detach().item())
        opt.step()
    return {"losses": losses, "state": module.full_state_dict(), "step": module.rng.step}


_REFERENCE: dict[str, dict[str, Any]] = {}


def one_rank(kind: str) -> dict[str, Any]:
    if kind not in _REFERENCE:
        cluster = cluster_of([1e10])
        model, inputs = build(kind)
        plan = hapc.synthesize(model, cluster, inputs)
        _REFERENCE[kind] = run_distributed(_train, 1, kind, cluster, plan)[0]
    return _REFERENCE[kind]


def _plans(world: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    ratios = {2: (0.6, 0.4), 3: (0.5, 0.3, 0.2), 4: (0.4, 0.3, 0.2, 0.1)}[world]
    return {
        "dp": (cluster_of([1e10] * world), {"baseline": "dp-ev"}),
        "tp": (cluster_of([1e10] * world), {"baseline": "tp"}),
        "ratios": (cluster_of([1e10] * world, bandwidth="10 MB/s"), {"ratios": ratios}),
    }


CASES = [(kind, world, how) for kind in ("bert", "gpt") for world in (2, 3, 4) for how in ("dp", "tp", "ratios")]


@pytest.mark.parametrize(("kind", "world", "how"), CASES, ids=[f"{k}-{w}-{h}" for k, w, h in CASES])
def test_n_ranks_equal_one_rank(kind: str, world: int, how: str) -> None:
    cluster, synth = _plans(world)[how]
    model, inputs = build(kind)
    plan = hapc.synthesize(model, cluster, inputs, **synth)
    if how == "tp":  # Megatron: attention by heads (the SDPA dropout's probabilities shard on dim 1)
        assert "h1:S(1),S(1),S(1)->S(1)" in _random_strategies(model, inputs, plan).values()
    if how == "ratios":
        assert plan.device_ratios == pytest.approx(_plans(world)[how][1]["ratios"])
    got = run_distributed(_train, world, kind, cluster, plan)
    want = one_rank(kind)
    assert want["losses"] != plain_losses(kind, p=0.0)  # the masks are really drawn
    for r in got:
        assert r["step"] == want["step"] == 3
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-12, atol=0)
        for k, v in want["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-12, atol=1e-15, msg=lambda m, k=k: f"{k}: {m}")


def _random_strategies(model: nn.Module, inputs: Any, plan: Any) -> dict[str, str]:
    """Node name -> the plan's strategy for each dropout / attention node."""
    graph = trace(model, inputs)
    return {
        graph[ins.ref].name: ins.strategy_key
        for ins in plan.instructions
        if isinstance(ins, Compute) and graph[ins.ref].op in ("dropout", "scaled_dot_product_attention")
    }


def test_the_plans_shard_the_random_ops() -> None:
    """Between them, the cases above run dropout replicated and sharded on batch, heads and features."""
    seen = set()
    for world in (2, 3):
        for cluster, synth in _plans(world).values():
            model, inputs = build("gpt")
            seen |= set(_random_strategies(model, inputs, hapc.synthesize(model, cluster, inputs, **synth)).values())
    assert {"replicate:R->R", "d0:S(0)->S(0)", "d2:S(2)->S(2)", "h1:S(1),S(1),S(1)->S(1)"} <= seen, seen


def plain_losses(kind: str, p: float, steps: int = 3) -> list[float]:
    """Single-device training of the same model (meaningful for p = 0 only: no masks)."""
    model, inputs = build(kind, p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*inputs)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


# -- the masks ------------------------------------------------------------------------------------------
class _Keep(nn.Module):
    """Whole-tensor dropout of a parameter: its gradient is the mask times 1 / (1 - p)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.w = nn.Parameter(torch.ones(64, 256, dtype=F64))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.drop(self.w * x) + F.dropout(self.w, self.p, training=self.training)).sum()


def _masks(rank: int, world: int, p: float) -> list[torch.Tensor]:
    module = hapc.compile(_Keep(p), cluster_of([1e10] * world), (torch.ones(64, 256, dtype=F64),))
    grads = []
    for _ in range(2):
        module.zero_grad()
        module(torch.ones(64, 256, dtype=F64)).backward()
        grads.append(module.full_gradients()["w"])
    return grads


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_one_rank_masks_have_the_requested_keep_rate(p: float) -> None:
    g1, g2 = run_distributed(_masks, 1, p)[0]
    n = g1.numel()
    for g in (g1, g2):  # two ops (module and functional), two steps: four independent masks
        scale = 1 / (1 - p)
        values = set(torch.unique(g).tolist())
        assert values <= {0.0, scale, 2 * scale}
        kept = ((g == scale).sum() + 2 * (g == 2 * scale).sum()).item() / (2 * n)
        assert abs(kept - (1 - p)) < 6 * math.sqrt(p * (1 - p) / (2 * n)), kept
    assert not torch.equal(g1, g2)  # the step counter gives every training forward new masks


def test_attention_dropout_keep_rate() -> None:
    """SDPA's dropout_p drops attention probabilities: with v = I the output is the dropped
    probabilities, each 1 / Tk when kept (q = k = 0), 0 when dropped."""
    q = torch.zeros(4, 8, 64, 16, dtype=F64)
    v = torch.eye(64, dtype=F64).expand(4, 8, 64, 64)
    y = hops.scaled_dot_product_attention(q, q[..., :64, :], v, dropout_p=P, stream=hops.RandomStream(3, 5))
    kept = (y != 0).double().mean().item()
    assert abs(kept - (1 - P)) < 6 * math.sqrt(P * (1 - P) / y.numel())
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 64 / (1 - P)))


def test_a_sharded_mask_is_the_slice_of_the_whole_mask() -> None:
    stream = hops.RandomStream(seed=7, step=2)
    x = torch.randn(6, 5, 7, 4, dtype=F64)
    whole = hops.dropout(x, 0.3, stream=stream, op="d")
    for starts, ends in [((2, 0, 0, 0), (5, 5, 7, 4)), ((0, 1, 3, 0), (6, 4, 7, 4)), ((5, 4, 6, 3), (6, 5, 7, 4))]:
        piece = x[tuple(slice(a, b) for a, b in zip(starts, ends))]
        got = hops.dropout(piece, 0.3, stream=stream, op="d", starts=starts, full_shape=x.shape)
        assert torch.equal(got, whole[tuple(slice(a, b) for a, b in zip(starts, ends))])
    assert not torch.equal(whole, hops.dropout(x, 0.3, stream=hops.RandomStream(7, 3), op="d"))  # another step
    assert not torch.equal(whole, hops.dropout(x, 0.3, stream=stream, op="e"))  # another op
    assert not torch.equal(whole, hops.dropout(x, 0.3, stream=hops.RandomStream(8, 2), op="d"))  # another seed


def test_every_strategy_of_the_rules_draws_the_whole_tensors_mask() -> None:
    """Each dropout / attention strategy, run per device with uneven ratios by the simulator,
    combines to exactly what the replicated strategy computes (Partial summands included)."""
    model, inputs = build("bert")
    theory = derive(trace(model, inputs))
    values = theory.graph.evaluate(dict(zip(["idx", "targets"], inputs)))
    ratios = (0.5, 0.3, 0.2)
    checked = 0
    for n in theory.graph:
        if n.op not in ("dropout", "scaled_dot_product_attention"):
            continue
        reference = None
        for s, got in strategy_results(theory, n, values, ratios):
            if reference is None:
                assert s.name == "replicate"
                reference = got
            else:
                torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-14)
            checked += 1
    assert checked >= 12


# -- identities and refusals ----------------------------------------------------------------------------
def _compare_eval(rank: int, world: int, compiled_in: str) -> dict[str, Any]:
    model, inputs = build("gpt")
    model.train(compiled_in == "train")
    module = hapc.compile(model, cluster_of([1e10] * world), inputs, plan=None)
    out: dict[str, Any] = {}
    if compiled_in == "train":
        module.eval()
        out["eval"] = module(*inputs).item()
        module.train()
        out["train"] = module(*inputs).item()
        out["step"] = module.rng.step
    else:
        out["eval"] = module(*inputs).item()
        with pytest.raises(HapcError, match="compiled from the model in eval mode"):
            module.train()
        out["refused"] = True
    return out


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_eval_mode_is_the_identity(compiled_in: str) -> None:
    model, inputs = build("gpt")
    want = model.eval()(*inputs).item()
    for r in run_distributed(_compare_eval, 2, compiled_in):
        assert r["eval"] == pytest.approx(want, rel=1e-12)
        if compiled_in == "train":
            assert r["step"] == 1  # eval forwards draw nothing
            assert r["train"] != pytest.approx(want, rel=1e-6)
        else:
            assert r["refused"]


class _Zero(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6).to(F64)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.drop(self.lin(x)), 0.0, training=True)
        return F.dropout(h, 0.5, training=False).square().sum()


def _zero_job(rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = _Zero()
    return hapc.compile(model, cluster_of([1e10] * world), (torch.ones(4, 6, dtype=F64),))(
        torch.ones(4, 6, dtype=F64)
    ).item()


def test_p_zero_and_training_false_are_identities() -> None:
    torch.manual_seed(0)
    want = _Zero()(torch.ones(4, 6, dtype=F64)).item()
    assert run_distributed(_zero_job, 2) == [pytest.approx(want, rel=1e-12)] * 2


class _Other(nn.Module):
    def __init__(self, op: str):
        super().__init__()
        self.op = op
        self.lin = nn.Linear(4, 4)
        self.drop2d = nn.Dropout2d(0.1)  # whole channels: not element-wise dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.op == "dropout2d":
            h = self.drop2d(h.view(1, 4, 2, 2))
        elif self.op == "alpha_dropout":
            h = F.alpha_dropout(h, 0.1, training=self.training)
        elif self.op == "rrelu":
            h = F.rrelu(h, training=self.training)
        else:
            h = h + torch.randn_like(h)
        return h.sum()


def _other_job(rank: int, world: int, op: str) -> None:
    hapc.compile(_Other(op), "local-cpu:2", (torch.randn(4, 4),))


@pytest.mark.parametrize("op", ["alpha_dropout", "rrelu", "randn_like", "dropout2d"])
def test_other_random_ops_are_refused_by_name(op: str) -> None:
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_other_job, 2, op, timeout=30)
    for text in err.value.errors.values():
        assert op in text and "test_dropout.py" in text and "rank-consistent" in text, text


@pytest.mark.parametrize("variant", ["plain", "causal", "bool-mask", "float-mask", "gqa", "scale"])
def test_explicit_attention_is_sdpa(variant: str) -> None:
    """The explicit attention SDPA's dropout runs through computes SDPA (checked with a p so small
    that nothing drops)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=F64)
    kv_heads = 2 if variant == "gqa" else 4
    k, v = (torch.randn(2, kv_heads, 5, 8, generator=g, dtype=F64) for _ in range(2))
    kw: dict[str, Any] = {
        "causal": {"is_causal": True},
        "bool-mask": {"attn_mask": torch.rand(5, 5, generator=g) > 0.3},
        "float-mask": {"attn_mask": torch.randn(2, 1, 5, 5, generator=g, dtype=F64)},
        "gqa": {"enable_gqa": True},
        "scale": {"scale": 0.3},
    }.get(variant, {})
    if variant == "bool-mask":
        kw["attn_mask"][:, 0] = True  # no row fully masked
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = hops.scaled_dot_product_attention(q, k, v, dropout_p=1e-300, **kw)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _accumulate(rank: int, world: int, cluster: Any, plan: Any) -> dict[str, Any]:
    """Two optimizer steps of two accumulated micro-batches each (the first under ``no_sync``),
    an eval forward between them: every training forward draws its own masks (step 1, 2, ...)."""
    model, inputs = build("gpt")
    torch.manual_seed(99)
    module = hapc.compile(model, cluster, inputs, plan=plan)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        with module.no_sync():
            module(*inputs).backward()
        loss = module(*inputs)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        module.eval()
        losses.append(module(*inputs).item())  # no masks, no step
        module.train()
    return {"losses": losses, "state": module.full_state_dict(), "step": module.rng.step}


def test_accumulation_and_eval_between_steps() -> None:
    cluster2 = cluster_of([1e10] * 2)
    model, inputs = build("gpt")
    plan2 = hapc.synthesize(model, cluster2, inputs, baseline="dp-ev")
    got = run_distributed(_accumulate, 2, cluster2, plan2)
    cluster1 = cluster_of([1e10])
    want = run_distributed(_accumulate, 1, cluster1, hapc.synthesize(model, cluster1, inputs))[0]
    assert want["step"] == 4
    for r in got:
        assert r["step"] == 4
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-12, atol=0)
        for k, v in want["state"].items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-12, atol=1e-15)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_masks_are_the_same_on_cuda() -> None:
    stream = hops.RandomStream(seed=11, step=4)
    x = torch.randn(3, 33, 65, dtype=F64)
    want = hops.dropout(x, 0.2, stream=stream, op="d", starts=(1, 0, 7), full_shape=(9, 33, 80))
    got = hops.dropout(x.cuda(), 0.2, stream=stream, op="d", starts=(1, 0, 7), full_shape=(9, 33, 80))
    assert torch.equal(got.cpu(), want)


def test_the_verifier_checks_every_dropout_triple() -> None:
    """``hapc.verify`` takes a random op's replicated, stream-drawn call as its reference, so every
    dropout and attention-dropout triple is checked forward and backward (no longer skipped)."""
    from collections import Counter

    from hapc.theory.verify import verify

    model, inputs = build("bert")
    theory = derive(trace(model, inputs))
    wanted = [n.index for n in theory.graph if n.op in ("dropout", "scaled_dot_product_attention")]
    checked: Counter = Counter()
    failures = verify(theory, dict(zip(["idx", "targets"], inputs)), [(0.5, 0.3, 0.2)], nodes=wanted, checked=checked)
    assert not failures, failures[:3]
    assert {s for op, s in checked if op == "dropout"} >= {"replicate", "d0", "d1", "d2", "linear"}, checked
    assert {s for op, s in checked if op == "scaled_dot_product_attention"} >= {"replicate", "h0", "h1", "linear"}
