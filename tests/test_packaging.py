"""Packaging: the model zoo installs as ``hapc.models`` and never shadows a user's ``models`` module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hapc.cli import tomllib_loads

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_under_hapc_is_listed_in_pyproject():
    """pyproject lists packages by hand (package-dir maps models/ to hapc.models): a new one must be added."""
    listed = set(tomllib_loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hapc").rglob("__init__.py")}
    assert found | {"hapc.models"} == listed


def test_zoo_is_hapc_models_and_leaves_models_to_the_user(tmp_path):
    (tmp_path / "models.py").write_text("MINE = True\n")
    code = "import models, hapc.models; print(models.MINE, hapc.models.load('mlp')[0].__class__.__module__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "hapc.models.mlp"]
