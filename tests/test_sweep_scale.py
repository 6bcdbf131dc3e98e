"""Sweeps at lab scale, on the real test cluster, with every job held (`--hold`: nothing
trains, nothing costs a CPU) and cancelled at the end: 1,500 jobs split at SLURM's MaxArraySize
(1001 by default) and polled with one query a pass; a cluster whose MaxArraySize is 101, where
array_parallelism holds across the arrays through their dependencies; a sweep of two resource
requests, which share array_parallelism out; a QOS's submit limit, which refuses the sweep
before anything is submitted; and `labrun bench sweep`, for real on 50 held jobs."""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_cluster_slurm import slurm  # noqa: F401 - the fixture that fails without a cluster

from conftest import FAST, PROJECT, PYTHON, manifest, run_labrun
from labrun.bench.sweep import SWEEP_TARGETS

pytestmark = pytest.mark.slurm

HELD = ["cluster=slurm_dev", "+cluster.extra_sbatch.hold=true", *FAST]
SLURM_CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
TIMEOUT = 60  # any one SLURM command: seconds at most


def sweep_args(sweep_dir: Path, *overrides: str) -> list[str]:
    return [PYTHON, "train.py", "-m", *HELD, *overrides, f"hydra.sweep.dir={sweep_dir}"]


def squeue(*args: str) -> list[str]:
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, check=True,
                          timeout=TIMEOUT).stdout.split()


def arrays_of(sweep_dir: Path) -> list[str]:
    """The sweep's SLURM array ids, in job-number order."""
    ids = [row["job_id"].split("_")[0] for row in manifest(sweep_dir)["jobs"]]
    return list(dict.fromkeys(ids))


def cancel(arrays: list[str]) -> None:
    if arrays:
        subprocess.run(["scancel", *arrays], timeout=TIMEOUT)


def shims(folder: Path) -> Path:
    """squeue and sacct on PATH that log each call with its arguments, then run the real
    one."""
    folder.mkdir()
    for name in ("squeue", "sacct"):
        real = subprocess.run(["which", name], capture_output=True, text=True).stdout.strip()
        (folder / name).write_text(f'#!/bin/sh\necho {name} "$*" >> "{folder}/calls"\n'
                                   f'exec {real} "$@"\n')
        (folder / name).chmod(0o755)
    return folder


def read_calls(shim: Path) -> list[tuple[str, set[str]]]:
    """Each logged call: the command and the job ids its -j named."""
    calls = []
    path = shim / "calls"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, *args = line.split()
        ids = set(args[args.index("-j") + 1].split(",")) if "-j" in args else set()
        calls.append((name, ids))
    return calls


