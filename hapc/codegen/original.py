"""The model a module was compiled from: never silently stale (DESIGN §9, "the original model object").

``hapc.compile(model, ...)`` copies ``model``'s weights into per-rank shards and trains those; the
``model`` object itself is never updated. A DDP user's habits -- ``torch.save(model.state_dict())``,
evaluating ``model`` after training, compiling it again after ``model.eval()`` -- would then use the
initial weights without any error. So the compiled module (its *owner*) guards the model:

* the model is **in sync** while the owner's parameters and buffers are unchanged since the model
  last received them: right after compile (the same values), after ``module.unwrap()`` (which
  writes the trained full weights back into it, a collective), or after the user loads a
  ``state_dict`` into it once the module has trained;
* any in-place change of the owner's state since -- an optimizer step, batch norm's running
  statistics, a ``load_state_dict`` -- makes it **stale** (each tensor's ``_version`` counter: no
  cost per step, read only when the model is used);
* the model changed while the module has not moved -- ``model.load_state_dict(ckpt)`` or an
  initialisation after compile, as one may do with DDP, whose module *is* the model -- makes the
  module's next forward raise: it would train its own copy without them (load into the module);
* while stale, ``model(...)``, ``model.state_dict()`` and ``hapc.compile(model, ...)`` raise a
  :class:`~hapc.errors.HapcError` saying to call ``module.unwrap()`` (or to use the module's own
  ``state_dict()`` / ``full_state_dict()``).

The model's train/eval mode is the module's, as with DDP (which wraps the model itself, so
``model.eval()`` switches what ``ddp_model(...)`` runs and ``ddp_model.eval()`` the model):
``model.train()`` / ``model.eval()`` switch the module too (``module.train(mode)``; where its program
cannot serve that mode, the model switches alone and every forward of the module raises that
refusal until the model is switched back -- ``model.eval()`` then ``hapc.compile(model)`` is how a
second, eval-mode module is made), and ``module.train()`` / ``module.eval()`` switch the model.
A part of the model switched alone (``model.drop.eval()``) is refused at the module's next forward:
hapc switches whole programs. Copies of the model (``copy.deepcopy`` for an EMA) switch only
themselves.

A model built on the meta device holds no weights at all (its tensors have no values, so nothing
silent can come of using it) until the module trains; then it is stale like any other.

``model.zero_grad()`` clears the module's gradients too (they are the ones training accumulates).

One more habit trains nothing without an error: an optimizer built over ``model.parameters()``
(before or after compile -- with DDP they are the module's). Those parameters never receive a
gradient, so every step is a no-op. A global optimizer step pre-hook checks each optimizer once,
at its first step: stepping guarded parameters that have no gradient while the module's have
raises, saying to build the optimizer over ``module.parameters()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import HapcError

_ATTR = "_hapc_guard"


class Guard:
    """Hooks on ``model`` that raise while ``owner``'s state differs from what the model holds."""

    def __init__(self, model: nn.Module, owner: nn.Module):
        self.owner = owner  # kept alive: the model can be synced from it as long as the model lives
        self.synced = versions(owner)  # the owner's state when the model last received it
        self.moved = False  # stale() was seen True since `synced` was taken (it stays so: see stale)
        self.sentinels = _sentinels(owner)  # the owner's parameters and their versions at `synced`
        self.holds_weights = not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        self.writing = False
        self.switching = False
        self.model = weakref.ref(model)
        self.model_state = tensor_versions(model)  # the model's tensors when it last matched the module
        self.modes = modes(model)  # the model's train/eval flags as the module last followed them
        self.handles = [
            # functions of the module, not methods of the guard: torch.save(model) pickles the hooks
            model.register_forward_pre_hook(_on_use),
            model.register_state_dict_pre_hook(_on_state_dict),
            model.register_load_state_dict_post_hook(_on_load),
            owner.register_forward_pre_hook(self._before_forward),
        ]
        # instance attributes win over the class's method: model.eval() (-> self.train(False)) lands here
        model.__dict__["train"] = _ModelTrain(model)
        owner.__dict__["train"] = _OwnerTrain(owner)
        model.__dict__["zero_grad"] = _ModelZeroGrad(model)
        ref = weakref.ref(self)
        for p in model.parameters():  # no attribute on the tensor: torch.save(model) must still pickle
            _GUARD_OF[p] = ref
        _install_optimizer_check()

    def __deepcopy__(self, memo: dict[int, Any]) -> Guard:  # a copy of the model is just as stale
        return self

    def __reduce__(self) -> tuple:
        """``torch.save(model)``: refused while stale; in sync, the file holds a plain model."""
        self.check("torch.save(model)")
        return (_no_guard, ())

    @contextlib.contextmanager
    def switching_modes(self) -> Iterator[None]:
        """One side's switch is passing to the other: not back again (a module holding its model)."""
        self.switching = True
        try:
            yield
        finally:
            self.switching = False

    def mark_synced(self) -> None:
        self.synced = versions(self.owner)
        self.moved = False
        self.sentinels = _sentinels(self.owner)
        self.holds_weights = True
        model = self.model()
        if model is not None:
            self.model_state = tensor_versions(model)

    def stale(self) -> bool:
        """Whether the owner's state has changed since the model last received it. Once true it
        stays true until :meth:`mark_synced`: ``versions`` are version counters, which only grow,
        and ``_state_epoch``, which only grows -- so it is remembered and the owner's state is not
        walked again (the guard asks before every forward of a module that trains)."""
        if not self.moved:
            self.moved = self.synced != versions(self.owner)
        return self.moved

    @contextlib.contextmanager
    def writing_back(self) -> Iterator[None]:
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        self.mark_synced()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        model = self.model()
        for m in (model, self.owner):
            if m is not None and isinstance(m.__dict__.get("train"), (_ModelTrain, _OwnerTrain)):
                del m.__dict__["train"]
        if model is not None and isinstance(model.__dict__.get("zero_grad"), _ModelZeroGrad):
            del model.__dict__["zero_grad"]

    def check(self, what: str) -> None:
        if self.stale():
            state = (
                "that model still holds the weights it was compiled with -- the compiled module has trained its "
                "own copy since"
                if self.holds_weights
                else "that model was built on the meta device and holds no weights -- the compiled module has "
                "drawn and trained its own"
            )
            raise HapcError(
                f"{what} of the model given to hapc.compile: {state}. Call module.unwrap() on every rank "
                "to write the trained weights back into it (it returns the model), or save and evaluate through "
                "the module: module.state_dict() (keys as in the model) or module.full_state_dict()"
            )

    def _on_use(self, module: nn.Module, args: Any) -> None:
        self.check("a forward")

    def _on_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not self.writing:
            self.check("state_dict()")

    def _on_load(self, module: nn.Module, incompatible: Any) -> None:
        if self.writing:
            return
        if self.stale():  # the module has trained: the user gives the model weights of their own
            self.mark_synced()  # (the module's, by hand, or another checkpoint's to evaluate)
        else:  # the module has not moved: weights meant for training, which it would not see --
            self.holds_weights = True  # its next forward refuses (see _before_forward)

    def _before_forward(self, owner: nn.Module, args: Any) -> None:
        """Before each forward of the module: weights the model was given after compile, while the
        module has not moved, are refused (the module would train its own copy without them); a part
        of the model switched alone since (whole-model switches are followed when they happen) is
        refused; all parts switched one by one are followed."""
        model = self.model()
        if model is None or owner is not self.owner:  # a copy of the module (an EMA) is not guarded
            return
        mods = _Tree.of(model)  # one walk for both checks, remembered while the model's tree holds
        # a module that has trained (stale) may see its model changed (weights loaded to evaluate):
        # once it is known to have moved, the model's tensors are not walked at every step. A
        # parameter's counter grown is the cheap sign (an optimizer step); stale() then says exactly
        if not self.moved and any(p._version != v for p, v in self.sentinels):
            if not self.stale():  # the owner's tensors were replaced, not stepped: watch the new counters
                self.sentinels = _sentinels(self.owner)
        if not self.moved and tensor_versions(model, mods) != self.model_state and not self.stale():
            raise HapcError(
                "the model given to hapc.compile was changed after compile (model.load_state_dict(...), an "
                "initialisation or another in-place update of its parameters or buffers), but the compiled "
                "module trains its own copy of the weights and would not see the change. Load weights into the "
                "module instead -- module.load_state_dict(state) on every rank, keys as in the model -- or "
                "change the model before hapc.compile"
            )
        now = modes(model, mods)
        if now == self.modes:
            return
        if len(set(now)) > 1:
            switched = [name or "the model" for (name, m), was in zip(model.named_modules(), self.modes)
                        if m.training != was]  # fmt: skip
            raise HapcError(
                f"part of the model given to hapc.compile was switched to another train/eval mode on its own "
                f"({', '.join(switched[:3])}); the compiled module runs one program for the whole model: "
                "switch the whole model (model.train() / model.eval(), or module.train() / module.eval())"
            )
        owner.train(now[0])


