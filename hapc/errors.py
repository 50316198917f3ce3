"""Errors hapc raises. Every message names what went wrong (node, op, device, file) and what to do.

All errors derive from :class:`HapcError`, so ``except hapc.HapcError`` catches everything this
package raises on purpose; anything else escaping hapc is a bug.
"""

from __future__ import annotations


class HapcError(Exception):
    """Base class of every error hapc raises on purpose."""


class TraceError(HapcError):
    """The model cannot be turned into a static reference graph (control flow, unsupported Python)."""


class UnsupportedOpError(HapcError):
    """An op has no sharding rule and ``strict=True`` was asked for."""


class RuleError(HapcError):
    """A user-supplied annotation or rule function is malformed or inconsistent with the node."""


class ClusterError(HapcError):
    """A cluster specification is malformed or impossible."""


class PlanError(HapcError):
    """A plan is corrupt, of another version, or for another model / cluster / world size."""


class ModelAttributeError(HapcError, AttributeError):
    """An attribute of the model given to ``hapc.compile`` asked of the compiled module (an
    ``AttributeError`` too, so ``hasattr`` and ``getattr(..., default)`` keep working)."""


def wrapped_model_error() -> ModelAttributeError:
    """``module.module``: DDP's / FSDP's handle on the wrapped model, asked of a hapc module (whose
    stage or segment programs hold this rank's part of the weights only)."""
    return ModelAttributeError(
        "'module' is DDP's wrapped model; a hapc module runs programs of its own and holds this rank's part of "
        "the weights. For the trained model call module.unwrap() on every rank (it gathers the weights into the "
        "model given to hapc.compile and returns it); for a checkpoint, module.state_dict() (every rank: the "
        "whole single-device state)"
    )


class InfeasibleError(HapcError):
    """No program fits the cluster (memory) or the search space is empty."""


class DistributedRunError(HapcError):
    """A multi-process run (:func:`hapc.testing.run_distributed`) failed: some rank raised, died,
    hung past the timeout, or was never started. The attributes say which, rank by rank."""

    def __init__(
        self,
        message: str,
        *,
        errors: dict[int, str] | None = None,
        died: dict[int, int] | None = None,
        hung: list[int] | None = None,
        absent: list[int] | None = None,
    ):
        super().__init__(message)
        self.errors = errors or {}  # rank -> "Type: message\ntraceback" of what it raised
        self.died = died or {}  # rank -> exit code of a process that ended without reporting
        self.hung = hung or []  # ranks still running at the deadline (killed by the harness)
        self.absent = absent or []  # ranks deliberately not started


class UnsupportedOpWarning(UserWarning):
    """An op without a rule is replicated on every device (pass ``strict=True`` to make it an error)."""


class DroppedOutputWarning(UserWarning):
    """A tensor the model returns is not computed by hapc's program (the loss does not depend on
    it), so the compiled module returns ``None`` in its place."""