def test_1500_jobs_are_two_arrays_every_task_queued_and_one_query_a_poll(tmp_path):
    sweep_dir, shim = tmp_path / "sweep", shims(tmp_path / "shims")
    proc = subprocess.Popen(sweep_args(sweep_dir, "seed=range(0,1500)"), cwd=PROJECT,
                            env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    arrays: list[str] = []
    try:
        # Planning and submitting 1,500 jobs: tens of seconds; 300 s: a submission that hangs.
        deadline = time.time() + 300
        while not ((sweep_dir / "jobs.json").is_file()
                   and all(row["job_id"] for row in manifest(sweep_dir)["jobs"])):
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"the sweep was not submitted: {proc.communicate()[0][-3000:]}")
            time.sleep(1)
        rows = manifest(sweep_dir)["jobs"]
        arrays = arrays_of(sweep_dir)
        assert [row["num"] for row in rows] == list(range(1500))
        assert len(arrays) == 2  # 1001 + 499: MaxArraySize 1001 allows indices 0 to 1000
        assert len(squeue("-r", "-j", ",".join(arrays), "-o", "%i")) == 1500
        # Each job's id is its array's task of its number: 0-1000 in the first, then 0-498.
        assert [row["job_id"] for row in rows] == \
            [f"{arrays[0]}_{i}" for i in range(1001)] + [f"{arrays[1]}_{i}" for i in range(499)]

        # The launcher waits: three of its polling passes, every SLURM query counted. Each
        # pass is one squeue naming every one of the 1,500 jobs (a query a job, or an array,
        # would name fewer), and no sacct (squeue knows every held job).
        (shim / "calls").unlink(missing_ok=True)
        deadline = time.monotonic() + 120  # the poll interval grows to 10 s: three passes
        while len(calls := read_calls(shim)) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, calls
            time.sleep(0.5)
        expected = {row["job_id"] for row in rows}
        for name, ids in calls:
            assert name == "squeue" and ids == expected, (name, len(ids))
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher cancels every job
        out, _ = proc.communicate(timeout=120)
        assert "cancelling the sweep's 1500 jobs" in out, out[-2000:]
        deadline = time.time() + 60
        while squeue("-r", "-j", ",".join(arrays), "-t", "PD,R", "-o", "%i"):
            assert time.time() < deadline, "cancelled jobs still queued"
            time.sleep(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        cancel(arrays)


def set_max_array_size(size: int | None) -> None:
    """MaxArraySize in the test cluster's slurm.conf (None: SLURM's default), the controller
    restarted: `scontrol reconfigure` would report the new value and enforce the old one."""
    text = re.sub(r"(?m)^MaxArraySize=.*\n", "", SLURM_CONF.read_text())
    if size is not None:
        text += f"MaxArraySize={size}\n"
    SLURM_CONF.write_text(text)
    subprocess.run(["bash", str(PROJECT / "scripts" / "slurm_up.sh"), "--restart-controller"],
                   check=True, capture_output=True, timeout=120)


def test_a_sweep_over_max_array_size_is_split_and_its_arrays_throttled_as_one(tmp_path):
    set_max_array_size(101)
    arrays: list[str] = []
    try:
        result = subprocess.run(sweep_args(tmp_path, "cluster.detach=true",
                                           "cluster.array_parallelism=5", "seed=range(0,250)"),
                                cwd=PROJECT, capture_output=True, text=True, timeout=300)
        arrays = arrays_of(tmp_path) if (tmp_path / "jobs.json").is_file() else []
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(arrays) == 3
        rows = manifest(tmp_path)["jobs"]
        sizes = [101, 101, 48]
        expected = [f"{array}_{i}" for array, size in zip(arrays, sizes, strict=True)
                    for i in range(size)]
        assert [row["job_id"] for row in rows] == expected
        assert [row["num"] for row in rows] == list(range(250))
        # The controller itself refuses a bigger array: the split is what SLURM needs.
        refused = subprocess.run(["sbatch", "--hold", "-p", "dev", "--array=0-101", "--wrap",
                                  "true"], capture_output=True, text=True, timeout=TIMEOUT)
        cancel(re.findall(r"\d+", refused.stdout))  # none, unless it was accepted
        assert "Invalid job array specification" in refused.stderr, refused
        # Each array runs at most 5 tasks at once (%5), and each after the first waits for the
        # one before to end: never more than 5 of the sweep run at once.
        for i, array in enumerate(arrays):
            job = subprocess.run(["scontrol", "show", "job", array], capture_output=True,
                                 text=True, check=True, timeout=TIMEOUT).stdout
            assert "ArrayTaskThrottle=5" in job
            dependency = squeue("-j", array, "-o", "%E")
            # squeue shows an array's dependency as afterany:ID_*(unfulfilled) while it waits.
            assert dependency[0].startswith(f"afterany:{arrays[i - 1]}_*" if i else "(null)"), \
                dependency
    finally:
        cancel(arrays)
        set_max_array_size(None)


def test_a_sweeps_resource_requests_share_its_array_parallelism(tmp_path):
    # cluster.mem_gb=1,2 asks SLURM for two kinds of job: two arrays of 3, whose %N throttles
    # together allow the sweep's 5 (one array gets 3, the other 2), not 5 each.
    result = subprocess.run(sweep_args(tmp_path, "cluster.detach=true", "cluster.mem_gb=1,2",
                                       "cluster.array_parallelism=5", "seed=range(0,3)"),
                            cwd=PROJECT, capture_output=True, text=True, timeout=300)
    arrays = arrays_of(tmp_path) if (tmp_path / "jobs.json").is_file() else []
    try:
        assert result.returncode == 0, result.stderr[-3000:]
        assert len(arrays) == 2
        throttles = []
        for array in arrays:
            job = subprocess.run(["scontrol", "show", "job", array], capture_output=True,
                                 text=True, check=True, timeout=TIMEOUT).stdout
            throttles.append(int(re.search(r"ArrayTaskThrottle=(\d+)", job)[1]))
        assert sorted(throttles) == [2, 3]
    finally:
        cancel(arrays)


@pytest.mark.parametrize("per", ["user", "account"])
def test_a_qos_submit_limit_refuses_the_sweep_before_anything_is_submitted(tmp_path, per):
    setting = "MaxSubmitJobsPerUser" if per == "user" else "MaxSubmitJobsPerAccount"

    def set_limit(limit: int) -> None:
        subprocess.run(["sacctmgr", "-i", "modify", "qos", "normal", "set",
                        f"{setting}={limit}"], check=True, capture_output=True,
                       timeout=TIMEOUT)

    before = squeue("-r", "-o", "%i")
    whose = (["-u", getpass.getuser()] if per == "user" else ["-A", "vision"])
    mine = len(squeue("-r", *whose, "-q", "normal", "-o", "%i"))
    set_limit(5)
    try:
        result = subprocess.run(sweep_args(tmp_path, "cluster.detach=true", "cluster.qos=normal",
                                           "cluster.account=vision", "seed=range(0,6)"),
                                cwd=PROJECT, capture_output=True, text=True, timeout=300)
    finally:
        set_limit(-1)
    assert result.returncode == 2, result.stdout + result.stderr
    scope = "per user" if per == "user" else "for account vision"
    assert result.stderr.strip().splitlines() == [
        f"error: QOS normal allows 5 queued jobs {scope} ({setting}); "
        f"{mine} are queued and this sweep would add 6: submit fewer jobs (fewer sweep "
        f"values, hydra.sweeper.n_trials), wait for some to end, or ask the cluster's admins to "
        f"raise it"]
    assert squeue("-r", "-o", "%i") == before  # nothing was submitted
    assert not (tmp_path / ".submitit").exists()


def test_max_job_count_refuses_a_sweep_the_controller_could_not_hold(composed):
    """The controller's MaxJobCount (slurm.conf; this cluster sets none, so the limit is given
    here): the jobs queued now, asked of the real squeue, plus the sweep's, above it."""
    from labrun.core.errors import ConfigError
    from labrun.core.scheduler import SlurmScheduler
    from labrun.launch.slurm_limits import check_submission

    cluster = composed("cluster=slurm_dev").cluster
    limits = replace(SlurmScheduler().limits(), qos={})
    queued = len(squeue("-r", "-o", "%i"))
    check_submission([cluster] * 4, replace(limits, max_job_count=queued + 4))
    with pytest.raises(ConfigError) as refused:
        check_submission([cluster] * 5, replace(limits, max_job_count=queued + 4))
    assert str(refused.value).startswith(
        f"the controller holds at most {queued + 4} queued jobs of all users at once "
        f"(MaxJobCount); {queued} are queued and this sweep would add 5")


def test_bench_sweep_submits_a_held_sweep_and_judges_its_figures(tmp_path):
    """`labrun bench sweep` (what `make bench` runs with 1,500 jobs) on 50: it submits its held
    sweeps to the test cluster, measures every figure and prints the verdict table; --check's
    exit status agrees with the figures it wrote (their speed is make bench's to judge)."""
    out = tmp_path / "sweep.json"
    result = run_labrun("bench", "sweep", "--jobs", "50", "--json", str(out), "--check",
                        check=False)
    assert out.is_file(), result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["jobs"] == 50
    assert figures["sweep_s"] > 0 and figures["one_job_s"] > 0
    assert figures["ms_per_job"] == \
        pytest.approx((figures["sweep_s"] - figures["one_job_s"]) / 49 * 1000)
    assert figures["hydra_ms_per_job"] > 0
    assert figures["speedup"] == pytest.approx(figures["hydra_ms_per_job"] / figures["ms_per_job"])
    assert figures["queries_per_pass"] >= 1  # the polling pass ran its query through the shim
    assert "50 held jobs submitted in" in result.stdout
    for target in SWEEP_TARGETS:
        (row,) = [line for line in result.stdout.splitlines() if f" sweep {target.figure} " in line]
        assert f"{target.op} {target.floor:g}" in row and f"{target.op} {target.goal:g}" in row
    missed = [t.figure for t in SWEEP_TARGETS if not t.met(figures[t.figure])]
    assert result.returncode == (1 if missed else 0), result.stdout[-3000:] + result.stderr
    assert [line.split(":")[1].strip() for line in result.stdout.splitlines()
            if line.startswith("target missed:")] == [f"sweep {figure}" for figure in missed]
