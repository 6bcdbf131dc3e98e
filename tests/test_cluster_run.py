"""One run on the cluster without -m (launch/cluster_run.py): `python train.py cluster=slurm_dev`
submits the run as one SLURM job of the test cluster (scripts/slurm_up.sh) and follows it as a
local run is followed, or attaches to the job its folder records; inside an allocation it
trains there, and from salloc's shell on this host (none of the allocation's nodes) it goes
into the allocation with srun. Jobs are held (--hold) where nothing needs to train. The bit-exact requeue (in
a container) and the two-node single run are scenarios of tests/test_cluster_lab.py, beside
the twins they are compared with."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import hostlist
import pytest

from conftest import (
    FAST,
    LABRUN,
    PROJECT,
    PYTHON,
    as_typed_in_a_terminal,
    manifest,
    read_summary,
    slurm_configured,
)

pytestmark = pytest.mark.slurm

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=2"]
HOLD = "+cluster.extra_sbatch.hold=true"  # submitted, then pending until released


@pytest.fixture(autouse=True, scope="module")
def cluster():
    # Never a skip (conftest.py): LABRUN_NO_SLURM=1 deselects these tests and says so.
    if not slurm_configured():
        pytest.fail("no SLURM cluster: `make test` as root starts one (scripts/slurm_up.sh)")


STARTED: list[subprocess.Popen] = []
SUBMITTED: list[str] = []  # every job a test saw recorded
# The name of every allocation a test holds with salloc: cancelled by it at the end, whatever
# became of the salloc that held it.
ALLOCATION_NAME = f"labrun-test-salloc-{os.getpid()}"


@pytest.fixture(autouse=True, scope="module")
def nothing_left_running():
    """A failed test leaves no process and no held job behind for the tests that follow."""
    yield
    for proc in STARTED:
        if proc.poll() is None:
            proc.kill()
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], check=False, timeout=30)
    subprocess.run(["scancel", f"--name={ALLOCATION_NAME}"], check=False, timeout=30)


def train(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python train.py cluster=slurm_dev ...` without -m, to its end."""
    return subprocess.run([PYTHON, "train.py", "cluster=slurm_dev", *FAST, *overrides],
                          cwd=PROJECT, capture_output=True, text=True, timeout=timeout)


def start(*overrides: str) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "train.py", "cluster=slurm_dev", *FAST, *overrides],
                            cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=as_typed_in_a_terminal)
    STARTED.append(proc)
    return proc


def job_id(run_dir: Path, proc: subprocess.Popen | None = None, timeout: float = 120) -> str:
    """The SLURM job the run folder records, once it does."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "jobs.json").is_file():
        assert proc is None or proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{run_dir} recorded no job"
        time.sleep(0.2)
    SUBMITTED.append(manifest(run_dir)["jobs"][0]["job_id"])
    return SUBMITTED[-1]


def squeue(job: str) -> tuple[str, str]:
    """(state, reason) of a job the controller lists."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T|%r"], capture_output=True,
                         text=True, timeout=30).stdout.strip()
    state, _, reason = out.partition("|")
    return state, reason


def jobs_of(run_dir: Path) -> list[str]:
    """Every job accounting knows that ran in this folder's code snapshots (its working
    directory: the test cluster's accounting keeps no job comment)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-a", "-S", "now-1hour", "-o",
                          "JobID,WorkDir"], capture_output=True, text=True, timeout=30).stdout
    inside = f"{run_dir.resolve()}/"
    return [job for job, _, workdir in (line.partition("|") for line in out.splitlines())
            if workdir.startswith(inside)]


def read_until(proc: subprocess.Popen, text: str) -> str:
    """The process's output up to the first line holding `text` (it keeps running)."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} never printed: {''.join(seen)}")


