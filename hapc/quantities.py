"""Quantities in cluster files: numbers with units, read by kind, and sanity ranges.

A field has a *kind* -- bandwidth (bytes/s), size (bytes), time (seconds), flop rate (flop/s) --
and accepts only that kind's units: ``bandwidth = "2 GB"`` (a size) is an error, not 2e9 bytes/s.
Plain numbers are SI values of the field's kind. Units are case-insensitive, so ``Gb/s`` reads as
``GB/s``; bits are spelled ``bps`` (``10 Gbps`` = 1.25e9 bytes/s).

The ranges catch a missing or wrong unit (``memory = 40`` meant as GiB, ``latency = 5`` meant as
microseconds) in files people write. They are wide -- a slow CPU process to a future accelerator:

========== =================== ==================================================================
kind       range               why
========== =================== ==================================================================
bandwidth  1 MB/s .. 100 TB/s  links: 8 Mbps is below any real interconnect; 100 TB/s is 10x HBM
size       1 MiB .. 100 TiB    one device's memory
time       0 .. 10 s           latency, per-op overhead, alpha: no link takes seconds per message
                               (no positive lower bound: ``hapc profile`` fits may be ~0)
flop rate  100 MFLOP/s ..      one device; ``hapc profile`` on a slow CPU core with a small GEMM
           100 PFLOP/s         measures ~1 GFLOP/s; 100 PFLOP/s is 50x a 2025 accelerator
s/byte     0 .. 1e-6           a fitted collective's beta, i.e. at least 1 MB/s
========== =================== ==================================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import ClusterError


@dataclass(frozen=True)
class Kind:
    """What a field measures: its units (spelled as shown -> SI factor) and its sanity range (SI)."""

    name: str
    si: str  # the SI unit a plain number is read in
    units: dict[str, float]
    low: float
    high: float
    shown: str  # the range, as a person writes it

    def accepts(self) -> str:
        spelled = ", ".join(self.units)
        return f"{spelled}, or a plain number in {self.si}" if spelled else f"a plain number in {self.si}"


_DEC = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BIN = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

BANDWIDTH = Kind(
    "bandwidth",
    "bytes/s",
    {
        **{f"{p}B/s": f for p, f in _DEC.items()},
        **{f"{p}B/s": f for p, f in _BIN.items()},
        **{f"{p}bps": f / 8 for p, f in _DEC.items()},
    },
    1e6,
    1e14,
    "1 MB/s .. 100 TB/s",
)
SIZE = Kind(
    "size",
    "bytes",
    {**{f"{p}B": f for p, f in _DEC.items()}, **{f"{p}B": f for p, f in _BIN.items()}},
    2**20,
    100 * 2**40,
    "1 MiB .. 100 TiB",
)
TIME = Kind("time", "seconds", {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}, 0.0, 10.0, "0 .. 10 s")
FLOPS = Kind(
    "flop rate",
    "flop/s",
    {
        **{f"{p}FLOPS": f for p, f in (("", 1.0), ("G", 1e9), ("T", 1e12), ("P", 1e15))},
        **{f"{p}FLOP/s": f for p, f in (("", 1.0), ("G", 1e9), ("T", 1e12), ("P", 1e15))},
    },
    1e8,
    1e17,
    "100 MFLOP/s .. 100 PFLOP/s",
)
PER_BYTE = Kind("seconds per byte", "seconds per byte", {}, 0.0, 1e-6, "0 .. 1e-6 s/byte (at least 1 MB/s)")

KINDS = (BANDWIDTH, SIZE, TIME, FLOPS)
_LOWER = {k.name: {u.lower(): f for u, f in k.units.items()} for k in KINDS}
_ANY = {u: f for k in KINDS for u, f in _LOWER[k.name].items()}


def parse_quantity(value: Any, what: str, kind: Kind | None = None) -> float:
    """``"10.4 Gbps"`` -> bytes/s, ``"16 GiB"`` -> bytes, numbers unchanged.

    With ``kind``, a unit of another kind is an error naming ``what``, the value and the accepted
    units; without, any known unit is read (command-line sizes and old callers)."""
    if isinstance(value, bool):
        raise ClusterError(f"{what}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", value)
        if m:
            unit = m.group(2).lower()
            table = _ANY if kind is None else _LOWER.get(kind.name, {})
            if kind is not None and unit and unit not in table and unit in _ANY:
                other = next(k for k in KINDS if unit in _LOWER[k.name])
                raise ClusterError(
                    f"{what}: {value!r} is a {other.name}, but this field is a {kind.name}: use {kind.accepts()}"
                )
            if unit == "" or unit in table:
                try:
                    return float(m.group(1)) * (table[unit] if unit else 1.0)
                except ValueError:
                    pass
    accepted = kind.accepts() if kind is not None else "a number, or e.g. '10 Gbps', '16 GiB', '14 TFLOPS', '5 us'"
    raise ClusterError(f"{what}: cannot read {value!r} (expected {accepted})")


def check_range(x: float, value: Any, what: str, kind: Kind) -> float:
    """``x`` (the SI value of ``value``) unless it is outside ``kind``'s sanity range."""
    if not kind.low <= x <= kind.high:
        raise ClusterError(
            f"{what}: {value!r} looks wrong: a {kind.name} is expected in {kind.shown} (a missing or wrong unit?)"
        )
    return x
