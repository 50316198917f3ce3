"""Clusters from the papers, loadable by name (``Cluster.load("hap-testbed")``).

Flop rates are *sustained* matmul rates for the papers' dtypes (about half of the datasheet
peak, the usual ratio for large GEMMs plus surrounding memory-bound work) and memory bandwidths
are the datasheet HBM/GDDR figures (element-wise ops are charged bytes / bandwidth); each preset
says where its numbers come from. ``local-cpu:N`` describes this machine's N CPU processes for the
end-to-end demo: gloo over loopback; ``hapc profile`` replaces guesses by measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ClusterError

#: device kind -> (sustained flop/s, memory, memory bandwidth); sources in the presets below
DEVICES: dict[str, tuple[float, str, str]] = {
    "v100-fp32": (14e12, "16 GB", "900 GB/s"),  # HAP testbed, fp32: 15.7 peak
    "p100": (9e12, "16 GB", "732 GB/s"),  # fp32: 9.3-10.6 peak
    "v100": (62e12, "16 GB", "900 GB/s"),  # fp16 tensor cores: 125 peak
    "v100e": (62e12, "32 GB", "900 GB/s"),  # HARP's V100e: a 32 GB V100
    "a100": (156e12, "40 GB", "1.5 TB/s"),  # fp16: 312 peak
    "t4": (32e12, "16 GB", "320 GB/s"),  # fp16: 65 peak
}

#: device kind -> sustained flop/s under autocast (``flops_bf16`` / ``flops_fp16``, read only by a
#: plan made with ``precision=``), on the same "about half of the tensor-core peak" basis. A device
#: without bf16 units (Pascal, Volta, Turing: ``torch.cuda.is_bf16_supported()`` is False; cuBLAS
#: computes their bf16 GEMMs in fp32) gets its fp32 rate: bf16 there saves bytes, not time.
HALF: dict[str, dict[str, float]] = {
    "v100-fp32": {"flops_fp16": 62e12, "flops_bf16": 14e12},  # fp16 tensor cores: 125 peak; no bf16
    "p100": {"flops_fp16": 17e12, "flops_bf16": 9e12},  # fp16 (half2, no tensor cores): 18.7-21.2 peak; no bf16
    "v100": {"flops_fp16": 62e12, "flops_bf16": 14e12},  # fp32 15.7 peak, no bf16
    "v100e": {"flops_fp16": 62e12, "flops_bf16": 14e12},
    "a100": {"flops_fp16": 156e12, "flops_bf16": 156e12},  # fp16 and bf16 tensor cores: 312 peak each
    "t4": {"flops_fp16": 32e12, "flops_bf16": 7e12},  # fp32 8.1 peak, no bf16
}

#: ``(bandwidth, latency)`` of link kinds the presets share
LINKS = {
    "pcie": {"bandwidth": "10 GB/s", "latency": "10 us"},
    "10.4g": {"bandwidth": "10.4 Gbps", "latency": "50 us"},
    "ib200": {"bandwidth": "200 Gbps", "latency": "10 us"},
}


def group(name: str, devices: int, per_host: int, kind: str | None = None, **extra: Any) -> dict[str, Any]:
    """One ``[[group]]`` of ``devices`` devices of ``kind`` (default: ``name``), ``per_host`` per host."""
    flops, memory, bandwidth = DEVICES[kind or name]
    return {
        "name": name,
        "devices": devices,
        "devices_per_host": per_host,
        "flops": flops,
        "memory": memory,
        "mem_bandwidth": bandwidth,
        **HALF[kind or name],
        **extra,
    }


def _between(*pairs: tuple[str, str], bandwidth: str) -> list[dict[str, Any]]:
    return [{"groups": list(p), "bandwidth": bandwidth, "latency": "100 us"} for p in pairs]


def _hap_testbed(arg: str | None) -> dict[str, Any]:
    # HAP §7.1: 2 hosts x 8 V100 (NVLink) + 6 hosts x 8 P100, ~10.4 Gbps between hosts (iperf3).
    # fp32 sustained: V100 ~14 TFLOP/s (15.7 peak), P100 ~9 TFLOP/s (9.3-10.6 peak); 16 GB each.
    # NVLink V100 hosts ~130 GB/s, PCIe P100 hosts ~10 GB/s (the slower one bounds a ring).
    # "hap-testbed:16" keeps the first N GPUs (V100 first, as in HAP's 8/16/32/64 experiments).
    n = int(arg) if arg else 64
    v100, p100 = min(n, 16), n - min(n, 16)
    groups = [group("v100", v100, 8, "v100-fp32")] + ([group("p100", p100, 8)] if p100 else [])
    return {
        "name": f"hap-testbed-{n}",
        "group": groups,
        "links": {"intra_host": LINKS["pcie"], "inter_host": LINKS["10.4g"]},
    }


def _hap_homogeneous(arg: str | None) -> dict[str, Any]:
    # HAP §7.3: the homogeneous subset, 4 hosts x 8 P100.
    return {
        "name": "hap-p100-32",
        "group": [group("p100", 32, 8)],
        "links": {"intra_host": LINKS["pcie"], "inter_host": LINKS["10.4g"]},
    }


def _harp1(arg: str | None) -> dict[str, Any]:
    # HARP Table 11 (Heterogeneous Setting 1): 4 hosts x 8 A100 (312 TFLOP/s fp16, 40 GB, 300 GB/s
    # intra-host) + 4 hosts x 8 V100e (125 TFLOP/s fp16, 32 GB, 150 GB/s); 200 Gbps between hosts of a
    # sub-cluster, 5 Gbps across (HARP §6: "cross-cluster bandwidth fixed at 5 Gbps").
    return {
        "name": "harp-setting1",
        "group": [
            group("a100", 32, 8, intra_host={"bandwidth": "300 GB/s", "latency": "5 us"}),
            group("v100e", 32, 8),
        ],
        "links": {
            "intra_host": {"bandwidth": "150 GB/s", "latency": "5 us"},  # the V100e hosts'; A100 hosts: 300 GB/s
            "inter_host": LINKS["ib200"],
            "between": _between(("a100", "v100e"), bandwidth="5 Gbps"),
        },
    }


def _harp2(arg: str | None) -> dict[str, Any]:
    # HARP Heterogeneous Setting 2: 1 host x 8 V100 (16 GB, NVLink) + 2 hosts x 2 A100 (40 GB, PCIe);
    # RDMA inside a sub-cluster, 10 Gbps Ethernet across.
    return {
        "name": "harp-setting2",
        "group": [group("v100", 8, 8), group("a100", 4, 2)],
        "links": {
            "intra_host": {"bandwidth": "32 GB/s", "latency": "5 us"},
            "inter_host": LINKS["ib200"],
            "between": _between(("v100", "a100"), bandwidth="10 Gbps"),
        },
    }


def _harp3(arg: str | None) -> dict[str, Any]:
    # HARP Heterogeneous Setting 3: 8 V100 (16 GB, NVLink) + 2 V100e (32 GB, PCIe) + 2 A100 (40 GB,
    # PCIe); V100 <-> V100e over 200 Gbps IB, A100 over 5 Gbps (HARP §6.4).
    return {
        "name": "harp-setting3",
        "group": [group("v100", 8, 8), group("v100e", 2, 2), group("a100", 2, 2)],
        "links": {
            "intra_host": {"bandwidth": "32 GB/s", "latency": "5 us"},
            "inter_host": LINKS["ib200"],
            "between": _between(("v100", "a100"), ("v100e", "a100"), bandwidth="5 Gbps"),
        },
    }


def _metis(arg: str | None) -> dict[str, Any]:
    # Metis §6 (GCP): T4 16 GB and V100 16 GB VMs, 4 GPUs each, T4+V100 16-GPU experiments.
    # fp16 sustained: T4 ~32 TFLOP/s (65 peak), V100 ~62 (125 peak). GCP VM network assumed 32 Gbps.
    return {
        "name": "metis-t4v100",
        "group": [group("v100", 8, 4), group("t4", 8, 4)],
        "links": {
            "intra_host": {"bandwidth": "16 GB/s", "latency": "5 us"},
            "inter_host": {"bandwidth": "32 Gbps", "latency": "30 us"},
        },
    }


def _local_cpu(arg: str | None) -> dict[str, Any]:
    # This machine: N gloo processes on one host. The first half are described as twice as fast
    # as the rest (a stand-in for a heterogeneous cluster; `hapc profile` measures the real thing).
    # One CPU core sustains roughly 20 GFLOP/s fp32 in PyTorch GEMMs; loopback gloo ~2 GB/s.
    n = int(arg) if arg else 3
    if n < 1:
        raise ClusterError("local-cpu:N needs N >= 1")
    fast = (n + 1) // 2
    groups = [
        {
            "name": "fast",
            "devices": fast,
            "devices_per_host": fast,
            "flops": 2e10,
            "flops_bf16": 2e10,
            "flops_fp16": 2e10,
            "memory": "4 GiB",
            "mem_bandwidth": "8 GB/s",
        }
    ]
    if n - fast:
        groups.append(
            {
                "name": "slow",
                "devices": n - fast,
                "devices_per_host": n - fast,
                "flops": 1e10,
                "flops_bf16": 1e10,
                "flops_fp16": 1e10,
                "memory": "4 GiB",
                "mem_bandwidth": "4 GB/s",
            }
        )
    return {
        "name": f"local-cpu-{n}",
        "group": groups,
        "links": {
            "intra_host": {"bandwidth": "2 GB/s", "latency": "50 us"},
            "inter_host": {"bandwidth": "2 GB/s", "latency": "50 us"},
        },
    }


PRESETS: dict[str, Callable[[str | None], dict[str, Any]]] = {
    "hap-testbed": _hap_testbed,
    "hap-homogeneous": _hap_homogeneous,
    "harp-setting1": _harp1,
    "harp-setting2": _harp2,
    "harp-setting3": _harp3,
    "metis-t4v100": _metis,
    "local-cpu": _local_cpu,
}


def preset(spec: str):
    """``"hap-testbed"``, ``"hap-testbed:16"``, ``"local-cpu:3"``..."""
    from .cluster import Cluster

    name, _, arg = spec.partition(":")
    if name not in PRESETS:
        raise ClusterError(f"unknown preset {name!r} (presets: {', '.join(sorted(PRESETS))})")
    try:
        data = PRESETS[name](arg or None)
    except ValueError as exc:
        raise ClusterError(f"preset {spec!r}: bad argument {arg!r}") from exc
    return Cluster.from_dict(data, check_ranges=True)
