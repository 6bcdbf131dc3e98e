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
TIME, DURATION = "time", "duration"
# Calls that give one of a collection's values, and those that give a collection of them.
ONE_OF = {"min", "max", "sum", "median", "mean", "fmean"}
ALL_OF = {"sorted", "list", "tuple", "reversed"}


class ClockFlow:
    """What the names of one file hold, followed through its assignments: a time (a reading
    of the clock, or a recorded one: time.time(), x.started_at, row["ended_at"]), a duration
    (a difference of times, scaled or shifted by numbers), a collection of either (a list
    built from them, appended to, or taken from such a collection), or a number (a constant,
    or a name bound to constants only). Names are followed file-wide, attributes by their
    name: `self.closed = now` makes every `x.closed` a time where `now` is one."""

    def __init__(self, tree: ast.AST):
        self.kinds: dict[str, str] = {}  # name -> TIME or DURATION
        self.holds: dict[str, str] = {}  # name -> what its collection holds
        bound: dict[str, list[ast.AST]] = {}
        # The nodes that bind, iterate or append: all that the passes below read.
        flowing = [node for node in ast.walk(tree) if isinstance(node, (
            ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.For, ast.ListComp, ast.SetComp,
            ast.GeneratorExp, ast.DictComp, ast.Call))]
        for node in flowing:
            for name, value in _bindings(node):
                bound.setdefault(name, []).append(value)
        # A name bound to numbers only, anywhere in the file, is a number (a constant).
        self.numbers: set[str] = set()
        while True:
            numbers = {name for name, values in bound.items()
                       if all(v is not None and self.is_number(v) for v in values)}
            if numbers == self.numbers:
                break
            self.numbers = numbers
        # Times, durations and collections, to a fixed point: each pass may bind more.
        while True:
            before = (dict(self.kinds), dict(self.holds))
            for node in flowing:
                self._learn(node)
            if (self.kinds, self.holds) == before:
                break

    def _learn(self, node: ast.AST) -> None:
        for name, value in _bindings(node):
            if value is None:
                continue
            if (kind := self.kind(value)) is not None:
                self.kinds.setdefault(name, kind)
            if (held := self.held(value)) is not None:
                self.holds.setdefault(name, held)
        # for a, b in zip(times, times[1:]) / for x in durations: each a value of its collection
        for target, source in _iterations(node):
            sources = (source.args if isinstance(source, ast.Call) and isinstance(
                source.func, ast.Name) and source.func.id in ("zip", "enumerate") else [source])
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            if isinstance(source, ast.Call) and getattr(source.func, "id", "") == "enumerate":
                names = names[1:]  # enumerate's index is no time
            if len(sources) == len(names):
                for name, each in zip(names, sources, strict=True):
                    if isinstance(name, ast.Name) and (held := self.held(each)) is not None:
                        self.kinds.setdefault(name.id, held)
        # times.append(t), calls.setdefault(k, []).append(t), row[k].append(t)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "add", "extend") and node.args):
            value = node.args[0]
            kind = self.kind(value) if node.func.attr != "extend" else self.held(value)
            owner = _root_name(node.func.value)
            if kind is not None and owner is not None:
                self.holds.setdefault(owner, kind)

    def kind(self, node: ast.AST) -> str | None:
        """TIME, DURATION, or None for anything else."""
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr in TIME_CALLS and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "time"):
                return TIME
            if node.func.attr in ONE_OF and node.args:  # statistics.median(durations)
                return self.held(node.args[0])
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("float", "int", "abs", "round") and node.args:
                return self.kind(node.args[0])
            if node.func.id in ONE_OF and node.args:  # max(held), max(a, b)
                if len(node.args) == 1:
                    return self.held(node.args[0]) or self.kind(node.args[0])
                return next((k for a in node.args if (k := self.kind(a))), None)
            return None
        if isinstance(node, ast.Name):
            return self.kinds.get(node.id) or (TIME if _recorded_time(node.id) else None)
        if isinstance(node, ast.Attribute):
            return self.kinds.get(node.attr) or (TIME if _recorded_time(node.attr) else None)
        if isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and _recorded_time(str(key.value)):
                return TIME
            return None if isinstance(key, ast.Slice) else self.held(node.value)
        if isinstance(node, ast.IfExp):
            return self.kind(node.body) or self.kind(node.orelse)
        if isinstance(node, ast.BinOp):
            left, right = self.kind(node.left), self.kind(node.right)
            if isinstance(node.op, ast.Sub) and left == TIME and right == TIME:
                return DURATION
            if isinstance(node.op, ast.Add | ast.Sub):
                if TIME in (left, right):
                    return TIME  # shifted: a bound taken from the clock
                if DURATION in (left, right):
                    return DURATION
            if isinstance(node.op, ast.Div) and left and right:
                return None  # a ratio of two durations: the machine's speed cancels out
            if isinstance(node.op, ast.Mult | ast.Div) and DURATION in (left, right):
                return DURATION  # in milliseconds, or per item
        return None

    def held(self, node: ast.AST) -> str | None:
        """What a collection holds: TIME, DURATION or None."""
        if isinstance(node, ast.Name):
            return self.holds.get(node.id)
        if isinstance(node, ast.Subscript):  # a slice, or one list of a dict of lists
            return self.held(node.value)
        if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp):
            return self.kind(node.elt)
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return next((k for e in node.elts if (k := self.kind(e))), None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in ("get", "setdefault", "values", "copy")):
            return self.held(node.func.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                node.func.id in ALL_OF) and node.args:
            return self.held(node.args[0])
        return None

    def is_number(self, node: ast.AST) -> bool:
        """A constant: a number, a name bound to numbers only or named as a constant is
        (MIN_CACHE_S), or arithmetic of those."""
        if isinstance(node, ast.Constant):
            return isinstance(node.value, int | float) and not isinstance(node.value, bool)
        if isinstance(node, ast.Name):
            return node.id in self.numbers or _constant_name(node.id)
        if isinstance(node, ast.Attribute):
            return _constant_name(node.attr)
        if isinstance(node, ast.UnaryOp):
            return self.is_number(node.operand)
        if isinstance(node, ast.BinOp):
            return self.is_number(node.left) and self.is_number(node.right)
        return False

    def shifted(self, node: ast.AST) -> bool:
        """A time plus or minus a number: a bound taken from the clock."""
        return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub)
                and any(self.is_number(side) for side in (node.left, node.right))
                and any(self.kind(side) for side in (node.left, node.right)))

    def judges(self, compare: ast.Compare) -> bool:
        """A comparison of a duration or a time with a number, or with a shifted time."""
        operands = [compare.left, *compare.comparators]
        timed = [o for o in operands if self.kind(o)]
        return bool(timed) and (any(self.is_number(o) for o in operands)
                                or any(self.shifted(o) for o in operands))


