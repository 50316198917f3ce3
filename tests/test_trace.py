"""Tracing: static reference graphs, normalisation, and clear errors for untraceable models."""

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hapc
from hapc.errors import TraceError


def test_shapes_are_python_values_and_modules_become_functions():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(12, 36)
            self.norm = nn.LayerNorm(12)
            self.drop = nn.Dropout(0.0)

        def forward(self, x):
            b, t, c = x.size()  # unpacking a size: plain Python under hapc's tracer
            q, k, v = self.proj(self.norm(x)).chunk(3, dim=-1)
            att = (q @ k.transpose(1, 2)) / c**0.5
            return self.drop(att.softmax(-1) @ v).view(b * t, c).sum()

    x = torch.randn(2, 5, 12)
    net = Net()
    graph = hapc.trace(net, (x,))
    ops = [n.op for n in graph if n.kind == "op"]
    assert ops[:3] == ["layer_norm", "linear", "add"]  # nn.Linear -> F.linear + bias add
    assert ops.count("narrow") == 3  # chunk -> narrow per piece
    assert "dropout" not in ops  # p == 0 disappears
    view = next(n for n in graph if n.op == "view")
    assert view.args[1:] == (10, 12)  # sizes are constants
    assert torch.allclose(graph.run(x=x), net(x))


def test_reference_graph_computes_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return F.cross_entropy(self.net(x), y)

    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    m = Loss()
    graph = hapc.trace(m, (x, y))
    assert torch.allclose(graph.run(x=x, y=y), m(x, y))
    # the mean became sum / count of non-ignored targets, so batch sharding is an exact Partial sum
    assert [n.op for n in graph][-3:] == ["cross_entropy", "hapc.ops.target_count", "div"]


def test_data_dependent_control_flow_names_the_line():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent
                return x.sum()
            return -x.sum()

    with pytest.raises(TraceError) as err:
        hapc.trace(Branchy(), (torch.randn(3),))
    msg = str(err.value)
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "torch.where" in msg  # says how to fix it


def test_item_is_an_error_with_the_node():
    class Item(nn.Module):
        def forward(self, x):
            return x * x.max().item()

    with pytest.raises(TraceError, match="item"):
        hapc.trace(Item(), (torch.randn(3),))


def test_loss_must_be_a_scalar():
    class NoReduce(nn.Module):
        def forward(self, x):
            return x * 2

    class Pair(nn.Module):
        def forward(self, x):
            return x.sum(), x

    class Logits(nn.Module):
        def forward(self, x):
            return {"logits": x * 2, "hidden": x}

    with pytest.raises(TraceError, match="scalar"):
        hapc.trace(NoReduce(), (torch.randn(3),))
    with pytest.raises(TraceError, match="must return the training loss"):
        hapc.trace(Logits(), (torch.randn(3),))
    with pytest.raises(TraceError, match="no tensor under that key"):
        hapc.trace(Pair(), (torch.randn(3),), loss="loss")
    # a structured output: the loss is its first scalar, the rest are outputs of the graph
    g = hapc.trace(Pair(), (torch.randn(3),))
    assert g.loss.op == "sum" and g.loss_leaf == 0 and len(g.outputs) == 2


def test_inplace_on_a_tensor_used_later_is_refused():
    class Bad(nn.Module):
        def forward(self, x):
            y = x * 2
            y.add_(1)  # mutates y, which is used below
            return (y + y).sum()

    class Fine(nn.Module):
        def forward(self, x):
            y = x * 2
            y += 1  # rebinds y: harmless
            return y.relu_().sum()

    x = torch.randn(3)
    with pytest.raises(TraceError, match="out of place"):
        hapc.trace(Bad(), (x,), capture="fx")
    # torch.export follows the mutation (later readers of y read the updated value): exact
    g = hapc.trace(Bad(), (x,))
    assert g.capture == "export"
    torch.testing.assert_close(g.run({"x": x}), Bad()(x))
    g = hapc.trace(Fine(), (torch.randn(3),))
    assert [n.op for n in g if n.kind == "op"] == ["mul", "add", "relu", "sum"]