@contextlib.contextmanager
def guard_suspended(model: nn.Module) -> Iterator[None]:
    """hapc's own captures of ``model`` after compile (another batch size, other constant inputs)
    call it while it may be stale: only shapes and control flow are read, so its guard stands aside."""
    guard = model.__dict__.pop(_ATTR, None)
    try:
        yield
    finally:
        if guard is not None:
            model.__dict__[_ATTR] = guard


def _no_guard() -> None:
    return None


def _on_use(module: nn.Module, args: Any) -> None:
    g = module.__dict__.get(_ATTR)
    if isinstance(g, Guard):
        g._on_use(module, args)


def _on_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    g = module.__dict__.get(_ATTR)
    if isinstance(g, Guard):
        g._on_state_dict(module, prefix, keep_vars)


def _on_load(module: nn.Module, incompatible: Any) -> None:
    g = module.__dict__.get(_ATTR)
    if isinstance(g, Guard):
        g._on_load(module, incompatible)


class _ModelTrain:
    """``model.train`` of a model given to hapc.compile: the model's own switch, then its module's."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, mode: bool = True) -> nn.Module:
        model = self.model
        type(model).train(model, mode)
        g = model.__dict__.get(_ATTR)
        if isinstance(g, Guard) and g.model() is model and not g.switching:  # not a copy (an EMA)
            try:
                with g.switching_modes():
                    type(g.owner).train(g.owner, mode)
            except HapcError:  # a program of one mode: the module refuses at its next forward, while
                return model  # the model may switch (model.eval() then hapc.compile: the fix it names)
            g.modes = modes(model)
        return model


class _ModelZeroGrad:
    """``model.zero_grad`` of a model given to hapc.compile: its own, then its module's -- the module
    holds the gradients (with DDP, whose module is the model, ``model.zero_grad()`` clears them;
    here it cleared nothing, and every step then added its gradient to all the earlier ones)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, set_to_none: bool = True) -> None:
        model = self.model
        type(model).zero_grad(model, set_to_none)
        g = model.__dict__.get(_ATTR)
        if isinstance(g, Guard) and g.model() is model:  # not a copy (an EMA)
            g.owner.zero_grad(set_to_none)


