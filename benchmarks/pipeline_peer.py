"""hapc's pipeline runtime against PyTorch's own (issue 15, acceptance 2).

Three gloo processes on this machine run one GPT cut into three stages at hapc's
``balanced_cuts``, one process per stage, side by side in the same processes:

* **hapc**: :class:`hapc.pipeline.runtime.PipelineModule` with the 1F1B warm-ups ``[3, 2, 1]``;
* **PyTorch**: ``torch.distributed.pipelining.PipelineStage`` + ``Schedule1F1B`` over hand-built
  stages: each is a ``torch.fx.GraphModule`` holding exactly the parameters of hapc's stage (the
  same ``state_dict`` names and values) and computing exactly its ops, the cut's activations packed
  into one ``[rows, features]`` message as hapc sends them. The last stage ends at the loss's
  input; the loss (``cross_entropy`` of it and the targets) is ``Schedule1F1B``'s ``loss_fn``, and
  ``scale_grads`` divides by the micro-batch count as hapc's ``1/M`` seeds do.

Both are checked against one device in float64 first (batch loss and every gradient, rtol 1e-9),
then timed in float32: blocks of steps alternate between the two (a step is ``zero_grad`` plus the
pipeline's forward and backward of every micro-batch; its time runs from a barrier to the last
stage's end, the slower rank's); each of ``--rounds`` rounds starts fresh processes and takes each
side's median step and their ratio; the table shows the median of the rounds' ratios and their
range (each round pairs the two sides under the same load; the machine's load moves between rounds,
so the times, medians over rounds, may come from different rounds for the two sides).

**CPU time**: the processes' CPU time (all threads, summed over the stages) per step, hapc's
over torch's. **Memory**: the peak of the bytes the CPU allocator holds beyond what it held when
the step started, on each stage, during one step of each side (``torch.profiler``'s raw
allocation and free events, summed in time order; the same measurement for both; buffers either
runtime keeps from one step to the next are not counted).

**Slow link**: every cross-stage message is delayed by the same emulator for both sides (a
shim around the process group's ``send`` and ``recv``, which ``torch.distributed``'s point-to-point
calls and hapc's messages both go through; hapc's own ``emulate`` option is not used): the
sender stamps each message's arrival time ``max(now, link free) + latency + bytes / bandwidth`` in
shared memory, one transfer at a time per direction, and the receiver's wait returns no sooner.
The bandwidth is set so that one micro-batch's activations take ``--link-share`` of the slowest
stage's forward + backward; hapc runs H-1F1B (warm-ups from HARP Eq. 1-2 on the measured times)
and PyTorch ``Schedule1F1B``.

    python benchmarks/pipeline_peer.py [--rounds 5] [--steps 16] [--micro 8 32] [--link-share 0.6]
                                       [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import fx, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hapc.errors import HapcError
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batches
from hapc.pipeline.schedule import h1f1b_warmup, one_f_one_b_warmup
from hapc.pipeline.stages import StageGraph, balanced_cuts, split_graph
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace
from hapc.theory.graph import BUFFER, INPUT, OP, PARAM, _getattr, map_refs
from models.gpt import GPT, GPTConfig
from models.layers import build, tokens

STAGES = 3
FULL = {"cfg": GPTConfig(layers=6, hidden=128, heads=4, vocab=512, seq=64), "batch": 64}
QUICK = {"cfg": GPTConfig(layers=3, hidden=32, heads=4, vocab=97, seq=16), "batch": 8}


def gpt(cfg: GPTConfig, batch: int, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = build(lambda: GPT(cfg), None, dtype, 0)
    return model, (tokens((batch, cfg.seq), cfg.vocab, None, 0), tokens((batch, cfg.seq), cfg.vocab, None, 7))


# ----------------------------------------------------------------------------- torch's stages


def _safe(name: str) -> str:
    return name.replace(".", "__")


def torch_stage(sg: StageGraph, model: nn.Module, last: bool) -> tuple[fx.GraphModule, Any]:
    """hapc's stage ``sg`` as a plain ``fx.GraphModule`` holding its own copies of the stage's
    parameters, and for the last stage the loss function ``(output, target) -> loss`` that
    ``Schedule1F1B`` applies (the ops that read the targets)."""
    g = sg.graph
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    root = nn.Module()
    inputs = sg.model_inputs
    if sg.index > 0 and inputs and not (last and len(inputs) == 1):
        raise HapcError(f"stage {sg.index} reads model inputs {inputs}: torch's later stages only get activations")
    # the last stage's loss part: every op that depends on a model input (the targets)
    data = {n.index for n in g if n.kind == INPUT and n.name in inputs} if last else set()
    for n in g:
        if n.kind == OP and any(o in data for o in n.operands):
            data.add(n.index)
    if last:
        bound = {o for n in g if n.index in data for o in n.operands if o not in data}
        if len(bound) != 1 or g.loss.index not in data:
            raise HapcError(f"the last stage's loss reads {len(bound)} activations, not one")
        (boundary,) = bound
    fg, lg = fx.Graph(), fx.Graph()
    env: dict[int, fx.Node] = {}
    lenv: dict[int, fx.Node] = {}
    if sg.index > 0:
        x = fg.placeholder("x")
        parts = fg.call_function(sg.unpack, (x,))
        acts = [n for n in g if n.kind == INPUT and n.name not in inputs]
        for i, n in enumerate(acts):
            env[n.index] = fg.call_function(operator.getitem, (parts, i))
    for n in g:
        if n.index in data:
            continue
        if n.kind == INPUT and n.index not in env:
            env[n.index] = fg.placeholder(n.name)
        elif n.kind in (PARAM, BUFFER):
            value = state[n.target] if n.target in state else _getattr(g.module, n.target)
            value = value.detach().clone()
            if n.kind == PARAM:
                root.register_parameter(_safe(n.target), nn.Parameter(value))
            else:
                root.register_buffer(_safe(n.target), value)
            env[n.index] = fg.get_attr(_safe(n.target))
        elif n.kind == OP:
            env[n.index] = _emit(fg, n, env)
    if not last:
        fg.output(env[len(g) - 1])
        return fx.GraphModule(root, fg), None
    fg.output(env[boundary])
    lenv[boundary] = lg.placeholder("output")
    for n in g:
        if n.index not in data:
            continue
        lenv[n.index] = lg.placeholder(n.name) if n.kind == INPUT else _emit(lg, n, lenv)
    lg.output(lenv[g.loss.index])
    return fx.GraphModule(root, fg), fx.GraphModule(nn.Module(), lg)


def _not_last(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise AssertionError("only the last stage computes the loss")


def _emit(graph: fx.Graph, n: Any, env: dict[int, fx.Node]) -> fx.Node:
    args, kwargs = map_refs((n.args, n.kwargs), lambda r: env[r.index])
    if n.is_method:
        out = graph.call_method(n.target, args, kwargs)
    else:
        out = graph.call_function(n.target, args, kwargs)
    return out if n.out_index is None else graph.call_function(operator.getitem, (out, n.out_index))


# ----------------------------------------------------------------------------- an emulated slow link


class Link:
    """The same slow link for both runtimes: wraps the process group's ``send`` and ``recv``, which
    ``torch.distributed``'s ``isend``/``irecv``/``recv`` and hapc's messages all go through.

    The sender writes each message's arrival time in ``board`` (shared memory, created before the
    processes fork), the receiver's ``recv(...).wait()`` sleeps until then. Messages between two
    ranks with one tag arrive in order, so the k-th receive from a rank with a tag reads the k-th
    stamp its sender wrote for that tag."""

    SLOTS = 1 << 14

    def __init__(self, world: int):
        self.board = torch.zeros(world, world, 4, self.SLOTS, dtype=torch.float64).share_memory_()
        self.bandwidth = 0.0  # bytes per second; 0: no emulation
        self.latency = 0.0

    def install(self) -> None:
        from torch._C._distributed_c10d import ProcessGroup

        self.sent: dict[tuple[int, int], int] = {}
        self.got: dict[tuple[int, int], int] = {}
        self.free: dict[int, float] = {}
        self.me = dist.get_rank()
        send, recv = ProcessGroup.send, ProcessGroup.recv
        link = self

        def delayed_send(pg: Any, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
            link._stamp(tensors[0], dist.get_global_rank(pg, dst), tag)
            return send(pg, tensors, dst, tag)

        def delayed_recv(pg: Any, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
            peer = dist.get_global_rank(pg, src)
            seq = link.got.get((peer, tag), 0)  # receives match sends in the order they are posted
            link.got[peer, tag] = seq + 1
            return _Delayed(recv(pg, tensors, src, tag), link, peer, tag, seq)

        ProcessGroup.send, ProcessGroup.recv = delayed_send, delayed_recv

    def _stamp(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if not self.bandwidth:
            return
        seq = self.sent.get((dst, tag), 0)
        self.sent[dst, tag] = seq + 1
        start = max(time.monotonic(), self.free.get(dst, 0.0))  # one transfer at a time per direction
        self.free[dst] = start + tensor.numel() * tensor.element_size() / self.bandwidth
        self.board[self.me, dst, tag % 4, seq % self.SLOTS] = self.free[dst] + self.latency

    def _arrive(self, src: int, tag: int, seq: int) -> None:
        if not self.bandwidth:
            return
        wait = float(self.board[src, self.me, tag % 4, seq % self.SLOTS]) - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def reset(self, bandwidth: float, latency: float) -> None:
        """Start over (every rank at a barrier, with no message in flight)."""
        self.bandwidth, self.latency = bandwidth, latency
        self.sent.clear(), self.got.clear(), self.free.clear()


class _Delayed:
    """A receive whose ``wait`` also waits for the message's emulated arrival."""

    def __init__(self, work: Any, link: Link, src: int, tag: int, seq: int):
        self.work, self.link, self.src, self.tag, self.seq = work, link, src, tag, seq

    def wait(self, *args: Any) -> bool:
        out = self.work.wait(*args)
        self.link._arrive(self.src, self.tag, self.seq)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


