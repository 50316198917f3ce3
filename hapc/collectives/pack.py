"""Packing uneven shards into the equal-sized blocks padded collectives need, and back.

Padded all-gather and reduce-scatter (HAP Fig. 3) move ``m`` equal blocks of the largest shard's
size ``M``. Viewing a tensor as ``[outer, D, inner]`` around the sharded dim (rank ``r`` owns rows
``off_r .. off_r + s_r`` of ``D``), the packed layout is ``[m, outer, M, inner]``:

* :func:`pack`   ``x -> P`` with ``P[r, o, j, i] = x[o, off_r + j, i]`` for ``j < s_r``, else 0
  (the input of ``reduce_scatter``);
* :func:`unpack` ``P -> x`` with ``x[o, k, i] = P[r, o, k - off_r, i]`` for the ``r`` owning row ``k``
  (the output of ``all_gather``).

Each is one pass over memory with the Triton kernels below (an optional dependency: ``pip install
hapc[triton]``), used for CUDA tensors -- and for CPU tensors under ``TRITON_INTERPRET=1``, which
is how the tests check them without a GPU. Otherwise a torch fallback does ``m`` strided copies.
``HAPC_PACK=torch`` forces the fallback.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

from ..balance.rounding import bounds

BLOCK = 1024


@functools.cache
def _kernels() -> Any:
    """The Triton kernels, compiled on first use (``None`` when Triton is not installed)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def pack_kernel(x_ptr, out_ptr, offs_ptr, sizes_ptr, outer, D, M, inner, total, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < total
        i = idx % inner
        t = idx // inner
        j = t % M
        t = t // M
        o = t % outer
        r = t // outer
        size = tl.load(sizes_ptr + r, mask=valid, other=0)
        off = tl.load(offs_ptr + r, mask=valid, other=0)
        keep = valid & (j < size)
        val = tl.load(x_ptr + (o * D + off + j) * inner + i, mask=keep, other=0)
        tl.store(out_ptr + idx, val, mask=valid)

    @triton.jit
    def unpack_kernel(buf_ptr, out_ptr, owner_ptr, offs_ptr, outer, D, M, inner, total, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < total
        i = idx % inner
        t = idx // inner
        k = t % D
        o = t // D
        r = tl.load(owner_ptr + k, mask=valid, other=0)
        off = tl.load(offs_ptr + r, mask=valid, other=0)
        val = tl.load(buf_ptr + ((r * outer + o) * M + (k - off)) * inner + i, mask=valid, other=0)
        tl.store(out_ptr + idx, val, mask=valid)

    return triton, pack_kernel, unpack_kernel


def backend_for(x: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: which implementation packs ``x``."""
    if os.environ.get("HAPC_PACK") == "torch":
        return "torch"
    usable = x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return "triton" if usable and _kernels() is not None else "torch"


def _split(shape: Sequence[int], dim: int) -> tuple[int, int, int]:
    outer = 1
    for n in shape[:dim]:
        outer *= n
    inner = 1
    for n in shape[dim + 1 :]:
        inner *= n
    return outer, shape[dim], inner


def pack(x: torch.Tensor, dim: int, sizes: Sequence[int], backend: str | None = None) -> torch.Tensor:
    """``x`` (``sum(sizes)`` long on ``dim``) as ``m`` zero-padded blocks ``[m, outer, M, inner]``."""
    outer, D, inner = _split(x.shape, dim)
    if D != sum(sizes):
        raise RuntimeError(f"pack: dim {dim} has {D}, the shards add up to {sum(sizes)}")
    m, M = len(sizes), max(sizes)
    x = x.contiguous()
    if (backend or backend_for(x)) == "triton":
        triton, pack_kernel, _ = _kernels()
        out = torch.empty(m * outer * M * inner, dtype=x.dtype, device=x.device)
        offs = torch.tensor([lo for lo, _ in bounds(sizes)], dtype=torch.int64, device=x.device)
        szs = torch.tensor(list(sizes), dtype=torch.int64, device=x.device)
        total = out.numel()
        pack_kernel[(triton.cdiv(total, BLOCK),)](x, out, offs, szs, outer, D, M, inner, total, BLOCK=BLOCK)
        return out.view(m, outer, M, inner)
    xs = x.view(outer, D, inner)
    out = x.new_zeros(m, outer, M, inner) if min(sizes) < M else x.new_empty(m, outer, M, inner)
    for r, (lo, hi) in enumerate(bounds(sizes)):
        out[r, :, : hi - lo].copy_(xs[:, lo:hi])
    return out


def unpack(
    buf: torch.Tensor, dim: int, sizes: Sequence[int], shape: Sequence[int], backend: str | None = None
) -> torch.Tensor:
    """The tensor of ``shape`` (``sum(sizes)`` on ``dim``) from ``m`` padded blocks (see :func:`pack`)."""
    outer, D, inner = _split(shape, dim)
    m, M = len(sizes), max(sizes)
    if buf.numel() != m * outer * M * inner:
        raise RuntimeError(f"unpack: buffer has {buf.numel()} elements, expected {m * outer * M * inner}")
    buf = buf.contiguous()
    if (backend or backend_for(buf)) == "triton":
        triton, _, unpack_kernel = _kernels()
        out = torch.empty(tuple(shape), dtype=buf.dtype, device=buf.device)
        offs = torch.tensor([lo for lo, _ in bounds(sizes)], dtype=torch.int64, device=buf.device)
        owner = torch.repeat_interleave(
            torch.arange(m, device=buf.device), torch.tensor(list(sizes), device=buf.device)
        )
        total = out.numel()
        unpack_kernel[(triton.cdiv(total, BLOCK),)](buf, out, owner, offs, outer, D, M, inner, total, BLOCK=BLOCK)
        return out
    blocks = buf.view(m, outer, M, inner)
    out = buf.new_empty(outer, D, inner)
    for r, (lo, hi) in enumerate(bounds(sizes)):
        out[:, lo:hi].copy_(blocks[r, :, : hi - lo])
    return out.view(tuple(shape))
