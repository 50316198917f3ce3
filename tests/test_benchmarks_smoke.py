"""Every benchmark runs end to end at tiny size (numbers are not asserted: machines are noisy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", ["synth_time.py", "segmentation.py", "runtime_overhead.py"])
def test_benchmark_smoke(script, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())
