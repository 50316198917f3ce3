"""The command line every benchmark module shares: ``--quick`` (the CI smoke size) and ``--json``
(where the results go; default ``<name>.json`` beside the script)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parse(quick_help: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--json", help="write results here (default: <benchmark>.json beside the script)")
    return ap.parse_args()


def save(name: str, result: dict[str, Any], args: argparse.Namespace) -> None:
    out = Path(args.json) if args.json else HERE / f"{name}.json"
    out.write_text(json.dumps(result, indent=1))
