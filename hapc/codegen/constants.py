"""Constant inputs of a compiled program: another value runs where it changes nothing, else is
refused (DESIGN §9, "habits: exact or refused").

The capture specialises the model's forward ``f`` on every argument that is not a tensor input:
an optional input left at ``None`` (an attention mask), a flag, a size -- given in the example
inputs or left at its default -- and, for a forward taking ``**kwargs``, on which keywords were
given at all. The program ``P = capture(f; x, c)`` computes ``f(.; c)``. A call with other values
``c'`` for some of them is the model's ``f(.; c')``, which ``P`` computes exactly when a capture
along the same path at the same example, ``capture(f; x, c')``, computes what ``capture(f; x, c)``
does: equal keys (:func:`hapc.theory.program_key.program_key`: every op with its shapes, dtypes and
operands, the returned structure, and ops computed from constants alone -- a causal mask -- by
their value, since transformers builds one mask by other ops under ``use_cache=False``). So the
first call giving a set of changed values ``c'`` captures the model with them and, once per
module, again as compiled (checked to be ``P``, op for op), and compares; equal keys accept the
call (``use_cache=False``, ``return_dict=True`` on a Hugging Face model), different ones refuse it
with a :class:`HapcError` naming the input and the fix (``output_hidden_states=True``, which
returns more; a scale that changes the loss). The verdict is cached by the changed
``(name, value)`` pairs: each later call with them costs a dict look-up, and a call with the
traced values costs nothing more than comparing them.

The capture is deterministic and local (no collective): every rank reaches the same verdict from
the same model and example inputs. It leaves the model as it was -- its train/eval mode, the
``_tensor_constant*`` attributes a capture attaches, the global RNG state -- and runs past the
guard of :mod:`hapc.codegen.original` (the model may be stale: only shapes and control flow are
read). Without a second capture are refused: a tensor where the program has a constant (a new
input the program lacks) and any value other than ``None``, ``bool``, ``int``, ``float`` or
``str`` (a cache object, a list). A keyword the call gives to ``**kwargs`` (transformers 5 routes
``return_dict`` and ``output_*`` there; fx passes those of the compiled example on as constants,
:func:`hapc.theory.trace._named_root`) and a flag off its default (an ``if`` fx cannot follow) are
judged by two ``torch.export`` captures, without and with the change.

A pipeline and per-segment ratios bind their calls the same way (:class:`hapc.codegen.calls.ModelCall`:
positional or keyword inputs, the constants checked by a :class:`ConstantInputs`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import HapcError
from ..theory.program_key import program_key
from ..theory.trace import constants_kept
from .original import guard_suspended

__all__ = ["ConstantInputs", "check_constant_inputs", "constant_inputs"]

_PLAIN = (type(None), bool, int, float, str)


class _Absent:
    """A keyword of ``**kwargs`` the example inputs did not give."""

    def __repr__(self) -> str:
        return "(not given)"


ABSENT = _Absent()


class ConstantInputs:
    """The constants one program was captured with and the verdicts on other values for them."""

    def __init__(
        self,
        values: dict[str, Any],
        defaults: dict[str, Any] | None = None,
        keywords: bool = False,
        named: set[str] | None = None,
        model: nn.Module | None = None,
        example: dict[str, Any] | None = None,
        graph: Any = None,
        options: dict[str, Any] | None = None,
    ):
        self.values = values  # name -> the value the program was captured with
        self.defaults = defaults or {}  # name -> what a call leaving it out gives (a parameter's default)
        self.keywords = keywords  # the forward takes **kwargs: another keyword is a constant too
        self.named = named or set()  # the forward's named parameters and the program's inputs
        self.model, self.example, self.graph = model, example or {}, graph
        self.options = options or {}  # how hapc.compile captured (leaf_modules, loss)
        self.mode = model.training if model is not None else True
        self.verdicts: dict[tuple, str | None] = {}  # changed (name, type, repr) pairs -> why different, or None
        self._bases: dict[str, list[tuple] | str] = {}  # capture -> the key of the model captured again as compiled

    def __deepcopy__(self, memo: dict[int, Any]) -> ConstantInputs:  # a copy of the module runs the same program
        return self

    def check(self, bound: dict[str, Any]) -> None:
        """Refuse a call whose constants change the program (see the module docstring)."""
        changes = []
        for name in [*self.values, *(k for k in bound if self.keywords and k not in self.named)]:
            want = self.values.get(name, ABSENT)
            got = bound[name] if name in bound else self.defaults.get(name, ABSENT)
            if not (got is want or (type(got) is type(want) and got == want)):
                changes.append((name, got, want))
        if not changes:
            return
        odd = next((c for c in changes if not isinstance(c[1], _PLAIN + (_Absent,))), None)
        if odd is not None:  # a tensor where None was traced: an input the program lacks
            raise self._refusal(*odd, why=None)
        key = tuple(sorted((name, type(got).__name__, repr(got)) for name, got, _ in changes))
        if key not in self.verdicts:
            self.verdicts[key] = self._differs(changes)
        why = self.verdicts[key]
        if why is not None:
            raise self._refusal(*changes[0], why=why)

    # -- a second capture -----------------------------------------------------------------------------
    def _differs(self, changes: list[tuple[str, Any, Any]]) -> str | None:
        """None where the model captured with ``changes`` is this program; else where it differs."""
        if self.model is None or self.graph is None:
            return "the model is not at hand to capture it again"
        example = dict(self.example)
        for name, got, _ in changes:
            if got is ABSENT:
                example.pop(name, None)
            else:
                example[name] = got
        capture = self.graph.capture
        if capture == "fx" and any(name not in self.defaults for name, _, _ in changes):
            capture = "export"  # fx does not see **kwargs
        try:
            other = self._key(example, capture)
        except Exception as exc:
            if capture != "fx":  # the model does not even capture with it: certainly another program
                return f"the model does not capture with it ({type(exc).__name__}: {str(exc)[:120]})"
            capture = "export"  # fx cannot follow it (a flag off its default is an input to fx's `if`)
            try:
                other = self._key(example, capture)
            except Exception as exc:
                return f"the model does not capture with it ({type(exc).__name__}: {str(exc)[:120]})"
        base = self._base(capture)
        if isinstance(base, str):
            return base
        if other == base:
            return None
        first = next((k for k, (a, b) in enumerate(zip(base, other)) if a != b), min(len(base), len(other)))
        if first >= len(base) - 1 or base[first][0] == "returns":
            return "the model returns something else"
        return f"its program differs from its operation {first} ({base[first][0]}) on"

    def _base(self, capture: str) -> list[tuple] | str:
        """The key of the model captured again as compiled (by ``capture``), or why there is none."""
        if capture not in self._bases:
            try:
                self._bases[capture] = self._key(self.example, capture, check=capture == self.graph.capture)
            except Exception as exc:
                self._bases[capture] = f"the model does not capture again by {capture} ({type(exc).__name__})"
        return self._bases[capture]

    def _key(self, example: dict[str, Any], capture: str, check: bool = False) -> list[tuple]:
        """The model captured at ``example`` by ``capture``, keyed with its data-free ops folded
        (inside the capture's context: their values read its ``_tensor_constant*``); ``check``: that
        capture is the compiled program's."""
        from ..theory import trace

        with untouched(self.model, self.mode):
            graph = trace(self.model, example, capture=capture, **self.options)
            if check and program_key(graph, outputs=True) != program_key(self.graph, outputs=True):
                raise HapcError("the model captured again is not the compiled program")
            return program_key(graph, outputs=True, fold=True)

    def _refusal(self, name: str, got: Any, want: Any, why: str | None) -> HapcError:
        shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
        if want is None:
            kind = "an optional input left at None"
        elif want is ABSENT:
            kind = "a keyword the example inputs did not give"
        else:
            kind = "a Python value"
        told = f"{name}={want!r}" if want is not ABSENT else f"no {name}"
        omit = want is ABSENT or (name in self.defaults and self.defaults[name] == want)
        fix = f"Pass {name}={want!r}" if want is not ABSENT else f"Leave {name} out"
        return HapcError(
            f"input {name!r} is {shown}, but the plan was made with {told}: the capture took it as a constant "
            f"({kind}), so the program would compute as if {told} -- silently unlike the model"
            + (f" ({why}: captured again with {name}={got!r})" if why else "")
            + f". {fix}{' (or leave it out)' if omit and want is not ABSENT else ''}, or compile again with this "
            f"{name} in example_inputs (a second compiled module for the other case)"
        )


@contextlib.contextmanager
def untouched(model: nn.Module, mode: bool) -> Iterator[None]:
    """Capture ``model`` in train/eval ``mode`` and leave it as it was: each submodule's mode, the
    ``_tensor_constant*`` attributes, the CPU RNG, and its guard (the capture calls it while it
    may be stale: only shapes are read)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with constants_kept(model), guard_suspended(model), torch.random.fork_rng(devices=[]):
            nn.Module.train(model, mode)  # the class's: the guard's model.train would switch the module too
            yield
    finally:
        for m, was in modes:
            m.training = was


def constant_inputs(model: nn.Module, example_inputs: Any, graph: Any, **options: Any) -> ConstantInputs:
    """The forward arguments the capture of ``model`` at ``example_inputs`` took as constants:
    given (or left at their default) as ``None`` or a plain Python value, by name, plus the
    keywords given to ``**kwargs``; ``options``: the capture's (``leaf_modules``, ``loss``)."""
    from ..theory.capture import bind_keywords

    try:
        sig = inspect.signature(model.forward)
        given = bind_keywords(model, example_inputs)[0]
    except (TypeError, ValueError, HapcError):
        return ConstantInputs({})
    traced = set(graph.input_names)
    values: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    keywords = False
    for name, p in sig.parameters.items():
        keywords |= p.kind == p.VAR_KEYWORD
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in traced:
            continue
        defaults[name] = p.default if p.default is not p.empty else ABSENT
        value = given[name] if name in given else p.default
        if isinstance(value, _PLAIN):
            values[name] = value
    if keywords:
        values.update({k: v for k, v in given.items() if k not in sig.parameters and k not in traced
                       and isinstance(v, _PLAIN)})  # fmt: skip
    example = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in given.items()}
    named = set(sig.parameters) | traced
    return ConstantInputs(values, defaults, keywords, named, model, example, graph, options)


def check_constant_inputs(constants: ConstantInputs, bound: dict[str, Any]) -> None:
    """Refuse a call that gives a constant input a value that changes the program."""
    constants.check(bound)
