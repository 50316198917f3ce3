"""A pipeline stage that recomputes its activations in backward (the planner's ``recompute`` choice).

The stage's per-rank program (a ``torch.fx`` graph, :class:`~hapc.codegen.program.RankProgram`) is cut
into runs of consecutive computing nodes between its collectives; each run becomes a submodule called
through :func:`hapc.codegen.regions.checkpointed`, i.e. ``torch.utils.checkpoint(...,
use_reentrant=False)``: what it saves for backward is its inputs only (the stage's input, the
parameters it reads, the outputs of the collectives before it), and its activations are computed
again when the backward reaches them -- once per micro-batch, in that micro-batch's backward
(HARP fn. 2: the recomputation is part of the backward node). The model the planner prices
(:mod:`hapc.pipeline.dp`): backward time ``+ fwd``, memory ``mem_p + N in + mem_a``.

Exactness, as for a user's checkpoint regions (:mod:`hapc.codegen.regions`):

* **randomness**: each run is recomputed at the ``RandomStream`` step of the forward it repeats, so
  hapc's counter-based dropout draws the forward's masks;
* **no collective is recomputed**: collectives stay outside every run, so each runs once, in the
  forward, in the program's order on every rank of the stage -- the backward's collectives (gradient
  buckets, a tensor-parallel backward) are the program's own, in its order, and the recomputation
  between them is local compute. Their outputs are kept instead: the planner counts them with the
  stage's input (``keep`` in :mod:`hapc.pipeline.stagecost`), so a tensor-parallel stage recomputes
  only where that still pays.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from ..codegen.regions import checkpointed, outline

#: the key under which a stage's program nodes carry their run
RUN = "hapc_recompute"


def _collective(n: fx.Node) -> bool:
    """A collective, an async collective's start or its wait: never inside a recomputed run."""
    target = n.target if n.op == "call_function" else None
    name = getattr(target, "__name__", str(target))
    return getattr(target, "__module__", "").startswith("hapc.collectives") or name == "wait" or name.endswith("_start")


def _runs(graph: fx.Graph) -> list[list[fx.Node]]:
    """Maximal runs of consecutive computing nodes with no collective among them (parameter reads,
    ``get_attr``, do not end a run: they are moved before it)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for n in graph.nodes:
        if n.op == "get_attr":
            continue
        if n.op in ("call_function", "call_method", "call_module") and not _collective(n):
            current.append(n)
            continue
        if current:
            runs.append(current)
        current = []
    if current:
        runs.append(current)
    return runs


def recompute_program(gm: fx.GraphModule) -> int:
    """Make every run of ``gm`` between its collectives recompute in backward; returns how many
    runs were made (0: nothing computes). ``gm`` is changed in place and recompiled."""
    g = gm.graph
    rng = getattr(gm, "rng", None)
    made = 0
    for run in _runs(g):
        stream = None
        if rng is not None:
            with g.inserting_before(run[0]), warnings.catch_warnings():
                # fx asks get_attr targets to be modules or tensors; rng is neither
                warnings.simplefilter("ignore", UserWarning)
                stream = g.get_attr("rng")
        if outline(gm, run, f"recompute{made}", checkpointed, (stream,)):
            made += 1
        elif stream is not None:
            g.erase_node(stream)
    if made:
        g.lint()
        gm.recompile()
    return made


__all__ = ["recompute_program"]
