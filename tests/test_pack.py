"""Packing uneven shards into padded blocks: the torch fallback and the Triton kernels (run on CPU
by Triton's interpreter, ``TRITON_INTERPRET=1``) against a plain reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hapc.balance.rounding import bounds
from hapc.collectives.pack import pack, unpack

CASES = [
    ((7, 3), 0, [4, 2, 1]),
    ((2, 9, 5), 1, [3, 3, 3]),
    ((2, 9, 5), 1, [5, 1, 2, 1]),
    ((4, 3, 11), 2, [6, 5]),
    ((1, 5), 1, [5]),
]


def reference_pack(x, dim, sizes):
    blocks = []
    for lo, hi in bounds(sizes):
        piece = x.narrow(dim, lo, hi - lo)
        pad = list(piece.shape)
        pad[dim] = max(sizes) - (hi - lo)
        blocks.append(torch.cat([piece, piece.new_zeros(pad)], dim))
    return torch.stack(blocks)


def check(backend: str) -> None:
    for shape, dim, sizes in CASES:
        for dtype in (torch.float32, torch.float64, torch.int64):
            x = (torch.randn(shape) * 100).to(dtype)
            packed = pack(x, dim, sizes, backend=backend)
            want = reference_pack(x, dim, sizes)
            assert torch.equal(packed.reshape(-1), want.reshape(-1)), (backend, shape, dim, sizes, dtype)
            assert torch.equal(unpack(packed, dim, sizes, x.shape, backend=backend), x), (backend, shape, dim, sizes)
            noisy = packed.clone()  # [m, outer, M, inner]
            for r, n in enumerate(sizes):
                noisy[r, :, n:] = 77  # padding is ignored when unpacking, whatever it holds
            assert torch.equal(unpack(noisy, dim, sizes, x.shape, backend=backend), x)


def test_torch_fallback_matches_reference():
    check("torch")


def test_bad_sizes_are_errors():
    with pytest.raises(RuntimeError, match="add up to"):
        pack(torch.zeros(5, 2), 0, [2, 2])
    with pytest.raises(RuntimeError, match="expected"):
        unpack(torch.zeros(7), 0, [2, 2], (4,))


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed (pip install hapc[triton])"
)
def test_triton_kernels_under_the_interpreter():
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_pack; test_pack.check('triton')"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
