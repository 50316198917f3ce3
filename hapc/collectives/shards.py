"""Taking a rank's share of a model input: the global batch is sliced, a local one is checked."""

from __future__ import annotations

import torch

from ..errors import HapcError


def take_shard(x: torch.Tensor, dim: int, start: int, length: int, total: int, name: str) -> torch.Tensor:
    """This rank's slice ``[start, start + length)`` of dim ``dim`` of input ``name``.

    ``x`` may be the global tensor (``total`` long on ``dim``: sliced here) or already this
    rank's part (``length`` long: used as is). Any other size means the input differs from the one
    the plan was made for: an error, never a silent wrong answer.
    """
    if not isinstance(x, torch.Tensor):
        raise HapcError(f"input {name!r} must be a tensor, got {type(x).__name__}")
    n = x.shape[dim] if x.dim() > dim else None
    if n == total:
        return x.narrow(dim, start, length)
    if n == length:
        return x
    raise HapcError(
        f"input {name!r} has shape {tuple(x.shape)}: dim {dim} should be {total} (the global batch) or {length} "
        f"(this rank's share); the plan was synthesized for that shape -- re-synthesize for the new one"
    )


def take_whole(x: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A replicated input: every rank needs all of it, in the shape the plan was made for."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise HapcError(
            f"input {name!r} has shape {got}, the plan expects {tuple(shape)} on every rank; pass the global "
            "batch (the same on every rank), or re-synthesize for the new shape"
        )
    return x
