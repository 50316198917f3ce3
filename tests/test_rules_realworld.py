"""Op coverage for the models people have (issue 12): every zoo model (:mod:`realworld`) derives
with ``strict=True`` -- every op it emits has a rule, none falls back to replication -- and the
rules added for them are sound on the models' own shapes and train exactly on gloo processes.

The rules themselves are checked on random sizes and ratios by ``test_theory_soundness.py``
(their cases are in ``catalogue.py``); here they meet the shapes transformers gives them
(GPT-2's ``Conv1D`` is ``addmm``, T5 shifts its labels with ``new_zeros``, Mixtral routes tokens
with ``topk``, index tensors, ``repeat_interleave`` and, by default, ``grouped_mm``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import hapc
from hapc.testing import run_distributed
from hapc.theory.instructions import Compute
from hapc.theory.rules.moe import GROUPED_MM
from hapc.theory.verify import verify

realworld = pytest.importorskip("realworld")

D = torch.float64
RATIOS = [[0.5, 0.3, 0.2], [0.6, 0.4]]


def _need(name: str) -> None:
    library = realworld.MODELS[name][1]
    if not realworld.has(library):
        pytest.skip(f"{library} is not installed")


@pytest.mark.parametrize("name", list(realworld.MODELS))
def test_every_zoo_model_derives_strict(name: str) -> None:
    _need(name)
    model, batch = realworld.build(name)
    graph = hapc.trace(model, batch)
    theory = hapc.derive(graph, strict=True)  # raises UnsupportedOpError naming any op without a rule
    assert len(theory.triples) > len(graph)


def _check_nodes(name: str, model: nn.Module, batch: dict, ops: set[str]) -> Counter:
    """Verify every strategy of the nodes running ``ops`` on the model's own shapes."""
    graph = hapc.trace(model, batch)
    theory = hapc.derive(graph, strict=True)
    # getitem: only indexing with index tensors (the slices are the old rule's)
    nodes = [n.index for n in graph if n.op in ops and (n.op != "getitem" or len(n.operands) > 1)]
    assert {graph[i].op for i in nodes} == ops, f"{name} no longer runs {ops - {graph[i].op for i in nodes}}"
    checked: Counter = Counter()
    failures = verify(theory, batch, RATIOS, nodes=nodes, checked=checked)
    assert not failures, "\n".join(map(str, failures[:5]))
    return checked


# (model, ops its rules were added for, strategies that must have been checked: (op, name))
ON_MODELS = [
    ("gpt2", {"addmm"}, {("addmm", "n"), ("addmm", "m"), ("addmm", "k"), ("addmm", "k-partial-bias")}),
    ("t5", {"new_zeros"}, {("new_zeros", "like-d0"), ("new_zeros", "d1"), ("new_zeros", "zeros")}),
    (
        "mixtral",
        {"getitem", "repeat_interleave"},
        {("getitem", "i0"), ("repeat_interleave", "d0-repeats"), ("repeat_interleave", "d1")},
    ),
    ("timm-efficientformer", {"interpolate"}, {("interpolate", "n"), ("interpolate", "c")}),
]


@pytest.mark.parametrize(("name", "ops", "must"), ON_MODELS, ids=[c[0] for c in ON_MODELS])
def test_new_rules_are_sound_on_the_models_shapes(name: str, ops: set[str], must: set) -> None:
    _need(name)
    model, batch = realworld.build(name)
    if isinstance(batch, tuple):  # a torchvision / timm classifier under WithLoss: forward(x, y)
        batch = dict(x=batch[0], y=batch[1])
    checked = _check_nodes(name, model, batch, ops)
    assert must <= set(checked), f"never checked: {sorted(must - set(checked))}"


def test_default_mixtral_experts_path_derives_strict_and_is_sound() -> None:
    """transformers' default experts path sorts tokens by expert, counts them with ``histc`` and
    runs ``grouped_mm`` (its fallback op on CPU float64); ``inv_perm[perm] = arange`` is an
    ``index_put``. Its float64 eager forward cannot run on CPU (``F.grouped_mm`` has no kernel),
    but capture, derivation and every rule's semantics can be checked."""
    _need("mixtral")
    torch.manual_seed(0)
    model, batch = realworld.mixtral(experts="grouped_mm")
    model = model.to(D)
    ops = {GROUPED_MM[-1], "histc", "index_put"}
    checked = _check_nodes("mixtral (grouped_mm)", model, batch, ops)
    assert {(GROUPED_MM[-1], "k"), (GROUPED_MM[-1], "n"), ("histc", "d0")} <= set(checked)