def test_leaf_modules_and_multiheadattention():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            y, _ = self.mha(x, x, x, need_weights=False)
            return y.sum()

    x = torch.randn(3, 4, 8, dtype=torch.float64)
    m = Net().double()
    # by default torch.nn modules without a functional form are traced into the ops they call,
    # so their parameters are the model's (sharded, synchronised) and every op has a rule
    graph = hapc.trace(m, (x,))
    assert not any("MultiheadAttention" in n.op for n in graph)
    assert {"mha.in_proj_weight", "mha.out_proj.weight"} <= {n.target for n in graph.params}
    theory = hapc.derive(graph, strict=True)
    assert not hapc.verify(theory, {"x": x}, [[0.5, 0.3, 0.2]])
    # declared a leaf, it stays one op with its own rule
    graph = hapc.trace(m, (x,), leaf_modules=(nn.MultiheadAttention,))
    node = next(n for n in graph if "MultiheadAttention" in n.op)
    assert node.out_index == 0 and node.target is m.mha
    theory = hapc.derive(graph)
    assert {s.name for s in theory.strategies[node.index]} == {"replicate", "batch"}
    assert not hapc.verify(theory, {"x": x}, [[0.5, 0.3, 0.2]])


def test_getattr_on_namedtuple_results_and_operator_targets():
    class Net(nn.Module):
        def forward(self, x):
            return x.max(dim=1).values.sum() + operator.neg(x).sum()

    g = hapc.trace(Net(), (torch.randn(3, 4),))
    assert "max" in [n.op for n in g] and "neg" in [n.op for n in g]


def test_evaluating_the_graph_leaves_the_models_buffers_alone():
    """Batch norm in training updates its running statistics in place: the reference evaluation
    (whole-batch counts, rule verification at compile) must not move the model's own."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double().train()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x).sum()

    net = Net()
    x = torch.randn(8, 4, dtype=torch.float64)
    graph = hapc.trace(net, (x,))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    loss = graph.run({"x": x})
    graph.run({"x": x})
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(loss, net(x))  # and the value is the model's


#: forward bodies over ``y`` (a fresh tensor) that update it in place while views of it are alive
_INPLACE_WITH_VIEWS = {
    "view before": "z = y.view(-1); y.add_(1); return z.sum()",
    "narrow and slice before": "a = y.narrow(0, 0, 2); b = y[2:]; y.add_(1); return a.sum() + b.mean()",
    "transpose, two updates": "w = y.t(); y.add_(1); y.mul_(3); return w[0].sum() + y.sum()",
    "view between updates": "y.add_(1); u = y.transpose(0, 1); y.mul_(3); return u[1].sum()",
    "row update through a view": "v = y[0]; v.mul_(2); return y.sum() + v.sum()",
    "update then read": "a = y * 2; y.add_(1); return y.sum() + a.sum()",
}


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
@pytest.mark.parametrize("body", list(_INPLACE_WITH_VIEWS), ids=list(_INPLACE_WITH_VIEWS))
def test_views_taken_before_an_inplace_update_see_it(body, capture):
    """``z = y.view(-1); y.add_(1)``: z shares y's storage, so eager reads the updated value. The
    captured graph must give the same loss and gradients, or the capture must refuse."""
    src = "def forward(self, x):\n    y = self.lin(x) * 2\n    " + _INPLACE_WITH_VIEWS[body].replace("; ", "\n    ")
    namespace: dict = {}
    exec(src, namespace)
    model_cls = type("M", (nn.Module,), {"forward": namespace["forward"]})
    torch.manual_seed(0)
    model = model_cls().double()
    model.lin = nn.Linear(4, 4).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    try:
        g = hapc.trace(model, (x,), capture=capture)
    except TraceError as e:  # refusing is allowed (fx: the update's result is read again); never wrong
        assert capture == "fx" and "in-place" in str(e) and "out of place" in str(e)
        return
    want = model(x)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = g.evaluate({g.inputs[0].name: x})[g.loss.index]
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=None):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        if scale is not None:
            y = y * scale
        return y.square().mean()


class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, double=False):
        y = self.lin(x)
        if double:  # a bool flag: a constant of the capture, as a None input is
            y = y * 2
        return y.square().mean()


@pytest.mark.parametrize("given", [{}, {"double": False}, {"double": True}])
def test_a_bool_flag_is_a_constant_of_the_capture(given):
    """``if flag:`` on a bool parameter (HF's ``interpolate_pos_encoding``) stopped fx: the flag was a
    placeholder. At its default it is a constant of the fx capture; another value is captured by
    torch.export (fx checks a specialised value against the default). A call with another value
    than the traced one is refused at run time (test_habits_forward)."""
    torch.manual_seed(0)
    model = _Flagged().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    g = hapc.trace(model, {"x": x, **given})
    assert g.capture == ("export" if given.get("double") else "fx")
    assert [n.name for n in g.inputs] == ["x"]
    torch.testing.assert_close(g.evaluate({"x": x})[g.loss.index], model(x, **given), rtol=1e-12, atol=0)


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
@pytest.mark.parametrize("given", ["left out", "given as None", "given"])
def test_optional_inputs_left_at_none_take_the_callers_branch(given, capture):
    """``if mask is not None:`` must take the branch the call takes: an input left at (or given as)
    None is a constant, not a traced input."""
    torch.manual_seed(0)
    model = _OptionalMask().double()
    x, mask = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
    inputs = {"left out": {"x": x}, "given as None": {"x": x, "mask": None}, "given": {"x": x, "mask": mask}}[given]
    g = hapc.trace(model, inputs, capture=capture)
    assert [n.name for n in g.inputs] == (["x", "mask"] if given == "given" else ["x"])
    got = g.evaluate({k: v for k, v in inputs.items() if v is not None})[g.loss.index]
    torch.testing.assert_close(got, model(**inputs), rtol=1e-12, atol=0)


def _returns_tuple_unless_asked(forward):
    """A decorator like Hugging Face's ``@can_return_tuple``: ``(self, *args, **kwargs)`` around
    the forward, popping an option from the keywords."""
    import functools

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        as_dict = kwargs.pop("return_dict", True)
        out = forward(self, *args, **kwargs)
        return out if as_dict else (out,)

    return wrapper


class _VariadicForward(nn.Module):
    """``forward(self, x, labels=None, scale=None, **kwargs)`` as Hugging Face models write it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels=None, scale=None, **kwargs):
        y = self.lin(x)
        if scale is not None:
            y = y * scale
        return F.cross_entropy(y, labels)


