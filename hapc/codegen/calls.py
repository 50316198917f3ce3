"""How a module made of several programs takes the model's call and hands back its result.

A pipeline (:mod:`hapc.pipeline.runtime`) and per-segment ratios (:mod:`hapc.segmented`) run the
model's traced inputs by name through programs of their own and compute the batch loss alone. The
user calls them as they call the model -- ``module(*batch)``, or ``module(**batch)`` for a Hugging
Face model whose example inputs were a dict -- and reads what the model returns (``out.loss`` of a
``ModelOutput``). :class:`ModelCall` does both ends, as :class:`~hapc.codegen.module.CompiledModule`
does for one SPMD program:

* :meth:`ModelCall.bind`: the arguments bound by the model's ``forward`` signature (what the
  forward refuses -- an unknown keyword, a positional too many -- is refused alike, a missing input
  is a ``TypeError``), and the constants the capture specialised on (a flag, an input left at
  ``None``) checked by :class:`~hapc.codegen.constants.ConstantInputs`: another value that changes
  the program raises a :class:`~hapc.errors.HapcError` naming it;
* :meth:`ModelCall.structured`: the model's returned structure (``ModelOutput``, dict, tuple) with
  the loss in its place and ``None`` for every other tensor (logits) -- which such a module does not
  compute whole, so :func:`hapc.planner.choose_plan` picks one for a model returning them only
  under ``outputs="loss"``.

Example::

    >>> call = ModelCall(model, {"input_ids": ids, "labels": ids}, graph)  # doctest: +SKIP
    >>> call.bind((), {"input_ids": ids, "labels": ids})  # doctest: +SKIP
    (ids, ids)
    >>> call.structured(loss).loss is loss  # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .constants import check_constant_inputs, constant_inputs


class ModelCall:
    """The calling convention of ``model`` as captured at ``example`` into ``graph``."""

    def __init__(self, model: nn.Module, example: Any, graph: Any):
        from .module import _call_checker, _positional_names, _signature

        self.names: list[str] = list(graph.input_names)  # the traced tensor inputs, in the program's order
        sig = _signature(model)
        self._positional = _positional_names(sig, self.names)
        self._check = _call_checker(sig, type(model).__name__, self.names)
        self._constants = constant_inputs(model, example, graph)
        self._spec, self._loss_leaf, self._outputs = graph.output_spec, graph.loss_leaf, len(graph.outputs)

    def bind(self, args: tuple, kwargs: dict[str, Any], who: str = "the module") -> tuple[Any, ...]:
        """The call's values of the traced inputs, in :attr:`names` order."""
        self._check(args, kwargs)
        if len(args) > len(self._positional):
            raise TypeError(f"{who} takes the model inputs {self.names}, got {len(args)} positional values")
        bound = dict(zip(self._positional, args))
        bound.update(kwargs)
        check_constant_inputs(self._constants, bound)
        missing = [n for n in self.names if n not in bound]
        if missing:
            raise TypeError(f"missing model input(s) {missing}: {who} takes {self.names}")
        return tuple(bound[n] for n in self.names)

    def structured(self, loss: torch.Tensor) -> Any:
        """What the model returns, the loss in its place and ``None`` for every other tensor."""
        if self._spec is None or isinstance(self._spec, int):
            return loss
        from ..theory.capture import rebuild_output

        return rebuild_output(self._spec, [loss if k == self._loss_leaf else None for k in range(self._outputs)])