def test_a_single_run_goes_to_the_cluster_and_reports_back_like_a_local_run(tmp_path):
    outputs = tmp_path / "outputs"
    result = train(*SHORT, f"paths.output_root={outputs}")
    assert result.returncode == 0, result.stdout + result.stderr
    [run_dir] = list(outputs.glob("*/*"))  # outputs/DATE/TIME-XXXX, as a local run's
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\w+",
                        run_dir.relative_to(outputs).as_posix())
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    [record] = [json.loads(p.read_text()) for p in (run_dir / "ranks").glob("rank-*.json")]
    assert record["host"] in ("node1", "node2", "node3")  # trained on a node, not here
    job = manifest(run_dir)["jobs"][0]
    assert job["state"] == "completed" and Path(job["log"]).is_file()
    assert (run_dir / ".code").is_dir()  # the snapshot the job ran, in the run folder
    # The follower's lines, then the run's own progress lines as the job wrote them.
    assert f"labrun: submitted SLURM job {job['job_id']}" in result.stdout
    assert re.search(rf"labrun: SLURM job {job['job_id']}: RUNNING on node\d", result.stdout)
    assert "epoch 1/1 step 3" in result.stdout
    assert f"completed: best val/acc {summary['best/val/acc']:.4f}" in result.stdout
    assert "submitit INFO" not in result.stdout and "[HYDRA]" not in result.stdout
    # The command that started the run is recorded, not the job's worker process.
    command = json.loads((run_dir / "provenance" / "command.json").read_text())
    assert command["argv"][0] == "train.py" and "cluster=slurm_dev" in command["argv"]
    status = subprocess.run([LABRUN, "status", str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=PROJECT)
    assert status.stdout.startswith(f"run {run_dir}"), status.stdout
    # `labrun rerun` of it goes to the cluster again: the command it prints is the one typed.
    rerun = subprocess.run([LABRUN, "rerun", str(run_dir)], capture_output=True, text=True,
                           timeout=120, cwd=PROJECT)
    assert rerun.stdout.split()[1:3] == [str(PROJECT / "train.py"), "cluster=slurm_dev"], rerun
    # `labrun dashboard RUN_DIR` takes it too (its files beside the run's, in .dashboard/).
    from labrun.views import dashboard

    assert dashboard.prepare(run_dir, port=0).what.startswith("1 runs by")


def test_a_run_that_fails_in_its_job_exits_non_zero_with_the_jobs_error(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_text("not an HDF5 file")  # exists (validation passes), fails as it is read
    result = train("dataset=hdf5", f"dataset.path={bad}", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run failed: ") and "is not a readable HDF5 file" in last
    assert manifest(tmp_path / "run")["jobs"][0]["state"] == "failed"


def test_detached_returns_while_pending_and_status_waits_for_the_end(tmp_path):
    run_dir = tmp_path / "run"
    result = train(*SHORT, "cluster.detach=true", HOLD, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout + result.stderr
    job = job_id(run_dir)
    assert squeue(job) == ("PENDING", "JobHeldUser")  # returned before the job could start
    assert f"labrun status {run_dir}" in result.stdout
    assert f"labrun cancel {run_dir}" in result.stdout
    subprocess.run(["scontrol", "release", job], check=True, timeout=30)
    waited = subprocess.run([LABRUN, "status", "--wait", str(run_dir)], capture_output=True,
                            text=True, timeout=300, cwd=PROJECT)
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert read_summary(run_dir)["status"] == "completed"


def test_after_sighup_the_same_command_attaches_to_the_job(tmp_path):
    run_dir = tmp_path / "run"
    command = [*SHORT, HOLD, f"hydra.run.dir={run_dir}"]
    first = start(*command)
    job = job_id(run_dir, first)
    first.send_signal(signal.SIGHUP)  # the terminal gone
    assert first.wait(timeout=60) != 0
    assert squeue(job)[0] == "PENDING"  # the job stays
    second = start(*command)
    # It attaches while the job is still held: nothing was submitted again.
    before = read_until(second, f"SLURM job {job}: PENDING (JobHeldUser)")
    assert f"labrun: attached to SLURM job {job}" in before and "submitted" not in before
    subprocess.run(["scontrol", "release", job], check=True, timeout=30)
    output = before + second.communicate(timeout=300)[0]
    assert second.returncode == 0, output
    assert "labrun: submitted" not in output
    assert jobs_of(run_dir) == [job]  # accounting: one job for this folder, ever
    assert manifest(run_dir)["jobs"][0]["attempts"] == []


def test_ctrl_c_cancels_the_job_which_checkpoints_and_resume_runs_it_to_completion(tmp_path):
    run_dir = tmp_path / "run"
    proc = start("trainer.max_epochs=500", "checkpoint.every_n_steps=5",
                 f"hydra.run.dir={run_dir}")
    job = job_id(run_dir, proc)
    deadline = time.monotonic() + 180  # queued, started, five steps
    while not (run_dir / "checkpoints" / "step-00000005.pt").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, output
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted", summary  # SIGTERM: a checkpoint, not a failure
    step = summary["step"]
    assert (run_dir / "checkpoints" / f"step-{step:08d}.pt").is_file()
    assert f"cancelled; the run is interrupted at step {step}" in output
    state = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"],
                           capture_output=True, text=True, timeout=30).stdout
    assert state.startswith("CANCELLED"), state
    # `labrun resume` sends it back to the cluster as a new job, followed from here to the
    # end of its first epoch (a budget a resume may change): from the checkpoint it stopped at.
    resumed = subprocess.run([LABRUN, "resume", str(run_dir), "trainer.max_epochs=1"],
                             capture_output=True, text=True, timeout=300, cwd=PROJECT)
    row = manifest(run_dir)["jobs"][0]
    SUBMITTED.append(row["job_id"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert row["job_id"] != job and [a["job_id"] for a in row["attempts"]] == [job]
    assert "completed: best val/acc" in resumed.stdout, resumed.stdout
    assert f"resuming from {run_dir / 'checkpoints' / f'step-{step:08d}.pt'}" in \
        Path(row["log"]).read_text()
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["step"] >= step, summary


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
def test_an_invalid_cluster_value_is_refused_before_anything_is_submitted(tmp_path, sweep):
    folder = tmp_path / "out"
    where = f"hydra.sweep.dir={folder}" if sweep else f"hydra.run.dir={folder}"
    result = subprocess.run([PYTHON, "train.py", *(["-m"] if sweep else []),
                             "cluster=slurm_dev", "cluster.array_parallelism=0", where],
                            cwd=PROJECT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("error: cluster.array_parallelism=0 must be 1 or more")
    assert not (folder / "jobs.json").exists() and not (folder / ".submitit").exists()


def test_inside_an_allocation_the_run_trains_there(tmp_path):
    run_dir = tmp_path / "run"
    srun = ["srun", "-p", "dev", "-N1", "-n1", "-c1", PYTHON, "train.py", "cluster=slurm_dev",
            *FAST]
    result = subprocess.run([*srun, *SHORT, f"hydra.run.dir={run_dir}"], cwd=PROJECT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    said = re.search(r"labrun: inside slurm job (\d+) \(1 node\(s\)\): training in this "
                     r"allocation", result.stdout)
    assert said, result.stdout
    assert not (run_dir / "jobs.json").exists()  # nothing submitted from inside the job
    [record] = [json.loads(p.read_text()) for p in (run_dir / "ranks").glob("rank-*.json")]
    assert record["host"] in ("node1", "node2", "node3")
    env = json.loads((run_dir / "provenance" / "environment.json").read_text())
    assert env["slurm"]["SLURM_JOB_ID"] == said.group(1)
    # An allocation smaller than the run asks: one line, exit 2, nothing trained.
    small = subprocess.run([*srun, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'two'}"],
                           cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert small.returncode == 2, small.stdout + small.stderr
    assert re.search(r"^error: inside slurm job \d+, which has 1 task\(s\): trainer.devices=2 "
                     r"x trainer.num_nodes=1 needs 2; ask the allocation for --ntasks=2",
                     small.stderr, re.MULTILINE), small.stderr
    assert not (tmp_path / "two" / "summary.json").exists()


def in_salloc(partition: str, *options: str, overrides: list[str],
              step: tuple[str, ...] = ()) -> list[str]:
    """`salloc ... python train.py cluster=slurm_dev ...`: salloc runs the command in its shell
    on this host, which is none of the allocation's nodes (the test cluster has no
    LaunchParameters=use_interactive_step, and its nodes are other hosts: node1..node3); with
    `step` (srun and its options), the person's own step runs it on the nodes. The time limit
    bounds an allocation a failed test would leave."""
    return ["salloc", "-p", partition, "-N1", "-c1", "-t", "2", f"--job-name={ALLOCATION_NAME}",
            *options, *step, PYTHON, "train.py", "cluster=slurm_dev", *FAST, *overrides]


def granted(result: subprocess.CompletedProcess | tuple[str, str]) -> str:
    """The job id salloc says it was granted."""
    stderr = result[1] if isinstance(result, tuple) else result.stderr
    found = re.search(r"salloc: Granted job allocation (\d+)", stderr)
    assert found, stderr
    return found.group(1)


def test_from_salloc_s_shell_outside_its_nodes_the_run_trains_in_the_allocation(tmp_path):
    """The run goes into the allocation with srun, its rank 0 on one of the allocation's
    nodes, never on this host; nothing is submitted."""
    assert socket.gethostname() not in ("node1", "node2", "node3")
    run_dir = tmp_path / "run"
    result = subprocess.run(in_salloc("dev", "-n1", overrides=[
        "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]), cwd=PROJECT, capture_output=True,
        text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    job = granted(result)
    assert re.search(rf"^labrun: this shell holds slurm job {job} on node\d, not this host "
                     rf"\({re.escape(socket.gethostname())}\): running the run there with srun$",
                     result.stdout, re.MULTILINE), result.stdout
    assert f"labrun: inside slurm job {job} (1 node(s)): training in this allocation" \
        in result.stdout
    recorded = json.loads((run_dir / "provenance" / "environment.json").read_text())["slurm"]
    assert recorded["SLURM_JOB_ID"] == job
    [rank_0] = [json.loads(p.read_text()) for p in (run_dir / "ranks").glob("rank-*.json")]
    assert rank_0["rank"] == 0
    assert rank_0["host"] in hostlist.expand_hostlist(recorded["SLURM_JOB_NODELIST"])
    assert read_summary(run_dir)["status"] == "completed"
    assert not (run_dir / "jobs.json").exists()


def test_an_salloc_with_fewer_gpus_or_nodes_than_the_run_asks_is_refused(tmp_path):
    """From salloc's shell, nodes and GPUs are counted before any step (the GPUs as SLURM holds
    them for the allocation: the shell is told none): one line, exit 2, nothing started. In the
    person's own step (`srun python train.py`), each task counts the SLURM_GPUS_ON_NODE it is
    told and refuses before the run folder's lock, so no task waits for a rank 0 that refused
    (one did, until the allocation's time limit). Nothing trains."""
    two_gpus = ["trainer.devices=2", "cluster.gpus_per_node=2"]
    started = {
        "nodes": in_salloc("dev", "-n1", overrides=[
            "trainer.num_nodes=2", f"hydra.run.dir={tmp_path / 'nodes'}"]),
        "gpus": in_salloc("gpu", "-n2", "--gpus-per-node=1", overrides=[
            *two_gpus, f"hydra.run.dir={tmp_path / 'gpus'}"]),
        "step": in_salloc("gpu", "-n2", "--gpus-per-node=1", step=("srun", "--ntasks=2"),
                          overrides=[*two_gpus, f"hydra.run.dir={tmp_path / 'step'}"])}
    procs = {name: subprocess.Popen(command, cwd=PROJECT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, command in started.items()}
    STARTED.extend(procs.values())
    said = {name: proc.communicate(timeout=240) for name, proc in procs.items()}

    def refusals(name: str) -> list[str]:
        assert procs[name].returncode == 2, said[name]
        return [line for line in said[name][1].splitlines()
                if not line.startswith(("salloc:", "srun:"))]

    held = rf"error: slurm job {granted(said['nodes'])}, the allocation this shell holds on node\d,"
    [line] = refusals("nodes")
    assert re.fullmatch(rf"{held} has 1 node\(s\): trainer.num_nodes=2; ask salloc for "
                        rf"--nodes=2, or leave the allocation to submit a job", line), said
    held = rf"error: slurm job {granted(said['gpus'])}, the allocation this shell holds on node\d,"
    [line] = refusals("gpus")
    assert re.fullmatch(rf"{held} has 1 GPU\(s\) a node: trainer.devices=2 needs 2; ask salloc "
                        rf"for --gpus-per-node=2, or lower trainer.devices", line), said
    for name in ("nodes", "gpus"):
        assert "srun" not in said[name][0]  # no step started
    refusal = (f"error: inside slurm job {granted(said['step'])}, which has 1 GPU(s) a node: "
               f"trainer.devices=2 x trainer.num_nodes=1 needs 2 GPUs; ask the allocation for "
               f"--gpus-per-node=2, or lower trainer.devices")
    assert refusals("step") == [refusal, refusal]  # each of the step's two tasks
    for name in started:
        assert not (tmp_path / name / "summary.json").exists()


def test_a_run_folder_on_this_machine_is_cancelled_with_a_checkpoint(tmp_path):
    """`labrun cancel RUN_DIR` of a local run (no jobs.json): SIGTERM to the process training
    it, which saves a checkpoint and ends interrupted."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, "train.py", *FAST, "trainer.max_epochs=500",
                             "checkpoint.every_n_steps=5", f"hydra.run.dir={run_dir}"],
                            cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ})
    STARTED.append(proc)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step-00000005.pt").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    cancelled = subprocess.run([LABRUN, "cancel", str(run_dir)], capture_output=True,
                               text=True, timeout=60, cwd=PROJECT)
    assert cancelled.returncode == 0 and "cancelled 1 jobs" in cancelled.stdout, cancelled
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    assert read_summary(run_dir)["status"] == "interrupted"