def _recorded_time(name: str) -> bool:
    return name == "at" or name.endswith("_at")


def _constant_name(name: str) -> bool:
    return name.isupper() and any(c.isalpha() for c in name)


def _root_name(node: ast.AST) -> str | None:
    """The name a chain of calls, attributes and subscripts starts from: calls for
    calls.setdefault(k, []), row for row["x"]."""
    while isinstance(node, ast.Call | ast.Attribute | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _bindings(node: ast.AST) -> list[tuple[str, ast.AST | None]]:
    """(name, value) for each name `node` binds: `a = v`, `a, b = v, w`, `self.a = v`,
    `a: T = v`, `(a := v)`; the value None where it cannot be told (a, b = f())."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign | ast.NamedExpr) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return []
    found = []
    pairs = [(target, value) for target in targets]
    while pairs:
        each, bound_to = pairs.pop()
        if isinstance(each, ast.Tuple):  # a, (b, c) = x, (y, z): each name its own value
            values = (bound_to.elts if isinstance(bound_to, ast.Tuple)
                      and len(bound_to.elts) == len(each.elts) else [None] * len(each.elts))
            pairs.extend(zip(each.elts, values, strict=True))
        elif isinstance(each, ast.Name):
            found.append((each.id, bound_to))
        elif isinstance(each, ast.Attribute):
            found.append((each.attr, bound_to))
    return found


def _iterations(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, iterable) of a for loop or of each generator of a comprehension."""
    if isinstance(node, ast.For):
        return [(node.target, node.iter)]
    if isinstance(node, ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp):
        return [(g.target, g.iter) for g in node.generators]
    return []


def _kept_values(tree: ast.AST) -> set[int]:
    """The ids of the nodes of a value a test keeps (`ok = ...`, `in_window = [...]`) or hands
    to a call of its own (`record.trial(...)`): a verdict that an assert may read later. Not
    an if's, a while's or a comprehension's condition, nor a lambda's or a function's answer:
    a comparison there steers a wait or a poll (wait_until(lambda: ...))."""
    kept = {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.Expr)
            and node.value is not None for inner in ast.walk(node.value)}
    steering = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.While | ast.IfExp):
            steering.append(node.test)
        elif isinstance(node, ast.comprehension):
            steering.extend(node.ifs)
        elif isinstance(node, ast.Lambda):
            steering.append(node.body)
    return kept - {id(inner) for test in steering for inner in ast.walk(test)}