class _DecoratedForward(_VariadicForward):
    @_returns_tuple_unless_asked
    def forward(self, x, labels=None, scale=None, **kwargs):
        return super().forward(x, labels, scale, **kwargs)


@pytest.mark.parametrize("cls", [_VariadicForward, _DecoratedForward])
def test_a_forward_taking_kwargs_is_traced_by_fx_with_its_named_inputs(cls):
    """fx gave ``**kwargs`` a placeholder with no example value, and called a decorated forward's
    wrapper with a proxy (or None) bound to the wrapper's own ``**kwargs``: both failed. The root is
    traced through a function of the named parameters only (``trace._named_root``)."""
    torch.manual_seed(0)
    model = cls().double()
    x, labels = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    g = hapc.trace(model, {"x": x, "labels": labels}, capture="fx")
    assert [n.name for n in g.inputs] == ["x", "labels"]  # scale left at None: a constant
    got = g.evaluate({"x": x, "labels": labels})[g.loss.index]
    torch.testing.assert_close(got, model(x, labels=labels), rtol=1e-12, atol=0)


@torch.jit.script
def _scaled_square(x: torch.Tensor, k: float) -> torch.Tensor:
    return (x * k).square()


class _ScriptedHelper(nn.Module):
    """Calls a ``@torch.jit.script`` function by its global name, as DeBERTa-v2 does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _scaled_square(self.lin(x), 0.5).mean()


class _FreshActivation(nn.Module):
    """Builds its activation module in forward, as Hugging Face's ``ACT2FN[name](x)`` does."""

    def __init__(self, fresh: type = nn.GELU):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fresh = fresh

    def forward(self, x):
        h = self.lin(x)
        return (self.fresh()(h) if self.fresh is nn.GELU else self.fresh(4, 4)(h)).square().mean()


