"""Random draws in a model's forward are never frozen into the program (:mod:`hapc.theory.draws`).

fx runs a forward's Python: ``torch.rand(n, d)`` with plain-int sizes used to run eagerly, and its
values became a constant of the graph -- the same "noise" at every step on every rank, where one
device draws anew each step. Now the draw is a node of the graph under either capture, which
``hapc.compile`` refuses on several ranks (each would draw its own). LayerDrop's
``if torch.rand([]) < p`` (BART, OPT, Whisper in training mode) is captured when its branch is the
same for every draw (p = 0, the default: every layer runs; p = 1) and refused otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_close, sgd_steps
from torch import nn

import hapc
from hapc.errors import HapcError, TraceError
from hapc.testing import run_distributed

F64 = torch.float64
CAPTURES = ["fx", "export"]


class Noisy(nn.Module):
    """Random masking of the input, as MAE does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape[0], 8) > 0.5
        return F.cross_entropy(self.fc(x * keep), y)


class NoisyOnDevice(Noisy):
    """The draw on the input's device and in its dtype, as Hugging Face's stochastic depth draws
    (``torch.rand(shape, dtype=x.dtype, device=x.device)``: fx's capture used to compute it on the
    example's device, beside meta tensors, and fail)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape[0], 8, dtype=x.dtype, device=x.device) > 0.5
        return F.cross_entropy(self.fc(x * keep), y)


class NoiseLeaf(nn.Module):
    """A module kept whole (``leaf_modules``) whose forward draws: the capture computes its value by
    running it, and that run's draw is no node of the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rand(x.shape[0], 1, dtype=x.dtype, device=x.device)


class WithNoiseLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.noise = nn.Linear(8, 8), NoiseLeaf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.noise(self.fc(x)).sum()


class LayerDrop(nn.Module):
    """A stack whose training forward skips each layer with probability ``p``, written as
    transformers writes it."""

    def __init__(self, p: float, layers: int = 3) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.p:  # skip the layer
                    continue
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x), y)


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("cls", [Noisy, NoisyOnDevice])
def test_a_random_factory_is_a_node_not_a_constant(capture, cls):
    torch.manual_seed(0)
    model, batch = cls().double(), _batch()
    graph = hapc.trace(model, batch, capture=capture)
    assert "rand" in [n.op for n in graph if n.kind == "op"], "the draw is an op of the graph"
    torch.manual_seed(1)
    first = graph.run(x=batch[0], y=batch[1])
    second = graph.run(x=batch[0], y=batch[1])
    assert not torch.equal(first, second), "each run draws anew, as the model does"


def test_a_leaf_modules_own_draw_is_not_recorded():
    model = WithNoiseLeaf().double()
    x = torch.randn(6, 8, dtype=F64)
    graph = hapc.trace(model, (x,), leaf_modules=[NoiseLeaf], capture="fx")
    ops = [n.op for n in graph if n.kind == "op"]
    assert "rand" not in ops and sum("NoiseLeaf" in op for op in ops) == 1, ops


def _compile_noisy(rank, world):
    torch.manual_seed(0)
    model, batch = Noisy().double(), _batch()
    with pytest.raises(HapcError, match=r"rand at .*torch\.rand\(x\.shape\[0\], 8\).*only for dropout"):
        hapc.compile(model, "local-cpu:2", batch)
    return True


def test_compile_refuses_a_random_factory_on_several_ranks():
    assert run_distributed(_compile_noisy, 2) == [True, True]


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("p, layers_run", [(0.0, 3), (1.0, 0)])
def test_layer_drop_whose_branch_holds_for_every_draw_is_captured(capture, p, layers_run):
    model, batch = LayerDrop(p).double(), _batch()
    graph = hapc.trace(model, batch, capture=capture)
    ops = [n.op for n in graph if n.kind == "op"]
    assert ops.count("tanh") == layers_run and "rand" not in ops
    torch.manual_seed(3)
    assert torch.allclose(graph.run(x=batch[0], y=batch[1]), model(*batch), rtol=1e-12)


