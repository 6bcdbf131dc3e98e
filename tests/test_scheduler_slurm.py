"""core/scheduler/slurm.py on the test cluster (scripts/slurm_up.sh): job states in one query
whatever the number of jobs, counted by a shim in front of every SLURM command; the cluster's
limits; this node's address towards the controller; and core/environment.py read inside real
multi-node jobs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

# The cluster's own check: without a cluster these tests fail, they never skip silently.
from test_cluster_slurm import slurm  # noqa: F401

from conftest import PYTHON
from labrun.core.scheduler import NodeLimits, QosLimits, SlurmScheduler

pytestmark = pytest.mark.slurm

COMMANDS = ("sbatch", "squeue", "sacct", "sacctmgr", "scontrol", "sinfo", "sshare", "sprio",
            "scancel", "srun")
# What scripts/slurm_up.sh declares for each node, and the QOS it makes.
NODE = NodeLimits(cpus=32, mem_mb=196608, gpus=4)
QOS = {"normal", "urgent", "scavenger"}
# A QOS of this test's own, with submit limits, removed when the test ends.
TEST_QOS = "labrun-limits-test"
# scripts/slurm_up.sh's controller address (CTL_ADDR); node N has 10.77.0.1N.
CONTROLLER = "10.77.0.1"
# 30 s bounds each SLURM command: the test cluster answers in milliseconds. A job run with srun
# starts within seconds; 120 s leaves room for the cluster finishing another test's jobs.
TIMEOUT, SRUN_TIMEOUT = 30, 120


def run(*args: str, timeout: float = TIMEOUT) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True,
                          timeout=timeout).stdout


def asked(counted, question):
    """(question's answer, the SLURM commands it ran)."""
    before = len(counted())
    answer = question()
    return answer, [call.split()[0] for call in counted()[before:]]


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """Every SLURM command this process runs from now on goes through a shim on PATH that logs
    the call, then runs the real command; returns the function that reads the log."""
    shims, log = tmp_path / "shims", tmp_path / "calls.log"
    shims.mkdir()
    for command in COMMANDS:
        real = shutil.which(command)
        assert real, f"{command} not installed"
        shim = shims / command
        shim.write_text(f'#!/bin/sh\necho "{command} $*" >> {log}\nexec {real} "$@"\n')
        shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
    return lambda: log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def held_jobs():
    """50 jobs that never start (sbatch --hold): 45 single jobs and the 5 elements of an array,
    by the ids squeue and submitit give them; cancelled when the test ends."""
    def submit(*extra: str) -> str:
        return run("sbatch", "--parsable", "--hold", "-p", "dev", "-t", "1", "-J",
                   "labrun-held", "-o", "/dev/null", *extra, "--wrap", "true"
                   ).strip().split(";")[0]

    submitted = []
    try:
        for _ in range(45):
            submitted.append(submit())
        array = submit("--array=0-4")
        submitted.append(array)
        yield submitted[:45] + [f"{array}_{i}" for i in range(5)]
    finally:
        if submitted:
            subprocess.run(["scancel", *submitted], timeout=TIMEOUT)


@pytest.fixture
def forgotten_job() -> str:
    """A job that ended long enough ago that the controller no longer lists it (MinJobAge):
    only accounting knows its state. One from earlier on this cluster, else a job run now."""
    listed = set(run("squeue", "-h", "-t", "all", "-o", "%A").split())
    ended = [line.split("|") for line in
             run("sacct", "-n", "-X", "-P", "-S", "now-7days", "-E", "now", "-s", "CD",
                 "-o", "JobIDRaw,JobID,State").splitlines()]
    for raw, job_id, _ in ended:
        if raw == job_id and raw not in listed:  # no array element: asked by its one id
            return raw
    job_id = run("sbatch", "--parsable", "--wait", "-p", "dev", "-t", "1", "-o", "/dev/null",
                 "--wrap", "true").strip()
    # MinJobAge=30 in the test cluster's slurm.conf; 90 s bounds a slow controller.
    deadline = time.monotonic() + 90
    while job_id in run("squeue", "-h", "-t", "all", "-o", "%A").split():
        assert time.monotonic() < deadline, f"the controller still lists job {job_id}"
        time.sleep(1)
    return job_id


def test_the_states_of_50_jobs_are_one_query(held_jobs, forgotten_job, counted):
    scheduler = SlurmScheduler()
    states, commands = asked(counted, lambda: scheduler.job_states(held_jobs))
    assert states == dict.fromkeys(held_jobs, "PENDING") and commands == ["squeue"]
    assert scheduler.job_alive(held_jobs[0]) is False  # pending: no process runs yet

    # Ended a moment ago: still the controller's, still one query.
    run("scancel", *{job.split("_")[0] for job in held_jobs})
    deadline = time.monotonic() + 30  # the controller cancels pending jobs at once
    while True:
        states, commands = asked(counted, lambda: scheduler.job_states(held_jobs))
        assert commands == ["squeue"]
        if states == dict.fromkeys(held_jobs, "CANCELLED"):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)

    # With a job only accounting still knows: one query more, whatever the number of jobs;
    # an id nobody knows is left out.
    states, commands = asked(counted, lambda: scheduler.job_states(
        [*held_jobs, forgotten_job, "999999999"]))
    assert states == {**dict.fromkeys(held_jobs, "CANCELLED"), forgotten_job: "COMPLETED"}
    assert commands == ["squeue", "sacct"]
    assert scheduler.job_alive(forgotten_job) is False


