"""A pipeline draws the dropout masks of hapc's one-rank run, whatever its stages and micro-batches.

Every hapc plan draws a random op's mask as a function of (seed, step, op, *global* element index)
(:mod:`hapc.theory.rules.random`), so any plan trains bit for bit like the one-rank run of the whole
batch. A pipeline runs its stages on one micro-batch at a time: each micro-batch used to draw at a
step of its own, over its own rows -- valid masks, but not the batch's, and different for each
micro-batch count (a 2-stage model with dropout: first loss 4.550 at 2 micro-batches, 3.448 at
4, against the one-rank run's 4.379), silently. Now micro-batch ``m`` draws its rows of the batch's
masks at the batch's step (:meth:`hapc.ops.RandomStream.locate`, :func:`micro_batch_dims`).

Checked in float64 on gloo processes against the one-rank run: dropout on activations, SDPA's
attention dropout and per-sample stochastic depth; 2 and 3 stages, a sharded stage, two replicas,
recomputation in backward, DDP's ``loss = module(...)`` + ``backward()`` order; a random op whose
tensor does not split by micro-batch is refused.
"""

from __future__ import annotations

import pytest
import realworld
import torch
import torch.nn.functional as F
from harness import pipeline_spec
from torch import nn

import hapc
from hapc.errors import HapcError
from hapc.pipeline.runtime import PipelineModule, PipelineSpec, micro_batch_dims, micro_batches
from hapc.pipeline.stages import balanced_cuts
from hapc.testing import cluster_of, run_distributed
from hapc.theory import trace

F64 = torch.float64
TV = realworld.import_torchvision()  # (beside a CPU torch)
BATCH, STEPS = 8, 3


