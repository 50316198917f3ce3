"""Start-up time of the ``hapc`` command: ``--help`` and usage errors answer before torch is imported.

Each case runs in a fresh process, ``--reps`` times (median kept), beside two references: an empty
interpreter and ``import torch`` (what every command that does work pays). Issue 13 asks for help
and usage errors in under 0.5 s; this is a measurement, not a timed test (tests/test_cli.py checks
that torch is not imported).

    python benchmarks/cli_startup.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def command() -> list[str]:
    """The installed ``hapc`` script beside this interpreter, else ``python -m hapc``."""
    script = Path(sys.executable).with_name("hapc")
    if script.exists() or shutil.which("hapc"):
        return [str(script) if script.exists() else "hapc"]
    return [sys.executable, "-m", "hapc"]


def cases() -> dict[str, list[str]]:
    hapc = command()
    return {
        "python -c pass (reference)": [sys.executable, "-c", "pass"],
        "python -c 'import torch' (reference)": [sys.executable, "-c", "import torch"],
        "hapc --help": [*hapc, "--help"],
        "hapc nosuch (unknown command)": [*hapc, "nosuch"],
        "hapc theory (missing MODEL)": [*hapc, "theory"],
        "hapc profile --local 0": [*hapc, "profile", "--local", "0"],
    }


def time_once(argv: list[str], cwd: str | None = None) -> tuple[float, int]:
    """Wall seconds and exit status of ``argv`` in a fresh process (output discarded)."""
    t0 = time.perf_counter()
    rc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd).returncode
    return time.perf_counter() - t0, rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per case (median kept)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rows = []
    for name, argv in cases().items():
        runs = [time_once(argv) for _ in range(args.reps)]
        rows.append({"case": name, "median_s": statistics.median(t for t, _ in runs), "exit": runs[-1][1]})
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  {'median s':>8}  exit")
    for r in rows:
        print(f"{r['case']:<{width}}  {r['median_s']:>8.3f}  {r['exit']:>4}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