@pytest.mark.parametrize("capture", CAPTURES)
def test_layer_drop_that_skips_random_layers_is_refused(capture):
    with pytest.raises(TraceError, match=r"random control flow at .*dropout_probability < self\.p.*layerdrop = 0"):
        hapc.trace(LayerDrop(0.3).double(), _batch(), capture=capture)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_scalar_draw_used_as_a_value_is_refused(capture):
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, y):
            return F.cross_entropy(self.fc(x) * torch.rand([]), y)

    with pytest.raises(TraceError, match=r"random scalar torch\.rand\(\[\]\) drawn in forward at .* is used"):
        hapc.trace(Scaled().double(), _batch(), capture=capture)


def _layer_drop_job(rank, world):
    torch.manual_seed(0)
    model, batch = LayerDrop(0.0).double(), _batch(7)
    module = hapc.compile(model, "local-cpu:2", batch, ratios=(0.6, 0.4))
    return sgd_steps(module, batch), module.full_state_dict()


def test_layer_drop_at_zero_trains_as_one_device():
    torch.manual_seed(0)
    model, batch = LayerDrop(0.0).double(), _batch(7)
    want = sgd_steps(model, batch)
    for losses, state in run_distributed(_layer_drop_job, 2):
        assert losses == pytest.approx(want, rel=1e-12)
        assert_close(state, model.state_dict(), F64, "weights after 2 steps")


class Stochastic(nn.Module):
    """A residual branch dropped per sample: torchvision's ``StochasticDepth`` (an fx leaf
    function, ``torch.fx.wrap``, drawn rank-consistently: tests/test_stochastic_depth.py) or the
    draw written inline as timm's ``drop_path`` writes it (``x.new_empty(..).bernoulli_(keep)``;
    timm's own function is kept whole and drawn rank-consistently too)."""

    def __init__(self, kind: str, p: float) -> None:
        super().__init__()
        import realworld

        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.kind, self.p = kind, p
        if kind == "torchvision":
            self.depth = realworld.import_torchvision().ops.StochasticDepth(p, "row")

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        branch = torch.tanh(self.fc(x))
        if self.kind == "torchvision":
            branch = self.depth(branch)
        elif self.training and self.p > 0:
            keep = 1 - self.p
            branch = branch * x.new_empty((x.shape[0], 1)).bernoulli_(keep).div_(keep)
        return F.cross_entropy(self.head(x + branch), y)


def _stochastic_job(rank, world, kind, p):
    torch.manual_seed(0)
    model, batch = Stochastic(kind, p).double(), _batch()
    if p > 0:
        with pytest.raises(HapcError, match=r"bernoulli at .*only for dropout"):
            hapc.compile(model, "local-cpu:2", batch)
        model.eval()  # the identity in eval mode
    module = hapc.compile(model, "local-cpu:2", batch)
    loss = module(*batch)
    loss.backward()
    return float(loss.detach()), module.full_gradients()


@pytest.mark.parametrize(("kind", "p"), [("torchvision", 0.0), ("inline", 0.0), ("inline", 0.2)])
def test_an_inline_per_sample_draw_is_refused_unless_it_is_the_identity(kind, p):
    import realworld

    if kind == "torchvision" and not realworld.has("torchvision"):
        pytest.skip("torchvision does not load")
    torch.manual_seed(0)
    model, batch = Stochastic(kind, p).double(), _batch()
    if p > 0:
        model.eval()
    loss = model(*batch)
    loss.backward()
    want = {k: v.grad for k, v in model.named_parameters()}
    for value, grads in run_distributed(_stochastic_job, 2, kind, p):
        assert value == pytest.approx(float(loss), rel=1e-12)
        assert_close(grads, want, F64, "grads")
