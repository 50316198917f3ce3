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

The model's gradients are never computed either, so anything that reads them would see nothing:
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` -- with DDP the gradients it clips --
would find no gradient, return a norm of 0 and clip nothing, silently. So each parameter of the
model without a gradient gets a :class:`NoGrad` at compile (and again after ``model.zero_grad()``):
a placeholder of the parameter's shape, dtype and device that holds one element (stride 0, not a
view) and raises a :class:`~hapc.errors.HapcError` naming ``module.parameters()`` at any use of
its values -- a norm, a clamp, ``.item()``, printing. What torch does to gradients on the model's
behalf stays possible: reading their shape, dtype or device, ``model.to(...)`` / ``model.double()``
(the placeholder converts to another placeholder), ``model.zero_grad()``, ``copy.deepcopy`` and
``torch.save`` (parameters copy and pickle without their gradients). The model's own forward
removes them (the model is then trained by itself, its own backward fills its gradients).
A gradient the model already holds at compile (a backward before it) is taken over by an SPMD
module (``CompiledModule.carry_gradients``) and replaced by a placeholder; a pipeline or segmented
plan refuses it unless it is all zero, and every plan refuses one held by a frozen parameter
(:func:`refuse_held_gradients`).

Its parameters' values go stale the same way, and reading them is how an EMA is usually kept:
``AveragedModel(model).update_parameters(model)``, or ``ema_p.lerp_(p, ...)`` over
``model.parameters()``, would average the weights the model was compiled with, silently. So from
the module's first forward on, each of the model's ``nn.Parameter`` objects is a
:class:`StaleParameter` (its class switched in place, as :mod:`hapc.codegen.grad_norm` does for
gradients): each use of its values asks whether the module's state has moved since the model
last received it -- an optimizer's step, a hand-written ``p.sub_(lr * p.grad)`` over the module's
parameters, running statistics -- and raises once it has, naming ``module.unwrap()`` and the
module's parameters, while describing it and writing into it (``load_state_dict``, which brings
the model back in sync) still work. ``module.unwrap()`` or a ``load_state_dict`` switches them
back to ``nn.Parameter``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import HapcError, ModelAttributeError, wrapped_model_error
from ..ops import eager_under_compile

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
        self.poisoned = False  # the model's parameters are StaleParameters (see poison)
        self.switching = False
        self.model = weakref.ref(model)
        self.model_state = tensor_versions(model)  # the model's tensors when it last matched the module
        self.modes = modes(model)  # the model's train/eval flags as the module last followed them
        self.handles = [
            # functions of the module, not methods of the guard: torch.save(model) pickles the hooks
            model.register_forward_pre_hook(_on_use),
            model.register_state_dict_pre_hook(_on_state_dict),
            model.register_load_state_dict_post_hook(_on_load),
            # eager under torch.compile (a graph break): every check runs at every call, and dynamo
            # never traces a StaleParameter's version counter (it recursed through __torch_function__)
            owner.register_forward_pre_hook(eager_under_compile(self._before_forward)),
        ]
        # instance attributes win over the class's method: model.eval() (-> self.train(False)) lands here
        model.__dict__["train"] = _ModelTrain(model)
        owner.__dict__["train"] = _OwnerTrain(owner)
        model.__dict__["zero_grad"] = _ModelZeroGrad(model)
        ref = weakref.ref(self)
        for p in model.parameters():  # no attribute on the tensor: torch.save(model) must still pickle
            _GUARD_OF[p] = ref
        for q in owner.parameters():
            _OWNER_OF[q] = ref
        plant_no_grads(model)
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

    def poison(self) -> None:
        """The module has trained past the model: its parameters' values now raise when used."""
        model = self.model()
        if model is None or self.poisoned:
            return
        for p in model.parameters():  # (a class of the user's own, or a parameter a module trains: left)
            if type(p) is nn.Parameter and p not in _OWNER_OF:
                p.__class__ = StaleParameter
        self.poisoned = True

    def cure(self) -> None:
        """The model holds the module's state again (or hapc reads it): plain parameters."""
        model = self.model()
        if model is None or not self.poisoned:
            return
        for p in model.parameters():
            if type(p) is StaleParameter:
                p.__class__ = nn.Parameter
        self.poisoned = False

    def mark_synced(self) -> None:
        self.cure()
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
        if torch.is_grad_enabled():  # the model trained by itself: its own backward fills its gradients
            clear_no_grads(module)

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
        if not self.poisoned:  # from now on the model may go stale without an optimizer (a manual step):
            self.poison()  # its parameters check the module at each use (StaleParameter)
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
    poisoned = guard is not None and guard.poisoned
    if guard is not None:
        clear_no_grads(model)  # (export's fake copy of the model reads its gradients and parameters)
        guard.cure()
    try:
        yield
    finally:
        if guard is not None:
            model.__dict__[_ATTR] = guard
            plant_no_grads(model)
            if poisoned:
                guard.poison()


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
        g = model.__dict__.get(_ATTR)
        ours = isinstance(g, Guard) and g.model() is model  # not a copy (an EMA)
        if ours:
            clear_no_grads(model)  # torch's zero_grad(set_to_none=False) would zero them in place
        type(model).zero_grad(model, set_to_none)
        if ours:
            g.owner.zero_grad(set_to_none)
            plant_no_grads(model)


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


class NoGrad(torch.Tensor):
    """The ``.grad`` of a parameter of a model given to ``hapc.compile``: that gradient is never
    computed (the compiled module trains its own copies), so any use of its values raises.

    Describing it -- shape, dtype, device, ``requires_grad`` -- answers truly, and the conversions
    torch applies to a model's gradients (``model.to(...)``, ``.double()``, ``.cpu()``,
    ``to_empty``) give another placeholder; everything else raises a HapcError naming
    ``module.parameters()``. It holds one element, seen at every index (stride 0).

    Example::

        >>> import torch, hapc
        >>> from hapc.codegen.original import NoGrad
        >>> model = torch.nn.Linear(4, 2)
        >>> module = hapc.compile(model, "local-cpu:1", (torch.randn(3, 4),))  # doctest: +SKIP
        >>> isinstance(model.weight.grad, NoGrad)  # doctest: +SKIP
        True
        >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
        Traceback (most recent call last):
        hapc.errors.HapcError: ... clip and read the module's: module.parameters() ...
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _describes(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _CONVERT and args and isinstance(args[0], NoGrad):
            shape = tuple(args[0].shape)
            with torch._C.DisableTorchFunctionSubclass():
                one = torch.zeros((), dtype=args[0].dtype, device=args[0].device)
                out = func(one, *args[1:], **kwargs)
                return no_grad_like(out, shape) if isinstance(out, torch.Tensor) else out
        name = getattr(func, "__name__", None) or repr(func)
        raise HapcError(
            f"{name} on a gradient of the model given to hapc.compile: that model's gradients are never computed "
            "-- the compiled module trains its own (possibly sharded) copies of the parameters, and a norm or a "
            "clip of these would see nothing. Clip and read the module's: module.parameters() / "
            "module.named_parameters(), e.g. torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm) (exact: "
            "the whole model's norm on every rank); build optimizers over module.parameters()"
        )


#: what a placeholder gradient answers truly: its description (what torch.compile's tracer reads of
#: every tensor the guard's hooks reach too), and the in-place updates of it that torch's
#: ``Module._apply`` makes (``p.grad.data = converted``, ``requires_grad_``)
_DESCRIBE = {
    torch.Tensor.data.__set__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.untyped_storage,
    torch.Tensor.is_contiguous,
    torch.Tensor._is_view,
    torch.Tensor.is_conj,
    torch.Tensor.is_neg,
    torch.Tensor.is_inference,
    torch.Tensor._is_zerotensor,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.element_size,
    torch.Tensor.get_device,
    torch.Tensor.requires_grad_,
    torch._has_compatible_shallow_copy_type,
}
#: properties that give the values (as another tensor): not a description (``.grad`` of the
#: placeholder is None: a description)
_VALUED = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})


def _describes(func: Any) -> bool:
    """One of :data:`_DESCRIBE`, or a property getter (``t.shape``, ``t.dtype``, ``t.is_leaf``, ...)
    other than those of :data:`_VALUED`."""
    if func in _DESCRIBE:
        return True
    return getattr(func, "__name__", None) == "__get__" and getattr(func.__self__, "__name__", None) not in _VALUED


#: conversions (``model.to(...)``, ``model.double()``, ``model.to_empty(...)``): another placeholder
_CONVERT = {
    torch.Tensor.to,
    torch.Tensor.type,
    torch.Tensor.double,
    torch.Tensor.float,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.detach,
    torch.empty_like,
}


def no_grad_like(like: torch.Tensor, shape: tuple[int, ...]) -> NoGrad:
    """A placeholder gradient of ``shape`` with ``like``'s dtype and device (one element)."""
    with torch._C.DisableTorchFunctionSubclass():
        # one element seen at every index (stride 0), allocated as such: not a view of another tensor
        t = torch.empty_strided(shape, (0,) * len(shape), dtype=like.dtype, device=like.device)
        if not t.is_meta and t.numel():
            t.as_strided((1,), (1,)).zero_()
        return t.as_subclass(NoGrad)


def plant_no_grads(model: nn.Module) -> None:
    """Give every trainable parameter of ``model`` without a gradient a :class:`NoGrad` (a parameter
    a compiled module trains excepted, should one be shared: its gradients are real)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.grad is None and p not in _OWNER_OF:
                p.grad = no_grad_like(p, tuple(p.shape))


def refuse_held_gradients(model: nn.Module, kind: str, group: Any = None) -> None:
    """Gradients ``model`` holds at compile (a backward run before it) that the ``kind`` of plan
    ("spmd", "pipeline" or "segmented") cannot take over are refused rather than left behind.

    * **A frozen parameter's** (``requires_grad=False``, frozen after a backward), on every kind:
      one device's optimizer and ``clip_grad_norm_`` go by ``.grad``, not ``requires_grad``, so
      that layer would still step once with it (AdamW would decay it even by a zero one), while the
      compiled module holds frozen parameters as constants, which no optimizer steps.
    * **Any gradient, on a pipeline or segmented plan** (an SPMD module takes them over,
      :meth:`~hapc.codegen.module.CompiledModule.carry_gradients`): its stages cannot, so the
      module's first step would lack what DDP's adds in (a loop that zeroes after its step), and
      ``clip_grad_norm_(model.parameters())`` would clip the left-behind ones, silently. Gradients
      that are all zero (``zero_grad(set_to_none=False)``) add nothing: they are cleared, and the
      model gets placeholders as with none.

    The ranks of ``group`` decide together (one all-reduce), so that a rank holding none still
    refuses with the others instead of waiting for them."""
    import torch.distributed as dist

    from .module import _default_device

    held = [(n, p) for n, p in model.named_parameters() if p.grad is not None and not isinstance(p.grad, NoGrad)]
    frozen = [n for n, p in held if not p.requires_grad]
    nonzero = [n for n, p in held if kind != "spmd" and bool(p.grad.count_nonzero())]
    count = torch.tensor([len(frozen), len(nonzero)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        count = count.to(_default_device(group))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if int(count[0]):
        raise HapcError(
            f"the model's frozen parameter(s) {_some(frozen)} hold a gradient at compile (a backward ran before "
            "requires_grad_(False)): one device's optimizer would still step them with it, but hapc's module "
            "holds frozen parameters as constants. Set their .grad to None (or call model.zero_grad()) before "
            "hapc.compile"
        )
    if int(count[1]):
        raise HapcError(
            f"the model holds gradients at compile ({_some(nonzero)}: a backward ran before hapc.compile), and a "
            f"{kind} plan's stages cannot take them over: its first step would lack them. Call model.zero_grad() "
            "before hapc.compile if they are not meant for the first step, or compile an SPMD plan "
            "(pipeline=False, segmented=False), which adds them into the module's first step as DDP does"
        )
    if kind != "spmd":
        for _, p in held:
            p.grad = None


def _some(names: list[str]) -> str:
    """Up to three quoted names, then how many more ("on another rank" for none: a rank that holds
    none refuses with the ranks that do)."""
    if not names:
        return "on another rank"
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def clear_no_grads(model: nn.Module) -> None:
    """Remove the placeholders :func:`plant_no_grads` gave (real gradients stay)."""
    for p in model.parameters():
        if isinstance(p.grad, NoGrad):
            p.grad = None


class StaleParameter(nn.Parameter):
    """A parameter of a model given to ``hapc.compile``, from its module's first forward on: once
    the module has trained past it (an optimizer's step or a manual one) it still holds the weights
    the model was compiled with, so any use of its values raises; until then each use asks the
    model's guard and runs (:func:`_in_sync`).

    Describing it (shape, dtype, device, ``requires_grad``, ``.grad``) answers truly, and writing
    into it (``copy_``: ``model.load_state_dict``, which brings the model back in sync) works.
    ``module.unwrap()`` switches it back to ``nn.Parameter``.

    Example::

        >>> ema = torch.optim.swa_utils.AveragedModel(model)  # doctest: +SKIP
        >>> module = hapc.compile(model, cluster, inputs)  # doctest: +SKIP
        >>> optimizer.step()  # over module.parameters()  # doctest: +SKIP
        >>> ema.update_parameters(model)  # doctest: +SKIP
        Traceback (most recent call last):
        hapc.errors.HapcError: ... has trained past ... module.unwrap() ...
    """

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        """A copy of a stale model is just as stale (its guard is the model's: :meth:`Guard.__deepcopy__`);
        one taken while the module has not moved yet is a plain parameter of those (current) weights."""
        with torch._C.DisableTorchFunctionSubclass():
            out = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        if not _in_sync(self):
            out.__class__ = StaleParameter
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``torch.save(model)``: refused by the model's guard, which says why and what to do (a
        parameter of a model still in sync pickles as a plain one)."""
        ref = _GUARD_OF.get(self)
        g = ref() if ref is not None else None
        if g is not None:
            g.check("torch.save(model)")
            return nn.Parameter.__reduce_ex__(self, protocol)
        raise _stale_use("pickling")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _WRITES or _describes(func) or _all_in_sync(args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise _stale_use(getattr(func, "__name__", None) or repr(func))


def _all_in_sync(args: tuple, kwargs: dict) -> bool:
    """Whether every :class:`StaleParameter` operand of a call (in lists too: ``torch._foreach_lerp_``)
    is :func:`_in_sync`; False where none is found (one in a container the walk does not open)."""
    from torch.utils._pytree import tree_leaves

    found = [x for x in tree_leaves((args, kwargs)) if isinstance(x, StaleParameter)]
    return bool(found) and all(map(_in_sync, found))


def _in_sync(p: StaleParameter) -> bool:
    """Whether ``p``'s model still holds its module's state: a model's parameters become
    :class:`StaleParameter` at the module's first forward (:meth:`Guard.poison`), and their values
    may be used until the module's state moves -- an optimizer step, a manual one (``p.sub_(lr *
    p.grad)`` over ``module.parameters()``), running statistics -- each use asking the guard
    (:meth:`Guard.stale`: the owner's version counters, walked until it has moved, then
    remembered). A copy of a stale parameter has no guard: never in sync."""
    ref = _GUARD_OF.get(p)
    g = ref() if ref is not None else None
    return g is not None and not g.stale()


def _stale_use(name: str) -> HapcError:
    return HapcError(
        f"{name} on a parameter of the model given to hapc.compile, which the compiled module has trained past: "
        "it holds the weights the model was compiled with. Read the module's instead -- an EMA over "
        "module.parameters() or copy.deepcopy(module), module.state_dict() (keys as in the model) -- or call "
        "module.unwrap() on every rank first: it writes the trained weights back into the model"
    )


#: writes into a stale parameter: ``load_state_dict`` copies into it (and brings the model back in sync)
_WRITES = {torch.Tensor.copy_, torch.Tensor.grad.__set__}
_OWNER_OF = WeakIdKeyDictionary()  # a compiled module's parameter -> weakref to its model's guard
_STEPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the guards its params reach


def mark_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After an optimizer step: the models whose modules it stepped are stale (see :class:`StaleParameter`).
    The guards an optimizer reaches are found at its first step; later steps cost one loop over them."""
    guards = _STEPPED.get(optimizer)
    if guards is None:
        found = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = _OWNER_OF.get(p)
                if ref is not None:
                    found[id(ref)] = ref
        guards = _STEPPED[optimizer] = list(found.values())
    for ref in guards:
        g = ref()
        if g is not None and not g.poisoned and g.model() is not None and g.stale():
            g.poison()


_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose parameters passed check_optimizer
_GUARD_OF = WeakIdKeyDictionary()  # a guarded model's parameter -> weakref to its guard
_HOOK: Any = None


def _install_optimizer_check() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOK = register_optimizer_step_pre_hook(check_optimizer), register_optimizer_step_post_hook(mark_stale)


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
            if g is None or (p.grad is not None and not isinstance(p.grad, NoGrad)):
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


def refuse_attribute(owner: nn.Module, name: str, error: AttributeError) -> None:
    """Raise for ``owner.<name>``, an attribute no ``nn.Module`` lookup found on a hapc module: for
    ``module`` (DDP's wrapped model) and for a method or attribute of the model ``owner`` was compiled
    from (``generate``, ``config``...) a :class:`~hapc.errors.ModelAttributeError` naming
    ``unwrap()`` (the module runs its traced forward only), else ``error`` itself."""
    if name == "module":
        raise wrapped_model_error() from None
    ref = owner.__dict__.get("_hapc_original")
    model = ref() if ref is not None else None
    if model is None or name.startswith("__") or not (hasattr(type(model), name) or name in model.__dict__):
        raise error
    raise ModelAttributeError(
        f"{name!r} belongs to the model given to hapc.compile ({type(model).__name__}); the compiled module "
        f"runs its traced forward only. Call module.unwrap().{name} (every rank: it gathers the trained "
        "weights into the model), or keep the value from before compiling"
    ) from None


class HapcModule(nn.Module):
    """The base of hapc's module kinds (:class:`~hapc.codegen.module.CompiledModule`, the pipeline's
    and the per-segment ratios' modules): an ``nn.Module`` whose attribute lookup refuses by name
    what belongs to the model it was compiled from, or to DDP's wrapper (:func:`refuse_attribute`)."""

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as any ``nn.Module``; DDP's ``module`` and the compiled
        model's own methods and attributes (``generate``, ``config``...) are refused by name, naming
        ``unwrap()``: this module runs the traced forward only."""
        try:
            return super().__getattr__(name)
        except AttributeError as e:
            refuse_attribute(self, name, e)
            raise
