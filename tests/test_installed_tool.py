"""labrun as an installed tool: a wheel built from this repository holds everything labrun reads
at run time (the config groups, the config review's list, the Prometheus files), and installed
non-editable into a fresh environment, outside the checkout, it trains with `labrun train` and
lists its config groups from any folder (its config review composes them, in a project). The environment reuses this one's torch and other
dependencies through a path line (nothing is downloaded), and the test asserts that labrun
itself is the wheel's.

Then a lab member's day: `labrun new` makes a project, whose `make train` and `make test` run;
in it, a local sweep, a rerun, a config review across its commits, export and serving of its
run, and a run on the test cluster from a snapshot of the project's repository."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.specifiers import SpecifierSet

from conftest import PROJECT, PYTHON, built_once, digit_jpeg, read_summary, slurm_configured
from labrun.deploy.served import serving


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Path:
    """A new environment with labrun's wheel installed, built once for every worker; its
    bin/ folder."""
    return built_once(tmp_path_factory, "installed-wheel", install_the_wheel) / "venv" / "bin"


def install_the_wheel(folder: Path) -> None:
    # setuptools adds what earlier builds left in build/lib (a file removed since, say) to the
    # wheel: it is built from the sources alone, as a fresh clone's is.
    shutil.rmtree(PROJECT / "build", ignore_errors=True)
    build = subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(folder / "wheels"), str(PROJECT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (folder / "wheels").glob("labrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for folder_in_wheel in ("labrun/scaffold/template/", "labrun/conf/"):
        tracked = subprocess.run(["git", "ls-files", f"src/{folder_in_wheel}"], cwd=PROJECT,
                                 capture_output=True, text=True, check=True).stdout.split()
        # The template and the config groups, file for file: none missing (`labrun configs
        # check` composes every one of them, tests/test_configs.py), nothing left over from an
        # earlier layout.
        assert sorted(n for n in names if n.startswith(folder_in_wheel)) == sorted(
            t.removeprefix("src/") for t in tracked)
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


@pytest.fixture(scope="session")
def plant_project(installed, tmp_path_factory) -> Path:
    """`labrun new plant-disease --task classification` by the installed tool, then its
    `make train` (its folder's project/ and run/), made once for every worker."""
    return built_once(tmp_path_factory, "plant-project",
                      lambda folder: make_and_train(installed, folder))


def make_and_train(installed: Path, folder: Path) -> None:
    made = run(installed, "labrun", "new", "plant-disease", "--task", "classification",
               cwd=folder)
    assert made.returncode == 0, made.stderr
    trained = run(installed, "make", "train", f"ARGS={' '.join(TINY)} "
                  f"hydra.run.dir={folder / 'run'}", cwd=folder / "plant-disease")
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "stand in for the data" in trained.stderr  # data/raw is empty: the digits stand in
    (folder / "project").symlink_to(folder / "plant-disease")


# The project's runs: a few steps, read back from files.
TINY = ["trainer.max_steps=3", "trainer.max_epochs=null", "logger=csv"]


def environment_of(bin_dir: Path) -> dict[str, str]:
    """The environment of a shell that activated `bin_dir`'s environment."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
            "PYTHONNOUSERSITE": "1"}


def run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command of the new environment, as a person who activated it types it."""
    command = args[0] if args[0] == "make" else str(bin_dir / args[0])
    return subprocess.run([command, *args[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=environment_of(bin_dir))


def provenance(run_dir: Path) -> dict[str, dict]:
    """A run's provenance/ files, by name."""
    return {path.stem: json.loads(path.read_text())
            for path in (run_dir / "provenance").glob("*.json")}


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


def test_the_wheel_trains_and_lists_its_configs_outside_any_checkout(installed, tmp_path):
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

    # The groups' options, read from the installed package (which holds every file of them,
    # install_the_wheel), for any model the lab trains.
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
                                                                           plant_project):
    """`labrun new` from the installed tool, then the project's own `make train` and `make
    test` in the environment labrun is installed in (no second torch), training the project's
    model on its data, with its task, recorded under the project's commit and labrun's
    version."""
    project, run_dir = plant_project / "project", plant_project / "run"
    head = subprocess.run(["git", "log", "--format=%H"], cwd=project, capture_output=True,
                          text=True).stdout.split()
    assert len(head) == 1  # the first commit, whatever git's identity here
    committed = subprocess.run(["git", "ls-files"], cwd=project, capture_output=True,
                               text=True).stdout.split()
    assert {name.split("/")[0] for name in committed} == {
        ".github", ".gitignore", ".pre-commit-config.yaml", "Makefile", "README.md", "conf",
        "pyproject.toml", "src", "tests", "train.py"}, committed
    assert (project / ".github" / "workflows" / "config-review.yml").is_file()
    assert (project / "data" / "raw").is_dir() and (project / "data" / "processed").is_dir()
    version = run(installed, "python", "-c", "import labrun; print(labrun.__version__)",
                  cwd=project).stdout.strip()
    wanted = re.search(r'"labrun(\S+)"', (project / "pyproject.toml").read_text()).group(1)
    # The range admits the labrun that made it, a development build's version included.
    assert SpecifierSet(wanted).contains(version, prereleases=True), (wanted, version)

    assert read_summary(run_dir)["status"] == "completed"
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    for target in ("plant_disease.model.Net", "plant_disease.data.load",
                   "plant_disease.task.Task"):
        assert f"_target_: {target}" in config
    recorded = provenance(run_dir)
    assert (recorded["git"]["project"], recorded["git"]["commit"], recorded["git"]["dirty"]) == (
        "plant-disease", head[0], False)
    assert (recorded["labrun"]["version"], recorded["labrun"]["checkout"]) == (version, None)
    assert Path(recorded["labrun"]["path"]).is_relative_to(installed.parent)

    tested = run(installed, "make", "test", cwd=project)
    assert tested.returncode == 0, tested.stdout[-3000:] + tested.stderr[-3000:]
    assert "2 passed" in tested.stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True,
                            text=True).stdout
    assert status == ""  # data/, outputs/ and the install stamp are ignored


def test_a_project_sweeps_reruns_reviews_exports_and_serves_with_the_installed_tool(
        installed, plant_project, tmp_path):
    """In the project, with labrun installed from the wheel: a local -m sweep of its model, a
    rerun that reproduces its run bit for bit, a config review across two of its commits,
    and its run exported, served and asked, through its task's deploy hooks."""
    project, run_dir = plant_project / "project", plant_project / "run"
    swept = run(installed, "labrun", "train", "-m", *TINY, "model.width=8,16",
                f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=project)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    for num, width in enumerate((8, 16)):
        assert read_summary(tmp_path / "sweep" / str(num))["status"] == "completed"
        assert f"width: {width}" in (tmp_path / "sweep" / str(num) / ".hydra" / "config.yaml"
                                     ).read_text()
    # The commands that read run folders, from the project: the sweep's state, its table, and
    # what its finished jobs need not keep.
    status = run(installed, "labrun", "status", str(tmp_path / "sweep"), cwd=project)
    assert status.returncode == 0 and status.stdout.count("completed") >= 2, status.stdout
    table = run(installed, "labrun", "compare", str(tmp_path / "sweep"), "--csv",
                str(tmp_path / "table.csv"), cwd=project)
    assert table.returncode == 0, table.stderr
    assert len((tmp_path / "table.csv").read_text().splitlines()) == 3  # a header, two jobs
    collected = run(installed, "labrun", "gc", str(tmp_path / "sweep"), "--dry-run", cwd=project)
    assert collected.returncode == 0, collected.stdout + collected.stderr

    again = tmp_path / "again"
    rerun = run(installed, "labrun", "rerun", "--exec", str(run_dir), f"hydra.run.dir={again}",
                cwd=project)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "warning" not in rerun.stderr  # the same commit, the same labrun
    same = run(installed, "labrun", "compare", "--exact", str(run_dir), str(again), cwd=project)
    assert same.returncode == 0, same.stdout[-3000:] + same.stderr[-3000:]
    # The run's best checkpoint evaluated again, by the project's task on its data (before,
    # refused: the project's model section has no model.init_from to clear).
    evaluated = run(installed, "labrun", "eval", str(again), "--split", "val", cwd=project)
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    scores = json.loads((again / "eval" / "plant_disease-val-best.json").read_text())["metrics"]
    assert scores["val/acc"] == pytest.approx(read_summary(again)["best/val/acc"])

    # Two commits of the project (in a clone, leaving the project as the other tests see it).
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True, timeout=60)
    model = clone / "conf" / "model" / "plant_disease.yaml"
    model.write_text(model.read_text().replace("width: 16", "width: 24"))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "wider"],
                   cwd=clone, check=True, timeout=60)
    reviewed = run(installed, "labrun", "configs", "review", "HEAD~1", cwd=clone)
    assert reviewed.returncode == 0, reviewed.stdout[-3000:] + reviewed.stderr[-3000:]
    assert "model.width: 16 -> 24  [changes results" in reviewed.stdout
    assert "fails" not in reviewed.stdout  # each side composed, the project's over labrun's

    exported = run(installed, "labrun", "export", str(run_dir), "--out",
                   str(tmp_path / "plant.onnx"), cwd=project)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    with serving(tmp_path / "plant.onnx", tmp_path / "serve.log", cwd=project,
                 python=str(installed / "python"), env=environment_of(installed)) as served:
        health = httpx.get(f"{served.url}/health", timeout=10).json()
        metadata = httpx.get(f"{served.url}/metadata", timeout=10).json()
        answer = httpx.post(f"{served.url}/predict", files={"file": ("3.jpg", digit_jpeg())},
                            timeout=30)
    # The project's task names its deploy hooks (labrun's classification, which it subclasses).
    assert (metadata["deploy"], health["num_classes"]) == ("labrun.tasks.classification", 10)
    assert answer.status_code == 200 and len(answer.json()["top"]) == 5, answer.text