# -- a plan through addmm's sharded strategies trains exactly -------------------------------------
class Conv1DPair(nn.Module):
    """Two GPT-2 ``Conv1D`` projections (``addmm(bias, x, w)``, weight ``[in, out]``) on one row:
    nothing to shard but the weights, so the plan is Megatron's -- the first column-parallel, the
    second row-parallel, its bias added once into a ``Partial`` result."""

    def __init__(self, k: int = 256, h: int = 192, o: int = 48):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(k, h, generator=g, dtype=D) / k**0.5)
        self.b1 = nn.Parameter(torch.randn(h, generator=g, dtype=D))
        self.w2 = nn.Parameter(torch.randn(h, o, generator=g, dtype=D) / h**0.5)
        self.b2 = nn.Parameter(torch.randn(o, generator=g, dtype=D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.b1, x, self.w1).tanh()
        return (torch.addmm(self.b2, h, self.w2, beta=0.5) ** 2).sum()


def _input() -> torch.Tensor:
    return torch.randn(1, 256, generator=torch.Generator().manual_seed(1), dtype=D)


def _train(module: Any, *inputs: torch.Tensor) -> dict[str, Any]:
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    loss = module(*inputs)
    loss.backward()
    if hasattr(module, "full_gradients"):
        grads = module.full_gradients()
    else:
        grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
    losses = [float(loss.detach())]
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        loss = module(*inputs)
        loss.backward()
        losses.append(float(loss.detach()))
    state = module.full_state_dict() if hasattr(module, "full_state_dict") else module.state_dict()
    return {"grads": grads, "losses": losses, "state": {k: v.detach().clone() for k, v in state.items()}}


def _job(rank: int, world: int, plan: Any, cluster: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hapc.compile(Conv1DPair(), cluster, (_input(),), plan=plan)
    return _train(module, _input())


@pytest.mark.parametrize(("world", "ratios"), [(2, None), (3, (0.4, 0.2))], ids=["2-default", "3-uneven"])
def test_addmm_tensor_parallel_matches_one_device(world: int, ratios: tuple | None) -> None:
    cluster = f"local-cpu:{world}"
    plan = hapc.synthesize(Conv1DPair(), cluster, (_input(),), ratios=ratios)
    graph = plan._theory.graph
    used = {graph[i.ref].name: i.strategy_key.split(":")[0] for i in plan.instructions if isinstance(i, Compute)}
    assert used["addmm"] == "m" and used["addmm_1"] == "k", used  # the test is about these two

    want = _train(Conv1DPair(), _input())
    for got in run_distributed(_job, world, plan, cluster, timeout=120):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-12)
        assert set(got["grads"]) == set(want["grads"])
        for k, v in want["grads"].items():
            torch.testing.assert_close(got["grads"][k], v, rtol=1e-9, atol=1e-12)
        for k, v in want["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12)


# -- a data-parallel plan through the indexing rules ---------------------------------------------------
class Router(nn.Module):
    """Token lookups and routing as MoE layers write them: ``index_select`` of embedding rows,
    ``repeat_interleave`` (each token to its top-2 slots), ``gather`` / ``scatter_add`` into a
    ``new_zeros`` buffer, indexing by an index tensor, ``diff``."""

    def __init__(self, vocab: int = 11, hidden: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(vocab, hidden, generator=g, dtype=D))
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=D))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        e = self.emb.index_select(0, ids.flatten()).view(b, t, -1)
        e = e.repeat_interleave(2, dim=1)  # [B, 2T, H]
        slots = pos.unsqueeze(-1).expand(-1, -1, e.shape[-1])
        h = (e.gather(1, slots) @ self.w).tanh()  # [B, T, H]
        acc = h.new_zeros(b, t, h.shape[-1]).scatter_add(1, slots // 2, h) * h
        picked = acc[:, ids[0] % t]
        return (picked**2).sum() + torch.diff(acc, dim=1).pow(2).sum()


def _router_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 11, (12, 5), generator=gen), torch.randint(0, 10, (12, 5), generator=gen)


def _router_job(rank: int, world: int, plan: Any, cluster: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    module = hapc.compile(Router(), cluster, _router_inputs(), plan=plan)
    return _train(module, *_router_inputs())


def test_indexing_rules_data_parallel_matches_one_device() -> None:
    cluster = "local-cpu:3"
    plan = hapc.synthesize(Router(), cluster, _router_inputs(), ratios=(0.4, 0.2))
    graph = plan._theory.graph
    used = {graph[i.ref].op: i.strategy_key for i in plan.instructions if isinstance(i, Compute)}
    for op in ("index_select", "repeat_interleave", "gather", "new_zeros", "scatter_add", "diff"):
        assert "S(0)" in used[op].split("->")[1], (op, used[op])  # the batch flows through sharded
    want = _train(Router(), *_router_inputs())
    for got in run_distributed(_router_job, 3, plan, cluster, timeout=120):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-12)
        for k, v in want["grads"].items():
            torch.testing.assert_close(got["grads"][k], v, rtol=1e-9, atol=1e-12)
        for k, v in want["state"].items():
            torch.testing.assert_close(got["state"][k], v, rtol=1e-9, atol=1e-12)
