"""The suite's own rules: the SLURM tests never skip silently, and the GitHub workflow runs the
suite where scripts/setup.sh and scripts/slurm_up.sh work as they are (Debian 12, as root,
privileged). The workflow itself cannot run here; these tests check what it says."""

from __future__ import annotations

import ast
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
    """A copy of scripts/test.sh and bench.sh beside a stand-in slurm_up.sh,
    container_image.sh, slurm_down.sh (which records that it ran, in slurm-down-ran) and a .venv
    python that records that pytest was started, so the scripts' own logic runs for real without
    touching the machine's cluster or podman's images."""
    (tmp_path / "scripts").mkdir()
    for script in ("test.sh", "bench.sh"):
        shutil.copy(PROJECT / "scripts" / script, tmp_path / "scripts" / script)
    (tmp_path / "scripts" / "slurm_up.sh").write_text(slurm_up)
    (tmp_path / "scripts" / "container_image.sh").write_text(container_image)
    (tmp_path / "scripts" / "slurm_down.sh").write_text(f"echo down > {tmp_path}/slurm-down-ran\n")
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


@pytest.mark.parametrize("script", ["test.sh", "bench.sh"])
@pytest.mark.parametrize("already_up", [True, False], ids=["already up", "not up"])
def test_make_test_and_make_bench_stop_only_a_cluster_they_started(tmp_path, script, already_up):
    """A `make bench` beside a running `make test` (or the other way round) found the cluster
    up, and stopped it at exit under the other. Each asks `slurm_up.sh --check` first."""
    if os.geteuid() != 0:
        pytest.skip("the scripts bring the cluster up only as root (CI runs as root)")
    check = 0 if already_up else 1
    project = fake_project(tmp_path, f'[ "${{1:-}}" = --check ] && exit {check}\n'
                                     f'echo up >> {tmp_path}/slurm-up-ran\n')
    result = subprocess.run(["bash", f"scripts/{script}"], cwd=project, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "LABRUN_NO_SLURM": "0"})
    assert result.returncode == 0, result.stderr
    assert (project / "slurm-up-ran").read_text() == "up\n"  # brought up (or checked) once
    assert (project / "slurm-down-ran").exists() is not already_up


@pytest.mark.parametrize("status", [0, 1])
def test_make_bench_exits_with_the_status_of_labrun_bench_all_check(tmp_path, status):
    """scripts/bench.sh runs `labrun bench all --check` and ends with its status: 1 when a
    floor is broken (tests/test_bench.py shows when that command exits 1), 0 when none is,
    whatever its cluster clean-up does after."""
    project = fake_project(tmp_path, "exit 0\n")
    python = project / ".venv" / "bin" / "python"
    python.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/bench-ran\nexit {status}\n")
    result = subprocess.run(["bash", "scripts/bench.sh"], cwd=project, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert (project / "bench-ran").read_text().split() == ["-m", "labrun.cli", "bench", "all",
                                                           "--check"]


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


# ---------------------------------------------------------------------------------------------
# No wall clock in a test's verdict: a test waits for events (a file, a state, a line), and a
# figure that depends on the machine's speed belongs in a benchmark (`make bench`), as a ratio.

TIME_CALLS = {"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns"}


def _is_time(node: ast.AST) -> bool:
    """A reading of the clock, or a recorded time: time.time(), x.started_at, row["ended_at"]."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (node.func.attr in TIME_CALLS and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "time")
    if isinstance(node, ast.Attribute):
        return node.attr.endswith("_at")
    if isinstance(node, ast.Name):
        return node.id.endswith("_at")
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and str(key.value).endswith("_at")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
            "float", "abs", "int"):
        return any(_is_time(arg) or _is_duration(arg) for arg in node.args)
    return False


def _is_duration(node: ast.AST) -> bool:
    """A difference of times (t1 - t0), or a time shifted by a constant (ended_at + 15)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "abs":
        return any(_is_duration(arg) for arg in node.args)
    if not isinstance(node, ast.BinOp) or not isinstance(node.op, ast.Add | ast.Sub):
        return False
    sides = (node.left, node.right)
    return (any(_is_time(side) or _is_duration(side) for side in sides)
            and (isinstance(node.op, ast.Sub) or any(_is_number(side) for side in sides)))


def _is_number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int | float) \
        and not isinstance(node.value, bool)


