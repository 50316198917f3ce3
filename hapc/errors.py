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


class InfeasibleError(HapcError):
    """No program fits the cluster (memory) or the search space is empty."""


class UnsupportedOpWarning(UserWarning):
    """An op without a rule is replicated on every device (pass ``strict=True`` to make it an error)."""
