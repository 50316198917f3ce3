"""The ``hapc rules`` / ``hapc theory`` commands (acceptance 1 and 4 of the theory issue)."""

import json
import subprocess
import sys

import pytest

from hapc.cli import main


def test_rules_json_lists_at_least_45_ops(capsys):
    assert main(["rules", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) >= 45
    assert all({"op", "kind", "shards"} <= set(r) for r in rows)


@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn", "moe"])
def test_theory_command_on_small_models(model, capsys):
    assert main(["theory", model, "--json", "--verify"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["triples"]["triples"] > 10 and info["verify"]["failures"] == []
    assert info["unsupported_ops"] == []
    assert any("{" in t and "}" in t for t in info["theory"])


def test_theory_of_gpt_1_3b_on_meta_without_allocating():
    """A 1.4B-parameter GPT (5.7 GB in fp32) is traced in a fresh process whose peak RSS stays small."""
    code = (
        "import json, resource; from hapc.cli import main; import sys, io\n"
        "buf = io.StringIO(); sys.stdout = buf\n"
        "rc = main(['theory', 'gpt-1.3b', '--json'])\n"
        "sys.stdout = sys.__stdout__\n"
        "info = json.loads(buf.getvalue())\n"
        "print(json.dumps({'rc': rc, 'params': info['graph']['parameters'], 'triples': info['triples']['triples'],"
        " 'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["rc"] == 0 and res["params"] > 1.3e9 and res["triples"] > 1000
    assert res["rss_mb"] < 1500, res  # the weights alone would be 5700 MB


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["theory", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


# -- usage errors, the current directory, factory arguments (issue 13) --------------------------

# a user's own module: a factory returning (model, example_inputs), as the zoo's do
MYNET = """
import torch


class Net(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x).square().mean()


def factory(width: int = 4, batch: int = 3):
    return Net(width), (torch.randn(batch, width),)
"""


def _hapc(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hapc", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "argv", [["--help"], ["nosuch"], ["theory"], ["synth", "gpt", "--bogus"], ["profile", "--local", "0"]]
)
def test_help_and_usage_errors_import_no_torch(argv):
    """Arguments are parsed before anything heavy is imported (benchmarks/cli_startup.py times it)."""
    code = f"import sys\nfrom hapc.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as e:\n"
    code += "    print(e.code, 'torch' in sys.modules, 'hapc.models' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    rc, torch_loaded, zoo_loaded = out.stdout.splitlines()[-1].split()
    assert (rc, torch_loaded, zoo_loaded) == ("0" if argv == ["--help"] else "2", "False", "False"), out.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["synth", "nosuch", "--cluster", "hap-testbed"], "unknown model 'nosuch'"),
        (["theory", "nosuch"], "unknown model 'nosuch'"),
        (["synth", "gpt", "--cluster", "nosuch"], "cluster 'nosuch'"),
    ],
)
def test_unknown_model_or_cluster_is_refused_before_torch(argv, message):
    """A misspelt model or cluster is a usage error: answered without importing torch (issue 15's cold start)."""
    code = f"import sys\nfrom hapc.cli import main\nrc = main({argv!r})\nprint(rc, 'torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.splitlines()[-1].split() == ["2", "False"], out.stderr
    assert message in out.stderr


def test_cli_zoo_aliases_match_the_zoo():
    from hapc import models
    from hapc.cli import ZOO_ALIASES

    assert ZOO_ALIASES == tuple(sorted(models.ZOO))


@pytest.mark.parametrize("local", ["0", "-2", "two"])
def test_profile_local_must_be_positive(local, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--local", local])
    assert exc.value.code == 2
    assert "--local: expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "-1", "inf", "soon"])
def test_time_limit_must_be_a_positive_number(limit, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["synth", "mlp", "--cluster", "hap-testbed:8", "--time-limit", limit])
    assert exc.value.code == 2
    assert "--time-limit: expected a positive number" in capsys.readouterr().err


def test_a_time_limited_synthesis_says_its_plan_is_not_proven(tmp_path):
    out = _hapc("synth", "mynet_tl:factory", "--cluster", "hap-testbed:8", "--kind", "spmd", "--arg", "batch=8",
                "--time-limit", "1e-9", "--json", "plan.json", cwd=_with_mynet(tmp_path, "mynet_tl"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "not proven optimal" in out.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["predicted"]["proven_optimal"] is False


def _with_mynet(path, name: str):
    (path / f"{name}.py").write_text(MYNET)
    return path


def test_a_model_in_the_current_directory_is_importable(tmp_path):
    (tmp_path / "mynet_cli.py").write_text(MYNET)
    out = _hapc("theory", "mynet_cli:factory", "--arg", "width=6", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["graph"]["parameters"] == 6 * 6 + 6


def test_a_misspelt_factory_argument_is_one_line_naming_the_accepted_ones(tmp_path):
    (tmp_path / "mynet_typo.py").write_text(MYNET)
    out = _hapc("theory", "mynet_typo:factory", "--arg", "widht=6", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == "hapc: error: model 'mynet_typo:factory': unknown --arg widht; it accepts width, batch"


def test_zoo_factory_arguments_are_checked_too(capsys):
    assert main(["theory", "mlp", "--arg", "widht=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown --arg widht" in err and "widths" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("spec", "message"),
    [("mynet_none:factory", "No module named 'mynet_none'"), ("hapc.models:nofactory", "has no 'nofactory'")],
)
def test_a_model_path_that_does_not_resolve_is_a_clear_error(spec, message, capsys):
    assert main(["theory", spec]) == 2
    assert message in capsys.readouterr().err


def test_cli_baselines_match_the_synthesizer():
    from hapc.cli import BASELINES
    from hapc.synth.baselines import BASELINES as SYNTH

    assert BASELINES == SYNTH