class _Out(dict):
    """A dict subclass returned by forward (like Hugging Face's ``ModelOutput``)."""


class _ReturnsOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y):
        logits = self.lin(x)
        return _Out(loss=F.cross_entropy(logits, y), parts=(_Out(logits=logits), logits.sum(0)))


def test_fx_traces_scripted_functions_and_modules_made_in_forward():
    """A ScriptFunction takes no proxies: fx traces its Python original (restored afterwards). A
    module made during forward has no name in the model: its forward is traced inline."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64)
    for model in (_ScriptedHelper().double(), _FreshActivation().double()):
        g = hapc.trace(model, (x,), capture="fx")
        torch.testing.assert_close(g.evaluate({"x": x})[g.loss.index], model(x), rtol=1e-12, atol=0)
    assert isinstance(_scaled_square, torch.jit.ScriptFunction)  # the module's global is put back
    assert "gelu" in {n.op for n in hapc.trace(_FreshActivation().double(), (x,), capture="fx")}
    with pytest.raises(TraceError, match="not a submodule of the model but holds parameters"):
        hapc.trace(_FreshActivation(nn.Linear).double(), (x,), capture="fx")


class _FollowsDevice(nn.Module):
    """Moves its labels to the logits' device, as Hugging Face's losses do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.lin(x)
        return F.cross_entropy(logits, labels.to(logits.device))


def test_fx_follows_a_device_read_from_a_tensor():
    """``labels.to(logits.device)``: the device folds to the example's, while shapes are computed on
    meta tensors (``Cannot copy out of meta tensor`` stopped every HF vision model's fx capture)."""
    torch.manual_seed(0)
    model = _FollowsDevice().double()
    x, labels = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    g = hapc.trace(model, (x, labels), capture="fx")
    got = g.evaluate({"x": x, "labels": labels})[g.loss.index]
    torch.testing.assert_close(got, model(x, labels), rtol=1e-12, atol=0)


def test_fx_keeps_the_types_of_returned_dicts():
    """fx turns every dict it records into a plain dict; the compiled module must still return the
    model's own ModelOutput-like type (issue: BERT captured by fx came back as a dict)."""
    from hapc.theory.capture import rebuild_output

    torch.manual_seed(0)
    model = _ReturnsOut().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    g = hapc.trace(model, (x, y), capture="fx")
    out = rebuild_output(g.output_spec, list(range(len(g.outputs))))
    assert type(out) is _Out and type(out["parts"][0]) is _Out and set(out) == {"loss", "parts"}


