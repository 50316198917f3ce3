"""Bad inputs: each is refused with a specific error type whose message names the cause (the
line, op, field, file, device or input) and the fix.

Covered elsewhere (the README's "Bad inputs and faults" table lists all of them): cluster-file
typos and plan version / JSON / model / cluster refusals in ``test_plan_cluster.py``; world size
versus cluster or plan, a global batch of another size, dropout on several ranks and train/eval
switches in ``test_runtime.py``. This file adds the rest, and the ones reached through
``hapc.compile`` on real processes.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import hapc
from hapc import models
from hapc.cluster import Cluster
from hapc.errors import (
    ClusterError,
    DistributedRunError,
    HapcError,
    InfeasibleError,
    PlanError,
    TraceError,
    UnsupportedOpError,
)
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64


# -- models -----------------------------------------------------------------------------------------


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # control flow on a tensor value
            return y.sum()
        return -y.sum()


def test_untraceable_model_names_the_line_and_the_fix():
    with pytest.raises(TraceError) as err:
        hapc.synthesize(_Branchy(), "local-cpu:2", (torch.randn(2, 3),))
    msg = str(err.value)
    assert "test_errors.py" in msg and "if y.sum() > 0" in msg  # the cause: file, line, code
    assert "torch.where" in msg and "@hapc.custom_op" in msg  # the fix


class _Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        h = self.lin(x)
        counts = torch.bincount(h.argmax(-1))  # max(x) + 1 bins: a length that depends on the values
        return h.sum() * counts.sum()


def test_value_sized_op_names_the_op_and_a_static_rewrite():
    """torch.bincount's output length is max(x) + 1: refused, naming the op and F.one_hot's count."""
    with pytest.raises(TraceError, match=r"(?s)node bincount.*torch\.bincount's output length.*one_hot"):
        hapc.trace(_Counts(), (torch.randn(6, 3),))


class _CountedSlice(nn.Module):
    """A slice bound computed from values (bincount's length): torch.export records it as a node."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        h = self.lin(x)
        counts = torch.bincount(h.argmax(-1))
        return (h[:, : counts.shape[0]].sum(0) * counts).sum()


def test_a_value_computed_slice_bound_is_refused_by_both_captures_naming_the_line():
    """fx refuses the bincount; torch.export captures the slice with a symbolic bound, which hapc's
    translator compared with an int: a raw TypeError escaped. Now a TraceError naming the line."""
    both = r"(?s)torch\.export could not capture it either.*slice.*test_errors\.py.*static"
    with pytest.raises(TraceError, match=both):
        hapc.trace(_CountedSlice(), (torch.randn(6, 3),))


class _RouterLoss(nn.Module):
    """A switch-style auxiliary loss, as transformers' MoE load-balancing loss counts tokens per
    expert: ``torch.bincount(top-k expert indices, minlength=experts)``."""

    def __init__(self, experts: int = 5, method: bool = False):
        super().__init__()
        self.router, self.head, self.experts = nn.Linear(6, experts), nn.Linear(6, 2), experts
        self.method = method  # the Tensor method, x.bincount(minlength=m), as some models write it

    def forward(self, x, y):
        probs = torch.softmax(self.router(x), -1)
        top = probs.topk(2, dim=-1).indices.reshape(-1)
        counts = top.bincount(minlength=self.experts) if self.method else torch.bincount(top, minlength=self.experts)
        counts = counts.to(x.dtype)
        aux = (counts / top.numel() * probs.mean(0)).sum() * self.experts
        return nn.functional.mse_loss(self.head(x), y) + 0.1 * aux


def _router_job(rank, world, method):
    torch.manual_seed(0)
    model = _RouterLoss(method=method).double()
    x, y = torch.randn(9, 6, dtype=F64), torch.randn(9, 2, dtype=F64)
    module = hapc.compile(model, cluster_of([3e9, 1e9]), (x, y))
    opt = torch.optim.SGD(module.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = module(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": module.full_state_dict(), "code": module.code}


@pytest.mark.parametrize("method", [False, True], ids=["function", "method"])
def test_bincount_with_minlength_counts_as_on_one_device(method):
    """``torch.bincount(x, minlength=m)`` (or ``x.bincount(minlength=m)``) of values below ``m`` (top-k
    expert indices) has ``m`` bins: captured as ``F.one_hot(x, m).sum(0)`` (static), it trains as one
    device on 2 ranks at uneven speeds (3 SGD steps, float64); transformers' Mixtral with
    ``output_router_logits=True`` is the slow suite's ``mixtral-router``."""
    torch.manual_seed(0)
    model = _RouterLoss(method=method).double()
    x, y = torch.randn(9, 6, dtype=F64), torch.randn(9, 2, dtype=F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    for got in run_distributed(_router_job, 2, method):
        assert "one_hot" in got["code"] and "bincount" not in got["code"]
        assert got["losses"] == pytest.approx(want, rel=1e-12)
        for k, v in model.state_dict().items():
            assert torch.allclose(got["state"][k], v, rtol=1e-10, atol=1e-12), k


class _Erfcx(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.special.erfcx(self.lin(x)).sum()


def test_op_without_a_rule_under_strict_names_the_op_and_the_registration():
    with pytest.raises(UnsupportedOpError) as err:
        hapc.synthesize(_Erfcx(), "local-cpu:2", (torch.randn(2, 3),), strict=True)
    msg = str(err.value)
    assert "'erfcx'" in msg and "no sharding rule" in msg and "test_errors.py" in msg
    assert "hapc.register_op(" in msg and '"d0 d1 -> d0 d1"' in msg
    with pytest.warns(hapc.UnsupportedOpWarning, match="erfcx"):  # not strict: replicated, with the same advice
        hapc.synthesize(_Erfcx(), "local-cpu:2", (torch.randn(2, 3),))


class _VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))

    def forward(self, *xs):
        return (xs[0] @ self.w).sum()


def test_varargs_forward_is_refused_at_trace_time():
    with pytest.raises(TraceError, match=r"\*xs"):
        hapc.trace(_VarArgs(), (torch.randn(2, 3),))


# -- cluster files ----------------------------------------------------------------------------------

GOOD = {
    "name": "lab",
    "group": [
        {"name": "fast", "devices": 2, "flops": "20 TFLOPS", "memory": "16 GiB"},
        {"name": "slow", "devices": 1, "flops": "5 TFLOPS", "memory": "8 GiB"},
    ],
    "links": {"between": [{"groups": ["fast", "slow"], "bandwidth": "1 Gbps"}]},
}


def _edit(path: list, value):
    data = json.loads(json.dumps(GOOD))
    obj = data
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    "path, value, cause",
    [
        (["group", 0, "memory"], _DELETE, "group 'fast': missing field 'memory'"),
        (["group", 1, "devices"], 2.5, "group 'slow': devices must be a positive integer, got 2.5"),
        (["group", 0, "memory"], "0 GiB", "group 'fast': memory: must be positive"),
        (["group", 0, "flops"], float("inf"), "group 'fast': flops: must be positive"),
        (["group", 1, "flops"], "-3 TFLOPS", "group 'slow': flops: must be positive"),
        (["group", 1, "devices_per_host"], 0, "devices_per_host must be a positive integer"),
        (["links", "between", 0, "groups"], ["fast", "medium"], "unknown group 'medium' (groups: fast, slow)"),
        (["links", "between", 0, "latency"], "-1 us", "latency: must be zero or positive"),
        (["group", 1, "name"], "fast", "group names must be unique"),
        (["group"], [], "at least one [[group]] is required"),
    ],
)
def test_cluster_file_errors_name_field_and_file(tmp_path, path, value, cause):
    file = tmp_path / "lab.toml"
    data = _edit(path, value)
    file.write_text(_to_toml(data))
    with pytest.raises(ClusterError) as err:
        Cluster.load(file)
    assert cause in str(err.value) and str(file) in str(err.value)


def _to_toml(data: dict) -> str:
    """A tiny TOML writer for the shapes above (so invalid values reach the validator as written)."""

    def val(v):
        if isinstance(v, float) and v == float("inf"):
            return "inf"
        return json.dumps(v)

    lines = [f"name = {val(data['name'])}"]
    for g in data["group"]:
        lines.append("[[group]]")
        lines += [f"{k} = {val(v)}" for k, v in g.items()]
    if "links" in data:
        lines.append("[links]")
        items = ", ".join(
            "{ " + ", ".join(f"{k} = {val(v)}" for k, v in b.items()) + " }" for b in data["links"]["between"]
        )
        lines.append(f"between = [ {items} ]")
    if not data["group"]:
        lines.insert(1, "group = []")
    return "\n".join(lines) + "\n"


# -- plans ------------------------------------------------------------------------------------------


def test_plan_files_that_are_not_plans_name_the_file_and_say_re_synthesize(tmp_path):
    model, inputs = models.load("mlp")
    plan = hapc.synthesize(model, "local-cpu:2", inputs)
    data = plan.to_json()
    cases = {
        "pickle.json": (b"\x80\x04\x95\x00", "is not JSON text"),
        "cut.json": (json.dumps(data)[:-40].encode(), "not valid JSON"),
        "noprogram.json": (json.dumps({k: v for k, v in data.items() if k != "program"}).encode(), "corrupt plan"),
        "old.json": (json.dumps({**data, "version": 0}).encode(), "version 0 is not supported"),
    }
    for name, (raw, cause) in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(PlanError) as err:
            hapc.Plan.load(tmp_path / name)
        msg = str(err.value)
        assert cause in msg, (name, msg)
        assert "re-run `hapc synth`" in msg, (name, msg)  # the fix
        if name != "old.json":
            assert str(tmp_path / name) in msg or "corrupt plan" in msg, (name, msg)


def _compile_with(rank, world, cluster, plan_path, alias):
    model, inputs = models.load(alias)
    hapc.compile(model, cluster, inputs, plan=plan_path, timeout=20)


def test_compile_refuses_a_plan_file_for_another_cluster_or_model(tmp_path):
    model, inputs = models.load("mlp")
    path = tmp_path / "p.json"
    hapc.synthesize(model, "local-cpu:2", inputs).save(path)
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_compile_with, 2, cluster_of([1e9, 1e9]), str(path), "mlp", timeout=30)
    assert set(err.value.errors) == {0, 1}
    assert all("PlanError" in e and "re-run synthesis for this cluster" in e for e in err.value.errors.values())
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_compile_with, 2, "local-cpu:2", str(path), "cnn", timeout=30)
    assert all("another model" in e and "re-run synthesis for this model" in e for e in err.value.errors.values())