class Drops(nn.Module):
    """Token embedding, then blocks of attention (SDPA with attention dropout), a dropped MLP and a
    residual dropped per sample (stochastic depth)."""

    def __init__(self, vocab: int = 40, dim: int = 16, heads: int = 2, blocks: int = 3):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(blocks))
        self.mlp = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        self.drop = nn.Dropout(0.3)
        self.depth = TV.ops.StochasticDepth(0.25, "row")  # its function is an fx leaf: one draw per sample
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.emb(idx))
        b, t, d = h.shape
        for qkv, mlp in zip(self.qkv, self.mlp):
            x = qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            q, k, v = x[0], x[1], x[2]  # (indexed: fx cannot unpack a proxy)
            a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)
            h = h + a.transpose(1, 2).reshape(b, t, d)
            h = h + self.depth(self.drop(torch.relu(mlp(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    idx = torch.randint(0, 40, (BATCH, 6), generator=torch.Generator().manual_seed(1))
    return Drops().double(), (idx, idx.roll(-1, dims=1))


def _train(module, inputs, ddp: bool = False) -> dict:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        if ddp:
            loss = module(*inputs)
            loss.backward()
        else:
            loss = module.train_step(*inputs)
        losses.append(float(loss))
        optimizer.step()
    return {"losses": losses, "state": module.full_state_dict()}


def _one_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    model, inputs = _model()
    return _train(hapc.compile(model, cluster_of([1e10]), inputs), inputs)


#: (stage weights, ranks per stage, flops per rank, warm-ups, micro-batches, replicas, recompute,
#: the last stage's memory per device, DDP's order)
CASES = {
    "two stages": ([1, 1], [[0], [1]], [1e10, 1e10], [2, 1], 4, None, None, "4 GiB", False),
    "two stages, module(...) and backward": ([1, 1], [[0], [1]], [1e10, 1e10], [2, 1], 2, None, None, "4 GiB", True),
    "three stages": ([1, 1, 1], [[0], [1], [2]], [1e10] * 3, [3, 2, 1], 4, None, None, "4 GiB", False),
    # the last stage on two ranks at uneven speeds, too little memory for a whole copy: sharded
    "sharded last stage": ([1, 1], [[0], [1, 2]], [1e10, 8e9, 3e9], [2, 1], 4, None, None, "60 KiB", False),
    "two replicas": ([1, 1], [[0], [1]], [1e10] * 4, [2, 1], 4, [[[0], [1]], [[2], [3]]], None, "4 GiB", False),
    "recomputed in backward": ([1, 1], [[0], [1]], [1e10, 1e10], [2, 1], 4, None, [True, True], "4 GiB", False),
}


def _job(rank, world, weights, ranks, flops, warmups, num_micro, replicas, recompute, memory, ddp):
    torch.set_num_threads(1)
    model, inputs = _model()
    spec = pipeline_spec(model, inputs, weights, ranks, flops, warmups, num_micro, replicas, memory, recompute)
    pm = PipelineModule(model, inputs, spec)
    out = _train(pm, inputs, ddp)
    mod = pm.stage_module
    out["sharded"] = any(lay.is_sharded for _, lay in mod._layouts.values())
    out["recomputes"] = pm.recomputes
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_distributed(_one_rank, 1, timeout=120)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_pipeline_draws_the_masks_of_the_one_rank_run(case, one_rank):
    ranks, replicas, recompute = CASES[case][1], CASES[case][5], CASES[case][6]
    world = sum(len(rs) for rep in (replicas or [ranks]) for rs in rep)
    results = run_distributed(_job, world, *CASES[case], timeout=300)
    model, inputs = _model()
    model.eval()  # no masks: the dropout must change the losses, else this test proves nothing
    assert abs(float(model(*inputs)) - one_rank["losses"][0]) > 1e-3
    for rank, got in enumerate(results):
        assert got["losses"] == pytest.approx(one_rank["losses"], rel=1e-12, abs=0), f"rank {rank}"
        for k, v in one_rank["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {k}")
    if case == "sharded last stage":
        assert any(r["sharded"] for r in results)  # the case is the one it names
    if recompute:
        assert all(r["recomputes"] for r in results)


def test_draws_are_located_by_the_batch_dim_of_their_tensor():
    """The attention dropout splits the batch along dim 0 of ``[b, heads, t, t]``; the per-sample
    drop along dim 0; none of them at 1 micro-batch."""
    model, inputs = _model()
    graph = trace(model, micro_batches(inputs, 4, BATCH)[0])
    dims = micro_batch_dims(model, inputs, graph, 4)
    ops = {n.name: n.op for n in graph}
    assert dims and set(dims.values()) == {0}
    assert {"scaled_dot_product_attention", "dropout"} <= {ops[k] for k in dims}
    assert micro_batch_dims(model, inputs, graph, 1) == {}


class _Pairs(nn.Module):
    """A dropout on a batch x batch matrix (every sample against every other): both dims change with
    the micro-batch, so a micro-batch's masks cannot be a slice of the batch's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        s = F.dropout(h @ h.transpose(0, 1), 0.1, self.training)  # [b, b]
        return ((s.sum(-1) - y) ** 2).mean()


def test_a_draw_that_does_not_split_by_micro_batch_is_refused_naming_the_fix():
    torch.manual_seed(0)
    model, x, y = _Pairs().double(), torch.randn(8, 4, dtype=F64), torch.randn(8, dtype=F64)
    graph = trace(model, micro_batches((x, y), 2, 8)[0])
    with pytest.raises(HapcError, match=r"\[4, 4\] per micro-batch, \[8, 8\] for the whole batch.*pipeline=False"):
        micro_batch_dims(model, (x, y), graph, 2)


class _Noise(nn.Module):
    """Noise drawn from torch's own generator in forward: one device draws it over the batch, a
    pipeline's processes would each draw their micro-batches' from generators of their own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc[1](torch.relu(self.fc[0](x)) * torch.rand_like(x))
        return ((h.sum(-1) - y) ** 2).mean()


def _noise_job(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model, x, y = _Noise().double(), torch.randn(8, 4, dtype=F64), torch.randn(8, dtype=F64)
    graph = trace(model, micro_batches((x, y), 2, 8)[0])
    spec = PipelineSpec(cuts=balanced_cuts(graph, [1, 1]), ranks=[[0], [1]], clusters=[cluster_of([1e10])] * 2,
                        warmups=[2, 1], num_micro=2)  # fmt: skip
    with pytest.raises(HapcError, match=r"rand_like at .*so replicas would diverge") as caught:
        PipelineModule(model, (x, y), spec)
    return str(caught.value)


def test_torch_s_own_random_draws_are_refused_by_a_pipeline():
    """As the SPMD and segmented modules refuse them on more than one rank."""
    for message in run_distributed(_noise_job, 2, timeout=120):
        assert "draw the values outside the model" in message
