"""Counted flops agree with PyTorch's own flop counter on the contractions."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hapc.theory.flops import contraction_flops

CASES = [
    ("linear", lambda: (torch.randn(3, 5, 7), torch.randn(11, 7)), F.linear),
    ("matmul", lambda: (torch.randn(2, 3, 5, 7), torch.randn(7, 4)), torch.matmul),
    ("mm", lambda: (torch.randn(5, 7), torch.randn(7, 4)), torch.mm),
    ("bmm", lambda: (torch.randn(3, 5, 7), torch.randn(3, 7, 4)), torch.bmm),
    (
        "conv2d",
        lambda: (torch.randn(2, 6, 9, 9), torch.randn(4, 3, 3, 3)),
        lambda x, w: F.conv2d(x, w, stride=2, groups=2),
    ),
    ("conv1d", lambda: (torch.randn(2, 3, 9), torch.randn(4, 3, 3)), F.conv1d),
    (
        "scaled_dot_product_attention",
        lambda: (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)),
        F.scaled_dot_product_attention,
    ),
]


@pytest.mark.parametrize("op, make, fn", CASES, ids=[c[0] for c in CASES])
def test_against_torch_flop_counter(op, make, fn):
    args = make()
    with FlopCounterMode(display=False) as c:
        out = fn(*args)
    assert contraction_flops(op, args, {}, out) == pytest.approx(c.get_total_flops())


@pytest.mark.parametrize(
    "eq, shapes",
    [
        ("bij,bjk->bik", [(3, 4, 5), (3, 5, 6)]),
        ("ecm,emh->ech", [(2, 3, 4), (2, 4, 5)]),
        ("...c,cd", [(2, 3, 4), (4, 5)]),
        ("ij,ij->", [(3, 4), (3, 4)]),
    ],
)
def test_einsum(eq, shapes):
    args = [torch.randn(*s) for s in shapes]
    with FlopCounterMode(display=False) as c:
        out = torch.einsum(eq, *args)
    counted = c.get_total_flops()
    assert contraction_flops("einsum", (eq, *args), {}, out) == pytest.approx(counted) or counted == 0
