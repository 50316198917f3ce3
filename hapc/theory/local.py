"""What one device runs for a computation triple: the strategy's local call, bound.

Shared by the simulator (``hapc.theory.simulate``) and codegen, so the code a device runs and the
semantics the theory is tested against come from one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .graph import Ref, RefNode, map_refs
from .strategy import LocalCall, Operand, ShardMarker, Strategy, StreamMarker


def default_call(node: RefNode) -> LocalCall:
    """The reference call with operands as :class:`Operand` placeholders."""
    counter = iter(range(len(node.operands)))
    args, kwargs = map_refs((node.args, node.kwargs), lambda r: Operand(next(counter)))
    return LocalCall(node.target, tuple(args), tuple(kwargs.items()), node.is_method, node.out_index)


def local_call(node: RefNode, strategy: Strategy) -> LocalCall:
    return strategy.local if strategy.local is not None else default_call(node)


def substitute(value: Any, operands: Sequence[Any], marker: Callable[[ShardMarker], int], device: Any = None) -> Any:
    """Fill a template: operands by position, shard markers by ``marker``, the device symbol."""
    from .trace import CurrentDevice

    if isinstance(value, Operand):
        return operands[value.position]
    if isinstance(value, ShardMarker):
        return marker(value)
    if isinstance(value, CurrentDevice):
        return device
    if isinstance(value, StreamMarker):  # simulation: one fixed stream, in training mode
        from ..ops import RandomStream

        return RandomStream()
    if isinstance(value, Ref):
        raise TypeError("local call templates use Operand(i), not Ref")
    if isinstance(value, tuple):
        return tuple(substitute(v, operands, marker, device) for v in value)
    if isinstance(value, list):
        return [substitute(v, operands, marker, device) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, operands, marker, device) for k, v in value.items()}
    return value


def run_call(call: LocalCall, operands: Sequence[Any], marker: Callable[[ShardMarker], int]) -> torch.Tensor:
    """Execute a local call on concrete operand tensors."""
    device = next((o.device for o in operands if isinstance(o, torch.Tensor)), None)
    args = substitute(call.args, operands, marker, device)
    kwargs = substitute(dict(call.kwargs), operands, marker, device)
    if call.is_method:
        out = getattr(args[0], call.target)(*args[1:], **kwargs)
    else:
        out = call.target(*args, **kwargs)
    return out if call.out_index is None else out[call.out_index]
