"""labrun as an installed tool: a wheel built from this repository holds everything labrun reads
at run time (the config groups, the config review's list, the Prometheus files), and installed
non-editable into a fresh environment, outside the checkout, it trains with `labrun train` and
checks its configs from any folder. The environment reuses this one's torch and other
dependencies through a path line (nothing is downloaded), and the test asserts that labrun
itself is the wheel's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import PROJECT, PYTHON, read_summary


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A new environment with labrun's wheel installed; its bin/ folder."""
    folder = tmp_path_factory.mktemp("installed")
    build = subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(folder / "wheels"), str(PROJECT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (folder / "wheels").glob("labrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"labrun/conf/train.yaml", "labrun/conf/review.yaml", "labrun/conf/model/resnet50.yaml",
            "labrun/monitoring/shipped/prometheus.yml", "labrun/monitoring/shipped/rules.yml",
            "labrun/monitoring/shipped/grafana/labrun.json",
            "hydra_plugins/labrun_launcher/labrun_project.py",
            "labrun/scaffold/template/Makefile.tmpl"} <= set(names)

    venv = folder / "venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # This environment's packages (torch...) behind the new one's own: a path line adds the
    # folder, without running its .pth files (labrun's editable finder among them).
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([PYTHON, "-m", "pip", "--python", str(venv / "bin" / "python"),
                              "install", "--no-deps", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    return venv / "bin"


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command of the new environment, as a person who activated it types it."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    command = args[0] if args[0] == "make" else str(bin_dir / args[0])
    return subprocess.run([command, *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**env, "PYTHONNOUSERSITE": "1"})


def test_the_wheel_imports_labrun_from_itself_with_a_version_from_git(installed, tmp_path):
    shown = run(installed, "python", "-c", "import json, labrun; from labrun.core import project;"
                " print(json.dumps([labrun.__file__, labrun.__version__, str(project.LABRUN_CONF),"
                " str(project.SHIPPED_MONITORING)]))", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    file, version, conf, monitoring = json.loads(shown.stdout)
    venv = installed.parent
    assert Path(file).is_relative_to(venv) and Path(conf).is_relative_to(venv)
    assert (Path(monitoring) / "prometheus.yml").is_file()
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=PROJECT,
                          capture_output=True, text=True).stdout.strip()
    # Built from this checkout: setuptools-scm names its commit (or, on a tag, the tag).
    assert head in version or "dev" not in version, version
    if shutil.which("promtool"):  # the configuration `labrun monitor up` starts with
        check = subprocess.run(["promtool", "check", "config", str(Path(monitoring) /
                                                                   "prometheus.yml")],
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_wheel_trains_and_checks_its_configs_outside_any_checkout(installed, tmp_path):
    work = tmp_path / "anywhere"
    work.mkdir()
    trained = run(installed, "labrun", "train", "trainer.max_steps=3", "logger=csv",
                  "trainer.limit_val_batches=2", "dataset.num_workers=0",
                  f"hydra.run.dir={work / 'run'}", cwd=work)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    summary = read_summary(work / "run")
    assert (summary["status"], summary["step"]) == ("completed", 3)
    environment = json.loads((work / "run" / "provenance" / "environment.json").read_text())
    assert Path(environment["labrun"]).is_relative_to(installed.parent)

    checked = run(installed, "labrun", "configs", "check", cwd=work)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    # Every option of every group, read from the installed package.
    assert f"configs in {installed.parent}" in checked.stdout and "compose and validate" in (
        checked.stdout)
    helped = run(installed, "labrun", "train", "--help", cwd=work)
    assert helped.returncode == 0 and "resnet50" in helped.stdout


def test_python_train_py_and_labrun_train_compose_the_same_config(tmp_path):
    """The repository's train.py is `labrun train`: the same app, the same composed job."""
    via_script = subprocess.run([PYTHON, str(PROJECT / "train.py"), "--cfg", "job",
                                 "model=resnet18"], cwd=PROJECT, capture_output=True, text=True,
                                timeout=120)
    via_command = subprocess.run([str(Path(sys.executable).with_name("labrun")), "train",
                                  "--cfg", "job", "model=resnet18"], cwd=PROJECT,
                                 capture_output=True, text=True, timeout=120)
    assert via_script.returncode == via_command.returncode == 0, via_command.stderr
    assert via_script.stdout == via_command.stdout and "resnet18" in via_script.stdout


def test_labrun_new_makes_a_project_that_trains_and_tests_with_its_own_make(installed,
                                                                           tmp_path):
    """`labrun new` from the installed tool, then the project's own `make train` and `make
    test` in the environment labrun is installed in (no second torch), training the project's
    model on its data, with its task, recorded under the project's commit."""
    made = run(installed, "labrun", "new", "plant-disease", "--task", "classification",
               cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    project = tmp_path / "plant-disease"
    head = subprocess.run(["git", "log", "--format=%H"], cwd=project, capture_output=True,
                          text=True).stdout.split()
    assert len(head) == 1  # the first commit, whatever git's identity here
    assert {".gitignore", ".pre-commit-config.yaml", "Makefile", "README.md", "train.py",
            "pyproject.toml"} <= {p.name for p in project.iterdir()}
    assert (project / ".github" / "workflows" / "config-review.yml").is_file()
    assert (project / "data" / "raw").is_dir() and (project / "data" / "processed").is_dir()
    assert "labrun>=" in (project / "pyproject.toml").read_text()

    run_dir = tmp_path / "run"
    trained = run(installed, "make", "train", f"ARGS=trainer.max_steps=3 trainer.max_epochs=null "
                  f"logger=csv hydra.run.dir={run_dir}", cwd=project)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "stand in for the data" in trained.stderr  # data/raw is empty: the digits stand in
    assert read_summary(run_dir)["status"] == "completed"
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    for target in ("plant_disease.model.Net", "plant_disease.data.load",
                   "plant_disease.task.Task"):
        assert f"_target_: {target}" in config
    git = json.loads((run_dir / "provenance" / "git.json").read_text())
    assert (git["commit"], git["dirty"]) == (head[0], False)

    tested = run(installed, "make", "test", cwd=project)
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert "2 passed" in tested.stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True,
                            text=True).stdout
    assert status == ""  # data/, outputs/ and the install stamp are ignored
