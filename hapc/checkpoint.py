"""Full-state checkpoints that move between plans, world sizes and a single device.

A *full state* is what single-device training would save, keyed by parameter name so that it
does not depend on how a plan shards or orders parameters::

    {"model": model.state_dict(),
     "optimizer": {"state": {"layers.0.weight": {"step": ..., "exp_avg": ..., ...}, ...},
                   "param_groups": [{"lr": ..., "betas": ..., ...}, ...]}}

:meth:`CompiledModule.full_state_dict` gathers it from the shards of a distributed run and
:meth:`CompiledModule.load_full_state_dict` slices it back under any plan; :func:`full_state` and
:func:`load_full_state` do the same for an ordinary single-device model and optimizer.
:func:`save` writes atomically (a temporary file, then a rename, so a crash mid-save leaves the
previous checkpoint intact) and :func:`load` reads with ``torch.load(weights_only=True)``: tensors
and plain containers only, never arbitrary pickled objects.
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import HapcError


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The full state of a single-device ``model`` (and ``optimizer``), optimizer state by name."""
    out: dict[str, Any] = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        names = {id(p): k for k, p in model.named_parameters()}
        state = {}
        for p, st in optimizer.state.items():
            if id(p) in names:
                state[names[id(p)]] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        out["optimizer"] = {"state": state, "param_groups": groups}
    return out


def load_full_state(model: nn.Module, state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a full state (from :func:`full_state` or ``CompiledModule.full_state_dict``) into a
    single-device model and optimizer."""
    model.load_state_dict(state["model"])
    if optimizer is None:
        return
    if "optimizer" not in state:
        raise HapcError("the checkpoint holds no optimizer state; save it with full_state_dict(optimizer)")
    params = dict(model.named_parameters())
    unknown = sorted(set(state["optimizer"]["state"]) - set(params))
    if unknown:
        raise HapcError(f"optimizer state names parameters the model lacks: {unknown[:5]}")
    for name, st in state["optimizer"]["state"].items():
        p = params[name]
        optimizer.state[p] = {k: v.to(p.device).clone() if torch.is_tensor(v) else v for k, v in st.items()}
    load_param_groups(optimizer, state["optimizer"].get("param_groups", []))


def load_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Hyper-parameters (learning rate, betas, ...) of each saved group onto the optimizer's."""
    if saved and len(saved) != len(optimizer.param_groups):
        raise HapcError(
            f"the checkpoint has {len(saved)} optimizer parameter groups, the optimizer {len(optimizer.param_groups)}"
        )
    for group, values in zip(optimizer.param_groups, saved):
        group.update({k: v for k, v in values.items() if k != "params"})


def save(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` to ``path`` atomically: a crash leaves either the old file or the new one.

    A process killed mid-save also leaves its temporary (``.<name>.*.tmp``, beside ``path``);
    :func:`load` never reads it, and it may be deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` (tensors and plain containers only)."""
    path = Path(path)
    if not path.exists():
        raise HapcError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" not in str(exc):  # not a pickle at all: garbage or truncated
            raise HapcError(
                f"{path} is not a readable hapc checkpoint (UnpicklingError); the file is truncated or not a "
                "torch checkpoint -- load an earlier one"
            ) from exc
        # weights_only refused a global: never run pickled code
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"it references {found.group(1)}" if found else "weights_only refused it"
        raise HapcError(
            f"{path} holds pickled objects other than tensors and plain containers ({what}); hapc reads "
            "checkpoints with torch.load(weights_only=True) and will not run pickled code. Re-save the state "
            "from full_state_dict() / full_state() with hapc.checkpoint.save"
        ) from exc
    except Exception as exc:
        raise HapcError(
            f"{path} is not a readable hapc checkpoint ({type(exc).__name__}: {exc}); the file is truncated or "
            "not a torch checkpoint -- load an earlier one"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise HapcError(f"{path} is not a full-state checkpoint: expected a dict with a 'model' entry")
    return state