# -- memory -----------------------------------------------------------------------------------------


def test_a_model_that_cannot_fit_names_each_device_need_and_capacity():
    model, inputs = models.load("mlp")
    small = {
        "name": "small",
        "group": [
            {"name": "big", "devices": 1, "flops": "1 TFLOPS", "memory": "2 KiB"},
            {"name": "tiny", "devices": 2, "flops": "1 TFLOPS", "memory": "1 KiB"},
        ],
    }
    with pytest.raises(InfeasibleError) as err:
        hapc.synthesize(model, small, inputs)
    msg = str(err.value)
    assert "does not fit the cluster's memory" in msg
    assert "big: needs" in msg and "tiny: needs" in msg and "has 1.91e-06 GiB" in msg  # 2 KiB
    assert "Add devices or memory" in msg and "smaller batch" in msg


def test_ratios_that_do_not_match_the_cluster_are_refused():
    model, inputs = models.load("mlp")
    with pytest.raises(HapcError, match="one ratio per group"):
        hapc.synthesize(model, cluster_of([1e9, 1e9]), inputs, ratios=[1.0])
    with pytest.raises(HapcError, match=r"sum to 0\.8, not 1"):
        hapc.synthesize(model, cluster_of([1e9, 1e9]), inputs, ratios=[0.4, 0.4])


