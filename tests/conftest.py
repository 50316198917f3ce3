"""Test-process set-up: the test helpers importable, one torch thread, and the modules every forked
rank needs imported once, here, instead of in each rank of each test.

``hapc.testing.run_distributed`` forks its ranks from this process, so they inherit what it has
imported. ``hapc.compile`` in a rank imports the runtime (``hapc.codegen``, ``hapc.collectives``,
``hapc.checkpoint``...) and checks the user-registered rules with ``torch.autograd.grad(...,
grad_outputs)``, whose first call imports ``torch.fx.experimental.symbolic_shapes`` and with it
sympy: 1-3 s of imports per rank, in every multi-process test (about 40% of a small equivalence
case). Imported here, each worker pays them once.

Tracing in this process then meets the real ``symbolic_shapes`` rather than hapc's stand-ins for it
(``hapc.theory.plain_meta``, used only where sympy is not imported yet), as it already did in any
worker after its first test that took such a gradient. The stand-ins and the no-sympy cold start are
checked in fresh interpreters by ``tests/test_cold_start.py`` (their answers against torch's own,
and the zoo's graphs with and without them).
"""

import importlib
import os
import sys

import torch

PRELOADED = (
    "torch.fx.experimental.symbolic_shapes",  # and sympy: see above
    "hapc.api",
    "hapc.checkpoint",
    "hapc.codegen.module",
    "hapc.materialize",
    "hapc.theory.verify",
)
for _name in PRELOADED:
    importlib.import_module(_name)

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)
