"""The suite's own rules: the SLURM tests never skip silently, and the GitHub workflow runs the
suite where scripts/setup.sh and scripts/slurm_up.sh work as they are (Debian 12, as root,
privileged). The workflow itself cannot run here; these tests check what it says."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import PROJECT, PYTHON

# A cheap one: it fails at submission, so with a cluster it would take seconds.
SLURM_TEST = "tests/test_cluster_slurm.py::test_a_request_no_node_can_satisfy_fails_at_submission"


def pytest_in_child(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=PROJECT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_slurm_test_without_a_cluster_fails_instead_of_skipping():
    # No SLURM commands on PATH (only the venv's): no cluster, as after a failed bring-up.
    # (Not SLURM_CONF=/nonexistent: sinfo would then look the controller up in DNS.)
    result = pytest_in_child(SLURM_TEST, env={"PATH": str(Path(PYTHON).parent),
                                              "LABRUN_NO_SLURM": "0"})
    assert result.returncode == 1, result.stdout[-2000:]
    assert "no SLURM cluster" in result.stdout and "1 error" in result.stdout
    assert "skipped" not in result.stdout.splitlines()[-1]


def test_labrun_no_slurm_skips_them_and_the_summary_says_so():
    # With the two xdist workers of `make test`: the skips happen in a worker, the summary is
    # the controller's.
    result = pytest_in_child("-n", "2", "--dist", "loadgroup", SLURM_TEST,
                             env={"LABRUN_NO_SLURM": "1"})
    assert result.returncode == 0, result.stdout[-2000:]
    assert "SLURM: 1 SLURM tests did not run (LABRUN_NO_SLURM=1)" in result.stdout
    assert "1 skipped" in result.stdout.splitlines()[-1]


def test_a_files_tests_stay_on_one_xdist_worker():
    """`make test`'s two workers keep a file's tests together (module fixtures train once) and
    all SLURM tests on one worker (conftest.pytest_itemcollected). With pytest 9 and xdist 3.8
    these groups were silently ignored and the tests spread over both workers."""
    result = pytest_in_child("-n", "2", "--dist", "loadgroup", "-v", "tests/test_architecture.py",
                             "-k", "upward or new_room", env={"LABRUN_NO_SLURM": "1"})
    assert result.returncode == 0, result.stdout[-2000:]
    workers = {line.split("]")[0] for line in result.stdout.splitlines() if "PASSED" in line}
    assert len(workers) == 1 and "@tests/test_architecture.py" in result.stdout, result.stdout


def fake_project(tmp_path: Path, slurm_up: str,
                 container_image: str = "echo localhost/labrun-test:bookworm\n") -> Path:
    """A copy of scripts/test.sh beside a stand-in slurm_up.sh, container_image.sh,
    slurm_down.sh and a .venv python that records that pytest was started, so the script's own
    logic runs for real without touching the machine's cluster or podman's images."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(PROJECT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "slurm_up.sh").write_text(slurm_up)
    (tmp_path / "scripts" / "container_image.sh").write_text(container_image)
    (tmp_path / "scripts" / "slurm_down.sh").write_text("exit 0\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/pytest-ran\n")
    python.chmod(0o755)
    tmp_path.chmod(0o755)  # readable by the unprivileged user of the non-root case
    return tmp_path


@pytest.mark.parametrize("failing", ["slurm_up", "container_image"])
def test_a_failed_bring_up_fails_make_test_with_its_own_error(tmp_path, failing):
    if os.geteuid() != 0:
        pytest.skip("test.sh's root path needs root (CI runs as root)")
    error = {"slurm_up": "slurm_up: ERROR: mariadbd exited at start-up",
             "container_image": "error: debootstrap of the test image failed; see LOG"}[failing]
    script = f'echo "{error}" >&2\nexit 1\n'
    project = (fake_project(tmp_path, script) if failing == "slurm_up"
               else fake_project(tmp_path, "exit 0\n", container_image=script))
    result = subprocess.run(["bash", "scripts/test.sh"], cwd=project, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "LABRUN_NO_SLURM": "0"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == error
    assert not (project / "pytest-ran").exists()  # the old script warned and ran pytest anyway


def test_a_good_bring_up_runs_pytest_with_durations(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("test.sh's root path needs root (CI runs as root)")
    project = fake_project(tmp_path, "exit 0\n")
    result = subprocess.run(["bash", "scripts/test.sh", "-k", "x"], cwd=project,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LABRUN_NO_SLURM": "0"})
    assert result.returncode == 0, result.stderr
    assert (project / "pytest-ran").read_text().split() == ["-m", "pytest", "-n", "2", "--dist",
                                                            "loadgroup", "--durations=25",
                                                            "-k", "x"]


def test_without_root_make_test_refuses_in_one_line_unless_told_to_skip_slurm(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to run the script as another, unprivileged user")
    project = fake_project(tmp_path, "echo started > started\n")
    as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "bash",
                 "scripts/test.sh"]
    result = subprocess.run(as_nobody, cwd=project, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "LABRUN_NO_SLURM": "0"})
    assert result.returncode == 2 and "LABRUN_NO_SLURM=1" in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert not (project / "pytest-ran").exists()


def test_the_workflow_runs_the_suite_in_privileged_debian_12_as_root():
    workflow = yaml.safe_load((PROJECT / ".github" / "workflows" / "ci.yml").read_text())
    job = workflow["jobs"]["test"]
    container = job["container"]
    image = container if isinstance(container, str) else container["image"]
    assert image == "debian:12"
    assert "--privileged" in container.get("options", "")
    assert "user" not in container  # root: slurm_up.sh needs it, and so does apt-get
    runs = [step.get("run", "") for step in job["steps"]]
    assert any(run.strip() == "make test" for run in runs), runs
    # Nothing between the checkout and `make test` installs the project's parts by hand, and
    # nothing swaps in another Python: setup.sh and slurm_up.sh must work as they are.
    assert not any("sudo" in run or "slurm" in run or "pip install" in run for run in runs)
    assert not any("setup-python" in step.get("uses", "") for step in job["steps"])


def test_the_declared_wandb_is_one_whose_leet_inspect_the_tests_use():
    """test_tracking reads runs back with `wandb leet inspect --json`, first tested on 0.31.
    The requirement is read from the installed metadata: what pip enforces (`make` reinstalls
    when pyproject.toml changes)."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement
    from packaging.version import Version

    wandb = next(Requirement(r) for r in requires("labrun") if r.startswith("wandb"))
    lowest = min(Version(spec.version) for spec in wandb.specifier if spec.operator == ">=")
    assert lowest >= Version("0.31"), f"pyproject allows {wandb}, older than leet inspect"
    assert Version(version("wandb")) in wandb.specifier