# -- inputs at run time -----------------------------------------------------------------------------


class _Broadcasting(nn.Module):
    """``x * w`` with ``x`` traced as (batch, 1): given (batch, 3) it would broadcast to another
    computation, still a scalar loss -- the case a shape check must catch."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=F64))

    def forward(self, x):
        return (x * self.w).sum()


def _input_job(rank, world, cluster, plan):
    out = {}
    model = _Broadcasting()
    x = torch.ones(6, 1, dtype=F64)
    m = hapc.compile(model, cluster, (x,), plan=plan, timeout=20)
    for name, bad in {
        "wider": torch.ones(6, 3, dtype=F64),
        "rank": torch.ones(6, dtype=F64),
        "dtype": torch.ones(6, 1, dtype=torch.float32),
        "batch": torch.ones(5, 1, dtype=F64),
    }.items():
        try:
            m(bad)
            out[name] = "accepted"
        except HapcError as exc:
            out[name] = str(exc)
    out["ok"] = m(x).item()
    for name, call in {"extra positional": lambda: m(x, x), "unknown keyword": lambda: m(x, scale=2.0)}.items():
        try:
            call()
            out[name] = "accepted"
        except TypeError as exc:  # what the model's own forward raises
            out[name] = str(exc)
    return out


def test_inputs_unlike_the_traced_ones_are_refused_not_computed():
    x = torch.ones(6, 1, dtype=F64)
    cluster = cluster_of([2e9, 1e9])
    plan = hapc.synthesize(_Broadcasting(), cluster, (x,), baseline="dp-cp")
    for out in run_distributed(_input_job, 2, cluster, plan):
        assert out["ok"] == pytest.approx(_Broadcasting()(x).item(), rel=1e-12)
        assert "has shape (6, 3) but the plan was synthesized for (6, 1)" in out["wider"]
        assert "has shape (6,)" in out["rank"]
        assert "is torch.float32 but the plan was synthesized for torch.float64" in out["dtype"]
        assert "x.to(torch.float64)" in out["dtype"]
        assert out["batch"] == "accepted"  # another batch size: a replicated step (tests/test_data_loading.py)
        assert all("synthesize" in out[k] for k in ("wider", "rank", "dtype"))  # the fix
        # an argument the model's forward has no parameter for raises as on one device, not dropped
        with pytest.raises(TypeError):
            _Broadcasting()(x, x)
        assert "takes 1 positional argument(s) but 2 were given" in out["extra positional"]
        assert "unexpected keyword argument 'scale'" in out["unknown keyword"]
