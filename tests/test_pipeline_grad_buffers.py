"""A stage's received output gradient may become a parameter's ``.grad`` itself.

``AccumulateGrad`` keeps an incoming contiguous gradient as it is (no copy) when the parameter has
none yet, and view-like ops pass the received gradient's storage through: torchvision's ViT
prepends its class token with ``cat([token.expand(b, -1, -1), x], 1)``, whose gradient for the
token, on a micro-batch of one row, is a contiguous slice of the gradient the stage received. The
pipeline runtime reused its gradient receive buffers across micro-batches, so the next micro-batch's
gradient overwrote the token's: silently wrong (tv-vit on 3 processes, 4 micro-batches of one row,
its class token 0.025 off after two SGD steps while every loss matched). Now each is a new buffer.

Float64 on 2 gloo processes, compared with one device after two SGD steps with momentum.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import pipeline_spec
from torch import nn

from hapc.pipeline.runtime import PipelineModule
from hapc.testing import run_distributed


class ClassToken(nn.Module):
    """A learned token prepended to every row's sequence, read back by the head (ViT's shape)."""

    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.token = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 6, d))
        self.blocks = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.token.expand(x.shape[0], -1, -1), self.proj(x)], 1) + self.pos
        for block in self.blocks:
            h = torch.tanh(block(h))
        return F.cross_entropy(self.head(h[:, 0]), y)


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = ClassToken().double()
    return model, (torch.randn(4, 5, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 1]))


def _steps(module: nn.Module, inputs: tuple, steps: int = 2) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        module(*inputs).backward()
        opt.step()
    return module.full_state_dict() if hasattr(module, "full_state_dict") else module.state_dict()


def _job(rank: int, world: int, num_micro: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model, inputs = _model()
    # the cut right after the cat: stage 0's output gradient flows to the token through views alone
    spec = pipeline_spec(model, inputs, [1, 30], [[0], [1]], [1e10, 1e10], [2, 1], num_micro)
    pm = PipelineModule(model, inputs, spec)
    names = {k for k, _ in pm.named_parameters()}
    assert ("token" in names) == (pm.stage == 0) and not (pm.stage == 0 and "blocks.0.weight" in names), names
    return _steps(pm, inputs)


@pytest.mark.parametrize("num_micro", [4, 2])
def test_a_class_token_trains_as_on_one_device(num_micro):
    """Micro-batches of one row (4) and of two (2): every parameter after two steps equals one
    device's, the token's included."""
    model, inputs = _model()
    want = _steps(model, inputs)
    for got in run_distributed(_job, 2, num_micro):
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-10, atol=1e-12, msg=k)
