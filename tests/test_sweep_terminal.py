"""Sweeps on cluster=local that outlive their terminal, and Optuna trials that start as soon as a
slot frees. (The same on SLURM: tests/test_cluster_slurm.py; what jobs.json remembers, in this
process: tests/test_sweep_records.py.)

The terminal going away is a SIGHUP to the launcher's whole process group, as a terminal sends
its session's foreground jobs: the launcher ends, its jobs train on, and the same command again
attaches to them instead of starting them twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import (
    FAST,
    LABRUN,
    PROJECT,
    PYTHON,
    as_typed_in_a_terminal,
    freeze_outside_the_journal_lock,
    holder_pid,
    manifest,
    read_summary,
    wait_for_text,
)

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]



def wait_for_file(path: Path, log: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)



def start_study(tmp_path: Path, *overrides: str) -> tuple[Path, Path, subprocess.Popen]:
    """An Optuna study of TINY trials on cluster=local, started in the background: its sweep
    folder, the file its output goes to, and its process."""
    sweep_dir = tmp_path / "sweep"
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    output = tmp_path / "study.log"
    with open(output, "w") as out:
        study = subprocess.Popen(args, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT)
    return sweep_dir, output, study


def test_a_local_sweep_outlives_sighup_and_the_same_command_attaches(tmp_path):
    # Job 0 trains, job 1 waits for the one slot this machine without GPUs has: the terminal
    # goes while job 0 trains and job 1 has not started.
    sweep_dir = tmp_path / "sweep"
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, "trainer.max_epochs=3,1",
            f"hydra.sweep.dir={sweep_dir}"]
    # Its output to a file: the jobs' controllers, which outlive it, would hold a pipe open.
    first = tmp_path / "first.log"
    with open(first, "w") as out:
        launcher = subprocess.Popen(args, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=as_typed_in_a_terminal)
    # Start-up and the first steps: under a minute on a loaded 2-core machine; 300 s only
    # keeps a hung launcher from blocking the suite.
    wait_for_file(sweep_dir / "0" / "metrics.jsonl", first, launcher, timeout=300)
    # Job 0 is held still (SIGSTOP) until the second launch has attached to it: a job that
    # ended meanwhile would be skipped as completed, which proves nothing about attaching.
    job = holder_pid(sweep_dir / "0")
    os.kill(job, signal.SIGSTOP)
    try:
        started = read_summary(sweep_dir / "0")["started_at"]
        os.killpg(launcher.pid, signal.SIGHUP)  # the terminal is gone: its group hangs up
        assert launcher.wait(timeout=60) == -signal.SIGHUP

        # The job lives on (its controller and the job itself ignore the hang-up), and
        # `labrun status` says so.
        rows = manifest(sweep_dir)["jobs"]
        assert [row["state"] for row in rows] == ["running", "pending"]
        status = subprocess.run([LABRUN, "status", str(sweep_dir), "--json"],
                                capture_output=True, text=True, timeout=120)
        assert [job["state"] for job in json.loads(status.stdout)["jobs"]] == ["running",
                                                                              "pending"]
        # The same command again attaches to job 0 (start-up: seconds; 300 s: a hang).
        output = tmp_path / "again.log"
        with open(output, "w") as out:
            again = subprocess.Popen(args, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT)
        wait_for_text(output, "attached to 1 jobs an earlier launch started that still run: "
                      f"0 ({rows[0]['job_id']})", again, timeout=300)
    finally:
        os.kill(job, signal.SIGCONT)
    # ...waits for it, starts job 1 once job 0 frees the slot, and ends as a whole sweep does
    # (two TINY jobs, well under two minutes loaded; 300 s: a hang).
    assert again.wait(timeout=300) == 0, output.read_text()
    after = manifest(sweep_dir)["jobs"]
    assert after[0]["job_id"] == rows[0]["job_id"] and after[0]["attempts"] == []
    assert read_summary(sweep_dir / "0")["started_at"] == started  # never started twice
    assert [read_summary(sweep_dir / n)["status"] for n in ("0", "1")] == ["completed"] * 2
    assert [row["state"] for row in after] == ["completed"] * 2
    # Job 1 started only after job 0 ended: one slot, still one job at a time.
    assert read_summary(sweep_dir / "1")["started_at"] > read_summary(sweep_dir / "0")["ended_at"]


# Trial lengths from the default seed's sampler (TPE, seed=0: its first trials are random):
# trial 0 trains 1 epoch, trial 1 trains 4, trial 2 one again.
ASYNC = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=2",
         "cluster.max_parallel=2", "trainer.max_epochs=choice(1,4)"]


def test_an_optuna_trial_starts_as_soon_as_a_slot_frees_not_when_its_batch_ends(tmp_path):
    sweep_dir, output, study = start_study(tmp_path, *ASYNC)
    # Trial 1, the long one, is held still (SIGSTOP) from its first logged step until trial 2
    # trains: the slot trial 0 frees must go to trial 2 while trial 1 still runs. A batch
    # sweeper starts trial 2 only once trial 1 has ended, so it would never come (the wait
    # below fails at its deadline). Start-up and a few steps: under a minute loaded; 300 s.
    wait_for_file(sweep_dir / "1" / "metrics.jsonl", output, study, timeout=300)
    long_trial = holder_pid(sweep_dir / "1")
    freeze_outside_the_journal_lock(long_trial, sweep_dir / "optuna.journal")
    try:
        wait_for_file(sweep_dir / "2" / "metrics.jsonl", output, study, timeout=300)
    finally:
        os.kill(long_trial, signal.SIGCONT)
    assert study.wait(timeout=300) == 0, output.read_text()
    trials = {num: read_summary(sweep_dir / str(num)) for num in range(3)}
    assert [trials[n]["epoch"] for n in range(3)] == [1, 4, 1], trials  # the seeded lengths
    # Trial 2 took trial 0's slot once trial 0 had ended, and trained while trial 1 was still
    # held: asynchronous, which a batched sweeper (waiting for the whole batch) could not be.
    rows = manifest(sweep_dir)["jobs"]
    assert trials[0]["ended_at"] < rows[2]["started_at"], rows
    assert trials[2]["started_at"] < trials[1]["ended_at"]
    assert f"study train in {sweep_dir}" in output.read_text()  # one table for the study
    assert [row["num"] for row in rows] == [0, 1, 2]
    assert [row["state"] for row in rows] == ["completed"] * 3


# The seeded sampler's first draws (TPE, seed=0): trial 0 trains with lr 0.05, trial 1 with
# lr 1e30, whose loss is no longer finite after a step, so trial 1 fails.
FAILING = ["hparams_search=optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
           "cluster.max_parallel=2", "hydra.sweeper.max_failure_rate=0.0",
           "optimizer.lr=choice(1e30,0.05)", "optimizer.weight_decay=0.0"]


def test_above_max_failure_rate_no_trial_starts_the_one_in_flight_finishes_and_it_fails(
        tmp_path):
    sweep_dir, output, study = start_study(tmp_path, *FAILING)
    # Trial 0 is held still from the moment its lock names it until the study has judged
    # trial 1's failure: it is in flight when the rate is crossed, whatever the machine's
    # speed. Start-up: under a minute loaded; 300 s only stops a hang.
    wait_for_file(sweep_dir / "0" / ".lock", output, study, timeout=300)
    in_flight = holder_pid(sweep_dir / "0")
    freeze_outside_the_journal_lock(in_flight, sweep_dir / "optuna.journal")
    try:
        wait_for_text(output, "stopping the study: 1 of 1 trials failed", study, timeout=300)
    finally:
        os.kill(in_flight, signal.SIGCONT)
    assert study.wait(timeout=300) != 0, output.read_text()  # the command fails
    text = output.read_text()
    assert ("error: 1 of 1 trials failed (hydra.sweeper.max_failure_rate=0.0); first: job 1 "
            "failed: NonFiniteLoss" in text), text[-3000:]
    # The trial in flight finished; no trial was asked for after the failure.
    assert read_summary(sweep_dir / "0")["status"] == "completed"
    assert read_summary(sweep_dir / "1")["status"] == "failed"
    assert not (sweep_dir / "2").exists() and not (sweep_dir / "3").exists()
    assert [(row["num"], row["state"]) for row in manifest(sweep_dir)["jobs"]] == [
        (0, "completed"), (1, "failed")]


def test_labrun_cancel_stops_a_local_sweeps_job_with_a_checkpoint(tmp_path):
    """`labrun cancel SWEEP_DIR` from another terminal: the local job gets SIGTERM through its
    controller, saves a checkpoint and ends interrupted; the launcher ends with the sweep."""
    sweep_dir = tmp_path / "sweep"
    log = tmp_path / "launcher.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen([PYTHON, "train.py", "-m", *FAST, "trainer.max_epochs=500",
                                     "checkpoint.every_n_steps=5", f"hydra.sweep.dir={sweep_dir}"],
                                    cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        wait_for_file(sweep_dir / "0" / "checkpoints" / "step-00000005.pt", log, launcher,
                      timeout=300)
        cancel = subprocess.run([LABRUN, "cancel", str(sweep_dir)], capture_output=True,
                                text=True, timeout=120)
        assert cancel.stdout.strip() == f"cancelled 1 jobs of {sweep_dir}: 0", cancel
        assert launcher.wait(timeout=120) != 0, log.read_text()  # the sweep did not complete
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    summary = read_summary(sweep_dir / "0")
    assert summary["status"] == "interrupted", summary
    assert (sweep_dir / "0" / "checkpoints" / f"step-{summary['step']:08d}.pt").is_file()
    assert manifest(sweep_dir)["jobs"][0]["state"] == "cancelled"
