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


def _hap_testbed(arg: str | None) -> dict[str, Any]:
    # HAP §7.1: 2 hosts x 8 V100 (NVLink) + 6 hosts x 8 P100, ~10.4 Gbps between hosts (iperf3).
    # fp32 sustained: V100 ~14 TFLOP/s (15.7 peak), P100 ~9 TFLOP/s (9.3-10.6 peak); 16 GB each.
    # NVLink V100 hosts ~130 GB/s, PCIe P100 hosts ~10 GB/s (the slower one bounds a ring).
    # "hap-testbed:16" keeps the first N GPUs (V100 first, as in HAP's 8/16/32/64 experiments).
    n = int(arg) if arg else 64
    v100 = min(n, 16)
    p100 = n - v100
    groups = [
        {
            "name": "v100",
            "devices": v100,
            "devices_per_host": 8,
            "flops": 14e12,
            "memory": "16 GB",
            "mem_bandwidth": "900 GB/s",
        }
    ]
    if p100:
        groups.append(
            {
                "name": "p100",
                "devices": p100,
                "devices_per_host": 8,
                "flops": 9e12,
                "memory": "16 GB",
                "mem_bandwidth": "732 GB/s",
            }
        )
    return {
        "name": f"hap-testbed-{n}",
        "group": groups,
        "links": {
            "intra_host": {"bandwidth": "10 GB/s", "latency": "10 us"},
            "inter_host": {"bandwidth": "10.4 Gbps", "latency": "50 us"},
        },
    }


def _hap_homogeneous(arg: str | None) -> dict[str, Any]:
    # HAP §7.3: the homogeneous subset, 4 hosts x 8 P100.
    return {
        "name": "hap-p100-32",
        "group": [
            {
                "name": "p100",
                "devices": 32,
                "devices_per_host": 8,
                "flops": 9e12,
                "memory": "16 GB",
                "mem_bandwidth": "732 GB/s",
            }
        ],
        "links": {
            "intra_host": {"bandwidth": "10 GB/s", "latency": "10 us"},
            "inter_host": {"bandwidth": "10.4 Gbps", "latency": "50 us"},
        },
    }


def _harp1(arg: str | None) -> dict[str, Any]:
    # HARP Table 11 (Heterogeneous Setting 1): 4 hosts x 8 A100 (312 TFLOP/s fp16, 40 GB, 300 GB/s
    # intra-host) + 4 hosts x 8 V100e (125 TFLOP/s fp16, 32 GB, 150 GB/s); 200 Gbps between hosts of a
    # sub-cluster, 5 Gbps across (HARP §6: "cross-cluster bandwidth fixed at 5 Gbps").
    return {
        "name": "harp-setting1",
        "group": [
            {
                "name": "a100",
                "devices": 32,
                "devices_per_host": 8,
                "flops": 156e12,
                "memory": "40 GB",
                "mem_bandwidth": "1.5 TB/s",
                "intra_host": {"bandwidth": "300 GB/s", "latency": "5 us"},
            },
            {
                "name": "v100e",
                "devices": 32,
                "devices_per_host": 8,
                "flops": 62e12,
                "memory": "32 GB",
                "mem_bandwidth": "900 GB/s",
            },
        ],
        "links": {
            "intra_host": {"bandwidth": "150 GB/s", "latency": "5 us"},  # the V100e hosts'; A100 hosts: 300 GB/s
            "inter_host": {"bandwidth": "200 Gbps", "latency": "10 us"},
            "between": [{"groups": ["a100", "v100e"], "bandwidth": "5 Gbps", "latency": "100 us"}],
        },
    }


def _harp2(arg: str | None) -> dict[str, Any]:
    # HARP Heterogeneous Setting 2: 1 host x 8 V100 (16 GB, NVLink) + 2 hosts x 2 A100 (40 GB, PCIe);
    # RDMA inside a sub-cluster, 10 Gbps Ethernet across.
    return {
        "name": "harp-setting2",
        "group": [
            {
                "name": "v100",
                "devices": 8,
                "devices_per_host": 8,
                "flops": 62e12,
                "memory": "16 GB",
                "mem_bandwidth": "900 GB/s",
            },
            {
                "name": "a100",
                "devices": 4,
                "devices_per_host": 2,
                "flops": 156e12,
                "memory": "40 GB",
                "mem_bandwidth": "1.5 TB/s",
            },
        ],
        "links": {
            "intra_host": {"bandwidth": "32 GB/s", "latency": "5 us"},
            "inter_host": {"bandwidth": "200 Gbps", "latency": "10 us"},
            "between": [{"groups": ["v100", "a100"], "bandwidth": "10 Gbps", "latency": "100 us"}],
        },
    }


def _harp3(arg: str | None) -> dict[str, Any]:
    # HARP Heterogeneous Setting 3: 8 V100 (16 GB, NVLink) + 2 V100e (32 GB, PCIe) + 2 A100 (40 GB,
    # PCIe); V100 <-> V100e over 200 Gbps IB, A100 over 5 Gbps (HARP §6.4).
    return {
        "name": "harp-setting3",
        "group": [
            {
                "name": "v100",
                "devices": 8,
                "devices_per_host": 8,
                "flops": 62e12,
                "memory": "16 GB",
                "mem_bandwidth": "900 GB/s",
            },
            {
                "name": "v100e",
                "devices": 2,
                "devices_per_host": 2,
                "flops": 62e12,
                "memory": "32 GB",
                "mem_bandwidth": "900 GB/s",
            },
            {
                "name": "a100",
                "devices": 2,
                "devices_per_host": 2,
                "flops": 156e12,
                "memory": "40 GB",
                "mem_bandwidth": "1.5 TB/s",
            },
        ],
        "links": {
            "intra_host": {"bandwidth": "32 GB/s", "latency": "5 us"},
            "inter_host": {"bandwidth": "200 Gbps", "latency": "10 us"},
            "between": [
                {"groups": ["v100", "a100"], "bandwidth": "5 Gbps", "latency": "100 us"},
                {"groups": ["v100e", "a100"], "bandwidth": "5 Gbps", "latency": "100 us"},
            ],
        },
    }


def _metis(arg: str | None) -> dict[str, Any]:
    # Metis §6 (GCP): T4 16 GB and V100 16 GB VMs, 4 GPUs each, T4+V100 16-GPU experiments.
    # fp16 sustained: T4 ~32 TFLOP/s (65 peak), V100 ~62 (125 peak). GCP VM network assumed 32 Gbps.
    return {
        "name": "metis-t4v100",
        "group": [
            {
                "name": "v100",
                "devices": 8,
                "devices_per_host": 4,
                "flops": 62e12,
                "memory": "16 GB",
                "mem_bandwidth": "900 GB/s",
            },
            {
                "name": "t4",
                "devices": 8,
                "devices_per_host": 4,
                "flops": 32e12,
                "memory": "16 GB",
                "mem_bandwidth": "320 GB/s",
            },
        ],
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
    return Cluster.from_dict(data)
