"""Installs that respect a lab's own torch (issue 14, part 4): pyproject.toml declares ranges,
scripts/setup.sh installs the tested pins from constraints.txt, and a machine without a C
compiler still installs labrun, with `labrun doctor` naming what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import version

import pytest
import tomllib
from packaging.requirements import Requirement

from conftest import PROJECT, PYTHON


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}


def pins() -> dict[str, str]:
    lines = (PROJECT / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_torch_is_a_range_and_setup_installs_the_tested_pins():
    declared, pinned = requirements(), pins()
    for name in ("torch", "torchvision"):
        specifier = declared[name].specifier
        assert not any(s.operator in ("==", "===") for s in specifier), f"{name} is pinned"
        assert pinned[name] in specifier, f"the tested {name} {pinned[name]} is outside {specifier}"
        # The lowest bound is the lowest release tested: the pin itself, at most a patch above.
        lowest = next(s.version for s in specifier if s.operator == ">=")
        assert pinned[name].startswith(lowest), (name, lowest, pinned[name])
        assert version(name).split("+")[0] == pinned[name], "this .venv is not the tested one"
    assert "-c constraints.txt" in (PROJECT / "scripts" / "setup.sh").read_text()


def test_installs_without_a_c_compiler(tmp_path):
    """The compiled decoders are optional: a build whose compiler is missing still makes a
    wheel (without them)."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(PROJECT / name, project / name)
    shutil.copytree(PROJECT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "LDSHARED": str(tmp_path / "no-ld")}
    result = subprocess.run(
        [PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "wheels"), str(project)], env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("labrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "labrun/train/trainer.py" in names
    assert not [n for n in names if n.endswith(".so")]  # neither _jpeg_region nor _png_rows


@pytest.mark.parametrize("module, check, package", [
    ("labrun.data.image._jpeg_region", "check_jpeg_regions", "libjpeg62-turbo-dev"),
    ("labrun.data.segmentation._png_rows", "check_mask_rows", "libpng-dev"),
])
def test_doctor_names_a_missing_compiled_decoder(module, check, package):
    # The compiled module made unimportable, as on a machine that built without a compiler.
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            f"from labrun.doctor.libraries import {check}\n"
            f"c = {check}(); print(c.status, '|', c.detail, '|', c.fix)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    status, detail, fix = (part.strip() for part in out.split("|"))
    assert status != "ok" and "not compiled" in detail
    assert package in fix and "pip install" in fix
