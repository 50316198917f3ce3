"""The module a rank holds: its program, its parameter shards, gradient synchronisation, and the
conversion between the sharded state and an ordinary single-device ``state_dict``.

* Parameters are sliced from the single-device model by the layout the plan sources them in
  (``S(d)``: this rank's rows by the ratios; ``R``: whole). A model built on the meta device is
  materialised one module at a time and only this rank's slices are kept (:mod:`hapc.materialize`).
* Replicated parameters end the backward with *Partial* gradients (DESIGN §3); they are summed
  across ranks in buckets whose all-reduces start while the backward is still running (as DDP
  does), and complete before ``loss.backward()`` returns. Parameters whose gradient a strategy
  makes whole (sufficient-factor broadcasting) are left alone; sharded ones need nothing.
* The returned loss's value is all-reduced lazily on gloo, on a process group of the module's
  own (:class:`hapc.collectives.LossChannel`); token counts of a mean loss are computed from the
  whole batch when every rank is given it (agreed on the first call) instead of all-reduced. A
  data-parallel step then communicates like DDP: the gradient buckets, plus one deferred scalar.
* ``full_state_dict()`` gathers the shards into the single-device ``state_dict`` (and, given the
  optimizer, its state keyed by parameter name), so a checkpoint moves between plans, world sizes
  and back to one device; ``load_full_state_dict`` does the reverse.
* Tools see the user's model (DESIGN §9): ``state_dict()`` / ``load_state_dict()`` speak its keys
  with whole tensors (``torch.save`` on rank 0, DCP); ``sharded_state_dict()`` describes each shard
  to ``torch.distributed.checkpoint`` by its ``(offset, size)`` chunk (:mod:`.dcp_shards`);
  ``unwrap()`` writes the trained weights into the model compiled from, which raises while stale
  (:mod:`.original`). Inputs the plan takes whole must be alike on every rank: their hashes ride
  in the loss all-reduce, and a difference raises instead of mixing the ranks' values.
* Batches as users load them: the global batch on every rank, each rank its ``batch / world``
  rows (``DistributedSampler``: all-gathered, then split by the plan's ratios) or its share of the
  plan's split; how is agreed on the first call. A batch of another size (the last, partial one;
  evaluation batches) runs an exact replicated step (:mod:`.odd_batch`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives as C
from .._util import same_ranks_group
from ..checkpoint import load_param_groups
from ..collectives.ops import gather_impl
from ..errors import HapcError
from ..materialize import Init, module_values, owner
from ..ops import RandomStream
from ..plan import Plan
from ..theory.graph import INPUT, PARAM
from ..theory.instructions import Source
from ..theory.precision import autocast_dtype
from ..theory.props import Layout
from ..theory.rules.random import sample_drop_p
from ..theory.triples import Theory
from .constants import ConstantInputs
from .constants import check_constant_inputs as _check_constant_inputs
from .grad_norm import install as install_grad_norms
from .odd_batch import OddBatches, is_odd
from .original import HapcModule
from .program import RankProgram

#: gradient buckets: the first closes once it holds FIRST_BUCKET_BYTES, the others BUCKET_BYTES (DDP's
#: 1 MiB and 25 MiB) or 1 / BUCKETS_PER_SYNC of the synchronised bytes where that is less (_setup_grad_sync)
BUCKET_BYTES = 25 * 2**20
FIRST_BUCKET_BYTES = 2**20
BUCKETS_PER_SYNC = 4
_MODE_SENSITIVE = (nn.modules.batchnorm._BatchNorm,)
_DROPOUT = (nn.modules.dropout._DropoutNd,)


def gradient_hooks(p: torch.Tensor) -> tuple[int, int]:
    """How many gradient hooks ``p`` carries: ``(Tensor.register_hook, register_post_accumulate_grad_hook)``."""
    return len(getattr(p, "_backward_hooks", None) or ()), len(getattr(p, "_post_accumulate_grad_hooks", None) or ())


class CompiledModule(HapcModule):
    """One rank's share of a model under a plan. Call it like the model: it returns the loss
    (its value is the full loss on every rank); ``loss.backward()`` leaves every local parameter
    with exactly its share of the single-device gradient."""

    def __init__(
        self,
        model: nn.Module,
        theory: Theory,
        plan: Plan,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        init: Init | None = None,
        elsewhere: Collection[str] = (),
        loss_sync: str = "lazy",
        outputs: str = "whole",
    ):
        """``elsewhere``: ``state_dict`` names another module owns (the other stages of a pipeline):
        not kept here and left out of :meth:`full_state_dict`. ``loss_sync``: when the all-reduce
        of the returned loss's value starts -- ``"lazy"`` (gloo: at the first read, the start of
        backward or the next call, see :class:`hapc.collectives.LossChannel`) or ``"eager"`` (at
        the end of the forward; always on NCCL, where it costs the CPU nothing)."""
        super().__init__()
        if loss_sync not in ("lazy", "eager"):
            raise HapcError(f"loss_sync must be 'lazy' or 'eager', got {loss_sync!r}")
        self.world = dist.get_world_size(group)
        plan.check(world_size=self.world, where="the plan")
        lazy = loss_sync == "lazy" and self.world > 1 and dist.get_backend(group) == "gloo"
        if lazy:  # a group of its own: nothing of the user's can come between a deferred loss and its peers
            group = same_ranks_group(group)
        self.group = group
        self.rank = dist.get_rank(group)
        self._channel = C.LossChannel(group) if lazy else None
        self.plan, self.theory = plan, theory
        self._graph_inputs = theory.graph.inputs
        self._input_names = [n.name for n in self._graph_inputs]  # the program's placeholders, in order
        # positional arguments bind by the model's signature: the graph omits unused inputs
        sig = _signature(model)
        self._positional = _positional_names(sig, theory.graph.input_names)
        self._call_checker = _call_checker(sig, type(model).__name__, theory.graph.input_names)
        # forward parameters the capture took as constants (None, a flag), and verdicts on other values
        # for them (set by compile: hapc.codegen.constants)
        self._constant_inputs = ConstantInputs({})
        self._free_dims = _sharded_input_dims(plan)
        self.device = torch.device(device) if device is not None else _default_device(group)
        if outputs not in ("whole", "local", "loss"):
            raise HapcError(f"outputs must be 'whole', 'local' or 'loss', got {outputs!r}")
        rp = RankProgram(theory, plan, self.rank, outputs=outputs)
        rp.build_graph()
        root = nn.Module()
        root.group = group  # type: ignore[assignment]
        root.device = self.device  # type: ignore[assignment]
        # random ops draw from (seed, step, op, global index): one stream per module, the seed agreed
        self.rng = RandomStream(self._agree_on_seed(seed) if rp.uses_stream else seed)
        root.rng = self.rng  # type: ignore[assignment]
        self._layouts: dict[str, tuple[int, Layout]] = {}
        full = _full_state(model)
        elsewhere = set(elsewhere)
        # what full_state_dict returns, in order
        self._state_keys = [k for k in model.state_dict() if k not in elsewhere]
        # the traced program baked in the model's train/eval mode; batch norm's counter is module
        # state outside the graph, advanced here as the module would
        self._traced_mode = model.training
        self._mode_sensitive = [q for q, mod in model.named_modules() if isinstance(mod, _MODE_SENSITIVE)]
        # compiled in eval mode, dropout was traced as the identity: no program for training here
        self._eval_only = [q for q, mod in model.named_modules() if isinstance(mod, _DROPOUT) and mod.p > 0]
        self._eval_only += [n.name for n in theory.graph if n.op in _RANDOM_NODES or sample_drop_p(n) > 0]
        self._counters = [
            f"{q}.num_batches_tracked" if q else "num_batches_tracked"
            for q, mod in model.named_modules()
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training and mod.track_running_stats
        ]
        values = _Materializer(model, seed, init)
        for attr, (ref, lay) in rp.state.items():
            node = theory.graph[ref]
            if node.target not in full:
                raise KeyError(f"the model has no parameter or buffer {node.target!r} (node {node.name})")
            local = self._slice(values(node.target, full[node.target]), ref, lay).to(self.device).clone()
            if node.kind == PARAM:
                root.register_parameter(attr, nn.Parameter(local, requires_grad=True))
            else:
                root.register_buffer(attr, local)
            self._layouts[attr] = (ref, lay)
        self.program = rp.module(root)
        self.grad_complete = rp.grad_complete
        self._backward_communicates = any(_communicates(n) for n in self.program.graph.nodes)
        # data-only values the program all-reduces (token counts): computed from the whole batch
        # instead when every rank is given it (settled on the first call, see _whole_batch_values)
        self._batch_refs = list(rp.batch_values.values())
        need = set().union(*(theory.graph.ancestors(r) for r in self._batch_refs))
        self._batch_inputs = [n for n in theory.graph.inputs if n.index in need]
        self._whole_batch: bool | None = None
        # "global" (every rank the whole batch), "even" (each its batch/world rows) or "plan" (each
        # its rows by the plan's ratios), as the last call of the plan's shapes was given; a call of
        # another batch size runs a replicated step (hapc.codegen.odd_batch)
        self._batch_mode: str | None = None
        self._outputs = outputs
        if outputs != "loss" and self.rank == 0:
            _warn_dropped_outputs(theory.graph)
        self._odd = OddBatches(self) if not elsewhere else None
        # inputs the plan takes whole: every rank must be given the same value (checked every step
        # in the loss all-reduce on gloo; on the first call on the eager path); not a pipeline
        # stage's (its activations arrive by the schedule, its model inputs are checked nowhere yet)
        self._whole_inputs = [] if elsewhere else _whole_inputs(theory, plan)
        # the plan prices and computes parameter gradients only (a pipeline stage's activations apart)
        self._input_grads_refused = self.world > 1 and not elsewhere
        self._inputs_compared = False
        targets = self._targets()
        self._unused = {
            k: values(k, v).cpu().clone() for k, v in full.items() if k not in targets and k not in elsewhere
        }
        self._setup_grad_sync()
        self._grad_norms = install_grad_norms(self)  # sharded gradients' norms are the whole ones
        self._own_hooks = self._hook_counts()
        # requires_grad as compiled: a frozen parameter is a constant of the plan, and this module
        # trains its own copies -- a flag changed on the model object later must not pass silently
        self._flags = [(k, weakref.ref(p), p.requires_grad) for k, p in model.named_parameters()]

    # -- running ------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._structured(*self._run(*args, **kwargs))

    def train_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of one batch; returns the batch loss (detached). The same call as a
        pipelined module's :meth:`~hapc.pipeline.runtime.PipelineModule.train_step`, so one loop --
        ``loss = module.train_step(*batch); optimizer.step()`` -- trains whichever plan kind
        ``hapc.compile`` chose; ``module(*batch)`` then ``loss.backward()`` is the same step here."""
        loss, _ = self._run(*args, **kwargs)
        loss.backward()
        return loss.detach()

    def _run(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, tuple]:
        """The program on one batch: the loss and the model's other returned tensors."""
        names = self._input_names
        self._call_checker(args, kwargs)
        bound = dict(zip(self._positional, args))
        bound.update(kwargs)
        _check_constant_inputs(self._constant_inputs, bound)
        missing = [n for n in names if n not in bound]
        if missing:
            raise TypeError(f"missing model input(s) {missing}")
        # how this loop passes batches -- "global", "even" (DistributedSampler) or the "plan"'s shares --
        # is agreed on the first call; a call of another batch size runs a replicated step
        odd = self._odd.agree(bound) if self._odd is not None and self._batch_mode is None else None
        if not odd:
            bound = self._from_even_shares(bound)
            if odd is None:
                odd = self._odd is not None and is_odd(self, bound)
        if odd:  # every rank computes the whole batch (hapc.codegen.odd_batch)
            bound = self._odd.global_batch(bound)
        else:
            _check_inputs(self._graph_inputs, self._free_dims, bound)
            if self._odd is not None:
                self._odd.release()
        self._check_flags()
        if self._input_grads_refused and torch.is_grad_enabled():
            wants = [n for n in names if isinstance(bound[n], torch.Tensor) and bound[n].requires_grad]
            if wants:
                raise HapcError(
                    f"input {wants[0]!r} requires grad: hapc's program computes gradients of the parameters only (each "
                    "rank takes its rows of the batch, and gradient paths into the inputs are not synchronised), so "
                    "its gradient would differ from one device. Pass it detached (x.detach()); for input gradients "
                    "(adversarial examples, gradient penalties) compute them on one device"
                )
        self._flush()
        if self.world > 1 and torch.is_grad_enabled():
            self._prepare_accumulation()
            self.__dict__["_synced"] = False  # (per step: not through nn.Module.__setattr__)
        extras: tuple = ()
        checks: list[tuple[int, str]] = []
        with self._autocast():
            if odd:
                out, extras = self._odd.run(bound)
            else:
                whole, checks = self._whole_batch_values(bound)
                checks += self._whole_input_checks(bound)
                with C.deferring(self._channel, checks):
                    out = self.program(*[bound[n] for n in names], *whole)
                if isinstance(out, tuple):  # the loss, then the model's other returned tensors
                    out, *rest = out
                    extras = tuple(rest)
        if self.rng.drops:  # every forward that may drop draws new masks (each accumulated micro-batch too)
            self.rng.step += 1
        if checks and not isinstance(out, C.GlobalLoss) and isinstance(out, torch.Tensor) and out.dim() == 0:
            # a Replicated loss is not all-reduced: the checks travel alone, in the same deferred way
            out = self._channel.defer(out, checks, replicated=True)
        with torch._C.DisableTorchFunctionSubclass():  # a GlobalLoss must not wait for its value here
            if not out.requires_grad:
                self._flush()  # no backward will start its all-reduce
            elif self.world > 1:
                C.on_backward(out, self._on_output_grad)
        for key in self._counters:
            if key in self._unused:
                self._unused[key] += 1
        return out, extras

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's mixed precision: ``torch.autocast`` to the plan's ``precision`` (bf16 /
        fp16, :mod:`hapc.theory.precision`) on this rank's device, as single-device AMP runs it
        (the backward follows autograd through its casts); nothing for a plan without one (a
        caller's own ``torch.autocast`` around the call then applies as it would to the model)."""
        dtype = autocast_dtype(self.plan.options.get("precision"))
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledModule:
        """A copy with its own parameters and buffers on the same ranks and process groups (which
        are handles, shared, not copied): ``AveragedModel(module)`` / an EMA copy is another
        compiled module of the same plan, its forward (every rank calls it) exact on its own
        weights, its gradient synchronisation set up afresh on its own parameters."""
        import copy

        pg = dist.ProcessGroup
        before = copy._deepcopy_dispatch.get(pg)  # type: ignore[attr-defined]
        copy._deepcopy_dispatch[pg] = lambda group, memo: group  # type: ignore[attr-defined]
        try:
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            for k, v in self.__dict__.items():
                if k not in ("_stash_handles",):
                    new.__dict__[k] = copy.deepcopy(v, memo)
        finally:
            if before is None:
                del copy._deepcopy_dispatch[pg]  # type: ignore[attr-defined]
            else:
                copy._deepcopy_dispatch[pg] = before  # type: ignore[attr-defined]
        new._flags = list(self._flags)
        new._setup_grad_sync()
        new._grad_norms = install_grad_norms(new)
        new._own_hooks = new._hook_counts()
        return new

    def _check_flags(self) -> None:
        """Refuse a ``requires_grad`` changed on the model given to ``hapc.compile`` (not this module's)."""
        for key, ref, flag in self._flags:
            p = ref()
            if p is not None and p.requires_grad != flag:
                how = "froze" if flag else "unfroze"
                fix = (
                    "freeze this module's copy instead "
                    f"(dict(module.named_parameters())[{key!r}].requires_grad_(False): names as in your model)"
                    if flag
                    else "a parameter frozen at compile is a constant of the plan: call hapc.compile again with it "
                    "trainable"
                )
                raise HapcError(
                    f"{how} {key!r} on the model given to hapc.compile after compiling; the compiled module trains "
                    f"its own parameters, so this would change nothing: {fix}"
                )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (whole or its shard) under the names the model gives them
        (``blocks.0.attn.q.weight``), as FSDP2's are: name-based parameter groups and freezing rules
        written for the model select the same parameters here. Parameters frozen at compile are
        constants of the plan (buffers), not listed."""
        seen: set[int] = set()
        for key, attr in self._targets().items():
            p = self._tensor(attr)
            if not isinstance(p, nn.Parameter) or (remove_duplicate and id(p) in seen):
                continue
            seen.add(id(p))
            yield prefix + key, p

    def _structured(self, loss: torch.Tensor, extras: tuple) -> Any:
        """What the model returns (a ``ModelOutput``, dict, tuple or the loss alone), the loss and
        the other tensors (see ``compile(outputs=)``) in their places."""
        graph = self.theory.graph
        spec = graph.output_spec
        if spec is None or (isinstance(spec, int) and not extras):
            return loss
        from ..theory.capture import rebuild_output

        others = iter(extras)
        leaves = [loss if k == graph.loss_leaf else next(others, None) for k in range(len(graph.outputs))]
        return rebuild_output(spec, leaves)

    def _from_even_shares(self, bound: dict[str, Any]) -> dict[str, Any]:
        """DDP's convention -- each rank its own ``batch / world`` rows (``DistributedSampler``) --
        under a plan whose shares are not those: the shares are all-gathered (in rank order) into
        the global batch, which the program then splits by its ratios. Exact: every loss hapc
        accepts is a sum over rows (or a sum over a count), whatever rank a row started on. The
        decision reads only shapes and the plan, so every rank takes it alike."""
        if self.world == 1 or self._batch_mode in ("global", "plan"):
            return bound  # global batches or the plan's shares: another size is an odd batch, not a share
        shares = []
        for n in self._graph_inputs:
            x = bound.get(n.name)
            if not isinstance(x, torch.Tensor) or x.dim() != n.meta.rank or x.dim() == 0 or x.shape[0] == n.shape[0]:
                continue
            full = n.shape[0]
            if full % self.world or x.shape[0] != full // self.world or tuple(x.shape[1:]) != tuple(n.shape[1:]):
                return bound  # not an even share: the checks below say what is wrong
            shares.append(n)
        if not shares:
            return bound
        planned = [
            self.theory.local_sizes(n.index, 0, self.plan.device_ratios) if 0 in self._free_dims.get(n.index, ())
            else [n.shape[0]] * self.world
            for n in shares
        ]  # fmt: skip
        if all(all(size == n.shape[0] // self.world for size in sizes) for n, sizes in zip(shares, planned)):
            return bound  # the plan's own shares: each rank computes on its rows
        self._flush()
        out = dict(bound)
        for n in shares:
            x = bound[n.name].contiguous()
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
            out[n.name] = torch.cat(parts, 0)
        return out

    def _flush(self) -> None:
        """Start the deferred loss all-reduces not started yet (this module's and any other's),
        before any other collective of this module, so every rank starts them in the same order."""
        C.flush_losses()

    def _whole_batch_values(self, bound: dict[str, Any]) -> tuple[list[torch.Tensor | None], list[tuple[int, str]]]:
        """The program's optional whole-batch arguments: the values of its data-only all-reduces
        (token counts of a mean loss), computed here from the inputs when every rank was given
        the same whole batch -- the single-device value, no communication -- else ``None`` (the
        program all-reduces its share). Whether they are is agreed on the first call (one
        all-reduce, which also compares the batches); it must hold on every later call, so the
        batch's hash (20 bits) goes along to be compared in the loss all-reduce."""
        if not self._batch_refs:
            return [], []
        batch = {n.name: bound[n.name] for n in self._batch_inputs}
        shapes = {n.name: tuple(getattr(bound[n.name], "shape", ())) for n in self._batch_inputs}
        whole = all(
            isinstance(batch[n.name], torch.Tensor) and shapes[n.name] == tuple(n.shape) for n in self._batch_inputs
        )
        if self._whole_batch is None:
            self._whole_batch = self._agree_on_whole_batch(whole, batch)
        if not self._whole_batch:
            return [None] * len(self._batch_refs), []
        if not whole:
            n = next(n for n in self._batch_inputs if shapes[n.name] != tuple(n.shape))
            raise HapcError(
                f"input {n.name!r} has shape {shapes[n.name]}, not the whole batch {tuple(n.shape)} that every rank "
                "was given on the first call (the module then counts tokens from it without communicating); pass "
                "the whole batch on every call, or compile again and pass each rank its share from the first call on"
            )
        values = self.theory.graph.evaluate(batch, upto=self._batch_refs)
        checks = [(_hash_batch(batch) & (2**20 - 1), _DIFFERENT_BATCHES)] if self._channel is not None else []
        return [values[r].to(self.device) for r in self._batch_refs], checks  # eager: no check

    def _whole_input_checks(self, bound: dict[str, Any]) -> list[tuple[int, str]]:
        """``(hash, error)`` of each input the plan takes whole. Ranks given different values of one
        (per-rank random masking of targets, a rank's own batch) would each compute with their own,
        and the loss and gradients would mix them without any error: on gloo the hashes (20 bits)
        ride in the loss all-reduce every step and every read of the loss raises; on the eager path
        (NCCL, ``loss_sync="eager"``) they are compared once, on the first call, by an all-reduce."""
        if self.world == 1 or not self._whole_inputs:
            return []
        if self._channel is None and self._inputs_compared:
            return []
        hashes = [
            (_hash_batch({name: bound[name]}), message)
            for name, message in self._whole_inputs
            if isinstance(bound[name], torch.Tensor)
        ]
        if self._channel is not None:
            return [(h & (2**20 - 1), message) for h, message in hashes]
        self._inputs_compared = True
        digests = torch.tensor([h for h, _ in hashes] + [-h for h, _ in hashes], dtype=torch.int64, device=self.device)
        self._flush()
        dist.all_reduce(digests, op=dist.ReduceOp.MIN, group=self.group)
        for i, (_, message) in enumerate(hashes):
            if int(digests[i]) != -int(digests[len(hashes) + i]):
                raise HapcError(message)  # the same minima on every rank: the same error everywhere
        return []

    def _agree_on_whole_batch(self, whole: bool, batch: dict[str, Any]) -> bool:
        """Whether every rank holds the same whole batch (then each can count it alone): one
        all-reduce of a flag and a hash of the batch's bytes."""
        if self.world == 1:
            return whole
        digest = _hash_batch(batch) if whole else 0
        agreed = torch.tensor([int(whole), digest, -digest], dtype=torch.int64, device=self.device)
        self._flush()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agreed[0] == 1) and int(agreed[1]) == -int(agreed[2])

    def train(self, mode: bool = True) -> CompiledModule:
        if mode != self._traced_mode and self._mode_sensitive:
            raise HapcError(
                f"this program was compiled from the model in {'training' if self._traced_mode else 'eval'} mode "
                f"and {self._mode_sensitive[0]!r} behaves differently in the other; compile the model again after "
                f"model.{'eval' if not mode else 'train'}() for that mode"
            )
        if mode and not self._traced_mode and self._eval_only:
            raise HapcError(
                f"this program was compiled from the model in eval mode, where {self._eval_only[0]!r} (dropout or "
                "stochastic depth) does nothing, so it has no training-mode draw; compile the model in training "
                "mode (model.train() before hapc.compile): that program serves eval mode too"
            )
        branch = self.__dict__.get("_mode_branch")
        if mode != self._traced_mode and branch:
            other = "training" if mode else "eval"
            raise HapcError(
                f"the model's forward computes something else in {other} mode (from {branch} on: a "
                f"`self.training` branch), and this program is the {'training' if self._traced_mode else 'eval'} "
                f"mode's; compile a second module for {other} mode (model.{'train' if mode else 'eval'}() then "
                "hapc.compile) -- module.unwrap() hands the trained weights to the model first"
            )
        # compiled in training mode, dropout follows the mode: the identity in eval
        self.rng.drops = mode or not self._traced_mode
        return super().train(mode)

    def _agree_on_seed(self, seed: int) -> int:
        """The random ops' seed: ``seed`` mixed with rank 0's ``torch.initial_seed()`` (so
        ``torch.manual_seed`` changes the masks as it does on one device), the same on every rank."""
        base = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64, device=self.device)
        if self.world > 1:
            self._flush()
            src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            dist.broadcast(base, src=src, group=self.group)
        return (int(base) * 1_000_003 + seed) & (2**64 - 1)

    @property
    def code(self) -> str:
        """This rank's program as readable Python source (what ``hapc synth --emit-code`` writes;
        ``self.program.code`` is the raw ``torch.fx`` rendering of the same graph)."""
        from .emit import rank_source

        return rank_source(self.theory, self.plan, self.rank)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.program.named_parameters())

    # -- sharding -------------------------------------------------------------------------------------
    def _slice(self, full: torch.Tensor, ref: int, lay: Layout) -> torch.Tensor:
        if not lay.is_sharded:
            return full
        sizes = self.theory.local_sizes(ref, lay.dim, self.plan.device_ratios)
        start = sum(sizes[: self.rank])
        return full.narrow(lay.dim, start, sizes[self.rank])

    def _gather(self, local: torch.Tensor, ref: int, lay: Layout, group: Any = None) -> torch.Tensor:
        """The whole tensor from every rank's shard (over ``group``, default the module's): a new
        tensor, never a view of ``local``."""
        if not lay.is_sharded:
            return local.detach().clone()
        sizes = self.theory.local_sizes(ref, lay.dim, self.plan.device_ratios)
        return gather_impl(local.detach().contiguous(), lay.dim, sizes, group or self.group, "padded")

    def _targets(self) -> dict[str, str]:
        """state_dict key -> local attribute (one per parameter / buffer, first layout wins)."""
        out: dict[str, str] = {}
        for attr, (ref, _) in self._layouts.items():
            out.setdefault(self.theory.graph[ref].target, attr)
        for alias, name in getattr(self.theory.graph, "aliases", {}).items():  # tied weights: every name
            if name in out:
                out.setdefault(alias, out[name])
        return out

    def _tensor(self, attr: str) -> torch.Tensor:
        return getattr(self.program, attr)

    # -- gradient synchronisation --------------------------------------------------------------------
    def _setup_grad_sync(self) -> None:
        params = []
        for attr, (ref, lay) in self._layouts.items():
            if self.theory.graph[ref].kind == PARAM and lay.is_replicated and ref not in self.grad_complete:
                params.append(self._tensor(attr))
        self._sync_params = params
        # static buckets in reverse order of use (gradients arrive roughly backwards), one dtype
        # and device each, each closed once it holds its cap (DDP's rule); the first is small so
        # that communication starts early. Only the last bucket's all-reduce cannot overlap the
        # backward, so no bucket holds more than 1 / BUCKETS_PER_SYNC of the bytes (1 MiB at
        # least): an 8 MiB MLP on two CPU ranks at 1 and 0.5 of a core (hetero_speedup) took
        # 1.03-1.07x DDP's step with one 25 MiB bucket, 1.00-1.04x with DDP's 1 + 25 MiB, and
        # 0.99-1.01x with these three, interleaved in the same processes
        total = sum(p.numel() * p.element_size() for p in params)
        share = max(FIRST_BUCKET_BYTES, total // BUCKETS_PER_SYNC)
        buckets: list[list[nn.Parameter]] = []
        size, cap = 0, FIRST_BUCKET_BYTES
        for p in reversed(params):
            if (
                not buckets
                or size >= min(cap, share)
                or (p.dtype, p.device) != (buckets[-1][0].dtype, buckets[-1][0].device)
            ):
                if buckets:
                    cap = BUCKET_BYTES
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._buckets = buckets
        self._bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self._sizes = [[p.numel() for p in b] for b in buckets]
        self._view_of: dict[int, torch.Tensor | None] = {id(p): None for p in params}
        self._flat: list[torch.Tensor | None] = [None] * len(buckets)  # allocated on first use
        self._views: list[list[torch.Tensor]] = [[] for _ in buckets]  # per bucket, its parameters' views of it
        self._carry: dict[int, torch.Tensor] = {}
        # the gradients held when the forward ran (id -> .grad): one still there at the sync got no
        # contribution from the backward (``backward(inputs=...)`` left it out)
        self._before: dict[int, torch.Tensor] = {}
        self._syncing = True  # False inside no_sync()
        self._synced = False  # a sync finished since the last forward (a further backward re-uses its graph)
        self._restore_queued = False
        self._unsynced = False  # .grad holds Partial contributions not summed yet (no_sync)
        self._stash_handles: list[Any] = []
        self._reset_sync()
        # one bucket cannot overlap with the backward (it is complete only at the end), so it needs
        # no per-parameter hooks: a hook on the program's output queues the sync when backward
        # starts (see forward). Several buckets go out as they fill.
        self._output_hook = self.world > 1 and len(buckets) == 1
        if self.world > 1 and not self._output_hook:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._guarded_task = -1  # the last backward pass checked to accumulate (see _partial_grad_guard)
        if self.world > 1:
            for p in params:
                p.register_hook(self._partial_grad_guard(p))

    def _partial_grad_guard(self, p: nn.Parameter):
        """A replicated parameter's gradient is this rank's Partial sum until the bucket all-reduce,
        which runs when it is accumulated into ``.grad``. ``torch.autograd.grad(loss, params)`` never
        accumulates: it would return the Partial sum, different on every rank -- refused instead.

        Checked once per backward pass (autograd graph task), not per parameter: in one pass either
        every parameter gradient computed is accumulated (``.backward()``) or none is
        (``autograd.grad``), so the first hook of the pass answers for all; the rest compare an id."""
        accumulate = p.view_as(p).grad_fn.next_functions[0][0]  # p's AccumulateGrad node
        task_id = torch._C._current_graph_task_id

        def hook(grad: torch.Tensor) -> torch.Tensor:
            task = task_id()
            if task == self._guarded_task:
                return grad
            try:
                accumulates = torch._C._will_engine_execute_node(accumulate)
            except RuntimeError as exc:  # torch cannot ask about a leaf under autograd.grad, which never accumulates
                if "autograd.grad" not in str(exc):
                    raise
                accumulates = False
            if not accumulates:
                self._reset_sync()  # the aborted backward runs no queued sync: nothing pending after it
                self._restore_gradients()
                raise HapcError(
                    "torch.autograd.grad over parameters the plan replicates would return this rank's partial "
                    "gradient (they are summed across ranks when accumulated into .grad): call loss.backward() "
                    "and read p.grad instead (gradients with respect to inputs or activations are fine)"
                )
            self._guarded_task = task
            return grad

        return hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate this rank's Partial gradients without summing them
        across ranks (as ``DistributedDataParallel.no_sync``); the next backward outside sums
        everything accumulated in one go. Micro-batches of a pipeline stage use it: one gradient
        all-reduce per step instead of one per micro-batch. Gradients read inside are Partial."""
        if self.world > 1 and not self._unsynced:
            for p in self._sync_params:  # summed gradients of earlier steps wait aside, as accumulation does
                if p.grad is not None and id(p) not in self._carry:
                    self._carry[id(p)] = p.grad.clone() if p.grad is self._view_of.get(id(p)) else p.grad
                    p.grad = None
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def _prepare_accumulation(self) -> None:
        """Gradient accumulation: when replicated parameters already hold (summed) gradients, the
        next backward must all-reduce only its new Partial contributions. A one-shot hook moves
        each old gradient aside just before the new one is accumulated, and the sync adds it back.
        Without this, earlier gradients would be summed ``world`` times. Nothing is registered
        when gradients were zeroed with ``set_to_none`` (the default)."""
        self.__dict__["_before"] = {id(p): p.grad for p in self._sync_params if p.grad is not None}
        for h in self._stash_handles:
            h.remove()
        self._refuse_user_hooks()
        if self._unsynced:  # the gradients are no_sync's Partial sums: the next sync sums them all
            self._stash_handles = []
            return
        self._stash_handles = [p.register_hook(self._stash(p)) for p in self._sync_params if p.grad is not None]

    def _hook_counts(self) -> list[tuple[str, nn.Parameter, tuple[int, int]]]:
        """Each parameter with the gradient hooks hapc itself put on it (the sync's, the norms')."""
        return [(k, p, gradient_hooks(p)) for k, p in self.named_parameters()]

    def _refuse_user_hooks(self) -> None:
        """A hook added to a parameter after compile runs on this rank's part of its gradient --
        the Partial sum of a replicated parameter (summed across ranks after accumulation), this
        rank's slice of a sharded one -- not on the single-device gradient: refused, at the next
        forward (with several ranks; on one the gradient is whole and a hook is exact). Not while
        ``torch.compile`` traces the forward: dynamo's view of a parameter's hooks is not the
        parameter's (it counted more, refusing every compiled call). A module that only ever runs
        under ``torch.compile`` is checked at the end of each backward instead (``_finish_sync``,
        an eager callback), after the hook has run but before anything is stepped: the backward raises."""
        if torch.compiler.is_compiling():
            return
        for name, p, own in self._own_hooks:
            if gradient_hooks(p) != own:
                raise HapcError(
                    f"parameter {name!r} of the compiled module has a gradient hook added after hapc.compile "
                    "(Tensor.register_hook or register_post_accumulate_grad_hook): it would run on this rank's part "
                    "of the gradient -- a partial sum for a parameter the plan replicates (summed across ranks after "
                    "it is accumulated), this rank's slice for a sharded one -- not on the single-device gradient. "
                    "Remove the hook and transform p.grad after loss.backward() returns (it holds the "
                    "single-device gradient then, or this rank's slice of it); step optimizers after the backward "
                    "rather than in a hook"
                )

    def _stash(self, p: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if p.grad is not None and id(p) not in self._carry:
                view = self._view_of.get(id(p))
                # a gradient living in a bucket would be overwritten by the next sync: copy it out
                self._carry[id(p)] = p.grad.clone() if p.grad is view else p.grad
                p.grad = None
            return grad

        return hook

    def _end_of_backward(self) -> None:
        # a pass that synced nothing (torch.autograd.grad accumulates no .grad) puts back what the
        # stash hooks moved aside; a sync still to come does it itself, and under no_sync the
        # next sync does (the Partial sums must be summed first)
        self._restore_queued = False
        if self._syncing and not self._queued:
            self._restore_gradients()

    def _restore_gradients(self) -> None:
        if self._stash_handles:
            for h in self._stash_handles:
                h.remove()
            self.__dict__["_stash_handles"] = []
        if self._carry:  # (empty unless a stash hook or no_sync moved gradients aside)
            for p in self._sync_params:
                old = self._carry.pop(id(p), None)
                if old is not None:
                    p.grad = old if p.grad is None else p.grad.add_(old)

    def _reset_sync(self) -> None:
        # per-step state is written into __dict__: none of it is a parameter, buffer or submodule,
        # and nn.Module.__setattr__'s checks cost ~1.3 us an assignment on every step
        state = self.__dict__
        state["_ready"] = [0] * len(self._buckets)
        state["_launched"] = []  # (work, bucket, which of its parameters it sums) started this backward
        state["_next"] = 0
        state["_queued"] = False

    def _bucket_buffer(self, b: int) -> torch.Tensor:
        flat = self._flat[b]
        if flat is None:
            bucket = self._buckets[b]
            flat = self._flat[b] = torch.empty(sum(self._sizes[b]), dtype=bucket[0].dtype, device=bucket[0].device)
            views = self._views[b] = [view.view_as(p) for p, view in zip(bucket, torch.split(flat, self._sizes[b]))]
            for p, view in zip(bucket, views):
                self._view_of[id(p)] = view
        return flat

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # backward has reached the output. A backward that communicates before its gradient
        # buckets starts the loss all-reduce now, first; otherwise the first bucket starts it
        # (measured: 5-7% of a CPU data-parallel step cheaper than now, see LossChannel). With a
        # single bucket the sync is queued (see _setup_grad_sync)
        if self._backward_communicates:
            self._flush()
        if self._synced:  # a second backward of the same forward (retain_graph): its gradients
            self._prepare_accumulation()  # are summed already and must not be summed again
            self._synced = False
        if self._stash_handles and not self._restore_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._restore_queued = True
        if not self._output_hook:
            return
        if not self._syncing:
            self._unsynced = True
        elif not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_sync)
            self.__dict__["_queued"] = True

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._syncing:
            self._unsynced = True
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_sync)
            self._queued = True
        b = self._bucket_of[id(p)]
        self._ready[b] += 1
        if b == self._next and self._ready[b] == len(self._buckets[b]):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        # buckets go out in a fixed order so every rank issues the same all-reduces; one
        # torch.cat per bucket keeps the per-parameter Python work to a counter
        while self._next < len(self._buckets) and (force or self._ready[self._next] == len(self._buckets[self._next])):
            b = self._next
            flat = self._bucket_buffer(b)
            bucket, views = self._buckets[b], self._views[b]
            grads = [p.grad if self._contributes(p) else None for p in bucket]
            for p, g, view in zip(bucket, grads, views):
                if g is None and p.grad is view:  # an old sum living in the bucket stays out of this one
                    p.grad = view.clone()
            if not any(g is view for g, view in zip(grads, views)):
                torch.cat(
                    [g.reshape(-1) if g is not None else p.new_zeros(p.numel()) for g, p in zip(grads, bucket)],
                    out=flat,
                )
            else:  # gradients zeroed in place last step were accumulated right into the bucket
                for g, view in zip(grads, views):
                    if g is None:
                        view.zero_()
                    elif g is not view:
                        view.copy_(g)
            self._flush()  # a pending loss all-reduce goes first, on every rank
            summed = [g is not None for g in grads]
            self._launched.append((dist.all_reduce(flat, group=self.group, async_op=True), b, summed))
            self.__dict__["_next"] = b + 1

    def _contributes(self, p: nn.Parameter) -> bool:
        """Does ``p.grad`` hold a contribution of this rank to be summed now? Under ``no_sync`` every
        gradient held is one (earlier sums wait aside); otherwise one that the backward accumulated:
        a ``.grad`` the forward saw unchanged got nothing (``loss.backward(inputs=[...])`` without
        ``p``, or no path from the loss), and summing it again would multiply an earlier sum."""
        g = p.grad
        return g is not None and (self._unsynced or g is not self._before.get(id(p)))

    def _finish_sync(self) -> None:
        # Summed gradients stay in the bucket: each .grad becomes a view of it (no copy back, as
        # DDP's gradient_as_bucket_view). The next backward overwrites the bucket, so a gradient
        # tensor kept across steps must be cloned by whoever keeps it.
        self._launch_ready(force=True)
        for work, b, summed in self._launched:
            work.wait()
            for p, view, got in zip(self._buckets[b], self._views[b], summed):
                if got:  # else no gradient reached it (frozen, or left out of backward(inputs=...)): as on one device
                    p.grad = view
        self._restore_gradients()  # (removes the accumulation's own hooks, before the check below)
        self._reset_sync()
        self.__dict__["_unsynced"] = False
        self.__dict__["_synced"] = True
        if self.world > 1:  # (the forward's check does not run where torch.compile traced it; this
            self._refuse_user_hooks()  # callback runs eagerly: a hook added there is refused here)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this module's parameters: the single-device total
        norm on every rank (every rank must call; :mod:`hapc.codegen.grad_norm`)."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, **kwargs)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's whole gradient by ``state_dict`` name, gathered from the shards (all
        ranks must call; every rank gets it): what single-device training would hold in ``.grad``."""
        self._flush()
        out: dict[str, torch.Tensor | None] = {}
        for key, attr in self._targets().items():
            ref, lay = self._layouts[attr]
            p = self._tensor(attr)
            if not isinstance(p, nn.Parameter):
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            out[key] = self._gather(grad, ref, lay).cpu()
        return out

    # -- state_dict as tools expect it ------------------------------------------------------------------
    def state_dict(  # type: ignore[override]
        self, *, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The single-device ``state_dict``, keys as in the user's model: whole tensors (CPU copies)
        gathered from the shards, so ``torch.save`` on rank 0 then ``model.load_state_dict`` gives the
        trained model, and ``torch.distributed.checkpoint`` saves and loads it under any plan and
        world size (DCP sees the same whole tensor on every rank and writes it once). Every rank
        must call it when the plan shards a parameter (a gather, as FSDP's full state dict; on a
        process group of its own, so a rank calling it alone waits and times out instead of pairing
        with its peers' training collectives); under a plan that shards nothing it is local.
        Memory: one whole copy of the model per rank, briefly. ``keep_vars`` is ignored (copies)."""
        out: dict[str, Any] = destination if destination is not None else OrderedDict()
        group = self._state_group() if any(lay.is_sharded for _, lay in self._layouts.values()) else None
        for key, value in self._model_state(group).items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a single-device ``state_dict`` (keys as in the user's model; from ``state_dict()``,
        ``model.state_dict()``, ``full_state_dict()`` or a DCP load into ``state_dict()``): each
        rank copies its slices. ``assign`` is ignored (the shards stay the module's tensors)."""
        from .dcp_shards import ShardEntry

        expected = set(self._state_keys)
        missing = [k for k in self._state_keys if k not in state_dict]
        targets = self._targets()
        loaded_in_place = set()  # entries of this module's sharded_state_dict(): dcp.load wrote them already
        for key, value in state_dict.items():
            if isinstance(value, ShardEntry):
                live = self._tensor(targets[key]) if key in targets else None
                if live is None or value._local.data_ptr() != live.data_ptr():
                    raise HapcError(
                        f"{key!r} is another module's sharded_state_dict() entry (one rank's chunk): load it into "
                        "this module with dcp.load(module.sharded_state_dict(), ...), or pass whole tensors"
                    )
                loaded_in_place.add(key)
        unexpected = [k for k in state_dict if k not in expected]
        errors = [f"missing key(s) {missing[:5]}"] if strict and missing else []
        errors += [f"unexpected key(s) {unexpected[:5]}"] if strict and unexpected else []
        for key, attr in targets.items():
            want = tuple(self.theory.graph[self._layouts[attr][0]].shape)
            if key in state_dict and tuple(state_dict[key].shape) != want:
                errors.append(f"{key!r} has shape {tuple(state_dict[key].shape)}, the model's is {want}")
        if errors:
            raise RuntimeError(
                f"Error(s) in loading state_dict for CompiledModule: {'; '.join(errors)} (keys and shapes are the "
                "single-device model's, as module.state_dict() and model.state_dict() give them)"
            )
        self.load_full_state_dict(
            {k: v for k, v in state_dict.items() if k in expected and k not in loaded_in_place}, partial=True
        )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def sharded_state_dict(self) -> dict[str, Any]:
        """``state_dict`` for ``torch.distributed.checkpoint`` without gathering: keys as in the user's
        model; a tensor the plan shards is a :class:`~hapc.codegen.dcp_shards.ShardEntry` (this rank's
        ``(offset, size)`` chunk, described to DCP by its checkpointable protocol, uneven shards
        included), any other is this rank's copy (alike on every rank: DCP writes it once). Values are
        views of the module's own tensors, so ``dcp.save(module.sharded_state_dict(), ...)`` writes one
        chunk per rank and ``dcp.load(module.sharded_state_dict(), ...)`` loads in place, from a
        checkpoint written under any plan or world size, or from whole tensors (``state_dict()``, one
        device). Local: no communication. Not for ``torch.save`` (an entry is not a whole tensor)."""
        from .dcp_shards import shard_entry

        out: dict[str, Any] = OrderedDict()
        targets = self._targets()
        for key in self._state_keys:
            attr = targets.get(key)
            if attr is None:  # a tensor the program never reads: every rank keeps it whole
                out[key] = self._unused[key]
                continue
            ref, lay = self._layouts[attr]
            local = self._tensor(attr).detach()
            if lay.is_sharded:
                sizes = self.theory.local_sizes(ref, lay.dim, self.plan.device_ratios)
                out[key] = shard_entry(local, lay.dim, sum(sizes[: self.rank]), tuple(self.theory.graph[ref].shape))
            else:
                out[key] = local
        return out

    def _state_group(self) -> Any:
        if self.__dict__.get("_gather_group") is None:
            self.__dict__["_gather_group"] = same_ranks_group(self.group)
        return self.__dict__["_gather_group"]

    def unwrap(self) -> nn.Module:
        """Write the trained weights (and buffers) into the model this module was compiled from and
        return it: every rank must call it (it gathers the shards), every rank's model is then the
        single-device model. Until then, and again once this module trains on, using that model
        (a forward, ``state_dict()``, ``hapc.compile``) raises a ``HapcError`` instead of silently
        giving its initial weights (:mod:`hapc.codegen.original`)."""
        from .original import write_back

        return write_back(self, self.full_state_dict())

    # -- checkpoints ----------------------------------------------------------------------------------
    def full_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The single-device ``state_dict`` (all ranks must call; every rank gets it). With an
        optimizer: ``{"model": ..., "optimizer": {"state": {name: {...}}, "param_groups": [...]}}``."""
        model = self._model_state(self.group)
        if optimizer is None:
            return model
        state: dict[str, dict[str, Any]] = {}
        by_param: dict[int, tuple[str, str]] = {}
        for k, a in self._targets().items():  # a tied weight's state goes under its first name
            by_param.setdefault(id(self._tensor(a)), (k, a))
        for p, st in optimizer.state.items():
            if id(p) not in by_param:
                continue
            key, attr = by_param[id(p)]
            ref, lay = self._layouts[attr]
            state[key] = {k: self._gather_state(v, p, ref, lay) for k, v in st.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
        return {"model": model, "optimizer": {"state": state, "param_groups": groups}}

    def _model_state(self, group: Any) -> dict[str, torch.Tensor]:
        """The single-device model state, gathered over ``group`` (``None``: nothing is sharded)."""
        self._flush()
        gathered: dict[str, torch.Tensor] = {}
        for key, attr in self._targets().items():
            ref, lay = self._layouts[attr]
            gathered[key] = self._gather(self._tensor(attr), ref, lay, group).detach().cpu()
        model = {}
        for key in self._state_keys:  # trace-time constants are not part of the user's state
            model[key] = gathered[key] if key in gathered else self._unused[key].clone()
        return model

    def _gather_state(self, value: Any, p: torch.Tensor, ref: int, lay: Layout) -> Any:
        """One optimizer-state entry, whole: moments shaped like the shard are gathered like it."""
        if not torch.is_tensor(value):
            return value
        if value.dim() and value.shape == p.shape:
            return self._gather(value, ref, lay).cpu()
        return value.detach().cpu().clone()

    def load_full_state_dict(
        self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None = None, *, partial: bool = False
    ) -> None:
        """Load a single-device ``state_dict`` (or ``{"model", "optimizer"}`` from
        :meth:`full_state_dict`), slicing this rank's shards (``partial``: keys it lacks keep their values)."""
        model_sd = state["model"] if "model" in state and isinstance(state["model"], dict) else state
        missing = [k for k in self._targets() if k not in model_sd and k in self._state_keys]
        self.__dict__["_state_epoch"] = self.__dict__.get("_state_epoch", 0) + 1  # the original model is stale
        if missing and not partial:
            raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for key, attr in self._targets().items():
                if key not in model_sd:
                    continue  # a trace-time constant: it never changes
                ref, lay = self._layouts[attr]
                self._tensor(attr).copy_(self._slice(model_sd[key], ref, lay).to(self.device))
        for key in self._unused:
            if key in model_sd:
                self._unused[key] = model_sd[key].detach().cpu().clone()
        if optimizer is not None and "optimizer" in state:
            self._load_optimizer(optimizer, state["optimizer"])

    def carry_gradients(self, model: nn.Module) -> None:
        """Take over the gradients ``model`` holds at compile (a backward run before it): this rank's
        share of each becomes the ``.grad`` of the module's parameter, and the model's is cleared.

        With DDP the module *is* the model, so a loop that zeroes gradients after its step
        (``loss.backward(); opt.step(); opt.zero_grad()``) adds them into its first step; the next
        backward here accumulates into them the same way (replicated: the earlier sum waits aside
        while the new contributions are summed, :meth:`_prepare_accumulation`; sharded: each rank's
        slice accumulates its own)."""
        from .original import NoGrad

        targets = self._targets()
        with torch.no_grad():
            for key, q in model.named_parameters():
                if q.grad is None or isinstance(q.grad, NoGrad) or key not in targets:
                    continue
                attr = targets[key]
                p = self._tensor(attr)
                if p.requires_grad:
                    ref, lay = self._layouts[attr]
                    p.grad = self._slice(q.grad, ref, lay).to(device=p.device, dtype=p.dtype).clone()
                q.grad = None

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> None:
        targets = self._targets()
        for key, st in full["state"].items():
            attr = targets.get(key)
            if attr is None:
                continue
            p = self._tensor(attr)
            ref, lay = self._layouts[attr]
            whole = tuple(self.theory.graph[ref].shape)
            local = {}
            for k, v in st.items():
                if torch.is_tensor(v) and tuple(v.shape) == whole and v.dim():
                    local[k] = self._slice(v, ref, lay).to(self.device).clone()  # a moment, sharded like p
                elif torch.is_tensor(v):
                    local[k] = v.to(self.device).clone()
                else:
                    local[k] = v
            optimizer.state[p] = local
        load_param_groups(optimizer, full.get("param_groups", []))


class _Materializer:
    """Full values of the model's tensors; meta ones are drawn one module at a time
    (:mod:`hapc.materialize`), keeping only the current module's in memory."""

    def __init__(self, model: nn.Module, seed: int, init: Init | None):
        self.model, self.seed, self.init = model, seed, init
        self._qual: str | None = None
        self._values: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor.detach()
        qual, module = owner(self.model, name)
        if qual != self._qual:
            self._qual, self._values = qual, module_values(module, qual, self.seed, self.init)
        return self._values[name]


# runtime functions whose backward sends nothing; every other one of hapc.collectives communicates
_SILENT_BACKWARD = {C.take_shard, C.take_whole, C.all_reduce_start, C.wait, C.global_value, C.grad_scale}


#: reference-graph ops that draw rank-consistently from the module's stream (hapc.theory.rules.random)
_RANDOM_NODES = ("dropout",)


def _communicates(node: Any) -> bool:
    target = node.target if node.op == "call_function" else None
    return getattr(target, "__module__", "").startswith("hapc.collectives") and target not in _SILENT_BACKWARD


_DIFFERENT_BATCHES = (
    "the ranks were given different whole batches in this step: each counted the tokens of its "
    "own batch, so the loss and its gradients are not those of any one batch. Give every rank the "
    "same global batch on every call, or compile again and pass each rank its share of the batch"
)


def _whole_inputs(theory: Theory, plan: Plan) -> list[tuple[str, str]]:
    """``(name, error)`` of each model input the plan sources whole (replicated) somewhere."""
    names: list[str] = []
    for ins in plan.instructions:
        node = theory.graph[ins.ref] if isinstance(ins, Source) else None
        if node is not None and node.kind == INPUT and not ins.layout.is_sharded and node.name not in names:
            names.append(node.name)
    return [
        (
            name,
            f"input {name!r} differs between the ranks, but the plan takes it whole (every rank computes with all "
            "of it), so the loss and the gradients would mix the ranks' different values. Give every rank the same "
            f"{name!r} on every call (the global batch; the module takes each rank's share itself) -- draw per-step "
            "randomness such as masking targets with -100 from a generator seeded alike on every rank",
        )
        for name in names
    ]


def _hash_batch(batch: dict[str, torch.Tensor]) -> int:
    """56 bits of a blake2b hash of the tensors' names, shapes, dtypes and bytes (exact in int64,
    and so is its negation)."""
    h = hashlib.blake2b(digest_size=7)
    for name in sorted(batch):
        x = batch[name].detach().cpu().contiguous()
        h.update(f"{name}{tuple(x.shape)}{x.dtype}".encode())
        h.update(x.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return int.from_bytes(h.digest(), "little")


def _signature(model: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _call_checker(sig: inspect.Signature | None, owner: str, inputs: list[str]) -> Any:
    """What the model's own ``forward`` refuses, refused alike: an argument it has no parameter for
    (a keyword without ``**kwargs``, one positional too many without ``*args``) raises the
    ``TypeError`` one device raises, where binding by name would drop it silently."""
    params = sig.parameters.values() if sig is not None else ()
    names = {p.name for p in params}
    if sig is None or not all(n in names for n in inputs):  # a pipeline stage's or a segment's program
        return lambda args, kwargs: None  # (its inputs are the cut's, by name): its runtime binds them
    if any(p.kind == p.VAR_KEYWORD for p in params):
        keywords = None  # any keyword binds
    else:
        keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    most = None if any(p.kind == p.VAR_POSITIONAL for p in params) else sum(p.kind in kinds for p in params)

    def check(args: tuple, kwargs: dict) -> None:
        if most is not None and len(args) > most:
            raise TypeError(f"{owner}.forward() takes {most} positional argument(s) but {len(args)} were given")
        if keywords is not None:
            unknown = [k for k in kwargs if k not in keywords]
            if unknown:
                raise TypeError(f"{owner}.forward() got an unexpected keyword argument {unknown[0]!r}")

    return check


def _positional_names(sig: inspect.Signature | None, fallback: list[str]) -> list[str]:
    if sig is None:
        return list(fallback)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in sig.parameters.values() if p.kind in kinds]


def _sharded_input_dims(plan: Plan) -> dict[int, set[int]]:
    """Per node, the dims the plan sources it sharded on (checked by ``take_shard``)."""
    sharded: dict[int, set[int]] = {}
    for ins in plan.instructions:
        if isinstance(ins, Source) and ins.layout.is_sharded:
            sharded.setdefault(ins.ref, set()).add(ins.layout.dim)
    return sharded


def _warn_dropped_outputs(graph: Any) -> None:
    """Warn of returned tensors the program does not compute: the capture keeps what the loss
    depends on, so a tensor the model returns beside it (CLIP's ``logits_per_image``, the
    transpose of the ``logits_per_text`` its loss reads) comes back as ``None``."""
    import warnings

    from ..errors import DroppedOutputWarning
    from ..theory.capture import leaf_paths

    spec = graph.output_spec
    if spec is None or not graph.outputs:
        return
    paths = leaf_paths(spec)
    dropped = [paths.get(k, f"[{k}]") for k, r in enumerate(graph.outputs) if r is None and k != graph.loss_leaf]
    if dropped:
        warnings.warn(
            f"the model returns {', '.join(dropped)} but its loss does not depend on "
            f"{'it' if len(dropped) == 1 else 'them'}: hapc's program computes what the loss needs, so the "
            "compiled module returns None there. Compute such tensors from the ones it returns (e.g. a "
            "transpose), or on one device for evaluation",
            DroppedOutputWarning,
            stacklevel=3,
        )


def _check_inputs(inputs: list[Any], sharded: dict[int, set[int]], bound: dict[str, Any]) -> None:
    """Refuse inputs whose rank, dtype or unsharded sizes differ from the traced ones (the
    sharded dim is checked where the rank takes its share): the program's literal shapes were
    made for those, and a broadcast could otherwise compute something else without an error."""
    for n in inputs:
        x = bound[n.name]
        if not isinstance(x, torch.Tensor):
            continue  # take_shard / take_whole name it
        free = sharded.get(n.index, set())
        same = x.dim() == len(n.shape) and all(a == b or d in free for d, (a, b) in enumerate(zip(x.shape, n.shape)))
        if not same:
            raise HapcError(
                f"input {n.name!r} has shape {tuple(x.shape)} but the plan was synthesized for {tuple(n.shape)}"
                + (f" (dim {sorted(free)[0]} may be this rank's share)" if free else "")
                + "; pass inputs shaped like the example inputs, or synthesize and compile again for the new shape"
            )
        want = n.meta.dtype
        if x.dtype != want and (x.dtype.is_floating_point or want.is_floating_point):
            raise HapcError(
                f"input {n.name!r} is {x.dtype} but the plan was synthesized for {want}; cast it "
                f"(x.to({want})) or synthesize and compile again for that dtype"
            )


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    out.update(dict(model.named_buffers()))
    for name, value in vars(model).items():  # constants fx attached to the root while tracing
        if name.startswith("_tensor_constant") and isinstance(value, torch.Tensor):
            out[name] = value
    return out