# ----------------------------------------------------------------------------- one job


def _spec(graph: Any, warmups: list[int], num_micro: int) -> PipelineSpec:
    return PipelineSpec(
        cuts=balanced_cuts(graph, [1] * STAGES),
        ranks=[[k] for k in range(STAGES)],
        clusters=[cluster_of([1e10]) for _ in range(STAGES)],
        warmups=warmups,
        num_micro=num_micro,
    )


class Sides:
    """Both runtimes of one model on this rank, and a step of each."""

    def __init__(self, cfg: GPTConfig, batch: int, num_micro: int, dtype: torch.dtype, warmups: list[int]):
        rank = dist.get_rank()
        self.model, self.inputs = gpt(cfg, batch, dtype)
        graph = trace(self.model, micro_batches(self.inputs, num_micro, batch)[0])
        spec = _spec(graph, warmups, num_micro)
        self.hapc = PipelineModule(self.model, self.inputs, spec)
        sg = split_graph(graph, spec.cuts)[rank]
        self.last = rank == STAGES - 1
        module, loss_fn = torch_stage(sg, self.model, self.last)
        self.torch_module = module
        self.names = {_safe(k): k for k in self.hapc.stage_tensors[rank]}
        self.first_args = tuple(self.inputs[self.model_index(n)] for n in sg.model_inputs) if rank == 0 else ()
        # the shapes of the messages, given (static metadata): no inference step with its own traffic
        if rank == 0:
            example = tuple(micro_batches(self.first_args, num_micro, batch)[0])
        else:
            rows = sg.recv_meta[0].shape[0]
            shape = (rows, sg.recv_numel // rows) if sg.by_rows else (sg.recv_numel,)
            example = (torch.zeros(shape, dtype=dtype, requires_grad=True),)  # (its gradient goes back)
        out = module(*example).detach().requires_grad_()  # (a gradient comes back)
        self.stage = PipelineStage(module, rank, STAGES, torch.device("cpu"), input_args=example, output_args=(out,))
        # every rank passes a loss function: Schedule1F1B runs backwards only where it has one
        self.schedule = Schedule1F1B(self.stage, num_micro, loss_fn=loss_fn or _not_last)
        self.losses: list[torch.Tensor] = []

    def model_index(self, name: str) -> int:
        return self.hapc.input_names.index(name)

    def hapc_step(self) -> None:
        for p in self.hapc.parameters():
            p.grad = None
        self.hapc.train_step(*self.inputs)

    def torch_step(self) -> None:
        self.torch_module.zero_grad(set_to_none=True)
        self.losses = []
        target = self.inputs[1] if self.last else None
        self.schedule.step(*self.first_args, target=target, losses=self.losses if self.last else None)


def check_job(rank: int, world: int, cfg: GPTConfig, batch: int, num_micro: int) -> dict:
    """float64: hapc's and torch's batch loss and gradients on this rank's stage."""
    torch.set_default_dtype(torch.float64)
    sides = Sides(cfg, batch, num_micro, torch.float64, one_f_one_b_warmup(STAGES))
    loss = sides.hapc.train_step(*sides.inputs)
    hapc_grads = sides.hapc.full_gradients()
    sides.torch_step()
    torch_grads = {sides.names[k]: p.grad for k, p in sides.torch_module.named_parameters()}
    torch_loss = float(torch.stack(sides.losses).detach().mean()) if sides.last else None
    return {"hapc_loss": float(loss), "hapc_grads": hapc_grads, "torch_loss": torch_loss, "torch_grads": torch_grads}


def _timed(step: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()  # the step ends when the last stage's last backward does
        out.append(time.perf_counter() - t0)
    return out


def _cpu(step: Any, n: int) -> float:
    t0 = time.process_time()
    _timed(step, n)
    return (time.process_time() - t0) / n


def _interleave(a: Any, b: Any, total: int, block: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    _timed(a, 2), _timed(b, 2)  # warm-up: allocator, torch's shape inference
    while len(ta) < total:
        ta += _timed(a, block)
        tb += _timed(b, block)
    return ta, tb


def peak_bytes(step: Any) -> int:
    """The peak of the allocator's bytes beyond those held when ``step`` starts: every CPU
    allocation and free ``torch.profiler`` records (its raw events), summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    dist.barrier()
    return peak


def time_job(
    rank: int, world: int, cfg: GPTConfig, batch: int, num_micro: int, steps: int, link: Link, share: float
) -> dict:
    """float32: interleaved steps; memory; then the slow link (1F1B vs hapc's H-1F1B)."""
    link.install()
    sides = Sides(cfg, batch, num_micro, torch.float32, one_f_one_b_warmup(STAGES))
    block = 2  # steps per side before switching: short blocks, so drifting machine load hits both alike
    th, tt = _interleave(sides.hapc_step, sides.torch_step, steps, block)
    cpu_h, cpu_t = _cpu(sides.hapc_step, block), _cpu(sides.torch_step, block)
    mem_h, mem_t = peak_bytes(sides.hapc_step), peak_bytes(sides.torch_step)
    # the slow link: each stage's forward + backward per micro-batch, from a plain hapc step
    sides.hapc_step()
    t_stage = torch.tensor([sides.hapc.compute_seconds / num_micro])
    times = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(times, t_stage)
    t_max = max(float(t) for t in times)
    rows = sides.hapc.cut[0].rows * sides.hapc.cut[0].features * 4  # bytes of one micro-batch's message
    bandwidth = rows / (share * t_max)
    warm = h1f1b_warmup([float(t) for t in times], [share * t_max] * (STAGES - 1))
    h1 = Sides(cfg, batch, num_micro, torch.float32, warm)  # the same model and parameters
    dist.barrier()
    link.reset(bandwidth, 0.0)
    ts_h, ts_t = _interleave(h1.hapc_step, sides.torch_step, max(3, steps // 2), block)
    dist.barrier()
    link.reset(0.0, 0.0)
    return {
        "hapc": th,
        "torch": tt,
        "cpu_hapc": cpu_h,
        "cpu_torch": cpu_t,
        "mem_hapc": mem_h,
        "mem_torch": mem_t,
        "slow_hapc": ts_h,
        "slow_torch": ts_t,
        "warmups": warm,
        "bandwidth": bandwidth,
        "t_max": t_max,
        "link_s": share * t_max,
    }


# ----------------------------------------------------------------------------- the report


def _max_rank(res: list[dict], key: str) -> list[float]:
    return [max(t) for t in zip(*(r[key] for r in res))]  # each step: the slower rank's time


def check(cfg: GPTConfig, batch: int, num_micro: int) -> dict:
    """Both runtimes against one device in float64; raises on a mismatch."""
    res = run_distributed(check_job, STAGES, cfg, batch, num_micro, timeout=300)
    torch.set_default_dtype(torch.float64)
    try:
        model, inputs = gpt(cfg, batch, torch.float64)
        loss = model(*inputs)
        loss.backward()
        loss = loss.detach()
    finally:
        torch.set_default_dtype(torch.float32)
    ref = {k: p.grad for k, p in model.named_parameters()}
    torch_grads = {k: v for r in res for k, v in r["torch_grads"].items()}
    worst = {"hapc": 0.0, "torch": 0.0}
    for side, loss_value, grads in (
        ("hapc", res[0]["hapc_loss"], res[0]["hapc_grads"]),
        ("torch", res[-1]["torch_loss"], torch_grads),
    ):
        if set(grads) != set(ref):
            raise AssertionError(f"{side}: gradients of {sorted(set(ref) ^ set(grads))[:3]} missing or extra")
        errs = [abs(loss_value - float(loss)) / abs(float(loss))]
        # relative to the largest gradient: a key bias's gradient is exactly 0 up to rounding in both
        scale = max(float(g.abs().max()) for g in ref.values())
        errs += [float((grads[k] - g).abs().max()) / scale for k, g in ref.items()]
        worst[side] = max(errs)
        if worst[side] > 1e-9:
            raise AssertionError(f"{side}'s pipeline differs from one device: relative error {worst[side]:.2e}")
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, each on fresh processes")
    ap.add_argument("--micro", type=int, nargs="*", default=[8, 32], help="micro-batch counts")
    ap.add_argument("--link-share", type=float, default=0.6, help="slow link: one message / slowest stage time")
    ap.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few steps, one round (smoke test)")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    cfg, batch = size["cfg"], size["batch"]
    steps, rounds, micros = (3, 1, [4]) if args.quick else (args.steps, args.rounds, args.micro)
    checked = check(cfg, batch, micros[0])  # the timed model and cut, in float64
    load = os.getloadavg()[0]  # this machine is shared: say how busy it was
    rows = []
    for m in micros:
        per = []
        for _ in range(rounds):
            link = Link(STAGES)
            per.append(run_distributed(time_job, STAGES, cfg, batch, m, steps, link, args.link_share, timeout=1800))
        rows.append(_summarise(m, per))
    load = max(load, os.getloadavg()[0])
    _print(cfg, batch, steps, rounds, checked, rows, load)
    result = {
        "config": {**cfg.__dict__, "batch": batch},
        "steps": steps,
        "rounds": rounds,
        "check": checked,
        "load_average": load,
        "rows": rows,
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _summarise(m: int, per: list[list[dict]]) -> dict:
    def med(key: str) -> list[float]:
        return [statistics.median(_max_rank(res, key)) for res in per]

    h, t, sh, st = med("hapc"), med("torch"), med("slow_hapc"), med("slow_torch")
    first = [res[0] for res in per]
    # each round's ratio pairs the two sides' steps interleaved in the same processes and minutes; the
    # ratio is the median of those (not the ratio of the two sides' medians over rounds, which would
    # divide one round's hapc time by another round's torch time under another load)
    ratios, slow = [a / b for a, b in zip(h, t)], [a / b for a, b in zip(sh, st)]
    return {
        "micro": m,
        "hapc_s": statistics.median(h),
        "torch_s": statistics.median(t),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "cpu_ratio": statistics.median(
            sum(r["cpu_hapc"] for r in res) / sum(r["cpu_torch"] for r in res) for res in per
        ),
        # peak extra bytes per stage: the largest over rounds
        "mem_hapc": [max(res[k]["mem_hapc"] for res in per) for k in range(STAGES)],
        "mem_torch": [max(res[k]["mem_torch"] for res in per) for k in range(STAGES)],
        "slow_hapc_s": statistics.median(sh),
        "slow_torch_s": statistics.median(st),
        "slow_ratio": statistics.median(slow),
        "slow_ratios": slow,
        "warmups": first[0]["warmups"],
        "link_ms": 1e3 * statistics.median(r["link_s"] for r in first),
        "bandwidth_MBps": statistics.median(r["bandwidth"] for r in first) / 1e6,
    }


def _print(cfg: GPTConfig, batch: int, steps: int, rounds: int, checked: dict, rows: list[dict], load: float) -> None:
    console = Console(width=140)
    console.print(
        f"pipeline_peer: GPT (layers {cfg.layers}, hidden {cfg.hidden}, seq {cfg.seq}, vocab {cfg.vocab}), batch "
        f"{batch}, {STAGES} stages at hapc's balanced_cuts, one gloo process each, float32; {os.cpu_count()} cores, "
        f"load average up to {load:.1f} during the run."
    )
    console.print(
        f"Both equal one device in float64 (largest relative error: hapc {checked['hapc']:.1e}, "
        f"torch {checked['torch']:.1e})."
    )
    table = Table(
        title=f"1F1B step: median of {steps} interleaved steps per side and round; ms: median over {rounds} round(s); "
        "hapc / torch: median of the rounds' ratios"
    )
    for col in (
        "micro-batches",
        "hapc ms",
        "torch ms",
        "hapc / torch",
        "range",
        "CPU time hapc / torch",
        "peak extra MB per stage: hapc",
        "torch",
        "goal",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        mem_ok = all(a <= 1.1 * b for a, b in zip(r["mem_hapc"], r["mem_torch"]))
        ok = "[green]met[/]" if r["ratio"] <= 1.0 and mem_ok else "[red]missed[/]"
        table.add_row(
            str(r["micro"]),
            f"{r['hapc_s'] * 1e3:.1f}",
            f"{r['torch_s'] * 1e3:.1f}",
            f"{r['ratio']:.3f}",
            f"{min(r['ratios']):.3f}-{max(r['ratios']):.3f}",
            f"{r['cpu_ratio']:.3f}",
            " / ".join(f"{b / 1e6:.1f}" for b in r["mem_hapc"]),
            " / ".join(f"{b / 1e6:.1f}" for b in r["mem_torch"]),
            f"<= 1.00, mem <= torch + 10 % {ok}",
        )
    console.print(table)
    slow = Table(
        title="an emulated slow link between the stages (the same emulator for both): hapc H-1F1B vs torch "
        "Schedule1F1B; hapc / torch: median of the rounds' ratios"
    )
    for col in (
        "micro-batches",
        "link ms / message",
        "MB/s",
        "H-1F1B warm-ups",
        "hapc ms",
        "torch ms",
        "hapc / torch",
        "range",
        "goal",
    ):
        slow.add_column(col, justify="right")
    for r in rows:
        ok = "[green]met[/]" if r["slow_ratio"] < 1.0 else "[red]missed[/]"
        slow.add_row(
            str(r["micro"]),
            f"{r['link_ms']:.1f}",
            f"{r['bandwidth_MBps']:.1f}",
            str(r["warmups"]),
            f"{r['slow_hapc_s'] * 1e3:.1f}",
            f"{r['slow_torch_s'] * 1e3:.1f}",
            f"{r['slow_ratio']:.3f}",
            f"{min(r['slow_ratios']):.3f}-{max(r['slow_ratios']):.3f}",
            f"< 1 {ok}",
        )
    console.print(slow)


if __name__ == "__main__":
    sys.exit(main())