def _shifted(node: ast.AST) -> bool:
    """A time plus or minus a constant: a bound taken from the clock."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub)
            and any(_is_number(side) for side in (node.left, node.right))
            and any(_is_time(side) or _is_duration(side) for side in (node.left, node.right)))


def clock_verdicts(source: str) -> list[int]:
    """The lines of `source` where a test judges by the clock: an assert comparing a duration
    or a timestamp with a number, or a time with a time shifted by a number; a tolerance of
    pytest.approx on a duration; a fixed sleep as a window (outside a wait loop), or a job that
    only sleeps. A wait loop's deadline (`assert time.monotonic() < deadline`) is allowed."""
    tree = ast.parse(source)
    loops = {id(node) for loop in ast.walk(tree) if isinstance(loop, ast.While | ast.For)
             for node in ast.walk(loop)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                operands = [compare.left, *compare.comparators]
                timed = [o for o in operands if _is_time(o) or _is_duration(o)]
                if timed and (any(_is_number(o) for o in operands)
                              or any(_shifted(o) for o in operands)):
                    found.add(node.lineno)
            # pytest.approx(t1 - t0, abs=0.5): a difference within a tolerance of tenths,
            # which only the clock needs (a float's rounding needs 1e-4 at most).
            for call in (n for n in ast.walk(node.test) if isinstance(n, ast.Call)):
                if (isinstance(call.func, ast.Attribute) and call.func.attr == "approx"
                        and call.args and isinstance(call.args[0], ast.BinOp)
                        and isinstance(call.args[0].op, ast.Sub)
                        and any(k.arg in ("abs", "rel") and _is_number(k.value)
                                and k.value.value >= 0.1 for k in call.keywords)):
                    found.add(node.lineno)
        is_sleep = (isinstance(node, ast.Attribute) and node.attr == "sleep"
                    and isinstance(node.value, ast.Name) and node.value.id == "time")
        if is_sleep:
            parent_calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
                            and c.func is node]
            if not parent_calls:  # time.sleep handed over as a job: a window of its length
                found.add(node.lineno)
            for call in parent_calls:
                if (call.args and _is_number(call.args[0]) and call.args[0].value >= 2
                        and id(call) not in loops):
                    found.add(call.lineno)
    return sorted(found)


def test_no_test_judges_by_the_wall_clock():
    offenders = {path.name: lines for path in sorted((PROJECT / "tests").glob("*.py"))
                 if (lines := clock_verdicts(path.read_text()))}
    assert offenders == {}


# The lines the rule was written for, as they were (issue: no wall clock in tests). Kept as
# samples the rule reads, never run: CHECK stands for the assert statement, so that no line of
# this file is itself an assert on the clock.
CLOCK_VERDICTS = [
    'CHECK trials[0]["ended_at"] < rows[2]["started_at"] < trials[0]["ended_at"] + 15',
    "time.sleep(10)",
    "job = executor.submit(time.sleep, 1)",
    'CHECK abs(facts["started_at"] - time.time()) < 60',
    "CHECK float(v1) - float(v0) == pytest.approx(t1 - t0, abs=0.5)",
    "CHECK float(samples[-1][1]) >= samples[-1][0] - submitted_at - 1",
    "CHECK time.monotonic() - started < 15",
]


@pytest.mark.parametrize("line", CLOCK_VERDICTS)
def test_the_clock_rule_flags_a_verdict_by_the_clock(line):
    source = line.replace("CHECK", "assert")
    assert clock_verdicts(f"def test():\n    {source}\n") == [2]


@pytest.mark.parametrize("line", [
    "assert time.monotonic() < deadline, 'gave up'",  # a wait loop's deadline
    'assert before <= facts["started_at"] <= after',  # an order of events
    'assert trials[0]["ended_at"] < rows[2]["started_at"]',
    "assert t0 <= submit + float(v0) < t1",
    "while not done():\n        time.sleep(2)",  # a poll
    "assert len(calls) == 3",
])
def test_the_clock_rule_lets_events_and_deadlines_pass(line):
    assert clock_verdicts(f"def test():\n    {line}\n") == []
