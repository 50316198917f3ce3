"""Random small models and clusters (hypothesis strategies) for optimality and equivalence tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import hapc
from hapc.cluster import Cluster

OPS = ["linear", "relu", "add", "scale", "transpose", "softmax", "tanh", "matmul_self"]


class RandomNet(nn.Module):
    """Applies a list of ops to a 2-D input; every op reads the latest tensor (and maybe an earlier one)."""

    def __init__(self, spec: list[tuple[str, int, int]], widths: list[int], dtype=torch.float64):
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(len(spec) * 7 + sum(widths))
        for i, (op, _, out) in enumerate(spec):
            if op == "linear":
                self.register_parameter(f"w{i}", nn.Parameter(torch.randn(out, widths[i], generator=g, dtype=dtype)))
            if op == "scale":
                self.register_parameter(f"s{i}", nn.Parameter(torch.randn(widths[i], generator=g, dtype=dtype)))

    def forward(self, x):
        hs = [x]
        for i, (op, other, _) in enumerate(self.spec):
            h = hs[-1]
            if op == "linear":
                h = F.linear(h, getattr(self, f"w{i}"))
            elif op == "relu":
                h = h.relu()
            elif op == "tanh":
                h = h.tanh()
            elif op == "add":
                h = h + hs[other] if hs[other].shape == h.shape else h * 2
            elif op == "scale":
                h = h * getattr(self, f"s{i}")
            elif op == "transpose":
                h = h.t().contiguous() if h.shape[0] == h.shape[1] else -h
            elif op == "softmax":
                h = h.softmax(-1)
            elif op == "matmul_self":
                h = h @ h.t() if h.shape[0] == h.shape[1] else h.sin()
            hs.append(h)
        return hs[-1].sum()


@st.composite
def random_models(draw, max_ops: int = 3, sizes=(2, 3, 4, 6)):
    n_ops = draw(st.integers(1, max_ops))
    width = draw(st.sampled_from(sizes))
    batch = draw(st.sampled_from(sizes))
    widths = [width]
    spec = []
    for i in range(n_ops):
        op = draw(st.sampled_from(OPS))
        out = draw(st.sampled_from(sizes)) if op == "linear" else widths[-1]
        other = draw(st.integers(0, i))
        spec.append((op, other, out))
        widths.append(out)
    model = RandomNet(spec, widths)
    x = torch.randn(
        batch, width, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))), dtype=torch.float64
    )
    return model, (x,)


@st.composite
def random_clusters(draw, min_devices: int = 2, max_devices: int = 4):
    n = draw(st.integers(min_devices, max_devices))
    kinds = draw(st.integers(1, min(3, n)))
    counts = [1] * kinds
    for _ in range(n - kinds):
        counts[draw(st.integers(0, kinds - 1))] += 1
    groups = [
        {
            "name": f"g{k}",
            "devices": c,
            "devices_per_host": c,
            "flops": draw(st.floats(1e6, 1e8)),
            "memory": "1 GB",
        }
        for k, c in enumerate(counts)
    ]
    bw = draw(st.floats(1e5, 1e8))
    lat = draw(st.floats(0.0, 1e-4))
    return Cluster.from_dict(
        {
            "name": "random",
            "group": groups,
            "links": {
                "intra_host": {"bandwidth": bw, "latency": lat},
                "inter_host": {"bandwidth": bw / 2, "latency": lat * 2},
            },
        }
    )


def ratios_for(draw, cluster: Cluster) -> tuple[float, ...]:
    types = cluster.device_types()
    raw = [draw(st.floats(0.2, 1.0)) for _ in types]
    total = sum(r * t.count for r, t in zip(raw, types))
    return tuple(r / total for r in raw)


_ = hapc


BRANCHY_OPS = ["linear", "relu", "tanh", "add", "mul", "softmax", "matmul"]


class BranchyNet(nn.Module):
    """A DAG of ``[batch, width]`` tensors: op ``i`` reads any earlier tensors ``a`` (and ``b``),
    and the loss sums every tensor nothing else reads, so work forks and joins around collectives."""

    def __init__(self, spec: list[tuple[str, int, int]], width: int, dtype=torch.float64):
        super().__init__()
        self.spec = spec
        g = torch.Generator().manual_seed(len(spec) * 11 + width)
        for i, (op, _, _) in enumerate(spec):
            if op in ("linear", "matmul"):
                w = torch.randn(width, width, generator=g, dtype=dtype) / width
                self.register_parameter(f"w{i}", nn.Parameter(w))

    def forward(self, x):
        hs = [x]
        read = set()
        for i, (op, a, b) in enumerate(self.spec):
            read.update((a, b) if op in ("add", "mul") else (a,))
            h = hs[a]
            if op == "linear":
                h = F.linear(h, getattr(self, f"w{i}"))
            elif op == "matmul":
                h = h @ getattr(self, f"w{i}")
            elif op == "relu":
                h = h.relu()
            elif op == "tanh":
                h = h.tanh()
            elif op == "softmax":
                h = h.softmax(-1)
            elif op == "add":
                h = h + hs[b]
            elif op == "mul":
                h = h * hs[b]
            hs.append(h)
        sinks = [h for k, h in enumerate(hs) if k and k not in read]
        loss = sinks[0].sum()
        for h in sinks[1:]:
            loss = loss + h.sum()
        return loss


@st.composite
def branchy_models(draw, min_ops: int = 4, max_ops: int = 8, sizes=(2, 3, 4, 6)):
    """Random branchy graphs: every op reads one or two tensors drawn from all earlier ones."""
    n_ops = draw(st.integers(min_ops, max_ops))
    width = draw(st.sampled_from(sizes))
    batch = draw(st.sampled_from(sizes))
    spec = []
    for i in range(n_ops):
        op = draw(st.sampled_from(BRANCHY_OPS))
        a = draw(st.integers(0, i))
        b = draw(st.integers(0, i))
        spec.append((op, a, b))
    model = BranchyNet(spec, width)
    x = torch.randn(
        batch, width, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))), dtype=torch.float64
    )
    return model, (x,)


def branchy_case(seed: int, min_ops: int = 4, max_ops: int = 7, sizes=(2, 3, 4, 6)):
    """A seeded random branchy graph (see :class:`BranchyNet`) on a cluster of 2-3 device types
    with random uneven ratios: ``(model, inputs, cluster, ratios, variants)``. Plain ``random``,
    not hypothesis, so a seed is a pinned, reproducible case."""
    import random

    rng = random.Random(seed)
    n_ops = rng.randint(min_ops, max_ops)
    width, batch = rng.choice(sizes), rng.choice(sizes)
    spec = []
    for i in range(n_ops):
        spec.append((rng.choice(BRANCHY_OPS), rng.randint(0, i), rng.randint(0, i)))
    model = BranchyNet(spec, width)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    kinds = rng.randint(2, 3)
    counts = [1] * kinds
    for _ in range(rng.randint(0, 4 - kinds)):
        counts[rng.randrange(kinds)] += 1
    bw = 10 ** rng.uniform(5, 8)
    lat = rng.uniform(0.0, 1e-4)
    cluster = Cluster.from_dict(
        {
            "name": "random",
            "group": [
                {
                    "name": f"g{k}",
                    "devices": c,
                    "devices_per_host": c,
                    "flops": 10 ** rng.uniform(6, 8),
                    "memory": "1 GB",
                }
                for k, c in enumerate(counts)
            ],
            "links": {
                "intra_host": {"bandwidth": bw, "latency": lat},
                "inter_host": {"bandwidth": bw / 2, "latency": lat * 2},
            },
        }
    )
    raw = [rng.uniform(0.2, 1.0) for _ in counts]
    total = sum(r * c for r, c in zip(raw, counts))
    ratios = tuple(r / total for r in raw)
    variants = rng.choice([("padded",), ("padded", "grouped")])
    return model, (x,), cluster, ratios, variants