@pytest.mark.slurm
def test_a_project_run_and_sweep_on_the_cluster_train_its_own_model_from_its_snapshot(
        installed, plant_project, tmp_path):
    """`labrun train cluster=slurm_dev` in the project: one job of the test cluster, which
    runs the project's code from its snapshot (RUN/.code/) and labrun from the installed
    package, and trains the project's model; with -m, a sweep of such jobs."""
    if not slurm_configured():
        pytest.fail("no SLURM cluster: `make test` as root starts one (scripts/slurm_up.sh)")
    project, run_dir = plant_project / "project", tmp_path / "run"
    sent = run(installed, "labrun", "train", "cluster=slurm_dev", *TINY,
               f"hydra.run.dir={run_dir}", cwd=project)
    assert sent.returncode == 0, sent.stdout[-3000:] + sent.stderr[-3000:]
    assert read_summary(run_dir)["status"] == "completed"
    assert "_target_: plant_disease.model.Net" in (run_dir / ".hydra" / "config.yaml").read_text()
    recorded = provenance(run_dir)
    (snapshot,) = (run_dir / ".code").iterdir()
    assert (snapshot / "src" / "plant_disease" / "model.py").is_file()
    assert not (snapshot / "src" / "labrun").exists()  # the project's code, not labrun's
    assert recorded["environment"]["slurm"]["SLURM_JOB_ID"]
    assert (recorded["git"]["project"], recorded["git"]["path"]) == ("plant-disease",
                                                                     str(snapshot))
    assert Path(recorded["labrun"]["path"]).is_relative_to(installed.parent)

    # A sweep of the project on the cluster: one array, each job the project's model.
    sweep = tmp_path / "sweep"
    swept = run(installed, "labrun", "train", "-m", "cluster=slurm_dev", *TINY,
                "model.width=8,16", f"hydra.sweep.dir={sweep}", cwd=project)
    assert swept.returncode == 0, swept.stdout[-3000:] + swept.stderr[-3000:]
    for num, width in enumerate((8, 16)):
        assert read_summary(sweep / str(num))["status"] == "completed"
        recorded = provenance(sweep / str(num))
        assert recorded["git"]["project"] == "plant-disease" and recorded["environment"][
            "slurm"]["SLURM_ARRAY_JOB_ID"]
        assert f"width: {width}" in (sweep / str(num) / ".hydra" / "config.yaml").read_text()
