"""The layer order of labrun's rooms (pyproject.toml [tool.importlinter]) holds, and the contract
bites: an upward import added to a copy of the package is reported."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import PROJECT, PYTHON

LINT_IMPORTS = str(Path(PYTHON).with_name("lint-imports"))


def lint_imports(python_path: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if python_path is not None:  # ahead of the installed labrun: lint that copy instead
        env["PYTHONPATH"] = f"{python_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # --no-cache: the copy must be analysed afresh, not from the project's cache.
    # grimp reads ~60 modules: well under a second; 120 s bounds a loaded machine.
    return subprocess.run([LINT_IMPORTS, str(PROJECT / "pyproject.toml"),
                          "--no-cache"], cwd=PROJECT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_source_tree_keeps_every_import_contract():
    result = lint_imports()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    copy = tmp_path / "src" / "labrun"
    shutil.copytree(PROJECT / "src" / "labrun", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    # core is the bottom room: it may import no other room, least of all the command line.
    (copy / "core" / "upward.py").write_text("import labrun.cli  # noqa: F401\n")
    result = lint_imports(tmp_path / "src")
    assert result.returncode == 1, result.stdout[-4000:]
    assert "labrun.core is not allowed to import labrun.cli" in result.stdout
    assert "labrun.core.upward -> labrun.cli" in result.stdout


def test_a_new_room_must_be_placed_in_the_order(tmp_path):
    copy = tmp_path / "src" / "labrun"
    shutil.copytree(PROJECT / "src" / "labrun", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (copy / "misc").mkdir()
    (copy / "misc" / "__init__.py").write_text("")
    result = lint_imports(tmp_path / "src")
    assert result.returncode == 1, result.stdout[-4000:]
    assert "labrun.misc" in result.stdout
