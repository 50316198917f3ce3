"""Common subexpressions (hapc/theory/cse.py): equal pure computations become one node, exactly.

T5's attention builds ``where(mask, position_bias, -inf)`` in every layer from the same tensors;
merged, the synthesizer sees one tensor instead of one per layer. The merged program must train
exactly as the model does on one device, and nothing impure (random draws, state updates) may merge.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapc
from hapc.testing import run_distributed

realworld = pytest.importorskip("realworld")

HEADS, SEQ, DIM = 2, 6, 8


class BiasedAttention(nn.Module):
    """T5's pattern: one learned position bias, masked again in every layer."""

    def __init__(self, layers: int = 3):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, HEADS, SEQ, SEQ))
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(layers))
        self.out = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = x
        for qkv in self.qkv:
            q, k, v = qkv(h).view(b, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) + torch.where(keep[:, None, None, :], self.bias, float("-inf"))
            h = h + (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, SEQ, DIM)
        return F.cross_entropy(self.out(h).mean(1), y)


def _inputs(batch: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, SEQ, DIM, generator=g, dtype=torch.float64)
    keep = torch.rand(batch, SEQ, generator=g) > 0.3
    keep[:, 0] = True  # every row attends somewhere
    return x, keep, torch.randint(0, 4, (batch,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return BiasedAttention().double()


def _ops(graph: Any, op: str) -> list[Any]:
    return [n for n in graph.nodes if n.kind == "op" and n.op == op]


def test_the_per_layer_masked_bias_is_one_node():
    graph = hapc.trace(_model(), _inputs())
    assert len(_ops(graph, "where")) == 1  # three layers, one where(mask, bias, -inf)
    assert len(_ops(graph, "linear")) == 4  # distinct weights: never merged
    model, inputs = _model(), _inputs()
    values = graph.evaluate(dict(zip(graph.input_names, inputs)))
    assert float(values[graph.loss.index].detach()) == pytest.approx(float(model(*inputs).detach()), rel=1e-15)


def _three_steps(module: Any, grads: Any, state: Any) -> dict[str, Any]:
    """Losses of 3 SGD steps, the first step's gradients (``grads()``) and the final ``state()``."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses, first = [], None
    for _ in range(3):
        opt.zero_grad()
        loss = module(*_inputs())
        loss.backward()
        first = grads() if first is None else first
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": first, "state": state()}


def _train(rank: int, world: int, opts: dict) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hapc.compile(_model(), f"local-cpu:{world}", _inputs(), **opts)
    return _three_steps(module, module.full_gradients, module.full_state_dict)


def _reference() -> dict[str, Any]:
    model = _model()
    grads = lambda: {k: p.grad.clone() for k, p in model.named_parameters()}  # noqa: E731
    return _three_steps(model, grads, model.state_dict)


@pytest.mark.parametrize(("world", "opts"), [(2, {}), (3, {"ratios": (0.4, 0.2)})], ids=["2-default", "3-ratios"])
def test_the_merged_program_trains_as_one_device(world: int, opts: dict) -> None:
    want = _reference()
    for got in run_distributed(_train, world, opts):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-12)
        for what in ("grads", "state"):
            assert set(got[what]) == set(want[what])
            for k, v in want[what].items():
                torch.testing.assert_close(got[what][k], v, rtol=1e-9, atol=1e-12, msg=f"{what} {k}")


def test_impure_or_different_computations_stay_apart():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("pos", torch.arange(4.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = F.dropout(x, 0.5, training=True)  # two draws, two masks
            b = F.dropout(x, 0.5, training=True)
            c = self.bn(x) + self.bn(x)  # running statistics updated twice
            d = torch.where(x > 0, x, 0.0) * torch.where(x > 0, x, -0.0)  # 0.0 is not -0.0
            e = (x + 1).sum() + (x + 1.0).sum()  # an int is not a float
            f = self.pos.cumsum(0) * self.pos.cumsum(0)  # static data: one per reader
            return (a * b).sum() + c.sum() + d.sum() + e + (x * f).sum()

    graph = hapc.trace(Net(), (torch.randn(5, 4),))
    assert len(_ops(graph, "dropout")) == 2
    assert len(_ops(graph, "batch_norm")) == 2
    assert len(_ops(graph, "where")) == 2
    assert len(_ops(graph, "gt")) == 1  # x > 0, twice: one node
    assert len(_ops(graph, "add")) >= 2 + 1  # x + 1 and x + 1.0 apart, plus the sums' adds
    assert len([n for n in _ops(graph, "add") if n.args[1:] in ((1,), (1.0,))]) == 2
    assert len(_ops(graph, "cumsum")) == 2


@pytest.mark.skipif(not realworld.has("transformers"), reason="transformers not installed")
def test_t5_masks_its_position_bias_once_per_stack():
    transformers = realworld._hf()  # loads beside a CUDA torchvision wheel (tests/realworld.py)

    cfg = transformers.T5Config(
        num_layers=3, num_decoder_layers=3, d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=50,
        decoder_start_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    ids = torch.randint(0, 50, (2, 8))
    graph = hapc.trace(transformers.T5ForConditionalGeneration(cfg), dict(input_ids=ids, labels=ids[:, :4].clone()))
    shapes = [tuple(n.shape) for n in _ops(graph, "where") if n.meta.rank == 4]
    # the self-attentions' learned biases, masked once per stack instead of once per layer; the
    # cross-attention's bias is a constant zero (static data: left one per layer, see cse.py)
    assert sorted(shapes) == sorted([(2, 2, 8, 8), (2, 2, 4, 4)] + [(2, 2, 4, 8)] * 3)