class _ItemAssignment(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        y = torch.zeros_like(h)
        y[0] = h[1] * 2  # fx records the write as a node nobody reads
        y[:, 1:] = h[:, :-1]
        return y.square().mean()


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_item_assignment_into_a_fresh_tensor_is_followed_or_refused(capture):
    torch.manual_seed(0)
    model = _ItemAssignment().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    try:
        g = hapc.trace(model, (x,), capture=capture)
    except TraceError as e:  # fx cannot follow it: refused, naming the line (auto then uses export)
        assert capture == "fx" and "y[0] = h[1] * 2" in str(e)
        return
    assert capture != "fx"
    got = g.evaluate({g.inputs[0].name: x})[g.loss.index]
    want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for a, b in zip(
        torch.autograd.grad(got, list(model.parameters())), torch.autograd.grad(want, list(model.parameters()))
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


class _TableAttribute(nn.Module):
    """A plain tensor attribute (not a registered buffer) written in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.zeros(3, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.lin(x)
        loss = (h + self.table[0]).square().mean()
        self.table[0] = h.mean(0).detach()
        return loss


@pytest.mark.parametrize("capture", ["auto", "fx", "export"])
def test_item_assignment_into_a_tensor_attribute_is_refused(capture):
    model = _TableAttribute().double()
    with pytest.raises(TraceError, match="in-place"):
        hapc.trace(model, (torch.randn(3, 4, dtype=torch.float64),), capture=capture)


def test_export_captures_mse_loss():
    """F.mse_loss calls torch.broadcast_tensors(*tensors); ATen's takes a list."""

    class Reg(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y):
            return F.mse_loss(self.lin(x), y)

    torch.manual_seed(0)
    model = Reg().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    g = hapc.trace(model, (x, y), capture="export")
    got = g.evaluate({g.inputs[0].name: x, g.inputs[1].name: y})[g.loss.index]
    torch.testing.assert_close(got, model(x, y), rtol=1e-12, atol=0)


class _TensorBoundedSlice(nn.Module):
    """DeBERTa's relative-position window: ``table[m - span : m + span]`` where ``span`` is a
    ``torch.tensor`` of static sizes (its ``compute_attention_span``), a concrete tensor while fx
    traces."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        span = torch.tensor(min(x.size(1), 8))  # 5: concrete, from the traced shape
        window = self.table[8 - span : 8 + span]  # [10, 4]
        return (self.lin(x) @ window.t()).square().mean()


def test_slice_bounded_by_concrete_integer_tensors_traces_under_fx():
    """Bounds that are concrete integer tensors slice by their ``__index__``, as eager does: fx
    kept them as tensor constants, whose meta values have no integer to slice with (DeBERTa
    failed to trace: ``__cuda_array_interface__`` must be a dict)."""
    torch.manual_seed(0)
    model = _TensorBoundedSlice().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    g = hapc.trace(model, {"x": x}, capture="fx")
    got = g.evaluate({"x": x})[g.loss.index]
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=0)
    g.run({"x": x}).backward()
    assert model.table.grad is not None and model.table.grad[:3].abs().sum() == 0  # rows 3..12 read
    assert model.table.grad[3:13].abs().sum() > 0


class _Contrastive(nn.Module):
    """CLIP's loss shape: scores of every row against every row (``a @ b.T``), cross entropy
    along both axes (the second through ``.T`` again)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        scores = self.a(x) @ self.b(x).T
        target = torch.arange(x.shape[0])
        return (F.cross_entropy(scores, target) + F.cross_entropy(scores.T, target)) / 2


def test_export_captures_dot_T_with_a_rule():
    """``x.T`` (ATen ``numpy_T``) becomes a transpose under export, so it has a sharding rule:
    CLIP derived with ``strict=True`` failed on it ('aten::numpy_T has no sharding rule')."""
    torch.manual_seed(0)
    model = _Contrastive().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    g = hapc.trace(model, (x,), capture="export")
    assert "numpy_T" not in " ".join(str(n.op) for n in g)
    hapc.derive(g, strict=True)
    got = g.evaluate({g.inputs[0].name: x})[g.loss.index]
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=0)


class _SigmoidPairs(nn.Module):
    """SigLIP's loss shape: unit-normalised embeddings (``x / x.norm(p=2, dim=-1, keepdim=True)``),
    every pair scored, ``-logsigmoid(sign * score)`` summed over pairs, averaged over rows."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x):
        u, v = self.a(x), self.b(x)
        u = u / u.norm(p=2, dim=-1, keepdim=True)
        v = v / v.norm(p=2, dim=-1, keepdim=True)
        scores = u @ v.t()
        sign = 2 * torch.eye(x.shape[0], dtype=x.dtype) - 1
        return -F.logsigmoid(sign * scores).sum() / x.shape[0]


def test_export_captures_logsigmoid_and_vector_norm_with_rules():
    """ATen's ``log_sigmoid`` and ``linalg_vector_norm`` (what export makes of ``F.logsigmoid`` and
    ``x.norm(p=2, dim=...)``) become ``F.logsigmoid`` and ``torch.linalg.vector_norm``, which have
    rules: SigLIP derived with ``strict=True`` failed on both."""
    torch.manual_seed(0)
    model = _SigmoidPairs().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    g = hapc.trace(model, (x,), capture="export")
    theory = hapc.derive(g, strict=True)
    norms = [n for n in g if n.op == "vector_norm"]
    assert len(norms) == 2
    for n in norms:  # rows shard, the normalised dim never does
        sharded = {s.output.dim for s in theory.strategies[n.index] if s.output.is_sharded}
        assert sharded == {0}, sharded
    got = g.evaluate({g.inputs[0].name: x})[g.loss.index]
    torch.testing.assert_close(got, model(x), rtol=1e-12, atol=0)
