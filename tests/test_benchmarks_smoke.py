"""Every benchmark runs end to end at tiny size (numbers are not asserted: machines are noisy)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script", ["synth_time.py", "segmentation.py", "runtime_overhead.py", "plan_quality.py", "uneven_experts.py"]
)
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


def test_run_all_writes_results_and_plots(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(tmp_path)]
        + ["--only", "synth_time", "segmentation"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = (tmp_path / "RESULTS.md").read_text()
    assert "## synth_time" in results and "## segmentation" in results and "failed" not in results
    assert "| ViT-2 |" in results  # the markdown table, not just a heading
    assert (tmp_path / "synth_time.png").stat().st_size > 0
    assert json.loads((tmp_path / "synth_time.json").read_text())["rows"]["ViT-2"]["total"] > 0
