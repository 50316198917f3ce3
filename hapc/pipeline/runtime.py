"""Running a pipeline: stages on process sub-groups, micro-batches by a schedule (HARP §4, HetAuto §5.2).

Every rank belongs to one stage. A stage is an SPMD program over its own process group, built
exactly like :func:`hapc.compile` builds one for a whole model (theory, A*, LP, generated code),
from the stage's reference graph (:mod:`hapc.pipeline.stages`); its output is packed as
``[rows, features]`` (the batch is the rows), batch-sharded or replicated as its plan chose.
Ranks execute their stage's action list (:mod:`hapc.pipeline.schedule`) in order, each action
one method of :class:`_Step`:

=============  =================================================================================
``SEND_ACT``   each rank holding a slice of the output rows sends it across the link, once, to
               that slice's *relay* in the next stage (:mod:`hapc.pipeline.reshard`)
``RECV_ACT``   a relay receives its slice and forwards the overlaps other ranks of its stage need
               over the fast links; every rank assembles the rows its program takes (its own rows
               when it takes the activations batch-sharded, all rows otherwise)
``F``          the stage's program on micro-batch ``m``
``B``          backward of micro-batch ``m`` (replicated weights accumulate under ``no_sync``
               and are summed once, at the step's last backward)
``SEND_GRAD``  each rank sends its rows' input gradient to the slices' relays, which sum them (a
               row several ranks used has a Partial gradient, DESIGN §3) and send each slice's
               gradient back across the link, once
``RECV_GRAD``  each sending rank receives its rows' gradient (a replicated output: the first
               rank receives it and broadcasts it in its group)
=============  =================================================================================

Sends never block and receives do, which the schedules are proven deadlock-free under; inside an
action every rank issues its sends before it waits. A sent tensor is held only until a later
message proves it received (:class:`_Step`), not to the step's end, so a stage's memory during a
step is bounded by its in-flight micro-batches, not by their number. Messages go to the process
group as they are (no copy, no header) unless links are emulated; activations land in buffers
reused across micro-batches and steps, output gradients in a new one each (autograd may keep a
received gradient as a parameter's ``.grad``: :meth:`_Step.RECV_GRAD`). Receiving the
next message ahead, into its own buffer, was measured slower on gloo (4-13 % at 32 micro-batches of
the benchmark ``pipeline_peer``) and again not faster on 2026-11-26 (A/B in the same processes,
load 6-10: 1.044 against 0.989 of torch's step at 32 micro-batches; within the noise at 8), so
receives are posted when the schedule reaches them, as ``Schedule1F1B`` posts its own.

The loss of micro-batch ``m`` is seeded with its weight in the batch loss
(:func:`~hapc.pipeline.stages.loss_weighting`): ``1/M`` for a mean over equal micro-batches,
``count_m / sum(count)`` for a mean over a data-dependent count (cross-entropy with ignored
targets, computed from the inputs), ``1`` for a sum.

**Tied weights** (a parameter several stages use: GPT-2's token embedding, read again by its
output layer): each of those stages holds a copy, and its backward gives the gradient of its own
uses. After a step's last backward the copies' gradients are summed over the sharing stages' ranks
(:meth:`PipelineModule._sum_tied`; the stage's whole gradient gathered from its shards, added by
its first rank), so each copy holds the single-device gradient and an elementwise optimizer step
keeps the copies equal; gradient norms count the weight in its first stage only.

Calls bind as the model's ``forward`` binds them, positionally or by keyword (a Hugging Face
model's ``module(**batch)``), and the forward returns the model's structure (a ``ModelOutput``)
with the batch loss in its place. **The model's other returned tensors** (logits;
``outputs="whole"``, the default) come back whole, on every rank, equal to one device's for the
batch: the stage computing each (:func:`~hapc.codegen.calls.route_outputs`; the last one for
logits) returns it from its program made whole over its ranks, one micro-batch at a time; after
the forwards, each replica's relay of that stage concatenates its micro-batches' values along the
batch dimension (dim 0) in micro-batch order and broadcasts them over the job, and every rank
concatenates the replicas' in replica order (replica ``r`` holds micro-batches ``r M/R ..``): the
global batch's order. That is exact only for a tensor whose dim 0 is the batch's rows (or a
multiple: ``[batch * seq, vocab]``): a returned tensor whose dim 0 does not scale with the batch
(a scalar metric, a transposed tensor) is refused (:func:`check_batch_major`) where the batch is
split (more than one micro-batch). They are for metrics: detached from the step, a backward through
them raises (as the SPMD module's). ``outputs="loss"``: ``None``, at no cost. ``train_step`` returns
the loss alone and moves none of them (the stage's program still makes its own whole).

**Data-parallel replicas** (:mod:`hapc.pipeline.replicas`, ``PipelineSpec.replicas``): ``R``
copies of the pipeline on disjoint ranks; replica ``r`` runs micro-batches ``r M/R .. (r+1) M/R - 1``
of the global batch's ``M``, each seeded with its weight in the *global* batch loss, so after the
schedule every stage sums its gradients across its ``R`` replicas (one flat all-reduce per rank over
the group of the ranks holding the same device position of the same stage in every replica) and
holds the single-device gradient; the batch loss is the sum of the replicas' weighted parts (the
loss all-reduce over the job adds them). Dropout draws continue the micro-batch count across
replicas (replica ``r`` starts at step ``r M/R``), as one pipeline of ``M`` micro-batches draws them.

A slow link can be *emulated* (``emulate={"bandwidth": bytes_per_s, "latency": s, "between": [(0, 1)]}``,
by default every link between neighbouring stages): each message across it carries the time it may
be consumed, ``max(sent, link free) + latency + bytes / bandwidth`` on a clock all local processes
share, and the receiver waits until then. This is emulation, for benchmarks on one machine; it
does not slow the sender's compute.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._util import broadcast_json
from ..cluster import Cluster
from ..codegen.calls import ModelCall, route_outputs
from ..codegen.grad_norm import install_pipeline as install_pipeline_norms
from ..codegen.grad_norm import mark_stage as mark_stage_grads
from ..codegen.original import HapcModule
from ..errors import HapcError
from ..plan import Plan
from ..theory.draws import refuse_random_ops
from ..theory.graph import BUFFER, PARAM
from . import reshard
from .rows import rows_coupled
from .schedule import Action, schedule
from .stages import ACT_PREFIX, StageGraph, loss_weighting, split_graph


@dataclass
class PipelineSpec:
    """Where the cuts are and who runs each stage (what the planner decides).

    ``cuts``: reference-graph node indices where stages begin (``S - 1`` of them); ``ranks[k]``:
    the global ranks of stage ``k`` (its first is the relay); ``clusters[k]``: those devices as a
    cluster, for the stage's SPMD synthesis; ``warmups[k]``: forwards stage ``k`` launches before
    its first backward; ``num_micro``: micro-batches per step of the global batch. ``replicas``:
    data-parallel replicas of the pipeline, ``replicas[r][k]`` the global ranks of stage ``k`` in
    replica ``r`` (empty: one replica, ``ranks``; else ``ranks`` is ``replicas[0]``); each replica
    runs ``num_micro / R`` micro-batches and the warm-up counts are per replica. ``recompute[k]``:
    stage ``k`` recomputes its activations in backward (:mod:`hapc.pipeline.recompute`; empty:
    none does)."""

    cuts: list[int]
    ranks: list[list[int]]
    clusters: list[Cluster]
    warmups: list[int]
    num_micro: int
    plans: list[Plan] = field(default_factory=list)
    replicas: list[list[list[int]]] = field(default_factory=list)
    recompute: list[bool] = field(default_factory=list)

    @property
    def all_replicas(self) -> list[list[list[int]]]:
        return self.replicas or [self.ranks]

    def check(self, world: int) -> None:
        S = len(self.ranks)
        if not (len(self.cuts) == S - 1 == len(self.clusters) - 1 == len(self.warmups) - 1):
            raise HapcError(
                f"pipeline spec: {len(self.cuts)} cuts, {S} rank lists, {len(self.clusters)} clusters and "
                f"{len(self.warmups)} warm-up counts; a pipeline of S stages needs S - 1 cuts and S of the others"
            )
        if self.recompute and len(self.recompute) != S:
            raise HapcError(
                f"pipeline spec: {len(self.recompute)} recompute flags for {S} stages; give one per stage or none"
            )
        reps = self.all_replicas
        if reps[0] != self.ranks:
            raise HapcError("pipeline spec: ranks must be the first replica's stage ranks (replicas[0])")
        if self.num_micro % len(reps):
            raise HapcError(
                f"pipeline spec: {len(reps)} replicas cannot share {self.num_micro} micro-batches equally; "
                "choose a micro-batch count the replica count divides"
            )
        flat = sorted(r for rep in reps for rs in rep for r in rs)
        if flat != list(range(world)):
            where = self.ranks if len(reps) == 1 else reps
            raise HapcError(
                f"pipeline stages use ranks {where}: every rank 0..{world - 1} of the job must be in exactly one stage"
            )
        for q, rep in enumerate(reps):
            if len(rep) != S:
                raise HapcError(f"replica {q} has {len(rep)} stages, replica 0 has {S}: replicas must be identical")
            for k, (rs, c) in enumerate(zip(rep, self.clusters)):
                if len(rs) != c.num_devices:
                    raise HapcError(f"stage {k} runs on {len(rs)} ranks but its cluster has {c.num_devices} devices")


def check_batch_major(whole: Any, micro: Any, parts: int) -> None:
    """Refuse a model output that cannot be rebuilt by concatenating its ``parts`` micro-batches'
    values along dim 0. ``whole`` / ``micro``: the model traced at the batch and at one micro-batch
    (:class:`~hapc.theory.graph.RefGraph`). Each returned tensor but the loss must have a dim 0 that
    scales with the batch (``whole`` dim 0 ``= parts x`` the micro-batch's, the other dims equal):
    a per-micro-batch scalar (a mean) or a tensor whose rows are not the batch's would concatenate
    into a wrong value silently. ``parts`` 1: nothing is split, any output is exact."""
    if parts <= 1:
        return
    for leaf, (a, b) in enumerate(zip(whole.outputs, micro.outputs)):
        if leaf == whole.loss_leaf or a is None or b is None:
            continue
        big, small = tuple(whole[a].meta.shape), tuple(micro[b].meta.shape)
        if big and small and big[0] == parts * small[0] and big[1:] == small[1:]:
            continue
        from ..theory.capture import leaf_paths

        where = leaf_paths(whole.output_spec).get(leaf, f"[{leaf}]") if whole.output_spec is not None else f"[{leaf}]"
        raise HapcError(
            f"the model returns {where} ({whole[a].name}, shape {list(big)} for the batch, {list(small)} for one of "
            f"{parts} micro-batches) besides its loss: a pipeline computes it one micro-batch at a time and hands it "
            "back concatenated along dim 0, which is exact only for a tensor whose dim 0 is the batch's rows. Compile "
            "with outputs='loss' (it comes back None; compute the metric from batch-major outputs such as logits), "
            "return it with the batch first, or compile without a pipeline (pipeline=False)"
        )


def batch_rows(inputs: Any) -> int | None:
    """The batch size of example inputs (a tensor, a sequence of positional inputs or a dict of
    keyword inputs): the first dim of the first input that has one (None: no input has)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return next((x.shape[0] for x in values if isinstance(x, torch.Tensor) and x.dim()), None)


def micro_batches(inputs: Any, num_micro: int, batch: int) -> list[Any]:
    """Split every input whose first dim is the batch into ``num_micro`` equal parts. ``inputs``:
    positional inputs (a sequence; each part a tuple) or keyword inputs (a dict; each part a dict
    with the same keys); other values (flags, ``None``) are in every part as they are."""
    if isinstance(inputs, dict):
        return [dict(zip(inputs, part)) for part in micro_batches(tuple(inputs.values()), num_micro, batch)]
    if batch % num_micro:
        raise HapcError(
            f"the batch of {batch} does not split into {num_micro} equal micro-batches; choose a "
            "micro-batch count that divides it"
        )
    out = []
    for m in range(num_micro):
        step = batch // num_micro
        out.append(
            tuple(
                x.narrow(0, m * step, step) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x
                for x in inputs
            )
        )
    return out


def micro_batch_dims(model: nn.Module, batch: Any, graph: Any, num_micro: int, whole: Any = None) -> dict[str, int]:
    """Random op (dropout, SDPA's attention dropout, stochastic depth) -> the dim along which its
    tensor in the micro-batch graph ``graph`` splits the batch's: the one dim whose extent is
    ``num_micro`` times larger when ``model`` is traced on the whole ``batch``. With it a stage
    draws, for micro-batch ``m``, exactly its rows of the one-rank run's masks
    (:meth:`hapc.ops.RandomStream.locate`): the draws do not depend on the plan, as for every other
    plan kind. An op whose tensor is the same at both sizes (no batch dim) is left out: it draws once
    per batch on one rank, so every micro-batch draws those same masks.

    The shapes decide, so a tensor whose batch rows are interleaved with another dim before the
    draw (``[t, b, d]`` flattened to ``[t * b, d]``) is taken as split along its dim 0: its
    micro-batches draw valid, independent masks, but not the one-rank run's rows (a layout no
    model in this repository's tests has).

    Raises HapcError for a random op whose tensor changes in another way (several dims, another
    factor, a node the whole batch's trace lacks): its masks could not be the batch's. ``whole``:
    ``model`` traced at ``batch`` already (else traced here)."""
    from ..theory.graph import OP
    from ..theory.program_key import follows_mode
    from ..theory.rules.random import SAMPLE_DROPS

    draws = [n for n in graph if n.kind == OP and (follows_mode(n) or n.op == "scaled_dot_product_attention")]
    if not draws or num_micro == 1:
        return {}
    from ..theory import trace

    whole = {n.name: n for n in (whole if whole is not None else trace(model, batch))}
    dims: dict[str, int] = {}
    for n in draws:
        w = whole.get(n.name)
        a, b = tuple(n.meta.shape), tuple(w.meta.shape) if w is not None else None
        moved = [d for d in range(len(a)) if b is not None and len(b) == len(a) and a[d] != b[d]]
        if b is not None and len(b) == len(a) and not moved:
            continue  # no batch dim: one draw per batch, the same for every micro-batch
        if len(moved) != 1 or b[moved[0]] != num_micro * a[moved[0]] or (n.op in SAMPLE_DROPS and moved[0] != 0):
            raise HapcError(
                f"random op {n.name} ({n.source}) draws on a tensor of shape {list(a)} per micro-batch, "
                f"{list(b) if b is not None else 'absent'} for the whole batch: it does not split into the "
                f"{num_micro} micro-batches along one dim, so a pipeline could not draw the batch's masks. "
                "Compile it without a pipeline (pipeline=False), or set that drop probability to 0"
            )
        dims[n.name] = moved[0]
    return dims


#: ops whose backward couples a batch's rows: op -> (position, keyword) of the flag that does it,
#: and what the op then does per micro-batch (forward couplings: hapc.pipeline.rows)
_BATCH_COUPLED = {
    "embedding": (5, "scale_grad_by_freq", "scales each row's gradient by its token's count in each micro-batch"),
    "embedding_bag": (5, "scale_grad_by_freq", "scales each row's gradient by its token's count in each micro-batch"),
    # F.batch_norm written out (timm); the module form is refused by the module scan
    "batch_norm": (5, "training", "normalises each micro-batch by its own statistics"),
}


def batch_coupled(graph: Any) -> str | None:
    """Why splitting the batch into micro-batches would change what ``graph`` computes (None: it
    would not). A pipeline runs each micro-batch's forward and backward on its own and sums the
    gradients: exact where each row's contribution does not depend on the other rows beyond the
    loss's sum. Not so for an embedding with ``scale_grad_by_freq`` (each row of the weight's
    gradient is divided by its token's count *in the batch*: per micro-batch the counts are smaller)
    or batch norm in training mode (each micro-batch normalised by its own statistics). The SPMD
    kinds compute both over the whole batch (the embedding's tokens stay whole, batch norm's
    statistics are all-reduced). Extend :data:`_BATCH_COUPLED` for a new batch-coupled op."""
    from ..theory.graph import OP

    for n in graph:
        if n.kind != OP or n.op not in _BATCH_COUPLED:
            continue
        position, name, why = _BATCH_COUPLED[n.op]
        flag = n.kwargs.get(name, n.args[position] if len(n.args) > position else False)
        if flag is True:
            what = "batch norm in training mode" if name == "training" else f"{n.op} with {name}=True"
            return (
                f"{what} at {n.source} {why}, not the batch's as single-device training does; compile it "
                "without a pipeline (pipeline=False)"
            )
    return None


class PipelineModule(HapcModule):
    """This rank's stage of a pipeline. ``loss = module.train_step(*batch)`` runs forward and
    backward of every micro-batch by the schedule and leaves each local parameter with exactly
    its share of the single-device gradient of the whole batch; then step any optimizer over
    ``module.parameters()``. The returned loss is the batch loss, on every rank. DDP's
    ``loss = module(*batch); loss.backward()`` trains the same step in GPipe's order
    (:meth:`forward`)."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Sequence[Any],
        spec: PipelineSpec,
        *,
        device: Any = None,
        seed: int = 0,
        emulate: dict[str, float] | None = None,
        timeout: float | None = None,
        outputs: str = "whole",
        **options: Any,
    ):
        """``timeout``: seconds after which a send, receive or collective of the pipeline gives up
        and raises (default: the job's own process-group timeout). ``outputs``: the model's other
        returned tensors, ``"whole"`` (default: every rank, the whole batch; see the module
        docstring) or ``"loss"`` (``None``, no cost); ``"local"`` is refused: a rank of a pipeline
        holds no piece of the batch's outputs, only its stage's micro-batches."""
        super().__init__()
        from ..codegen.module import CompiledModule
        from ..theory import derive, trace

        if not dist.is_initialized():
            raise HapcError("a pipeline runs inside a distributed job: start it with torchrun")
        if outputs not in ("whole", "loss"):
            raise HapcError(
                f"a pipeline takes outputs='whole' (the model's other returned tensors on every rank) or 'loss' "
                f"(None), got {outputs!r}: no rank holds its own piece of them ('local'), the last stage computes "
                "them a micro-batch at a time"
            )
        norms = [q for q, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
        if norms:
            raise HapcError(
                f"batch norm {norms[0]!r} in training mode would normalise each micro-batch by its own statistics, "
                "not the batch's as single-device training does; pipeline a model with layer/group norm, or "
                "batch norm in eval mode, or compile it without a pipeline (pipeline=False)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        spec.check(world)
        self.spec, self.num_micro, self.emulate = spec, spec.num_micro, emulate
        replicas = spec.all_replicas
        self.num_replicas = len(replicas)
        self.replica = next(q for q, rep in enumerate(replicas) if any(rank in rs for rs in rep))
        mine = replicas[self.replica]  # this replica's ranks per stage
        self.replica_micro = spec.num_micro // self.num_replicas  # micro-batches this replica runs
        example = dict(example_inputs) if isinstance(example_inputs, dict) else tuple(example_inputs)
        batch = batch_rows(example)
        if batch is None:
            raise HapcError("no input has a batch dimension to split into micro-batches: a pipeline needs one")
        self.batch = batch
        micro = micro_batches(example, spec.num_micro, self.batch)[0]
        # the batch's program, traced first: the stages' (the micro-batch's) tensors made in forward
        # stay on the model (_tensor_constant*)
        whole = trace(model, example) if spec.num_micro > 1 else None
        graph = trace(model, micro)
        # torch's own draws (torch.rand, bernoulli) would differ from one device's by micro-batch and rank
        refuse_random_ops(graph, max(world, spec.num_micro))
        coupled = batch_coupled(graph) if whole is not None else None
        if coupled is not None:
            raise HapcError(coupled)
        self.input_names = list(graph.input_names)
        # calls bind as the model's forward binds them (positionally or by keyword); the model's
        # structure comes back with the loss in its place (hapc.codegen.calls)
        self._call = ModelCall(model, micro, graph)
        # where each random op's tensor splits into micro-batches: their draws are the batch's
        draws = micro_batch_dims(model, example, graph, spec.num_micro, whole=whole)
        self._loss_dtype = graph.loss.meta.dtype
        stages = split_graph(graph, spec.cuts)
        # how the micro-batches' losses make the batch loss; checked on every rank before any work
        self._weighting = loss_weighting(stages[-1].graph)
        # the model's other returned tensors: which stage's program returns each (hapc.codegen.calls)
        self._routed = route_outputs(graph, stages) if outputs == "whole" else []
        if self._routed and spec.num_micro > 1:  # concatenating micro-batches must rebuild the batch's
            check_batch_major(whole, graph, spec.num_micro)
        if whole is not None:  # the micro-batches must compute what the batch does (hapc.pipeline.rows)
            coupled = rows_coupled(whole, graph, spec.num_micro, outputs=outputs == "whole")
            if coupled is not None:
                raise HapcError(coupled)
        # every rank creates every stage's group, in the same order (torch.distributed requires it);
        # with a timeout, the job's messages and broadcasts also go over a group that has it
        limit = timedelta(seconds=timeout) if timeout is not None else None
        self.job = dist.new_group(list(range(world)), timeout=limit) if timeout is not None else None
        groups = [[dist.new_group(rs, timeout=limit) for rs in rep] for rep in replicas][self.replica]
        # the ranks holding one device position of one stage in every replica: their gradients are summed
        self.replica_group = None
        for k in range(len(spec.ranks)):
            for j in range(len(spec.ranks[k]) if self.num_replicas > 1 else 0):
                peers = [rep[k][j] for rep in replicas]
                pg = dist.new_group(peers, timeout=limit)
                if rank in peers:
                    self.replica_group = pg
        self._stage_of = {r: k for rep in replicas for k, rs in enumerate(rep) for r in rs}
        self.stage = self._stage_of[rank]
        self.sg: StageGraph = stages[self.stage]
        self._reads, self._names = self.sg.model_inputs, list(self.sg.graph.input_names)  # (once, not per forward)
        self.group = groups[self.stage]
        self.num_stages = len(stages)
        self.relay = [rs[0] for rs in mine]  # each stage's first rank in this replica (its loss)
        self.relay0 = [rs[0] for rs in spec.ranks]  # the first replica's: broadcasts of state every rank agrees on
        S = len(spec.ranks)
        theories = [derive(s.graph, **_theory_options(options)) for s in stages]
        if not spec.plans:
            spec.plans = _agree_on_plans(theories, spec.clusters, options, self.job)
        plan = spec.plans[self.stage]
        keys = set(model.state_dict())
        owned = [{n.target for n in s.graph if n.kind in (PARAM, BUFFER) and n.target in keys} for s in stages]
        for names in owned:  # a stage holding a tied weight holds it under each of its names
            names |= {a for a, c in graph.aliases.items() if c in names}
        # other stages' tensors are neither materialised nor kept here: a stage holds only its own
        elsewhere = set().union(*owned) - owned[self.stage]
        self._tie(stages, owned, replicas, limit)
        # eager loss all-reduces: the schedule's sends and receives interleave with them
        self.stage_module = CompiledModule(
            model,
            theories[self.stage],
            plan,
            group=self.group,
            device=device,
            seed=seed,
            elsewhere=elsewhere,
            loss_sync="eager",
            outputs="whole",  # this stage's share of the model's other outputs, if any (route_outputs)
        )
        self.stage_module.rng.batch_dims = draws
        # this stage recomputes its activations in backward (the planner's choice): its program's runs
        # between collectives are checkpointed
        self.recomputes = bool(spec.recompute and spec.recompute[self.stage])
        if self.recomputes:
            from .recompute import recompute_program

            recompute_program(self.stage_module.program)
        # clip_grad_norm_ over this stage's parameters adds up every stage's gradients (one all-reduce)
        install_pipeline_norms(self.stage_module, self.job, rank == self.relay0[self.stage])  # one replica counts
        self.device = self.stage_module.device
        self.actions: list[Action] = schedule(spec.warmups, self.replica_micro)[self.stage]
        self._calls = [(a.kind, a.micro) for a in self.actions]
        # how each cut's rows travel (HetAuto §5.2): slices held by senders, rows needed by receivers
        self.cut = [_Boundary(k, stages, theories, spec, mine) for k in range(S - 1)]
        self.inbound = self.cut[self.stage - 1] if self.stage > 0 else None
        self.outbound = self.cut[self.stage] if self.stage < S - 1 else None
        self._link_free: dict[int, float] = {}  # per destination: when the emulated link is idle again
        self.peak_in_flight = 0  # most micro-batches held between forward and backward in a step
        self.peak_sends = 0  # most sends held (not yet known received) at once in a step
        # messages go straight to the process group (no per-call checks of torch.distributed's wrappers);
        # ranks are global, the group spans every rank in order
        self._pg = self.job if self.job is not None else dist.distributed_c10d._get_default_group()
        # the warm-up counts as the action lists run them (capped by the micro-batch count)
        self._warm = [min(w, self.replica_micro) for w in spec.warmups]
        self._pool: list[torch.Tensor] = []  # activation receive buffers, reused across micro-batches and steps
        # (output-gradient receive buffers are not reused: autograd may keep one as a parameter's
        # .grad -- see _Step.RECV_GRAD)
        self._pending: _Step | None = None  # a forward() awaiting its loss's backward
        # emulated links, as (stage, stage + 1) pairs; all of them unless ``emulate["between"]`` says
        self._slow_links = {tuple(p) for p in (emulate or {}).get("between", zip(range(S), range(1, S)))}
        # state_dict names (and shapes) of the parameters and buffers each stage holds, tied ones by every name
        self.stage_tensors = [
            {n.target: n.meta for n in s.graph if n.kind in (PARAM, BUFFER) and n.target in keys} for s in stages
        ]
        for names in self.stage_tensors:
            names.update({a: names[c] for a, c in graph.aliases.items() if c in names and a in keys})
        self._agree_on_outputs()

    def _agree_on_outputs(self) -> None:
        """Which routed outputs the stages' programs return (a program computes only what its plan
        covers: an op its loss does not need may be left out, as the SPMD module leaves it ``None``):
        each computing stage's first relay says so, every rank learns it (the hand-back's broadcasts
        must match)."""
        if not self._routed:
            return
        mine: list[bool] = []
        out = next(n for n in self.stage_module.program.graph.nodes if n.op == "output").args[0]
        if isinstance(out, tuple):
            mine = [x is not None for x in out[1:]]
        present: dict[int, bool] = {}
        for k in sorted({r.stage for r in self._routed}):
            flags = broadcast_json(lambda: mine, src=self.relay0[k], group=self.job, device=self.device)
            for r in self._routed:
                if r.stage == k:
                    present[r.leaf] = bool(flags[r.position]) if r.position < len(flags) else False
        self._routed = [r for r in self._routed if present[r.leaf]]

    def _tie(self, stages: list[StageGraph], owned: list[set[str]], replicas: list[Any], limit: Any) -> None:
        """Tied weights that several stages use (GPT-2's token embedding, read again by its output
        layer): each of those stages trains a copy and its backward gives the gradient of its own
        uses only, where one device sums them. Per set of stages sharing weights, a process group of
        their ranks in each replica (every rank creates every group, in one order), summed over by
        :meth:`_sum_tied` after each step; the first of the stages counts the weight in gradient norms."""
        params = sorted({n.target for s in stages for n in s.graph if n.kind == PARAM})
        users = {key: tuple(k for k, names in enumerate(owned) if key in names) for key in params}
        shared: dict[tuple[int, ...], list[str]] = {}
        for key, ks in users.items():
            if len(ks) > 1:
                shared.setdefault(ks, []).append(key)
        self._tied: list[tuple[list[str], Any]] = []  # (weights this stage shares, the group summing them)
        for ks, names in sorted(shared.items()):
            for q, rep in enumerate(replicas):
                pg = dist.new_group(sorted(r for k in ks for r in rep[k]), timeout=limit)
                if q == self.replica and self.stage in ks:
                    self._tied.append((names, pg))
        self._counted_elsewhere = {key for ks, names in shared.items() for key in names if self.stage in ks[1:]}
        self._tied_names = sorted(key for names in shared.values() for key in names)  # every stage's, on every rank

    # -- the step -------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``loss = module(*batch)`` then ``loss.backward()``, as with DDP: the forwards of every
        micro-batch now, their backwards when the loss's backward runs (GPipe's order: exact like
        :meth:`train_step`, but every micro-batch's activations are held until the backward, where
        the planned schedule holds only its in-flight ones -- :meth:`train_step` is the faster
        step and the one the plan's memory check is for).

        Inputs bind as the model's ``forward`` binds them: positionally, or by keyword
        (``module(**batch)`` for a Hugging Face model compiled from a dict of example inputs).

        Returns the batch loss on every rank, in the structure the model returns (a
        ``ModelOutput``, dict or tuple: the loss in its place, the other tensors -- logits --
        whole on every rank, one device's values for the batch, under ``outputs="whole"``: the
        stage computing them hands its micro-batches' values to every rank, concatenated along
        the batch dimension (detached: a backward through them raises); ``None`` under
        ``outputs="loss"``). Its backward seeds the last
        stage with the gradient it is given (``(2 * loss).backward()`` doubles every gradient),
        which must be the same on every rank. Under ``torch.no_grad()`` only the forwards run
        (evaluation). A forward whose loss is never backpropagated is dropped at the next forward
        or step; one loss per backward: summing two forwards' losses before one backward is
        refused."""
        inputs = self._call.bind(args, kwargs, "the pipeline")
        step = self._begin(inputs)
        step.extras = {} if self._routed else None
        for kind, m in self._calls:
            if kind in _FORWARD:
                getattr(step, kind)(m)
        step.drawn()
        loss = self._batch_loss(step.losses, step.weights, inputs)
        others = self._hand_back(step)
        if not torch.is_grad_enabled():  # (the same on every rank: one that would skip the backward would hang it)
            self._drop(step)
            return self._call.structured(loss, others)
        self._pending = step
        anchor = torch.zeros((), dtype=loss.dtype, device=loss.device, requires_grad=True)
        return self._call.structured(_PipelineLoss.apply(anchor, loss, self, step), others)

    def _hand_back(self, step: _Step) -> dict[int, torch.Tensor]:
        """The model's other returned tensors for the whole batch, on every rank (see the module
        docstring): per output and replica, one broadcast over the job from the replica's relay of
        the computing stage of its micro-batches' values, concatenated along dim 0 in micro-batch
        order (in the traced dtype: under ``precision=`` an upcast of what the stage computed);
        the replicas' concatenated in replica order. Detached; a backward through one raises."""
        from ..collectives.outputs import _MetricsOnly

        if not self._routed:
            return {}
        me = dist.get_rank()
        per = self.replica_micro
        out: dict[int, torch.Tensor] = {}
        for r in self._routed:
            shape = (per * r.shape[0], *r.shape[1:]) if per > 1 else r.shape
            parts = []
            for rep in self.spec.all_replicas:
                src = rep[r.stage][0]
                if me == src:
                    mine = [step.extras[m][r.position] for m in range(per)]
                    t = (torch.cat(mine) if per > 1 else mine[0]).to(device=self.device, dtype=r.dtype).contiguous()
                else:
                    t = torch.empty(shape, dtype=r.dtype, device=self.device)
                dist.broadcast(t, src=src, group=self.job)
                parts.append(t)
            whole = torch.cat(parts) if len(parts) > 1 else parts[0]
            if torch.is_grad_enabled():  # for metrics: a loss term from it would be counted once per rank
                whole = _MetricsOnly.apply(whole.requires_grad_(), r.name)
            out[r.leaf] = whole
        step.extras = None
        return out

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch by the planned schedule; the batch loss (the
        tensor alone, as the SPMD module's ``train_step`` returns it). Inputs bind as for
        :meth:`forward`."""
        inputs = self._call.bind(args, kwargs, "the pipeline")
        step = self._begin(inputs)
        for kind, m in self._calls:
            getattr(step, kind)(m)  # one method per action kind, as fx's Interpreter
        step.drawn()
        self._finish(step)
        return self._batch_loss(step.losses, step.weights, inputs)

    def _begin(self, inputs: Sequence[Any]) -> _Step:
        """A step over this replica's micro-batches of ``inputs`` (bound by ``ModelCall.bind``); a
        forward left without its backward is dropped first."""
        rows = batch_rows(inputs)
        if rows != self.batch:  # another size would not split as planned (a batch of one micro-batch's
            # rows even ran as every micro-batch: a sum loss counted it num_micro times)
            raise HapcError(
                f"the pipeline was compiled for batches of {self.batch} rows ({self.num_micro} micro-batches of "
                f"{self.batch // self.num_micro}), got {rows}: its stages' programs and the rows sent between them "
                "are planned for that size. Pass every rank the whole batch, of that size (a DataLoader's last "
                "partial batch: drop_last=True), or compile without a pipeline (pipeline=False), whose module takes "
                "any batch"
            )
        if self._pending is not None:
            self._drop(self._pending)
        self._hold_gradients()
        batches = [dict(zip(self.input_names, b)) for b in micro_batches(inputs, self.num_micro, self.batch)]
        weights = self._micro_weights(batches)  # in the global batch loss
        lo, hi = self.replica * self.replica_micro, (self.replica + 1) * self.replica_micro
        step = _Step(self, batches[lo:hi])
        step.weights = weights[lo:hi]
        step.first, step.base = lo, self.stage_module.rng.step  # every micro-batch draws at the batch's step
        return step

    def _finish(self, step: _Step) -> None:
        """After a step's last backward: its sends waited on, replicas summed, gradients marked."""
        step.release(list(step.sends))  # the sends whose receipt no later message proved
        if self._tied:
            self._sum_tied()
        if self.num_replicas > 1:
            self._sum_replicas()
        self._release_gradients()
        self.compute_seconds = step.compute
        targets = self.stage_module._targets()
        mark_stage_grads(self.stage_module, [self.stage_module._tensor(targets[k]) for k in self._counted_elsewhere])

    def _drop(self, step: _Step) -> None:
        """Forget a step that ran its forwards only. Every message of a forward is received within
        the forwards (the next stage's receives come before its loss all-reduce, which every rank
        reached), so waiting on its sends returns at once."""
        step.release(list(step.sends))
        step.outs.clear()
        step.acts.clear()
        self._pool.extend(step.raw.values())
        step.raw.clear()
        step.dropped = True
        self._release_gradients()
        if self._pending is step:
            self._pending = None

    def _hold_gradients(self) -> None:
        """Before a step: the gradients summed across stages (tied weights) or replicas after it are
        set aside, so that those sums add this step's contributions alone; :meth:`_release_gradients`
        adds them back after. Accumulating over steps (no ``zero_grad`` between) then gives the
        single-device sum, where summing the held gradients again would count them once per copy.
        Copies (a held gradient may be a view of a bucket the next backward overwrites)."""
        self._held: list[tuple[nn.Parameter, torch.Tensor]] = []
        if self.num_replicas > 1:
            params = list(self.stage_module.parameters())
        elif self._tied:
            targets = self.stage_module._targets()
            params = [self.stage_module._tensor(targets[key]) for names, _ in self._tied for key in names]
        else:
            return
        for p in params:
            if p.grad is not None:
                self._held.append((p, p.grad.detach().clone()))
                p.grad = None

    def _release_gradients(self) -> None:
        """The gradients :meth:`_hold_gradients` set aside, added back (after the step's sums)."""
        for p, g in self.__dict__.pop("_held", []):
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)

    def _backward(self, step: _Step, scale: float) -> None:
        """The backwards of a :meth:`forward`'s micro-batches, the last stage seeded by ``scale``."""
        if step.dropped or self._pending is not step:
            raise HapcError(
                "this loss's pipeline forward was followed by another forward or step before its backward, or was "
                "backpropagated already: a pipelined module runs one forward, then its backward. Call "
                "loss.backward() after each forward (for gradient accumulation, one backward per forward: the "
                "gradients add up), or use loss = module.train_step(*batch)"
            )
        agree = torch.tensor([scale, -scale], dtype=torch.float64, device=self.device)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX, group=self.job)
        if float(agree[0]) != -float(agree[1]):
            raise HapcError(
                f"the gradient seeding the pipeline's loss differs between the ranks (from {-float(agree[1]):g} to "
                f"{float(agree[0]):g}): every rank holds the same batch loss and must backpropagate it alike, e.g. "
                "loss.backward() or (loss / accumulation_steps).backward() on every rank"
            )
        step.scale = scale
        self._pending = None
        with torch.enable_grad():  # (autograd runs a Function's backward without it)
            for kind, m in self._calls:
                if kind not in _FORWARD:
                    getattr(step, kind)(m)
        self._finish(step)

    def _sum_tied(self) -> None:
        """Each tied weight's gradient summed over the stages that use it (see :meth:`_tie`): the
        stage's whole gradient gathered from its shards, the stage's first rank adding it (the
        others zeros) in an all-reduce over the sharing stages' ranks, every rank keeping its slice.
        Every copy then holds the single-device gradient, so an elementwise optimizer step (SGD,
        Adam...) keeps the copies equal."""
        mod = self.stage_module
        targets = mod._targets()
        first = dist.get_rank() == self.relay[self.stage]
        for names, pg in self._tied:
            for key in names:
                attr = targets[key]
                ref, lay = mod._layouts[attr]
                p = mod._tensor(attr)
                whole = mod._gather(p.grad if p.grad is not None else torch.zeros_like(p), ref, lay)
                if not first:
                    whole.zero_()
                dist.all_reduce(whole, group=pg)
                local = mod._slice(whole, ref, lay)
                if p.grad is None:
                    p.grad = local.clone()
                else:
                    p.grad.copy_(local)

    def _sum_replicas(self) -> None:
        """Sum this rank's gradients with the same stage position's in every other replica (one flat
        all-reduce): each replica's are its micro-batches' shares of the global batch loss."""
        grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.replica_group)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``DistributedDataParallel.no_sync`` for loops written for DDP's gradient accumulation
        (``with module.no_sync(): module(*batch).backward()`` on all but the last batch): backward
        passes inside accumulate exactly as outside -- each step sums its own contributions across
        replicas and tied copies and adds them to the gradients held (the single-device sum,
        :meth:`_hold_gradients`). It defers no communication."""
        yield

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        """This stage's local parameters (whole or this rank's shard) under the names the model gives
        them (``transformer.h.1.ln_2.bias``), as the SPMD module's: name-based parameter groups (weight
        decay off for biases and norms, layer-wise learning rates) select the same parameters as on
        one device. (nn.Module's own listing named them by the program's attributes,
        ``module.program.transformer_h_1_ln_2_bias``: such rules silently missed.)"""
        return self.stage_module.named_parameters(prefix, recurse, remove_duplicate)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this stage's parameters: the total norm of the whole
        model's gradients, from every stage, on every rank (every rank calls)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, **kwargs)

    def _micro_weights(self, batches: list[dict[str, Any]]) -> list[float]:
        """Each micro-batch's share of the batch loss: ``1/M``, or ``count_m / sum(count)`` for a
        mean over a data-dependent count (only the last stage needs them)."""
        kind, den = self._weighting
        if kind != "count" or self.stage != self.num_stages - 1:  # (the last stage: of every replica's batches)
            return [1.0 if kind == "sum" else 1.0 / self.num_micro] * self.num_micro
        counts = [float(self.sg.graph.evaluate(b, upto=den)[den]) for b in batches]
        empty = [m for m, c in enumerate(counts) if c <= 0]
        if empty:  # its loss is 0/0 and so would be every gradient of it
            raise HapcError(
                f"micro-batch {empty[0]} has no counted target (all are ignore_index): its mean loss is undefined; "
                "use fewer micro-batches or shuffle the batch so every micro-batch has a target"
            )
        total = sum(counts)
        return [c / total for c in counts]

    def _batch_loss(self, losses: list[torch.Tensor], weights: list[float], inputs: Sequence[Any]) -> torch.Tensor:
        """The batch loss on every rank, from the last stage's relay, in one all-reduce of
        ``[loss, h1, h1^2, ...]`` that also compares a 20-bit hash of each input across the job:
        every stage reads the inputs from its own copy, so ranks given different batches (per-rank
        masking of targets) would mix them -- equal hashes iff ``world * sum(h^2) == sum(h)^2``."""
        from ..codegen.module import _hash_batch

        last = self.num_stages - 1
        named = [(n, x) for n, x in zip(self.input_names, inputs) if isinstance(x, torch.Tensor)]
        hashes = [float(_hash_batch({n: x}) & (2**20 - 1)) for n, x in named]
        value = torch.tensor([0.0, *(v for h in hashes for v in (h, h * h))], dtype=torch.float64)
        if self.stage == last and dist.get_rank() == self.relay[last]:
            value[0] = sum(w * float(loss.detach().to(torch.float64)) for w, loss in zip(weights, losses))
        value = value.to(self.device)
        dist.all_reduce(value, group=self.job)
        world = dist.get_world_size(self.job)
        for i, (name, _) in enumerate(named):
            if world * float(value[2 + 2 * i]) != float(value[1 + 2 * i]) ** 2:
                raise HapcError(  # the same sums on every rank: the same error everywhere
                    f"input {name!r} differs between the ranks, but every rank of a pipeline must be given the same "
                    "global batch (each stage reads the inputs it needs from its own copy), so the loss and the "
                    f"gradients would mix the ranks' different values. Give every rank the same {name!r} on every "
                    "call -- draw per-step randomness such as masking targets with -100 from a generator seeded "
                    "alike on every rank"
                )
        return value[0].to(self._loss_dtype)  # (summed in float64) the dtype the model's loss has

    # -- messages -------------------------------------------------------------------------------------
    def _isend(self, x: torch.Tensor, dst: int, tag: int, emulated: bool) -> tuple[Any, torch.Tensor]:
        """Start sending ``x`` (with its emulated arrival time appended when links are emulated): one
        message, never waited on here. Returns the work and the tensor it reads, which the step holds
        until a later message proves the receiver has it (:meth:`_Step.release`)."""
        x = x.detach()
        if self.emulate is None:
            msg = x if x.is_contiguous() else x.contiguous()
        else:
            nbytes = x.numel() * x.element_size()
            when = self._arrival(dst, nbytes) if emulated else 0.0
            stamp = torch.tensor([when], dtype=torch.float64, device=x.device).view(x.dtype)
            msg = torch.cat([x.reshape(-1), stamp])
        return self._pg.send([msg], dst, tag), msg

    def _recv(
        self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Receive a message into ``out`` (contiguous, of ``shape``) or a new tensor, waiting for its
        emulated arrival, if any."""
        if self.emulate is None:
            buf = out if out is not None else torch.empty(shape, dtype=dtype, device=self.device)
            self._pg.recv([buf], src, tag).wait()
            return buf
        numel = math.prod(shape)
        extra = torch.empty(1, dtype=torch.float64).view(dtype).numel()  # the stamp, in elements of dtype
        msg = torch.empty(numel + extra, dtype=dtype, device=self.device)
        self._pg.recv([msg], src, tag).wait()
        wait = float(msg[numel:].cpu().view(torch.float64)) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if out is None:
            return msg[:numel].view(shape)
        return out.copy_(msg[:numel].view(shape))

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An activation receive buffer: one a finished micro-batch gave back, or a new one."""
        pool = self._pool
        for i, b in enumerate(pool):
            if b.shape == shape and b.dtype == dtype:
                return pool.pop(i)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _arrival(self, dst: int, nbytes: int) -> float:
        now = time.monotonic()
        peer = self._stage_of[dst]
        if not self.emulate or (min(peer, self.stage), max(peer, self.stage)) not in self._slow_links:
            return now
        start = max(now, self._link_free.get(dst, 0.0))  # one transfer at a time per direction
        self._link_free[dst] = start + nbytes / self.emulate["bandwidth"]
        return self._link_free[dst] + self.emulate.get("latency", 0.0)

    # -- state ----------------------------------------------------------------------------------------
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient by ``state_dict`` name, from all stages (all ranks
        call; every rank gets them): what single-device training of the batch holds in ``.grad``."""
        return self._from_relays(self.stage_module.full_gradients())

    def full_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The single-device ``state_dict`` of the whole model, gathered from every stage (all ranks
        call; all get it); with the optimizer, ``{"model", "optimizer"}`` keyed by parameter name as
        :func:`hapc.checkpoint.full_state` gives it, so a checkpoint moves to any plan or one device."""
        local = self.stage_module.full_state_dict(optimizer)
        model = self._from_relays(local["model"] if optimizer is not None else local)
        if optimizer is None:
            return model
        state: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        for k, relay in enumerate(self.relay0):
            mine = local["optimizer"] if k == self.stage else None
            # what stage k holds, as JSON (names, shapes, dtypes, plain values), then its tensors
            meta = broadcast_json(lambda m=mine: _describe_optimizer(m), src=relay, group=self.job)
            for name, entries in meta["state"].items():
                out = state.setdefault(name, {})
                for key, (kind, value) in entries.items():
                    if kind == "value":
                        out[key] = value
                        continue
                    shape, dtype = value
                    t = mine["state"][name][key] if mine is not None else torch.empty(shape, dtype=_dtype(dtype))
                    t = t.to(self.device).contiguous()
                    dist.broadcast(t, src=relay, group=self.job)
                    out[key] = t.cpu()
            groups = groups or meta["param_groups"]
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}}

    def load_full_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load a single-device state (or ``{"model", "optimizer"}``): each stage slices its part."""
        self.stage_module.load_full_state_dict(state, optimizer)

    def state_dict(  # type: ignore[override]
        self, *, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The whole model's single-device ``state_dict`` (keys as in the model; every rank calls,
        every rank gets it): what ``CompiledModule.state_dict`` is, over all stages."""
        out: dict[str, Any] = destination if destination is not None else {}
        for key, value in self.full_state_dict().items():
            out[prefix + key] = value
        return out

    def sharded_state_dict(self) -> dict[str, Any]:
        """``state_dict`` for ``torch.distributed.checkpoint`` without gathering (as
        :meth:`~hapc.codegen.module.CompiledModule.sharded_state_dict`): this stage's tensors under
        the model's names, this rank's chunk of a sharded one, its copy of a replicated one.
        ``dcp.save(module.sharded_state_dict(), ...)`` on every rank writes every tensor of the
        model once (each stage its own; the replicas' identical entries are deduplicated by DCP),
        and ``dcp.load(module.sharded_state_dict(), ...)`` loads in place, from a checkpoint of any
        plan, world size or one device.

        Raises HapcError for a pipeline whose stages share a weight (GPT-2's token embedding read by
        its output layer): each stage holds a copy, possibly laid out differently, and an in-place
        load into one copy would leave the other behind -- ``dcp.save(module.state_dict())`` and
        ``module.load_state_dict`` keep them equal."""
        if self._tied_names:
            raise HapcError(
                f"this pipeline's stages share weight(s) {self._tied_names[:3]}: each stage holds a copy, so a "
                "chunked, in-place checkpoint could load one copy and leave the other behind. Use whole tensors: "
                "dcp.save(module.state_dict(), ...), and to load, sd = module.state_dict(); dcp.load(sd, ...); "
                "module.load_state_dict(sd)"
            )
        return self.stage_module.sharded_state_dict()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a single-device ``state_dict``: each stage copies its slices (the other stages' keys
        are expected and skipped)."""
        mine = set(self.stage_module._state_keys)
        incompatible = self.stage_module.load_state_dict({k: v for k, v in state_dict.items() if k in mine}, strict)
        known = {k for names in self.stage_tensors for k in names} | mine
        unexpected = [k for k in state_dict if k not in known]
        if strict and unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for PipelineModule: unexpected key(s) {unexpected[:5]}")
        return nn.modules.module._IncompatibleKeys(incompatible.missing_keys, unexpected)

    def unwrap(self) -> nn.Module:
        """Write the trained weights of every stage into the model this module was compiled from and
        return it (every rank calls; see ``CompiledModule.unwrap``)."""
        from ..codegen.original import write_back

        return write_back(self, self.full_state_dict())

    def _from_relays(self, mine: dict[str, Any]) -> dict[str, torch.Tensor]:
        # each stage's relay broadcasts its tensors, whose names and shapes every rank knows
        out: dict[str, torch.Tensor] = {}
        for k, names in enumerate(self.stage_tensors):
            for name, meta in names.items():
                if name in out:
                    continue
                t = mine[name] if k == self.stage else torch.empty(meta.shape, dtype=meta.dtype)
                t = t.to(self.device).contiguous()  # NCCL broadcasts device tensors
                dist.broadcast(t, src=self.relay0[k], group=self.job)
                out[name] = t.cpu()
        for name, t in mine.items():  # no stage's (an unused buffer): every rank holds the same
            out.setdefault(name, t)
        return out


#: the actions of the forward half of a step (:meth:`PipelineModule.forward` runs them alone)
_FORWARD = frozenset({"RECV_ACT", "F", "SEND_ACT"})


class _PipelineLoss(torch.autograd.Function):
    """The batch loss of :meth:`PipelineModule.forward`, whose backward runs the micro-batches'."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, loss: torch.Tensor, pm: PipelineModule, step: _Step) -> torch.Tensor:
        ctx.pm, ctx.step = pm, step
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        if ctx.step is None:  # loss.backward(retain_graph=True), then loss.backward() again
            raise HapcError(
                "this loss of a pipelined module was backpropagated already: its micro-batches' activations are "
                "freed by the first backward (retain_graph=True does not keep them). One backward per forward: "
                "call the module again for another backward, or scale the loss once ((2 * loss).backward() adds "
                "what two backwards of it would)"
            )
        ctx.pm._backward(ctx.step, float(grad))
        ctx.step = None  # its activations and buffers are not held past the backward
        return None, None, None, None


class _Step:
    """The state of one training step on one rank while its actions run (see the module table).

    **Sends are released as soon as a later message proves them received** (gloo's send completes
    only once the receiver has posted its receive, so waiting on it earlier could stall, and a
    send kept to the step's end keeps its tensor alive): an activation of micro-batch ``m`` sent
    across the link is received before the next stage's backward of ``m``, so it is released when
    its gradient comes back (``RECV_GRAD(m)``); a relay's forwards of ``m`` inside its group, when
    the receivers' gradient contributions of ``m`` arrive (its ``SEND_GRAD(m)``); a gradient of
    ``m`` sent back, when activation ``m + N_prev`` arrives (``RECV_ACT``): the previous stage sends
    it only after its backward of ``m`` (``N_prev`` its warm-up count; a relay inside this stage,
    whose warm-up count is no larger, forwards it after its own ``SEND_GRAD(m)``). What no later
    message proves is waited on at the step's end."""

    def __init__(self, pm: PipelineModule, batches: list[dict[str, Any]]):
        self.pm, self.batches = pm, batches
        self.acts: dict[int, torch.Tensor] = {}  # received activations (leaves whose grad we send back)
        self.raw: dict[int, torch.Tensor] = {}  # their receive buffers, back to the pool after the backward
        self.outs: dict[int, torch.Tensor] = {}  # outputs awaiting their backward
        self.grads: dict[int, torch.Tensor] = {}  # received output gradients
        self.back: dict[int, torch.Tensor] = {}  # input gradients awaiting their send
        self.sends: list[tuple[Any, torch.Tensor]] = []  # every send not yet released
        self.act_sends: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # across the link, by micro-batch
        self.forwards: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # a relay's copies inside its group
        self.grad_sends: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # gradients sent back
        self.losses: list[torch.Tensor] = []
        self.compute = 0.0
        self.backwards = 0
        self.weights: list[float] = []
        self.scale = 1.0  # the gradient of the batch loss the last stage's seeds are multiplied by
        self.dropped = False  # forwards only, never to be backpropagated (PipelineModule._drop)
        # the model's other outputs this stage's program returns, per micro-batch (forward() only)
        self.extras: dict[int, tuple] | None = None
        self.first = 0  # this replica's first micro-batch in the batch
        self.base = 0  # the random stream's step for every micro-batch of this batch
        k = pm.stage
        self.prev = k - 1 if k > 0 else None
        self.next = k + 1 if k < pm.num_stages - 1 else None
        self.prev_warm = pm._warm[k - 1] if k > 0 else 0

    def _send(self, into: dict[int, list[tuple[Any, torch.Tensor]]], m: int, sent: tuple[Any, torch.Tensor]) -> None:
        into.setdefault(m, []).append(sent)
        self.sends.append(sent)
        self.pm.peak_sends = max(self.pm.peak_sends, len(self.sends))

    def release(self, sent: list[tuple[Any, torch.Tensor]] | None) -> None:
        """Wait on sends known received (this returns at once) and drop their tensors."""
        if not sent:
            return
        for work, _ in sent:
            work.wait()
        done = {id(x) for x in sent}
        self.sends = [x for x in self.sends if id(x) not in done]

    def RECV_ACT(self, m: int) -> None:
        """Rows this rank needs, slice by slice: across the link if it relays the slice, else from
        the slice's relay inside the group (which forwards without waiting)."""
        pm, cut, me = self.pm, self.pm.inbound, dist.get_rank()
        lo, hi = cut.need[me]
        buf = pm._buffer((hi - lo, cut.features), cut.dtype)
        for rt in cut.routes:
            mine = next((c for c in rt.copies if c[0] == me), None)
            if me == rt.relay:
                _, a, b = mine
                whole = (a, b) == (lo, hi) == (rt.lo, rt.hi)  # the slice is exactly the rows needed: no copy
                piece = pm._recv((rt.hi - rt.lo, cut.features), cut.dtype, rt.src, _ACT, buf if whole else None)
                for r, c, d in rt.copies:
                    if r != me:
                        self._send(self.forwards, m, pm._isend(piece[c - rt.lo : d - rt.lo], r, _ACT, False))
                if not whole:
                    buf[a - lo : b - lo] = piece[a - rt.lo : b - rt.lo]
            elif mine is not None:
                _, a, b = mine
                pm._recv((b - a, cut.features), cut.dtype, rt.relay, _ACT, buf[a - lo : b - lo])
        self.raw[m] = buf
        self.acts[m] = buf.detach().requires_grad_()
        # the previous stage sent this after its backward of m - N_prev: our gradient of it has arrived
        self.release(self.grad_sends.pop(m - self.prev_warm, None))

    def drawn(self) -> None:
        """After the batch's forwards: the random stream one step on, as after the one-rank forward
        of the whole batch (whose masks every micro-batch drew its rows of, :meth:`F`)."""
        rng = self.pm.stage_module.rng
        rng.micro = None
        if rng.drops:
            rng.step = self.base + 1

    def F(self, m: int) -> None:
        t0 = time.perf_counter()
        pm, sg = self.pm, self.pm.sg
        args = [self.batches[m][n] for n in pm._reads]
        if sg.receives:
            args += sg.unpack(self.acts[m])
        rng = pm.stage_module.rng  # micro-batch m draws its rows of the batch's masks (RandomStream.locate)
        rng.step, rng.micro = self.base, (self.first + m, pm.num_micro)
        out, extras = pm.stage_module._run(**dict(zip(pm._names, args)))  # by name: not the model's signature
        if self.extras is not None and extras and dist.get_rank() == pm.relay[pm.stage]:
            # whole on every rank of the stage; its relay keeps them (detached) for the hand-back
            self.extras[m] = tuple(None if e is None else e.detach() for e in extras)
        if self.next is not None and out.dtype != pm.outbound.dtype:
            # a stage under autocast (precision=) may end in the half dtype: the cut travels, and the
            # next stage's input is checked, in the traced dtype (an upcast: exact)
            out = out.to(pm.outbound.dtype)
        self.outs[m] = out
        pm.peak_in_flight = max(pm.peak_in_flight, len(self.outs))
        if self.next is None:
            self.losses.append(self.outs[m])
        self.compute += time.perf_counter() - t0

    def SEND_ACT(self, m: int) -> None:
        """This rank's slice of the output, across the link to the slice's relay."""
        cut, me = self.pm.outbound, dist.get_rank()
        rows = self.outs[m].detach().reshape(-1, cut.features)
        for rt in cut.routes:
            if rt.src == me:
                self._send(self.act_sends, m, self.pm._isend(rows, rt.relay, _ACT, True))

    def RECV_GRAD(self, m: int) -> None:
        """The gradient of this rank's rows (a replicated output: the first rank's, then broadcast),
        into a new buffer each time, never one reused: autograd may keep the received tensor itself
        as a parameter's ``.grad`` (``AccumulateGrad`` takes a contiguous incoming gradient as it is),
        and a view of it reaches one through view-like ops -- torchvision ViT's class token,
        ``cat([token.expand(b, -1, -1), x])``, on micro-batches of one row: its gradient a contiguous
        slice of the received one. A reused buffer overwrote it with the next micro-batch's."""
        pm, cut, me = self.pm, self.pm.outbound, dist.get_rank()
        out = self.outs[m]
        if cut.replicated:  # every rank of the stage receives (the first) or is broadcast the whole gradient
            g = torch.empty(tuple(out.shape), dtype=out.dtype, device=pm.device)
            for rt in cut.routes:
                if rt.src == me:
                    pm._recv((rt.hi - rt.lo, cut.features), cut.dtype, rt.relay, _GRAD, g.view(-1, cut.features))
            if pm.stage_module.world > 1:
                dist.broadcast(g, src=pm.relay[pm.stage], group=pm.group)
        else:
            rows = out.numel() // cut.features
            routes = [rt for rt in cut.routes if rt.src == me]
            if routes:  # one at most: a rank holds one slice
                g = torch.empty((rows, cut.features), dtype=out.dtype, device=pm.device)
                for rt in routes:
                    pm._recv((rt.hi - rt.lo, cut.features), cut.dtype, rt.relay, _GRAD, g)
            else:
                g = torch.zeros((rows, cut.features), dtype=out.dtype, device=pm.device)
            g = g.view(out.shape)
        self.grads[m] = g
        # its gradient is back: the next stage received activation m
        self.release(self.act_sends.pop(m, None))

    def B(self, m: int) -> None:
        t0 = time.perf_counter()
        pm = self.pm
        out = self.outs.pop(m)
        # the batch loss is the weighted sum of the micro-batches' losses: seed each with its weight
        if self.next is None:
            seed = torch.tensor(self.weights[m] * self.scale, dtype=out.dtype, device=out.device)
        else:
            seed = self.grads.pop(m)
        self.backwards += 1
        if self.backwards < pm.replica_micro:
            with pm.stage_module.no_sync():  # the stage's replicated gradients are summed once, at the last
                out.backward(seed)
        else:
            out.backward(seed)
        del out, seed
        if self.prev is not None:
            x = self.acts.pop(m)
            self.back[m] = x.grad if x.grad is not None else torch.zeros_like(x)
        self.compute += time.perf_counter() - t0

    def SEND_GRAD(self, m: int) -> None:
        """Each overlap's gradient to its slice's relay; relays sum them and send each slice's
        gradient back across the link. All sends to relays go first: relays then only wait."""
        pm, cut, me = self.pm, self.pm.inbound, dist.get_rank()
        g = self.back.pop(m)
        lo = cut.need[me][0]
        for rt in cut.routes:
            for r, a, b in rt.copies:
                if r == me and rt.relay != me:
                    self._send(self.grad_sends, m, pm._isend(g[a - lo : b - lo], rt.relay, _GRAD, False))
        for rt in cut.routes:
            if rt.relay != me:
                continue
            own = [(a, b) for r, a, b in rt.copies if r == me]
            if len(rt.copies) == 1 and own == [(rt.lo, rt.hi)] and (rt.lo, rt.hi) == cut.need[me]:
                total = g  # this rank alone took the whole slice: its gradient is the slice's
            else:
                total = torch.zeros((rt.hi - rt.lo, cut.features), dtype=cut.dtype, device=pm.device)
                for r, a, b in rt.copies:
                    if r == me:
                        total[a - rt.lo : b - rt.lo] += g[a - lo : b - lo]
                    else:
                        total[a - rt.lo : b - rt.lo] += pm._recv((b - a, cut.features), cut.dtype, r, _GRAD)
            self._send(self.grad_sends, m, pm._isend(total, rt.src, _GRAD, True))
        # every receiver of this relay's forwards of m has sent its gradient of m: they arrived
        self.release(self.forwards.pop(m, None))
        pm._pool.append(self.raw.pop(m))  # nothing holds activation m's buffer any more


_ACT, _GRAD = 1, 2  # message tags: activations forward, gradients backward


class _Boundary:
    """The cut between stage ``k`` and ``k + 1``: the packed output's rows and who holds / needs which.

    The sender's rows follow its plan's output layout (batch-sharded: every rank its rows;
    replicated: the first rank all). A receiver needs its own rows when its plan sources every
    incoming activation batch-sharded, all rows otherwise."""

    def __init__(
        self, k: int, stages: list[StageGraph], theories: list[Any], spec: PipelineSpec, ranks: list[list[int]]
    ):
        send, recv = stages[k], stages[k + 1]
        out = send.graph.loss
        self.dtype = out.meta.dtype
        self.rows = out.meta.shape[0] if out.meta.rank == 2 else out.meta.numel
        self.features = out.meta.numel // self.rows
        lay = _output_layout(spec.plans[k], out.index)
        self.replicated = not lay.is_sharded
        sizes = None if self.replicated else theories[k].local_sizes(out.index, 0, spec.plans[k].device_ratios)
        held = reshard.slices(ranks[k], sizes, self.rows)
        acts = [n for n in recv.graph.inputs if n.name.startswith(ACT_PREFIX)]
        need_sizes = None
        if out.meta.rank == 2:
            layouts = [_source_layouts(spec.plans[k + 1], n.index) for n in acts]
            if all(ls and all(lay.is_sharded and lay.dim == 0 for lay in ls) for ls in layouts):
                per = [tuple(theories[k + 1].local_sizes(n.index, 0, spec.plans[k + 1].device_ratios)) for n in acts]
                if len(set(per)) == 1:
                    need_sizes = list(per[0])
        self.need = reshard.needs(ranks[k + 1], need_sizes, self.rows)
        self.routes = reshard.routes(held, self.need)


def _output_layout(plan: Plan, ref: int) -> Any:
    return next(i.layout for i in plan.instructions if type(i).__name__ == "Loss" and i.ref == ref)


def _source_layouts(plan: Plan, ref: int) -> list[Any]:
    return [i.layout for i in plan.instructions if type(i).__name__ == "Source" and i.ref == ref]


def _describe_optimizer(opt_state: dict[str, Any] | None) -> dict[str, Any]:
    """JSON of a gathered optimizer state: tensors by shape and dtype, everything else by value."""
    if opt_state is None:
        return {}
    state = {
        name: {
            key: ["tensor", [list(v.shape), str(v.dtype).removeprefix("torch.")]]
            if torch.is_tensor(v)
            else ["value", v]
            for key, v in entries.items()
        }
        for name, entries in opt_state["state"].items()
    }
    return {"state": state, "param_groups": opt_state["param_groups"]}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _theory_options(options: dict[str, Any]) -> dict[str, Any]:
    from ..planner import THEORY_OPTIONS

    out = {k: options[k] for k in THEORY_OPTIONS if k in options}
    if "variants" in out:
        out["variants"] = tuple(out["variants"])
    return out


def _agree_on_plans(theories: list[Any], clusters: list[Cluster], options: dict[str, Any], group: Any) -> list[Plan]:
    """Rank 0 synthesizes every stage's SPMD program; all ranks receive the plans as JSON."""
    from ..planner import SYNTH_OPTIONS, synthesize_theory

    synth = {k: v for k, v in options.items() if k in SYNTH_OPTIONS}
    data = broadcast_json(
        lambda: [synthesize_theory(t, c, **synth).to_json() for t, c in zip(theories, clusters)], group=group
    )
    return [Plan.from_json(p) for p in data]


__all__ = ["PipelineModule", "PipelineSpec", "check_batch_major", "micro_batches"]