def clock_verdicts(source: str) -> list[int]:
    """The lines of `source` where a test judges by the clock: a comparison of a duration or
    a timestamp with a number, or of a time with a time shifted by a number, in an assert or
    kept as a value (a verdict asserted later: `in_window = [h <= 8 for h in held]`), a
    duration or time held in a variable included; a tolerance of pytest.approx on a
    duration; a fixed sleep as a window (outside a wait loop), or a job that only sleeps. A
    wait loop's deadline (`assert time.monotonic() < deadline`) and a comparison that steers
    a loop, an if or a wait's condition are allowed."""
    tree = ast.parse(source)
    flow = ClockFlow(tree)
    kept = _kept_values(tree)
    loops = {id(node) for loop in ast.walk(tree) if isinstance(loop, ast.While | ast.For)
             for node in ast.walk(loop)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and id(node) in kept and flow.judges(node):
            found.add(node.lineno)
        if isinstance(node, ast.Assert):
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                if flow.judges(compare):
                    found.add(node.lineno)
            # pytest.approx(t1 - t0, abs=0.5): a difference within a tolerance of tenths,
            # which only the clock needs (a float's rounding needs 1e-4 at most).
            for call in (n for n in ast.walk(node.test) if isinstance(n, ast.Call)):
                if (isinstance(call.func, ast.Attribute) and call.func.attr == "approx"
                        and call.args and isinstance(call.args[0], ast.BinOp)
                        and isinstance(call.args[0].op, ast.Sub)
                        and any(k.arg in ("abs", "rel") and flow.is_number(k.value)
                                and isinstance(k.value, ast.Constant)
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
                if (call.args and isinstance(call.args[0], ast.Constant)
                        and flow.is_number(call.args[0]) and call.args[0].value >= 2
                        and id(call) not in loops):
                    found.add(call.lineno)
    return sorted(found)


# The folders whose files the clock rule reads: the suite's own tests, and the fault trials.
CLOCK_RULE_FOLDERS = ("tests", "tests/faults")


def clock_offenders(root: Path) -> dict[str, list[int]]:
    """{file relative to `root`: its clock verdicts' lines} over CLOCK_RULE_FOLDERS."""
    return {str(path.relative_to(root)): lines
            for folder in CLOCK_RULE_FOLDERS for path in sorted((root / folder).glob("*.py"))
            if (lines := clock_verdicts(path.read_text()))}


def test_no_test_judges_by_the_wall_clock():
    assert clock_offenders(PROJECT) == {}


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


def _in_a_test(lines: list[str]) -> str:
    """`lines` as the body of a test function, CHECK standing for assert."""
    return "def test():\n" + "".join(f"    {line.replace('CHECK', 'assert')}\n"
                                      for line in lines)


# Verdicts through variables, the last line of each (issue 54): the first as the issue gives
# it; then the old slowloris window of tests/faults/test_server.py (a 5 s deadline, 3 s late)
# and the old cache-period check of tests/test_queue_exporter.py, as they were. These strings
# are the rule's input, never run: each is a clock verdict the rule must find (the test below
# fails if it does not), so they read like the assertions the rule forbids.
CLOCK_VERDICTS_THROUGH_VARIABLES = {
    "a duration held": ["elapsed = time.monotonic() - t0", "CHECK elapsed < 5"],
    "two times held": ["start = time.time()", "work()", "end = time.time()",
                       "CHECK end - start < 5"],
    "in milliseconds": ["started = time.monotonic()", "answer_ms = (time.monotonic() - started)"
                        " * 1000", "CHECK answer_ms < 300"],
    "a verdict kept": ["elapsed = time.monotonic() - t0", "record.trial(elapsed < 5, lost=False)"],
    "the slowloris window": [
        "head.opened, head.closed = time.monotonic(), time.monotonic()",
        "deadline, early, late = SLOWLORIS_DEADLINE_S, SLOWLORIS_EARLY_S, SLOWLORIS_LATE_S",
        "held = [head.closed - head.opened if head.closed else None for head in heads]",
        "in_window = [h is not None and deadline - early <= h <= deadline + late for h in held]"],
    "the cache period": [
        "for name, at, *_ in (line.split() for line in lines):",
        "    calls.setdefault(name, []).append(float(at))",
        "times = calls.get('squeue', [])",
        "gaps = [b - a for a, b in zip(times, times[1:], strict=False)]",
        "CHECK min(gaps) >= queue_exporter.MIN_CACHE_S - 0.1, gaps"],
}


@pytest.mark.parametrize("lines", CLOCK_VERDICTS_THROUGH_VARIABLES.values(),
                         ids=list(CLOCK_VERDICTS_THROUGH_VARIABLES))
def test_the_clock_rule_follows_a_time_or_duration_held_in_a_variable(lines):
    assert clock_verdicts(_in_a_test(lines)) == [1 + len(lines)]


ALLOWED_THROUGH_VARIABLES = {
    # A ratio against a baseline measured in the same test: the machine's speed cancels out.
    "a ratio": ["held = time.monotonic() - opened", "baseline = time.monotonic() - t0",
                "CHECK held / baseline < 0.8"],
    "a deadline held": ["deadline = time.monotonic() + 30", "while not done():",
                        "    CHECK time.monotonic() < deadline"],
    "a wait's condition": ["started = time.monotonic()",
                           "wait_until(lambda: time.monotonic() - started > 5, 'a beat')"],
    "a note": ["elapsed = time.monotonic() - t0", "print(f'{elapsed:.1f} s')"],
}


@pytest.mark.parametrize("lines", ALLOWED_THROUGH_VARIABLES.values(),
                         ids=list(ALLOWED_THROUGH_VARIABLES))
def test_the_clock_rule_lets_ratios_deadlines_and_notes_through_variables_pass(lines):
    assert clock_verdicts(_in_a_test(lines)) == []


def test_the_clock_rule_reads_the_fault_trials(tmp_path):
    for folder in ("tests", "tests/faults"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / "test_sample.py").write_text(
            _in_a_test(["elapsed = time.monotonic() - t0", "CHECK elapsed < 5"]))
    assert clock_offenders(tmp_path) == {"tests/test_sample.py": [3],
                                         "tests/faults/test_sample.py": [3]}
