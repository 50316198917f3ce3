"""Every benchmark runs end to end at tiny size (numbers are not asserted: machines are noisy).

Every benchmark but segmentation takes 12-57 s at its quick size on CI's 2-core machine, so they
are marked ``slow``: CI runs them in ``make test-slow``, which keeps ``make test`` within its
budget (about 15 minutes there).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "script",
    [
        pytest.param("synth_time.py", marks=pytest.mark.slow),
        "segmentation.py",
        pytest.param("runtime_overhead.py", marks=pytest.mark.slow),
        pytest.param("plan_quality.py", marks=pytest.mark.slow),
        pytest.param("uneven_experts.py", marks=pytest.mark.slow),
        pytest.param("pipeline_peer.py", marks=pytest.mark.slow),
        pytest.param("hetero_speedup.py", marks=pytest.mark.slow),
        pytest.param("memory_fidelity.py", marks=pytest.mark.slow),
    ],
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
    assert proc.returncode == 0, _failure(proc.stderr)
    result = json.loads(out.read_text())
    assert result
    _check_printed(script, proc.stdout, result)


@pytest.mark.slow
def test_realworld_smoke(tmp_path):
    """Real models (tiny configs) synthesize on hap-testbed:8, each in its own subprocess; a row per model."""
    pytest.importorskip("transformers")
    out = tmp_path / "out.json"
    models = ["gpt2", "tv-resnet"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "realworld.py"), "--quick", "--json", str(out), "--models", *models],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, _failure(proc.stderr)
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == models
    assert rows["gpt2"]["status"] == "ok", rows["gpt2"]["status"]
    assert rows["gpt2"]["hapc_ms"] > 0 and rows["gpt2"]["dpev_ms"] >= rows["gpt2"]["hapc_ms"]
    for row in rows.values():
        assert f"| {row['model']} |" in proc.stdout


def _failure(stderr: str) -> str:
    """What a failed benchmark wrote to stderr, cut for the assertion message: its first lines, every
    line that names an error (each rank's, where several processes failed: the first may be another
    rank's "connection reset" after the one that raised), and its last lines."""
    lines = stderr.splitlines()
    if len(lines) <= 50:
        return stderr[-6000:]
    errors = [ln for ln in lines[20:-30] if "Error" in ln or "error:" in ln or "Traceback" in ln]
    return "\n".join([*lines[:20], "...", *errors[:40], "...", *lines[-30:]])[-6000:]


def _check_printed(script: str, stdout: str, result: dict) -> None:
    """What the benchmark prints is the table of its JSON rows (not only a clean exit)."""
    if script == "synth_time.py":
        assert "Synthesis time" in stdout
        for name, row in result["rows"].items():
            assert f"| {name} |" in stdout, name
            assert row["total"] > 0
    elif script == "segmentation.py":
        assert "node segments vs HAP's stage model" in stdout and "random graphs" in stdout
        for case in result["zoo"]:
            assert case in stdout, case
    elif script == "runtime_overhead.py":
        for row in result["rows"]:
            assert row["hapc_s"] > 0 and row["torch_s"] > 0
            assert f"{row['ratio']:.3f}" in stdout, row["case"]  # the ratio column shows the JSON's ratio
    elif script == "plan_quality.py":
        assert "Plan quality" in stdout and "hapc speedup" in stdout
        for case, row in result["heterogeneous"].items():
            assert f"| {case} |" in stdout, case
            # the FSDP (ZeRO-3) baseline is priced in every cell: a time, or the reason it has none
            assert "time" in row["fsdp"] or row["fsdp"].get("error"), (case, row["fsdp"])
        assert "fsdp (ms)" in stdout
    elif script == "pipeline_peer.py":
        assert "Both equal one device in float64" in stdout
        for row in result["rows"]:
            assert row["hapc_s"] > 0 and row["torch_s"] > 0 and row["slow_hapc_s"] > 0
            assert f"{row['ratio']:.3f}" in stdout and f"{row['slow_ratio']:.3f}" in stdout, row["micro"]
    elif script == "hetero_speedup.py":
        if not result["emulated"]:  # no writable cgroup cpu controller on this machine
            assert "cannot be emulated" in stdout
            return
        assert "EMULATED" in stdout
        for row in result["rows"]:
            assert row["hapc_s"] > 0 and row["ddp_even_s"] > 0 and row["ddp_prop_s"] > 0 and row["hapc_dpcp_s"] > 0
            assert f"{row['measured_speedup_vs_ddp_even']:.2f}" in stdout, row["model"]
            assert (row["plan"] == "DP") == (not row["sharded_params"]), row["plan"]
            # the predicted speedup's two factors, each beside its measured counterpart
            assert row["dp_gain_predicted"] * row["plan_gain_predicted"] == pytest.approx(row["predicted_speedup"])
            assert row["dp_gain_measured"] == pytest.approx(row["ddp_even_s"] / row["ddp_prop_s"])
            assert row["plan_gain_measured"] == pytest.approx(row["hapc_dpcp_s"] / row["hapc_s"])
            assert f"{row['plan_gain_measured']:.2f}" in stdout, row["model"]
        assert "[[group]]" in result["cluster"]  # the profile the cases were planned on
    elif script == "memory_fidelity.py":
        assert len(result["configs"]) >= 6 and f"of {len(result['configs'])} configurations within" in stdout
        for row in result["rows"]:
            assert row["predicted"] > 0 and row["measured"] > 0
            assert f"{row['ratio']:.3f}" in stdout, row["config"]
    elif script == "uneven_experts.py":
        assert "Uneven experts" in stdout
        for link in result["links"]:
            assert f"{link} between the hosts" in stdout, link


@pytest.mark.slow
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
