"""Reference models for tests, examples and benchmarks: plain PyTorch, no hapc internals.

Each factory returns ``(model, example_inputs)`` and accepts ``device="meta"`` to build a paper-size
model without allocating it. ``load("gpt-1.3b")`` resolves a zoo alias; ``load("pkg.mod:fn")`` any
factory importable by path.

The papers' models: HAP's VGG19 (``vgg19``, 133 * 2**20 parameters as in HAP Table 1), ViT
(``vit-hap``, 8 layers = 54 * 2**20), BERT-Base (``bert-base``) and BERT-MoE (``bert-moe-base``; any
``experts``); GPT-1.3B ... 39B (Metis, HARP); Wide-ResNet 1B ... 6.8B (Metis Table 2). Each module's
docstring says how its size compares with the paper's.

Batches: HAP's weak scaling for its models (64 samples per GPU, BERT-MoE 32; ``vgg19``,
``vit-hap`` at one GPU's share). ``gpt-1.3b`` is a training step of 16 sequences of 2048 tokens
(32K tokens): one sequence per GPU of ``hap-testbed:16`` (issue 14's cell), and the global batch
of Metis's GPT-3 microbenchmark and of HetAuto's resharding study (both 16). A batch of one is
not a training workload: its pipeline has a single micro-batch (14.8 % predicted efficiency on
hap-testbed:16 at best; 2.9 % when it was SPMD across the 10 Gbps link). Much more does not fit
SPMD in fp32 without recomputation (16 sequences on 8 V100s need 40.6 GiB each) -- HARP's 1024
sequences are ``--arg batch=1024``, for pipelines. The larger GPTs keep a batch of one.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from .bert import bert, moe_block
from .gpt import gpt
from .mlp import mlp
from .vgg import vgg
from .vit import vit
from .wide_resnet import wide_resnet

#: alias -> factory (keyword arguments bound). Paper sizes build on the meta device.
ZOO: dict[str, Callable[..., Any]] = {
    "mlp": mlp,
    "transformer": functools.partial(bert, "block"),
    "bert": functools.partial(bert, "tiny"),
    "bert-base": functools.partial(bert, "base", batch=8, device="meta"),
    "bert-moe": functools.partial(bert, "tiny", experts=3),
    "moe": moe_block,
    "gpt": functools.partial(gpt, "tiny"),
    "gpt-small": functools.partial(gpt, "small"),
    "gpt-1.3b": functools.partial(gpt, "1.3b", batch=16, device="meta"),
    "gpt-2.7b": functools.partial(gpt, "2.7b", batch=1, device="meta"),
    "gpt-6.7b": functools.partial(gpt, "6.7b", batch=1, device="meta"),
    "gpt-13b": functools.partial(gpt, "13b", batch=1, device="meta"),
    "gpt-39b": functools.partial(gpt, "39b", batch=1, device="meta"),
    "cnn": vgg,
    "vit": vit,
    "vit-24": functools.partial(vit, "base", layers=24, batch=64, device="meta"),
    "vgg19": functools.partial(vgg, "vgg19", batch=64, device="meta"),
    # the papers' models (HAP Table 1, Metis Table 2); tiny configs first, paper sizes on meta
    "cnn-pool": functools.partial(vgg, "tiny", image=8, pool=3),
    "bert-moe5": functools.partial(bert, "tiny", experts=5),
    "vit-hap": functools.partial(vit, "base", layers=8, batch=64, device="meta"),
    "bert-moe-base": functools.partial(bert, "base", experts=8, batch=32, device="meta"),
    "wide-resnet": wide_resnet,
    **{
        f"wide-resnet-{s}": functools.partial(wide_resnet, s, batch=32, device="meta")
        for s in ("1b", "2b", "4b", "6.8b")
    },
}


def factory(spec: str) -> Callable[..., Any]:
    """The factory behind a zoo alias or a ``package.module:function`` path (not called)."""
    if spec in ZOO:
        return ZOO[spec]
    if ":" not in spec:
        raise KeyError(
            f"unknown model {spec!r}: use a zoo alias ({', '.join(sorted(ZOO))}) or 'package.module:function'"
        )
    mod, _, fn = spec.partition(":")
    module = importlib.import_module(mod)
    if not hasattr(module, fn):
        raise AttributeError(f"model {spec!r}: module {mod!r} ({module.__file__}) has no {fn!r}")
    return getattr(module, fn)


def load(spec: str, **kwargs: Any) -> tuple[Any, Any]:
    """``(model, example_inputs)`` for a zoo alias or a ``package.module:function`` path."""
    if spec in ZOO:
        return ZOO[spec](**kwargs)
    out = factory(spec)(**kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{spec} must return (model, example_inputs), got {type(out).__name__}")
    return out


__all__ = ["ZOO", "bert", "factory", "gpt", "load", "mlp", "moe_block", "vgg", "vit", "wide_resnet"]
