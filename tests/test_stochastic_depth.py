"""Stochastic depth draws rank-consistently (:func:`hapc.ops.stochastic_depth`,
:mod:`hapc.theory.rules.random`): torchvision's ``StochasticDepth`` (EfficientNet, ConvNeXt, Swin)
and timm's ``DropPath`` train on several ranks.

Sample ``i``'s keep/drop decision is a function of (seed, step, op, global sample index ``i``)
alone, so a rank holding rows ``[a, b)`` draws exactly those rows' decisions and a rank holding a
slice along another dim draws the same decision as every other rank. Checked: the op alone (keep
rate, scale, "batch" mode, identities, slices), the rule's every strategy under the simulator, and
residual models in float64 on 2 and 3 gloo processes with uneven ratios and an odd batch, whose
loss, gradients and two SGD steps equal the same model compiled on one rank (and differ from the
model without the drop, so an identity op cannot pass); tiny torchvision ConvNeXt and EfficientNet
and a timm ViT with ``drop_path_rate`` on 2 ranks equal 1 rank; eval mode and the verifier.
Hugging Face's ``*DropPath`` modules (BEiT, Swin, ConvNeXt, ... each its own copy, drawing with
``torch.rand`` inline) are normalised to :func:`hapc.ops.drop_path`: the residual model with
``BeitDropPath`` and a tiny HF ConvNeXt with ``drop_path_rate`` train on several ranks too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import realworld
import torch
import torch.nn.functional as F
from harness import assert_close, sgd_steps, strategy_results
from torch import nn

import hapc
import hapc.ops as hops
from hapc.errors import HapcError
from hapc.testing import cluster_of, run_distributed
from hapc.theory.instructions import Compute
from hapc.theory.trace import trace
from hapc.theory.triples import derive

F64 = torch.float64
P = 0.3
TV_OP = "torchvision.ops.stochastic_depth.stochastic_depth"
TIMM_OP = "timm.layers.drop.drop_path"
HF_OP = "hapc.ops.drop_path"  # Hugging Face's *DropPath modules, normalised
OPS = {"torchvision": TV_OP, "timm": TIMM_OP, "hf": HF_OP}

pytestmark = pytest.mark.skipif(not realworld.has("torchvision"), reason="torchvision does not load")


def _tv() -> Any:
    return realworld.import_torchvision()


# -- the op alone -----------------------------------------------------------------------------------------
def test_row_mode_keeps_samples_at_the_requested_rate_scaled() -> None:
    x = torch.rand(20000, 3, 2, dtype=F64) + 1
    y = hops.stochastic_depth(x, P, "row", stream=hops.RandomStream(3, 5), op="s")
    kept = y[:, 0, 0] != 0
    assert torch.equal(y != 0, kept.view(-1, 1, 1).expand_as(y)), "one decision per sample"
    torch.testing.assert_close(y[kept], x[kept] / (1 - P), rtol=1e-15, atol=0)
    rate = kept.double().mean().item()
    assert abs(rate - (1 - P)) < 6 * math.sqrt(P * (1 - P) / x.shape[0]), rate


def test_batch_mode_keeps_or_drops_the_whole_tensor() -> None:
    x = torch.rand(4, 3, dtype=F64) + 1
    kept = 0
    draws = 2000
    for step in range(draws):
        y = hops.stochastic_depth(x, P, "batch", stream=hops.RandomStream(1, step), op="b")
        if y.abs().sum() == 0:
            continue
        torch.testing.assert_close(y, x / (1 - P), rtol=1e-15, atol=0)
        kept += 1
    assert abs(kept / draws - (1 - P)) < 6 * math.sqrt(P * (1 - P) / draws), kept


def test_identities_zeros_and_bad_arguments_are_torchvisions() -> None:
    x = torch.randn(5, 4, dtype=F64)
    assert hops.stochastic_depth(x, 0.0, "row") is x
    assert hops.stochastic_depth(x, 0.5, "row", training=False) is x
    assert hops.stochastic_depth(x, 0.5, "batch", stream=hops.RandomStream(drops=False)) is x
    for mode in ("row", "batch"):
        assert torch.equal(hops.stochastic_depth(x, 1.0, mode), torch.zeros_like(x))
        torch.testing.assert_close(hops.stochastic_depth(x, 1.0, mode), _tv().ops.stochastic_depth(x, 1.0, mode))
    for p, mode in [(-0.1, "row"), (1.5, "batch"), (0.5, "rows")]:
        with pytest.raises(ValueError) as want:
            _tv().ops.stochastic_depth(x, p, mode)
        with pytest.raises(ValueError, match="has to be") as got:
            hops.stochastic_depth(x, p, mode)
        assert str(got.value) == str(want.value)


def test_a_slice_draws_the_slice_of_the_whole() -> None:
    stream = hops.RandomStream(seed=7, step=2)
    x = torch.randn(11, 5, 3, dtype=F64)
    for mode in ("row", "batch"):
        whole = hops.stochastic_depth(x, 0.5, mode, stream=stream, op="d")
        for starts, ends in [((3, 0, 0), (8, 5, 3)), ((0, 2, 1), (11, 4, 3)), ((9, 1, 0), (11, 5, 2))]:
            index = tuple(slice(a, b) for a, b in zip(starts, ends))
            got = hops.stochastic_depth(x[index], 0.5, mode, stream=stream, op="d", starts=starts, full_shape=x.shape)
            assert torch.equal(got, whole[index]), (mode, starts)
    whole = hops.stochastic_depth(x, 0.5, "row", stream=stream, op="d")
    assert not torch.equal(whole, hops.stochastic_depth(x, 0.5, "row", stream=hops.RandomStream(7, 3), op="d"))
    assert not torch.equal(whole, hops.stochastic_depth(x, 0.5, "row", stream=stream, op="e"))
    # a slice drawn as if it were the whole batch is not the slice (the global index matters)
    assert not torch.equal(hops.stochastic_depth(x[3:], 0.5, "row", stream=stream, op="d"), whole[3:])


def test_drop_path_is_row_mode_with_timms_scaling() -> None:
    stream = hops.RandomStream(seed=2, step=1)
    x = torch.randn(64, 3, dtype=F64)
    want = hops.stochastic_depth(x, P, "row", stream=stream, op="p")
    assert torch.equal(hops.drop_path(x, P, True, stream=stream, op="p"), want)
    unscaled = hops.drop_path(x, P, True, False, stream=stream, op="p")
    assert torch.equal(unscaled, x * (want != 0).to(F64))
    assert hops.drop_path(x, P) is x  # timm's default: training=False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_are_the_same_on_cuda() -> None:
    stream = hops.RandomStream(seed=11, step=4)
    x = torch.randn(9, 33, 5, dtype=F64)
    for mode in ("row", "batch"):
        want = hops.stochastic_depth(x, 0.4, mode, stream=stream, op="d", starts=(3, 0, 7), full_shape=(20, 33, 80))
        got = hops.stochastic_depth(
            x.cuda(), 0.4, mode, stream=stream, op="d", starts=(3, 0, 7), full_shape=(20, 33, 80)
        )
        assert torch.equal(got.cpu(), want), mode


# -- the rule's strategies ----------------------------------------------------------------------------------
class Residual(nn.Module):
    """A conv block and an MLP block, each with a residual branch under stochastic depth (the MLP's
    twice: between its linears, where tensor parallelism shards features, and after them, where it
    leaves a Partial sum)."""

    def __init__(self, mode: str, p: float = P, kind: str = "torchvision"):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.fc1, self.fc2, self.fc3 = nn.Linear(48, 16), nn.Linear(16, 32), nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)
        if kind == "torchvision":
            self.sd1, self.sd2, self.sd3 = (_tv().ops.StochasticDepth(p, mode) for _ in range(3))
        elif kind == "timm":
            import timm

            self.sd1, self.sd2, self.sd3 = (timm.layers.DropPath(p) for _ in range(3))
        else:
            realworld._hf()
            from transformers.models.beit.modeling_beit import BeitDropPath

            self.sd1, self.sd2, self.sd3 = (BeitDropPath(p) for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.sd1(torch.tanh(self.conv(x)))
        h = self.fc1(x.flatten(1))
        h = h + self.sd3(self.fc3(self.sd2(torch.tanh(self.fc2(h)))))
        return F.cross_entropy(self.head(h), y)


def build(mode: str, p: float = P, kind: str = "torchvision", batch: int = 7) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = Residual(mode, p, kind).to(F64)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 3, 4, 4, generator=g, dtype=F64), torch.randint(0, 4, (batch,), generator=g))


@pytest.mark.parametrize("mode", ["row", "batch"])
def test_every_strategy_of_the_rule_computes_the_replicated_draw(mode: str) -> None:
    """Each stochastic-depth strategy, run per device with uneven ratios by the simulator,
    combines to exactly what the replicated strategy computes (Partial summands included)."""
    model, inputs = build(mode, batch=11)
    theory = derive(trace(model, inputs))
    values = theory.graph.evaluate(dict(zip(["x", "y"], inputs)))
    ratios = (0.5, 0.3, 0.2)
    names = set()
    for n in theory.graph:
        if n.op != TV_OP:
            continue
        reference = None
        for s, got in strategy_results(theory, n, values, ratios):
            if reference is None:
                assert s.name == "replicate"
                reference = got
                assert not torch.equal(got, values[n.operands[0]]), "the replicated draw drops something"
            else:
                torch.testing.assert_close(got, reference, rtol=1e-12, atol=1e-14)
            names.add(s.name)
    assert {"replicate", "d0", "d1", "linear"} <= names, names


# -- N ranks == one rank -------------------------------------------------------------------------------------
def _train(rank: int, world: int, mode: str, kind: str, cluster: Any, plan: Any) -> dict[str, Any]:
    model, inputs = build(mode, kind=kind)
    torch.manual_seed(1234)  # the seed the draws derive from (rank 0's, broadcast)
    module = hapc.compile(model, cluster, inputs, plan=plan)
    loss = module(*inputs)
    loss.backward()
    first = (float(loss.detach()), module.full_gradients())
    return {"first": first, "losses": sgd_steps(module, inputs), "state": module.full_state_dict()}


_ONE: dict[tuple[str, str], dict[str, Any]] = {}


def one_rank(mode: str, kind: str) -> dict[str, Any]:
    if (mode, kind) not in _ONE:
        cluster = cluster_of([1e10])
        model, inputs = build(mode, kind=kind)
        _ONE[mode, kind] = run_distributed(_train, 1, mode, kind, cluster, hapc.synthesize(model, cluster, inputs))[0]
    return _ONE[mode, kind]


def plain_losses(mode: str, kind: str) -> list[float]:
    """The eager model without the drop (p = 0): what an identity op would give."""
    model, inputs = build(mode, p=0.0, kind=kind)
    loss = model(*inputs)
    return [float(loss.detach()), *sgd_steps(model, inputs)]


def _strategies(model: nn.Module, inputs: Any, plan: Any, op: str) -> list[str]:
    graph = trace(model, inputs)
    return [ins.strategy_key for ins in plan.instructions if isinstance(ins, Compute) and graph[ins.ref].op == op]


CASES = [
    ("row", "torchvision", 2, "ratios"),
    ("row", "torchvision", 3, "ratios"),
    ("row", "torchvision", 2, "tp"),
    ("batch", "torchvision", 2, "ratios"),
    ("batch", "torchvision", 3, "ratios"),
    ("row", "timm", 3, "ratios"),
    ("row", "hf", 3, "ratios"),
    ("row", "hf", 2, "tp"),
]


@pytest.mark.parametrize(("mode", "kind", "world", "how"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_n_ranks_equal_one_rank(mode: str, kind: str, world: int, how: str) -> None:
    if kind != "torchvision" and not realworld.has({"timm": "timm", "hf": "transformers"}[kind]):
        pytest.skip(f"{kind} does not load")
    model, inputs = build(mode, kind=kind)
    if how == "ratios":
        ratios = {2: (0.6, 0.4), 3: (0.5, 0.3, 0.2)}[world]
        cluster = cluster_of([1e10] * world, bandwidth="10 MB/s")
        plan = hapc.synthesize(model, cluster, inputs, ratios=ratios)
        assert plan.device_ratios == pytest.approx(ratios)
    else:  # Megatron-style: the MLP's hidden features shard, so sd2 runs on a slice of dim 1
        cluster = cluster_of([1e10] * world)
        plan = hapc.synthesize(model, cluster, inputs, baseline="tp")
    op = OPS[kind]
    used = _strategies(model, inputs, plan, op)
    assert len(used) == 3 and any(k.startswith("d") for k in used), used  # the drop runs sharded
    if how == "tp":
        assert "d1:S(1)->S(1)" in used, used  # on a slice of features: every rank draws every sample
    want = one_rank(mode, kind)
    drawn = [want["first"][0], *want["losses"]]
    # the draws really drop: an identity op would give the p = 0 run's losses
    assert all(a != pytest.approx(b, rel=1e-6) for a, b in zip(drawn, plain_losses(mode, kind))), drawn
    for r in run_distributed(_train, world, mode, kind, cluster, plan):
        assert_close(r["first"], want["first"], F64, "loss and gradients")
        assert_close(r["losses"], want["losses"], F64, "losses of 2 SGD steps")
        assert_close(r["state"], want["state"], F64, "weights after 2 steps")


# -- modes ---------------------------------------------------------------------------------------------------
def _modes(rank: int, world: int, compiled_in: str) -> dict[str, Any]:
    model, inputs = build("row")
    model.train(compiled_in == "train")
    module = hapc.compile(model, cluster_of([1e10] * world), inputs)
    out: dict[str, Any] = {}
    if compiled_in == "train":
        out["train"] = module(*inputs).item()
        module.eval()
        out["eval"] = module(*inputs).item()
    else:
        out["eval"] = module(*inputs).item()
        with pytest.raises(HapcError, match=r"compiled from the model in eval mode.*stochastic depth"):
            module.train()
        out["refused"] = True
    return out


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_eval_mode_is_the_identity(compiled_in: str) -> None:
    """Compiled in training mode the module serves eval mode (no drop); compiled in eval mode,
    where the drop is traced off, switching to training is refused, never silently drop-free."""
    model, inputs = build("row")
    want = model.eval()(*inputs).item()
    for r in run_distributed(_modes, 2, compiled_in):
        assert r["eval"] == pytest.approx(want, rel=1e-12)
        if compiled_in == "train":
            assert r["train"] != pytest.approx(want, rel=1e-6)
        else:
            assert r["refused"]


# -- torchvision's and timm's own models -------------------------------------------------------------------
def _convnext() -> tuple[nn.Module, tuple]:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    torch.manual_seed(0)
    blocks = [CNBlockConfig(8, 16, 2), CNBlockConfig(16, None, 2)]
    model = ConvNeXt(blocks, stochastic_depth_prob=0.4, layer_scale=0.5, num_classes=4)
    g = torch.Generator().manual_seed(0)
    return realworld.WithLoss(model).to(F64), (torch.randn(5, 3, 16, 16, generator=g, dtype=F64), torch.arange(5) % 4)


def _efficientnet() -> tuple[nn.Module, tuple]:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    torch.manual_seed(0)
    config = [MBConvConfig(1, 3, 1, 8, 8, 2, 1.0, 1.0), MBConvConfig(4, 3, 2, 8, 16, 2, 1.0, 1.0)]
    model = EfficientNet(config, dropout=0.2, stochastic_depth_prob=0.5, num_classes=4, last_channel=32)
    g = torch.Generator().manual_seed(0)
    return realworld.WithLoss(model).to(F64), (torch.randn(5, 3, 16, 16, generator=g, dtype=F64), torch.arange(5) % 4)


def _timm_vit() -> tuple[nn.Module, tuple]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=4, drop_path_rate=0.5
    )
    g = torch.Generator().manual_seed(0)
    return realworld.WithLoss(model).to(F64), (torch.randn(5, 3, 32, 32, generator=g, dtype=F64), torch.arange(5) % 4)


def _hf_convnext() -> tuple[nn.Module, dict]:
    """transformers' ConvNeXt (its ``ConvNextDropPath`` modules) with a drop rate of 0.5."""
    t = realworld._hf()
    torch.manual_seed(0)
    cfg = t.ConvNextConfig(hidden_sizes=[8, 16], depths=[2, 2], num_stages=2, num_labels=4, drop_path_rate=0.5)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(5, 3, 32, 32, generator=g, dtype=F64)
    return t.ConvNextForImageClassification(cfg).to(F64), dict(pixel_values=pixels, labels=torch.arange(5) % 4)


