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
