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
  the loss in its place and every other tensor (logits) as the module hands it back: whole, on
  every rank, under ``outputs="whole"``; ``None`` under ``outputs="loss"`` (or where no program
  computes it, as :class:`~hapc.codegen.module.CompiledModule` returns it).

:func:`route_outputs` says which program computes each of those other tensors: the program of the
stage (segment) whose graph holds the op -- the one parameter-dependent ops live in, or for a
data-only value the last that recomputes it -- and makes that stage graph return it after its own
output (``RefGraph.outputs``), so that stage's SPMD program hands it back made whole over its
ranks (:meth:`~hapc.codegen.program.RankProgram._extra_outputs`).

Example::

    >>> call = ModelCall(model, {"input_ids": ids, "labels": ids}, graph)  # doctest: +SKIP
    >>> call.bind((), {"input_ids": ids, "labels": ids})  # doctest: +SKIP
    (ids, ids)
    >>> call.structured(loss).loss is loss  # doctest: +SKIP
    True
    >>> call.structured(loss, {1: logits}).logits is logits  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    def structured(self, loss: torch.Tensor, others: dict[int, torch.Tensor | None] | None = None) -> Any:
        """What the model returns: the loss in its place, every other tensor from ``others`` (by its
        position among the model's returned tensors, :attr:`RefGraph.outputs`) or ``None``."""
        if self._spec is None or isinstance(self._spec, int):
            return loss
        from ..theory.capture import rebuild_output

        others = others or {}
        leaves = [loss if k == self._loss_leaf else others.get(k) for k in range(self._outputs)]
        return rebuild_output(self._spec, leaves)


@dataclass(frozen=True)
class RoutedOutput:
    """One of the model's other returned tensors and the program computing it: ``leaf``, its
    position in :attr:`RefGraph.outputs`; ``stage``, the stage (segment) whose program returns it,
    as that program's ``position``-th other output; ``name``, the op's; ``shape`` / ``dtype``, as
    traced (for a pipeline: of one micro-batch)."""

    leaf: int
    stage: int
    position: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def route_outputs(graph: Any, stages: Sequence[Any]) -> list[RoutedOutput]:
    """The model's other returned tensors (all but the loss; those the capture could not keep are
    left out: ``None``), each assigned to the stage graph computing it, which is made to return it
    (its ``outputs`` then ``[its own output, *these]``, ``loss_leaf`` 0): the stage whose ops include
    it (a parameter-dependent op lives in one stage only; a data-only op, recomputed by every stage
    that needs it, goes to the last of them). Call before deriving the stages' theories. Raises
    :class:`~hapc.errors.HapcError` for a returned tensor no stage computes (a model input or
    weight returned as it is)."""
    from ..errors import HapcError
    from ..theory.graph import OP

    routed: list[RoutedOutput] = []
    per_stage: dict[int, list[int]] = {}
    for leaf, ref in enumerate(graph.outputs):
        if leaf == graph.loss_leaf or ref is None:
            continue
        node = graph[ref]
        at = None
        for s in reversed(stages):
            hit = next((n.index for n in s.graph if n.kind == OP and n.name == node.name), None)
            if hit is not None:
                at = (s.index, hit)
                break
        if at is None:
            raise HapcError(
                f"the model returns {node.name!r} ({node.kind}) besides its loss, which no stage's program computes "
                "(an input or a weight returned as it is); return it from outside the model, or compile with "
                "outputs='loss'"
            )
        mine = per_stage.setdefault(at[0], [])
        mine.append(at[1])
        routed.append(RoutedOutput(leaf, at[0], len(mine) - 1, node.name, tuple(node.meta.shape), node.meta.dtype))
    for k, refs in per_stage.items():
        g = stages[k].graph
        g.outputs, g.loss_leaf = [len(g) - 1, *refs], 0
    return routed