def _library_model(rank: int, world: int, name: str, p_zero: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    builders = {"convnext": _convnext, "efficientnet": _efficientnet, "timm-vit": _timm_vit}
    model, inputs = {**builders, "hf-convnext": _hf_convnext}[name]()
    if p_zero:
        for m in model.modules():
            if isinstance(m, _tv().ops.StochasticDepth):
                m.p = 0.0
            if type(m).__name__.endswith("DropPath"):
                m.drop_prob = 0.0
    torch.manual_seed(1234)
    ratios = {"ratios": (0.6, 0.4)} if world == 2 else {}
    module = hapc.compile(model, cluster_of([1e10] * world), inputs, **ratios)
    loss = module(**inputs).loss if isinstance(inputs, dict) else module(*inputs)[0]
    loss.backward()
    return float(loss.detach()), module.full_gradients()


@pytest.mark.parametrize("name", ["convnext", "efficientnet", "timm-vit", "hf-convnext"])
def test_library_model_on_two_ranks_equals_one(name: str) -> None:
    if name.startswith("timm") and not realworld.has("timm"):
        pytest.skip("timm does not load")
    if name.startswith("hf") and not realworld.has("transformers"):
        pytest.skip("transformers does not load")
    want = run_distributed(_library_model, 1, name)[0]
    plain = run_distributed(_library_model, 1, name, True)[0]
    assert want[0] != pytest.approx(plain[0], rel=1e-9), "stochastic depth drops some block"
    for got in run_distributed(_library_model, 2, name):
        assert_close(got, want, F64, f"{name}: loss and gradients")


def test_the_verifier_checks_every_stochastic_depth_triple() -> None:
    """``hapc.verify`` takes the replicated, stream-drawn call as the reference, so every
    stochastic-depth triple is checked forward and backward (not skipped as random)."""
    from collections import Counter

    from hapc.theory.verify import verify

    model, inputs = build("row", batch=11)
    theory = derive(trace(model, inputs))
    wanted = [n.index for n in theory.graph if n.op == TV_OP]
    checked: Counter = Counter()
    failures = verify(theory, dict(zip(["x", "y"], inputs)), [(0.5, 0.3, 0.2)], nodes=wanted, checked=checked)
    assert not failures, failures[:3]
    assert {s for op, s in checked if op == TV_OP} >= {"replicate", "d0", "d1", "linear"}, checked
