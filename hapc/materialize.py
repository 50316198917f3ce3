"""Real values for a model built on the meta device, one module at a time.

A model too large for one host is built with ``device="meta"`` (shapes only). :func:`hapc.compile`
then gives each rank just its shards: it materialises the parameters of one module at a time on
the CPU -- with the module's own ``reset_parameters()``, seeded by ``(seed, module name)`` -- slices
this rank's part and drops the rest. Every rank draws the same values, and :func:`materialize`
draws them again for a single-device copy (tests, checkpoints), so the sharded model is exactly a
slicing of one well-defined single-device model whatever the plan.

Modules without ``reset_parameters`` get ``normal(0, 0.02)`` for tensors of two or more dims and
zeros for vectors (GPT-2's scheme); pass ``init=`` to choose otherwise. Buffers on the meta device
are recreated only by ``reset_parameters`` (batch norm's running statistics); others are an error,
since their values (masks, position tables) cannot be guessed -- build those on the CPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from .errors import HapcError

Init = Callable[[str, torch.Tensor], None]  # (qualified name, tensor to fill in place)


def _seed(seed: int, qual: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{qual}".encode()).digest()[:8], "little") & (2**63 - 1)


def _default_init(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point():
        if t.dim() >= 2:
            nn.init.normal_(t, 0.0, 0.02)
        else:
            nn.init.zeros_(t)
    else:
        t.zero_()


def module_values(
    module: nn.Module, qual: str, seed: int = 0, init: Init | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Values of ``module``'s own (not its children's) meta parameters and buffers, by full name."""
    own = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
    own += [(n, t, False) for n, t in module.named_buffers(recurse=False)]
    wanted = [(n, t, is_param) for n, t, is_param in own if t.is_meta]
    if not wanted:
        return {}
    prefix = f"{qual}." if qual else ""
    shell = module.__class__.__new__(module.__class__)
    shell.__dict__ = dict(module.__dict__)  # same configuration, own tensor tables
    shell._parameters = {
        n: nn.Parameter(torch.empty_like(t, device=device), t.requires_grad) if t is not None else None
        for n, t in module._parameters.items()
    }
    shell._buffers = {
        n: torch.empty_like(t, device=device) if t is not None else None for n, t in module._buffers.items()
    }
    shell._modules = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, qual))
        with torch.no_grad():
            if init is None and hasattr(shell, "reset_parameters"):
                shell.reset_parameters()
            else:
                for n, _, is_param in wanted:
                    if not is_param and init is None:
                        raise HapcError(
                            f"buffer {prefix}{n} is on the meta device and {type(module).__name__} has no "
                            "reset_parameters() to recreate it; build buffers on the CPU (they are small)"
                        )
                    (init or _default_init)(prefix + n, shell._parameters[n] if is_param else shell._buffers[n])
    out = {}
    for n, _, is_param in wanted:
        value = shell._parameters[n] if is_param else shell._buffers[n]
        out[prefix + n] = value.detach()
    return out


def materialize(model: nn.Module, seed: int = 0, init: Init | None = None, device: str = "cpu") -> nn.Module:
    """Replace every meta parameter and buffer of ``model`` by the values :func:`hapc.compile`
    shards from (in place; returns ``model``)."""
    for qual, module in model.named_modules():
        values = module_values(module, qual, seed, init, device)
        prefix = f"{qual}." if qual else ""
        for full, value in values.items():
            name = full[len(prefix) :]
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(value, module._parameters[name].requires_grad)
            else:
                module._buffers[name] = value
    return model


def owner(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """``(qualified module name, module)`` owning the tensor called ``name`` in ``state_dict``."""
    qual, _, _ = name.rpartition(".")
    return qual, model.get_submodule(qual) if qual else model
