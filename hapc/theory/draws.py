"""Random draws met while capturing a model: never frozen into the program.

fx runs a forward's Python, so ``torch.rand(n, d)`` called with plain-int sizes ran eagerly and its
values became a constant of the graph: the same "noise" at every step, silently unlike the model
(MAE's random masking, noise injection). While hapc's fx capture runs, every random factory called
without a traced operand becomes a graph node instead (an in-place draw into a plain tensor,
``torch.empty(n).uniform_()``, is a capture error, and ``capture="auto"`` retries with
torch.export, which records it). On several ranks :func:`hapc.compile` then refuses those nodes:
each rank would draw its own values (:data:`RANDOM_OPS`, :func:`refuse_random_ops`; a pipeline's
micro-batches too); dropout and stochastic depth
(torchvision's ``stochastic_depth``, timm's ``drop_path``) are the random ops hapc draws
rank-consistently (:mod:`hapc.theory.rules.random`).

**LayerDrop** (BART, OPT, Whisper, mBART, Marian, ... in training mode)::

    dropout_probability = torch.rand([])
    if dropout_probability < self.layerdrop:  # skip the layer
        continue

A 0-dim draw compared with a number decides a branch, which no static graph can hold. But for
``u`` uniform on ``[0, 1)``, ``u < p`` is False for every draw when ``p <= 0`` and True for every
draw when ``p >= 1``: then the branch is the same at every step, and the capture takes it (LayerDrop
at its default 0 keeps every layer, exactly as the model computes). For ``0 < p < 1`` the layers run
change from step to step: refused, naming the fix. A 0-dim draw used any other way is refused too.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import HapcError, TraceError

#: functions drawing random values (factories and ``*_like``): a node of the graph, never a constant
FACTORIES = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.normal, torch.bernoulli, torch.multinomial, torch.poisson,
})  # fmt: skip

#: in-place draws into a tensor: on a traced tensor fx records them; on a plain one, a capture error
IN_PLACE = frozenset({
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
})  # fmt: skip

# u uniform on [0, 1): (the answer for every draw when p is at most lo, when p is at least hi)
_ALWAYS = {
    "<": lambda p: False if p <= 0 else True if p >= 1 else None,
    "<=": lambda p: False if p < 0 else True if p >= 1 else None,
    ">": lambda p: True if p < 0 else False if p >= 1 else None,
    ">=": lambda p: True if p <= 0 else False if p >= 1 else None,
}


class ScalarDraw:
    """``torch.rand([])`` during a capture: it answers comparisons with a number whose result is the
    same for every draw, and refuses anything else (see the module docstring)."""

    def __init__(self, where: Any):
        self.where = where  # the model's line running now (a callable)
        self.drawn = where()

    def _compare(self, p: Any, op: str) -> bool:
        if isinstance(p, bool) or not isinstance(p, numbers.Real):
            raise self._used(f"compared ({op}) with {type(p).__name__}")
        answer = _ALWAYS[op](float(p))
        if answer is None:
            raise TraceError(
                f"random control flow at {self.where()}: a draw torch.rand([]) (from {self.drawn}) {op} {p} "
                "decides a branch differently from step to step (LayerDrop with probability between 0 and 1 "
                "skips random layers), which no static program can hold: set the probability to 0 for training "
                "under hapc (Hugging Face: config.layerdrop = 0, its default), or compile the model in eval mode"
            )
        return answer

    def __lt__(self, p: Any) -> bool:
        return self._compare(p, "<")

    def __le__(self, p: Any) -> bool:
        return self._compare(p, "<=")

    def __gt__(self, p: Any) -> bool:
        return self._compare(p, ">")

    def __ge__(self, p: Any) -> bool:
        return self._compare(p, ">=")

    def _used(self, how: str) -> TraceError:
        return TraceError(
            f"a random scalar torch.rand([]) drawn in forward at {self.drawn} is {how} at {self.where()}: "
            "hapc captures a 0-dim draw only as a branch condition that holds for every draw (LayerDrop at "
            "probability 0). Draw a tensor instead (torch.rand(n)), or pass the value in as an input"
        )

    def __getattr__(self, name: str) -> Any:
        raise self._used(f"used as a value (.{name})")

    def __bool__(self) -> bool:
        raise self._used("used as a truth value")

    def __float__(self) -> float:
        raise self._used("converted to a number")

    def _arith(self, *_: Any) -> Any:
        raise self._used("used in arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arith
    __eq__ = __ne__ = _arith  # type: ignore[assignment]
    __hash__ = object.__hash__


def _zero_dim(args: tuple, kwargs: dict) -> bool:
    size = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args)
    return isinstance(size, (list, tuple)) and len(size) == 0


def _traced(tree: Any) -> bool:
    return any(isinstance(x, fx.Proxy) for x in pytree.tree_leaves(tree))


#: how many leaf evaluations are running (:func:`leaf_evaluation`): their draws are recorded nowhere
_IN_LEAF = [0]


@contextlib.contextmanager
def leaf_evaluation() -> Iterator[None]:
    """While the fx capture computes a leaf module's meta value by running the module itself (its
    forward's ops are not nodes of the graph): a draw there runs as written, on meta tensors, and
    is not recorded as a node (Hugging Face's ``*DropPath`` modules draw with ``torch.rand``)."""
    _IN_LEAF[0] += 1
    try:
        yield
    finally:
        _IN_LEAF[0] -= 1


class CaptureDraws(TorchFunctionMode):
    """Active while a capture runs the model's forward. ``tracer``: the fx tracer (it records a
    random factory with plain arguments as a node); None under torch.export, which records them
    itself."""

    def __init__(self, tracer: fx.Tracer | None = None, where: Any = None):
        super().__init__()
        self.tracer = tracer
        self.where = where or (lambda: "forward")

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _IN_LEAF[0]:
            return func(*args, **kwargs)
        if func is torch.rand and _zero_dim(args, kwargs):
            return ScalarDraw(self.where)
        if self.tracer is not None and not _traced((args, kwargs)):
            if func in FACTORIES:
                return self.tracer.create_proxy("call_function", func, args, kwargs)
            if func in IN_PLACE:
                raise TraceError(
                    f"{func.__name__} draws random values into a plain tensor at {self.where()}: fx would freeze "
                    "them into the program (torch.export records the draw)"
                )
        return func(*args, **kwargs)


#: random ops without a rank-consistent draw (dropout, SDPA's dropout_p and stochastic depth have one:
#: hapc.theory.rules.random), with the position and default of their ``training`` flag where they
#: have one (None: random always)
RANDOM_OPS: dict[str, tuple[int, bool] | None] = {
    "alpha_dropout": (2, False),
    "feature_alpha_dropout": (2, False),
    "dropout1d": (2, True),
    "dropout2d": (2, True),
    "dropout3d": (2, True),
    "rrelu": (3, False),
    "rand": None,
    "randn": None,
    "randint": None,
    "poisson": None,
    "rand_like": None,
    "randn_like": None,
    "randint_like": None,
    "bernoulli": None,
    "multinomial": None,
    "normal": None,
    "uniform": None,
    "exponential": None,
    "randperm": None,
}


def refuse_random_ops(graph: Any, world: int) -> None:
    """Random ops other than dropout and stochastic depth would draw different values on different
    ranks, so a replicated tensor would stop being replicated: refuse rather than train a silently
    different model. (Dropout, SDPA's ``dropout_p``, torchvision's ``stochastic_depth`` and timm's
    ``drop_path`` draw from (seed, step, op, global index) on every rank:
    :mod:`hapc.theory.rules.random`.)"""
    if world == 1:
        return
    for n in graph:
        if n.op not in RANDOM_OPS:
            continue
        flag = RANDOM_OPS[n.op]
        if flag is not None:
            pos, default = flag
            training = n.kwargs.get("training", n.args[pos] if len(n.args) > pos else default)
            p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5) if "dropout" in n.op else 1
            if not training or p == 0:
                continue  # the identity (rrelu: a fixed slope)
        mode = " in training mode" if flag is not None else ""
        raise HapcError(
            f"{n.op}{mode} at {n.name} ({n.source or 'model'}): hapc draws rank-consistent "
            "random values only for dropout (F.dropout, nn.Dropout, scaled_dot_product_attention's dropout_p) "
            "and stochastic depth (torchvision.ops.StochasticDepth, timm's DropPath, Hugging Face's *DropPath "
            "modules), so replicas would diverge; "
            "use nn.Dropout / F.dropout (or a StochasticDepth module for a per-sample drop) instead, draw the "
            "values outside the model "
            "and pass them in as an input, or compile the model in eval mode"
        )