def test_a_running_job_is_alive_and_unknown_ids_and_no_slurm_are_told_apart(monkeypatch):
    job_id = run("sbatch", "--parsable", "-p", "dev", "-t", "2", "-J", "labrun-alive",
                 "-o", "/dev/null", "--wrap", "sleep 60").strip()
    try:
        scheduler = SlurmScheduler()
        # 60 s: the test cluster starts a job within seconds.
        deadline = time.monotonic() + 60
        while scheduler.job_states([job_id]).get(job_id) != "RUNNING":
            assert time.monotonic() < deadline, f"job {job_id} did not start"
            time.sleep(0.5)
        assert scheduler.job_alive(job_id) is True
        assert scheduler.job_alive("999999999") is False  # never existed, or long gone
        # No slurm.conf: SLURM cannot be asked here, which is no answer either way.
        with monkeypatch.context() as without_slurm:
            without_slurm.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
            assert scheduler.job_alive(job_id) is None
    finally:
        subprocess.run(["scancel", job_id], timeout=TIMEOUT)


def test_the_clusters_limits():
    run("sacctmgr", "-i", "add", "qos", TEST_QOS, "MaxSubmitJobsPerUser=7",
        "MaxSubmitJobsPerAccount=9", "MaxJobsPerUser=3")
    try:
        limits = SlurmScheduler().limits()
    finally:
        run("sacctmgr", "-i", "delete", "qos", TEST_QOS)
    assert limits.partitions == {"gpu": NODE, "dev": NODE}
    assert limits.default_partition == "gpu"
    # The test cluster's slurm.conf leaves MaxArraySize at SLURM's default.
    assert limits.max_array_size == 1001
    assert QOS <= set(limits.qos) and limits.qos["normal"] == QosLimits()
    assert limits.qos[TEST_QOS] == QosLimits(max_submit_per_user=7, max_submit_per_account=9,
                                             max_jobs_per_user=3)


def test_this_nodes_address_towards_the_controller():
    """Here (the controller's own machine) and on a compute node, in its own network namespace:
    the address of the interface the kernel routes to the controller through."""
    route = run("ip", "-o", "route", "get", CONTROLLER).split()
    assert SlurmScheduler().node_address() == (route[route.index("src") + 1], "")
    out = run("srun", "-p", "dev", "-w", "node2", "-t", "1", PYTHON, "-c",
              "from labrun.core.scheduler import SlurmScheduler; "
              "print(SlurmScheduler().node_address()[0])", timeout=SRUN_TIMEOUT)
    assert out.split() == ["10.77.0.12"]


PRINT_ENVIRONMENT = """
import json
from dataclasses import asdict
from labrun.core import environment
print(json.dumps(asdict(environment.read())))
"""


def test_the_environment_of_each_task_of_a_two_node_job():
    out = run("srun", "-p", "dev", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-t", "1",
              PYTHON, "-c", PRINT_ENVIRONMENT, timeout=SRUN_TIMEOUT)
    tasks = sorted((json.loads(line) for line in out.splitlines()), key=lambda t: t["rank"])
    assert [(t["rank"], t["local_rank"], t["node_rank"]) for t in tasks] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert {(t["world_size"], t["num_nodes"], t["scheduler"]) for t in tasks} == {
        (4, 2, "slurm")}
    [job_id] = {t["job_id"] for t in tasks}
    # One launch. The rendezvous: the job's first node as SLURM itself lists the nodes (the
    # test may ask scontrol; labrun does without), the port from the job id.
    assert {t["launch_id"] for t in tasks} == {f"slurm:{job_id}:0"}
    [nodelist] = {t["scheduler_variables"]["SLURM_JOB_NODELIST"] for t in tasks}
    first = run("scontrol", "show", "hostnames", nodelist).split()[0]
    assert {(t["master_addr"], t["master_port"]) for t in tasks} == {
        (first, str(20000 + int(job_id) % 20000))}


def test_labrun_status_asks_the_scheduler_once_for_every_unfinished_job(held_jobs, counted,
                                                                        tmp_path):
    """A detached sweep's jobs.json with 50 jobs still waiting: `labrun status` shows each as
    pending from one query."""
    from labrun.runs.sweepdir import Job, SweepDir
    from labrun.views import status

    jobs = [Job(num=n, overrides=[f"seed={n}"], dir=str(tmp_path / str(n)), state="submitted",
                job_id=job_id) for n, job_id in enumerate(held_jobs)]
    SweepDir(tmp_path).write_jobs("slurm", jobs)
    shown, backend = status.sweep_jobs(tmp_path)
    assert backend == "slurm" and {job.state for job in shown} == {"pending"}
    assert [call.split()[0] for call in counted()] == ["squeue"]