class _OwnerTrain:
    """``module.train`` of a compiled module: its own switch (which may refuse), then its model's."""

    def __init__(self, owner: nn.Module):
        self.owner = weakref.ref(owner)

    def __deepcopy__(self, memo: dict[int, Any]) -> _OwnerTrain:
        """A copy of the module (an EMA, ``AveragedModel``) switches itself, not the original."""
        copied = memo.get(id(self.owner()))
        return _OwnerTrain(copied) if copied is not None else self

    def __call__(self, mode: bool = True) -> nn.Module:
        owner = self.owner()
        type(owner).train(owner, mode)
        ref = owner.__dict__.get("_hapc_original")
        model = ref() if ref is not None else None
        g = model.__dict__.get(_ATTR) if model is not None else None
        if isinstance(g, Guard) and g.owner is owner and not g.switching:
            with g.switching_modes():
                type(model).train(model, mode)
            g.modes = modes(model)
        return owner


class _Tree:
    """``_submodules(model)`` remembered on the model itself (it lives and dies with it; a copy or a
    pickle of the model starts empty), with each module's children. The walk is a function of the
    ``_modules`` dicts of the modules it reaches, so while each of them holds the same children in
    the same order it gives the same list; a module added, removed or replaced anywhere changes its
    parent's entry and the model is walked again. The root is not kept (no reference cycle)."""

    __slots__ = ("kids", "rest")

    def __init__(self) -> None:
        self.rest: list[nn.Module] = []  # the walk after the root
        self.kids: list[tuple] = []  # per module of the walk, its children as the walk saw them

    def __reduce__(self) -> tuple:
        return (_Tree, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> _Tree:
        return _Tree()

    @staticmethod
    def of(model: nn.Module) -> list[nn.Module]:
        tree = model.__dict__.get(_TREE)
        if not isinstance(tree, _Tree):
            tree = model.__dict__[_TREE] = _Tree()
        mods = [model, *tree.rest]
        if len(mods) != len(tree.kids) or any(tuple(m._modules.values()) != k for m, k in zip(mods, tree.kids)):
            mods = _submodules(model)
            tree.rest, tree.kids = mods[1:], [tuple(m._modules.values()) for m in mods]
        return mods


_TREE = "_hapc_tree"


def _sentinels(owner: nn.Module) -> list[tuple[torch.Tensor, int]]:
    """The owner's parameters with their version counters now: one grown means the owner has
    (almost surely) moved since -- :meth:`Guard.stale` decides."""
    return [(p, p._version) for p in owner.parameters()]


def _submodules(model: nn.Module) -> list[nn.Module]:
    """``list(model.modules())`` -- the same modules in the same order (pre-order, each once) -- without
    ``named_modules``' prefix strings and generator frames: the guard walks the model before every
    forward of the module, and torch's walk cost ~0.25 ms a step on a 2-layer GPT (0.5 ms on a rank
    throttled to half a core), more than the rest of the step's bookkeeping together."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return out


def modes(model: nn.Module, mods: list[nn.Module] | None = None) -> tuple[bool, ...]:
    """Every submodule's ``training`` flag, in ``named_modules`` order."""
    return tuple(m.training for m in (mods if mods is not None else _submodules(model)))


def tensor_versions(model: nn.Module, mods: list[nn.Module] | None = None) -> tuple[tuple[int, int], ...]:
    """Each parameter's and buffer's identity and version counter: changes with any in-place update
    (``load_state_dict`` copies in place) or a tensor replaced."""
    out = []
    for m in mods if mods is not None else _submodules(model):
        out += [(id(t), t._version) for t in m._parameters.values() if t is not None]
        out += [(id(t), t._version) for t in m._buffers.values() if t is not None]
    return tuple(out)


def versions(owner: nn.Module) -> tuple[int, ...]:
    """A tuple that changes whenever ``owner``'s trained state changes in place: every parameter's
    and buffer's version counter, and those of state a compiled module keeps outside them."""
    out = [t._version for t in owner.parameters()]
    out += [t._version for t in owner.buffers()]
    for m in owner.modules():
        out += [t._version for t in getattr(m, "_unused", {}).values()]
        out.append(getattr(m, "_state_epoch", 0))
    return tuple(out)


def guard(model: nn.Module, owner: nn.Module) -> None:
    """Make ``model`` raise while stale with respect to ``owner`` (the module compiled from it);
    the model's previous owner, if any, lets go of it."""
    old = model.__dict__.get(_ATTR)
    if old is not None:
        old.remove()
    model.__dict__[_ATTR] = Guard(model, owner)
    owner.__dict__["_hapc_original"] = weakref.ref(model)


def ensure_fresh(model: nn.Module) -> None:
    """Refuse to compile a model whose weights an earlier compiled module has trained past."""
    g = model.__dict__.get(_ATTR)
    if g is not None:
        g.check("hapc.compile")


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose parameters passed check_optimizer
_GUARD_OF = WeakIdKeyDictionary()  # a guarded model's parameter -> weakref to its guard
_HOOK: Any = None


def _install_optimizer_check() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(check_optimizer)


def check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before an optimizer's first step: refuse to step the parameters of a model given to
    ``hapc.compile`` that have no gradient while its module's have (the optimizer was built over
    ``model.parameters()``: it would never change anything). Once passed, never checked again."""
    if optimizer in _CHECKED:
        return
    suspect = False
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _GUARD_OF.get(p)
            g = ref() if ref is not None else None
            if g is None or p.grad is not None:
                continue
            suspect = True
            if any(q.grad is not None for q in g.owner.parameters()):
                raise HapcError(
                    "this optimizer steps the parameters of the model given to hapc.compile, which never receive "
                    "gradients: the compiled module trains its own (sharded) copies. Build the optimizer over "
                    "module.parameters() (after hapc.compile), as FSDP requires"
                )
    if not suspect:  # else: checked again at the next step, once the module has gradients
        _CHECKED.add(optimizer)


def original(owner: nn.Module) -> tuple[nn.Module, Guard]:
    """The model ``owner`` was compiled from, and its guard."""
    ref = owner.__dict__.get("_hapc_original")
    model = ref() if ref is not None else None
    g = model.__dict__.get(_ATTR) if model is not None else None
    if model is None or g is None or g.owner is not owner:
        raise HapcError(
            "this module has no model to write back into (it was not made by hapc.compile, the model was "
            "deleted, or the model was compiled again into another module); use module.state_dict() "
            "(keys as in the model) and model.load_state_dict(...) instead"
        )
    return model, g


def write_back(owner: nn.Module, full: dict[str, Any]) -> nn.Module:
    """Load the single-device state ``full`` into ``owner``'s original model; it is in sync after."""
    model, g = original(owner)
    meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    with g.writing_back():
        model.load_state_dict(full, strict=True, assign=meta)
    return model
