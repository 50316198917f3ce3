"""Plan -> per-rank PyTorch (DESIGN §5): :class:`RankProgram` emits one rank's ``torch.fx`` graph,
:class:`CompiledModule` holds it with the rank's parameter shards and synchronises gradients."""

from . import optimizers
from .module import CompiledModule
from .program import RankProgram

optimizers.install()  # refuse optimizers that would update sharded slices differently (see optimizers.py)

__all__ = ["CompiledModule", "RankProgram"]
