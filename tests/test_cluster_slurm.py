"""Sweeps on a real SLURM cluster (scripts/slurm_up.sh; cluster=slurm_dev uses its CPU
partition dev, with slurmdbd accounting) through submitit: job arrays, DDP with two tasks,
preemption and requeue (bit-exact weights, a whole W&B history), cancelling on Ctrl-C and
with `labrun cancel`, detached submission, a sweep that outlives its terminal (SIGHUP) and is
attached to, an Optuna study with its trials in flight, and requests no node can satisfy. The
array and the study sweep a language model (task=lm, a step budget); the others classify."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from test_tracking import OFFLINE
from test_wandb_history import history_problems

from conftest import (
    DETERMINISTIC,
    FAST,
    LABRUN,
    LM_TINY,
    PROJECT,
    PYTHON,
    as_typed_in_a_terminal,
    assert_identical,
    freeze_outside_the_journal_lock,
    holder_pid,
    manifest,
    read_metrics,
    read_summary,
    slurm_configured,
    text_preset,
    wait_for,
    wait_for_text,
)

pytestmark = pytest.mark.slurm


def cluster_is_up() -> bool:
    if shutil.which("sinfo") is None or not slurm_configured():
        return False
    # sinfo answers in milliseconds; 30 s: a controller that does not answer is not up.
    out = subprocess.run(["sinfo", "-h", "-p", "dev", "-o", "%T"], capture_output=True,
                         text=True, timeout=30)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(autouse=True, scope="module")
def slurm():
    # Never a skip: a missing cluster is a failure (LABRUN_NO_SLURM=1 deselects these tests in
    # conftest.py before this fixture runs, and the summary says so).
    if not cluster_is_up():
        pytest.fail("no SLURM cluster: `make test` as root starts one (scripts/slurm_up.sh); "
                    "LABRUN_NO_SLURM=1 runs the suite without the SLURM tests")


def sweep_args(sweep_dir: Path, *overrides: str) -> list[str]:
    return [PYTHON, "train.py", "-m", "cluster=slurm_dev", *FAST, *overrides,
            f"hydra.sweep.dir={sweep_dir}"]


def requeue_with_usr2(sweep_dir: Path, proc: subprocess.Popen, job: int) -> None:
    """Preempt job `job` of a running sweep with USR2 once it has a checkpoint at step 10
    (USR2 may land anywhere in the steps left: a requeue from any later checkpoint must end
    the same), then wait for the sweep; assert it ended well, requeued and resumed."""
    # 180 s: submission, start-up and 10 steps, under a minute on a loaded machine, 3x that.
    wait_for(sweep_dir / str(job) / "checkpoints" / "step-00000010.pt", proc, timeout=180)
    job_id = manifest(sweep_dir)["jobs"][job]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    # 300 s: the requeued job starts again and finishes three epochs, with room for load.
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    log = Path(manifest(sweep_dir)["jobs"][job]["log"]).read_text()
    assert "SIGUSR2" in log and "resuming from" in log  # it was requeued, then resumed


# timeout: a sweep here is two or three tiny jobs on the test cluster, each under a minute
# on a loaded 2-core machine; 300 s only keeps a hung sweep from blocking the suite.
def run_sweep(sweep_dir: Path, *overrides: str, timeout: int = 300):
    return subprocess.run(sweep_args(sweep_dir, *overrides), cwd=PROJECT, capture_output=True,
                          text=True, timeout=timeout)


def sacct_state(job_id: str) -> str:
    """The job's final state, once it has one. 300 tries a second apart: accounting lags a few
    seconds behind the controller, and the detached test waits here for its short jobs to end,
    which on a loaded 2-core machine takes a minute or two."""
    for _ in range(300):
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id],
                             capture_output=True, text=True, timeout=30).stdout.split()
        if out and out[0] not in ("PENDING", "RUNNING", "REQUEUED"):
            return out[0]
        time.sleep(1)
    return out[0] if out else "UNKNOWN"


def summary_once_ended(run: Path) -> dict:
    """The run's summary.json once its process has ended. SLURM's accounting says CANCELLED as
    soon as scancel is taken, while the job's process is still saving its checkpoint; it has
    KillWait (10 s, scripts/slurm/slurm.conf.in) before SIGKILL, which leaves "running"."""
    deadline = time.time() + 60
    while (summary := read_summary(run))["status"] == "running" and time.time() < deadline:
        time.sleep(0.5)
    return summary


# A language model's jobs (task=lm, a step budget validated mid-epoch): the cluster tests'
# classification jobs cover the epoch budget.
LM_STEPS = [*LM_TINY, "trainer.max_steps=4", "trainer.val_every_n_steps=2",
            "trainer.limit_val_batches=2"]


def test_three_job_sweep_is_one_array_and_runs_the_snapshot(tmp_path, python_docs_tokens):
    result = run_sweep(tmp_path, *LM_STEPS, f"dataset.path={python_docs_tokens}",
                       "optimizer.lr=0.001,0.003,0.01")
    assert result.returncode == 0, result.stdout + result.stderr
    ids = [job["job_id"] for job in manifest(tmp_path)["jobs"]]
    [array_id] = {i.split("_")[0] for i in ids}  # one array
    assert sorted(i.split("_")[1] for i in ids) == ["0", "1", "2"]
    for num in range(3):
        run = tmp_path / str(num)
        summary = read_summary(run)
        assert (summary["status"], summary["step"], summary["monitor"]) == (
            "completed", 4, "val/loss")
        assert [m["step"] for m in read_metrics(run) if "val/ppl" in m] == [2, 4]
        assert {"metrics.jsonl", "summary.json", "checkpoints", "provenance", ".hydra"} <= {
            p.name for p in run.iterdir()}
        env = json.loads((run / "provenance" / "environment.json").read_text())
        assert env["slurm"]["SLURM_ARRAY_JOB_ID"] == array_id
        # The job imported labrun from the snapshot taken at submission, not the working tree,
        # and recorded the commit the snapshot was taken from.
        assert env["labrun"].startswith(str(tmp_path / ".code"))
        git = json.loads((run / "provenance" / "git.json").read_text())
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True,
                              text=True).stdout.strip()
        assert git["commit"] == head
    assert result.stdout.count("completed") >= 3


def assert_compare_ranks(sweep_dir: Path, column: str, best) -> None:
    """`labrun compare` lists the sweep's jobs by their best figure, highest first."""
    out = sweep_dir / "runs.csv"
    subprocess.run([LABRUN, "compare", str(sweep_dir), "--csv", str(out)], check=True,
                   capture_output=True)
    rows = out.read_text().splitlines()
    index = rows[0].split(",").index(column)
    shown = [float(row.split(",")[index]) for row in rows[1:]]
    assert shown == pytest.approx(sorted(best, reverse=True), abs=1e-4)


def test_a_segmentation_grid_runs_on_the_cluster_and_compare_ranks_it_by_mean_iou(tmp_path):
    """task=segmentation's jobs (a tiny U-Net on dataset=shapes): judged by val/miou, the
    task's own monitor, without naming it."""
    result = run_sweep(tmp_path, "experiment=seg_shapes", "model.width=4", "model.depth=2",
                       "dataset.num_train=32", "dataset.num_val=16", "trainer.batch_size=8",
                       "trainer.max_epochs=2", "optimizer.lr=0.001,0.01")
    assert result.returncode == 0, result.stdout + result.stderr
    best = {}
    for num in ("0", "1"):
        summary = read_summary(tmp_path / num)
        assert (summary["status"], summary["step"], summary["monitor"]) == (
            "completed", 8, "val/miou")
        best[num] = summary["best/val/miou"]
    assert_compare_ranks(tmp_path, "best val/miou", best.values())


def test_a_detection_grid_runs_on_the_cluster_and_compare_ranks_it_by_map(tmp_path):
    """task=detection's jobs (FCOS on dataset=shapes_boxes at 64 px, mosaic off for the last
    epoch): judged by val/map, the task's own monitor, without naming it; each job's
    checkpoint carries the mosaic switch its run fixed."""
    result = run_sweep(tmp_path, "experiment=det_shapes", "dataset.image_size=64",
                       "dataset.num_train=32", "dataset.num_val=8", "trainer.batch_size=8",
                       "trainer.max_epochs=2", "dataset.augment.close_mosaic=1",
                       "optimizer.lr=0.001,0.003")
    assert result.returncode == 0, result.stdout + result.stderr
    best = {}
    for num in ("0", "1"):
        summary = read_summary(tmp_path / num)
        assert (summary["status"], summary["step"], summary["monitor"]) == (
            "completed", 8, "val/map")
        best[num] = summary["best/val/map"]
        last = torch.load(tmp_path / num / "checkpoints" / "last.pt", weights_only=True)
        assert last["data"]["schedule"] == {"mosaic_off_from": 1}
    assert_compare_ranks(tmp_path, "best val/map", best.values())


def test_a_text_grid_trains_on_the_cluster_and_a_missing_model_submits_nothing(tmp_path,
                                                                              text_assets):
    """task=text_classification's jobs (the tiny BERT from the weights cache, offline on the
    nodes): judged by val/f1, the task's own monitor; a model absent from the cache is refused
    in one line before the sweep submits a job."""
    steps = ["trainer.max_epochs=null", "trainer.max_steps=6", "trainer.val_every_n_steps=6"]
    missing = run_sweep(tmp_path / "missing", *text_preset(text_assets, *steps),
                        "model.name=lab/absent-bert", "optimizer.lr=0.001,0.0003")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert missing.stderr.strip().splitlines() == [
        f"error: model.name=lab/absent-bert: not in the weights cache (looked in "
        f"{text_assets / 'weights' / 'hub' / 'models--lab--absent-bert'} and 1 more place); "
        f"fetch it on a machine with internet: labrun weights fetch model=hf "
        f"model.name=lab/absent-bert paths.weights_cache={text_assets / 'weights'}"]
    assert not (tmp_path / "missing" / ".submitit").exists()  # nothing was submitted

    result = run_sweep(tmp_path / "grid", *text_preset(text_assets, *steps),
                       "optimizer.lr=0.001,0.0003")
    assert result.returncode == 0, result.stdout + result.stderr
    best = {}
    for num in ("0", "1"):
        summary = read_summary(tmp_path / "grid" / num)
        assert (summary["status"], summary["step"], summary["monitor"]) == (
            "completed", 6, "val/f1")
        best[num] = summary["best/val/f1"]
    assert_compare_ranks(tmp_path / "grid", "best val/f1", best.values())


def test_two_task_ddp_job_trains_and_only_rank_0_writes(tmp_path):
    """A sweep over trainer.devices: each job gets its own tasks per node (two arrays)."""
    result = run_sweep(tmp_path, "trainer.devices=1,2", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=3")
    assert result.returncode == 0, result.stdout + result.stderr
    tasks = [json.loads((tmp_path / n / "provenance" / "environment.json").read_text())
             ["slurm"]["SLURM_NTASKS"] for n in ("0", "1")]
    assert tasks == ["1", "2"]
    run = tmp_path / "1"
    assert read_summary(run)["status"] == "completed"
    steps = [p["step"] for p in read_metrics(run) if "train/loss" in p]
    assert steps == sorted(set(steps)) == [3]  # one writer: each point once
    job_folder = Path(manifest(tmp_path)["jobs"][1]["log"]).parent
    assert len(list(job_folder.glob("*_log.out"))) == 2  # both tasks ran
    assert not (run / "errors").exists()


INJECT_RANK_1_FAILURE = """
import os
if os.environ.get("SLURM_PROCID") == "1":
    from labrun.train.trainer import Trainer
    fit = Trainer.fit
    def fit_then_fail(self, *args, **kwargs):
        fit(self, *args, **kwargs)
        raise RuntimeError("failure injected by the test on rank 1")
    Trainer.fit = fit_then_fail
"""


def test_a_failure_on_rank_1_is_reported(tmp_path):
    """Rank 1 raises after training, rank 0 completes: SLURM says COMPLETED, the sweep must
    say failed. The fault is injected through a sitecustomize module on PYTHONPATH."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT_RANK_1_FAILURE)
    import os

    result = subprocess.run(
        sweep_args(tmp_path / "sweep", "trainer.devices=2", "trainer.max_epochs=1",
                   "trainer.limit_train_batches=3", "+variant=rank1fails"),
        cwd=PROJECT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(inject)})
    job_id = manifest(tmp_path / "sweep")["jobs"][0]["job_id"]
    assert sacct_state(job_id) == "COMPLETED"
    assert result.returncode != 0
    assert "rank 1: RuntimeError: failure injected by the test on rank 1" in result.stdout
    assert read_summary(tmp_path / "sweep" / "0")["status"] == "completed"  # rank 0's view


def test_preempted_job_requeues_into_identical_weights_and_a_whole_wandb_history(
        tmp_path, reference_weights):
    """A one-job sweep of the reference run (conftest.DETERMINISTIC), logging to W&B offline,
    is preempted (USR2), requeued and resumed: its weights equal the uninterrupted reference
    run's, and its W&B offline segments, read back with `wandb leet inspect`, hold every step
    of metrics.jsonl exactly once with the same values (logging changes no weight)."""
    overrides = [*DETERMINISTIC, "logger=wandb", "trainer.log_every_n_steps=5",
                 "+variant=preempted"]
    # The job inherits the submitting environment (submitit's sbatch): W&B offline there too.
    proc = subprocess.Popen(sweep_args(tmp_path, *overrides), cwd=PROJECT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **OFFLINE})
    requeue_with_usr2(tmp_path, proc, job=0)
    preempted = torch.load(tmp_path / "0/checkpoints/last.pt", weights_only=True)["model"]
    assert_identical(preempted, reference_weights)
    steps = [p["step"] for p in read_metrics(tmp_path / "0") if "train/loss" in p]
    assert len(steps) == len(set(steps))
    assert history_problems(tmp_path / "0") == []


def test_ctrl_c_cancels_the_sweeps_jobs(tmp_path):
    proc = subprocess.Popen(sweep_args(tmp_path, "trainer.max_epochs=50", "optimizer.lr=0.1,0.2"),
                            cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # 180 s each: submission, then a job's start-up, under a minute on a loaded machine, 3x that.
    wait_for(tmp_path / "jobs.json", proc, timeout=180)
    wait_for(tmp_path / "0" / "summary.json", proc, timeout=180)  # running
    proc.send_signal(signal.SIGINT)  # 50 epochs: the jobs are still running, for minutes
    # scancel and the launcher's exit: seconds; 120 s: a Ctrl-C that hangs.
    output, _ = proc.communicate(timeout=120)
    assert "cancelling the sweep's 2 jobs" in output
    for job in manifest(tmp_path)["jobs"]:
        assert sacct_state(job["job_id"]).startswith("CANCELLED")


def test_detached_sweep_returns_at_once_and_status_follows_it(tmp_path):
    result = run_sweep(tmp_path, "cluster.detach=true", "trainer.max_epochs=1",
                       "trainer.limit_train_batches=3", "optimizer.lr=0.1,0.2")
    returned = time.time()
    assert result.returncode == 0, result.stderr
    assert f"labrun status {tmp_path}" in result.stdout
    for job in manifest(tmp_path)["jobs"]:
        assert sacct_state(job["job_id"]) == "COMPLETED"  # waits until the job has ended
    # "At once", told by order, not by a time limit: the command returned before either job
    # had finished (a launcher that waited would return after both ended_at).
    ended = [read_summary(tmp_path / num)["ended_at"] for num in ("0", "1")]
    assert returned < min(ended), (returned, ended)
    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True)
    assert status.returncode == 0
    assert status.stdout.count("completed") == 2, status.stdout


def test_a_request_no_node_can_satisfy_fails_at_submission(tmp_path):
    result = run_sweep(tmp_path, "cluster.cpus_per_task=64", "optimizer.lr=0.1,0.2")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: cluster.cpus_per_task x tasks_per_node = 64 CPUs")
    assert "partition dev offers at most" in lines[-1]
    assert not (tmp_path / "jobs.json").exists()


def sweep_jobs_since(start: str) -> set[str]:
    """The ids of every job (array elements as ARRAY_TASK) accounting has seen since `start`
    (sacct's time, YYYY-MM-DDTHH:MM:SS): the SLURM tests run one at a time, on one worker."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", start],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return set(out.split())




def freeze_as_they_start(run_dirs: list[Path], proc: subprocess.Popen, timeout: float
                         ) -> list[int]:
    """SIGSTOP each run's process as soon as its lock file names it (taken before data loads);
    fails if `proc` ends first or time runs out. The process ids, in `run_dirs`' order."""
    frozen: dict[Path, int] = {}
    deadline = time.time() + timeout
    try:
        while len(frozen) < len(run_dirs):
            for run_dir in run_dirs:
                if run_dir not in frozen and (run_dir / ".lock").exists():
                    frozen[run_dir] = holder_pid(run_dir)
                    os.kill(frozen[run_dir], signal.SIGSTOP)
            assert proc.poll() is None, f"the launcher ended with {proc.returncode}"
            assert time.time() < deadline, f"started in time: {sorted(map(str, frozen))}"
            time.sleep(0.02)
    except BaseException:
        for pid in frozen.values():
            os.kill(pid, signal.SIGCONT)
        raise
    return [frozen[run_dir] for run_dir in run_dirs]


def test_a_sweep_outlives_sighup_and_the_same_command_attaches_without_submitting(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = sweep_args(sweep_dir, "trainer.max_epochs=2", "trainer.limit_train_batches=3",
                      "trainer.limit_val_batches=2", "optimizer.lr=0.1,0.2")
    start = time.strftime("%Y-%m-%dT%H:%M:%S")
    # Output to a file, the launcher in a session of its own: a terminal's process group.
    first = tmp_path / "first.log"
    with open(first, "w") as out:
        launcher = subprocess.Popen(args, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=as_typed_in_a_terminal)
    # Submission, then both jobs' start-up: under a minute loaded, 3x that (180 s). Each job is
    # held still (SIGSTOP; SLURM still runs it) the moment its lock names it, until the second
    # launch has attached: a tiny job that ended meanwhile would only be skipped as completed.
    jobs = freeze_as_they_start([sweep_dir / "0", sweep_dir / "1"], launcher, timeout=180)
    try:
        rows = manifest(sweep_dir)["jobs"]
        os.killpg(launcher.pid, signal.SIGHUP)  # the terminal is gone
        assert launcher.wait(timeout=60) == -signal.SIGHUP
        status = subprocess.run([LABRUN, "status", str(sweep_dir), "--json"],
                                capture_output=True, text=True, timeout=120)
        assert [job["state"] for job in json.loads(status.stdout)["jobs"]] == ["running"] * 2
        # `labrun status --wait` follows the sweep from another terminal, the same command
        # attaches to its jobs (start-up: seconds; 300 s: a hang).
        waiter = subprocess.Popen([LABRUN, "status", str(sweep_dir), "--wait"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        second = tmp_path / "second.log"
        with open(second, "w") as out:
            again = subprocess.Popen(args, cwd=PROJECT, stdout=out, stderr=subprocess.STDOUT)
        ids = ", ".join(f"{row['num']} ({row['job_id']})" for row in rows)
        wait_for_text(second, f"attached to 2 jobs an earlier launch started that still run: "
                      f"{ids}", again, timeout=300)
    finally:
        for pid in jobs:
            os.kill(pid, signal.SIGCONT)
    # Two tiny jobs finish: a minute at most loaded; 300 s: a hang.
    assert again.wait(timeout=300) == 0, second.read_text()
    output, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, output
    assert output.count("completed") == 2, output
    # The first launch submitted these two jobs, the second nothing (accounting has them by now;
    # it may lag the jobs' start by seconds).
    assert sweep_jobs_since(start) == {row["job_id"] for row in rows}
    after = manifest(sweep_dir)["jobs"]
    assert [(row["job_id"], row["state"], row["attempts"]) for row in after] == [
        (row["job_id"], "completed", []) for row in rows]
    assert second.read_text().count("completed") >= 2


def test_cancel_stops_a_detached_sweeps_jobs_from_any_terminal_and_records_it(tmp_path):
    # Held jobs: they wait in the queue, costing nothing, until cancelled.
    result = run_sweep(tmp_path, "cluster.detach=true", "+cluster.extra_sbatch.hold=true",
                       "optimizer.lr=0.1,0.2")
    assert result.returncode == 0, result.stderr
    rows = manifest(tmp_path)["jobs"]
    assert [row["state"] for row in rows] == ["submitted"] * 2
    cancel = subprocess.run([LABRUN, "cancel", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"cancelled 2 jobs of {tmp_path}: 0-1"
    for row in manifest(tmp_path)["jobs"]:
        assert row["state"] == "cancelled" and row["cancelled_at"] is not None
        # Elements of an array that never started: accounting keeps one row, the array's.
        assert sacct_state(row["job_id"].split("_")[0]).startswith("CANCELLED")
    status = subprocess.run([LABRUN, "status", str(tmp_path), "--wait"], capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 1  # the sweep has ended, not every job completed
    assert status.stdout.count("cancelled") == 2, status.stdout
    # Running the command again submits the cancelled jobs again, each keeping its history.
    again = run_sweep(tmp_path, "cluster.detach=true", "+cluster.extra_sbatch.hold=true",
                      "optimizer.lr=0.1,0.2")
    assert again.returncode == 0, again.stderr
    for old, row in zip(rows, manifest(tmp_path)["jobs"], strict=True):
        assert row["job_id"] != old["job_id"]
        assert [(a["job_id"], a["state"]) for a in row["attempts"]] == [(old["job_id"],
                                                                          "cancelled")]
    subprocess.run([LABRUN, "cancel", str(tmp_path)], capture_output=True, timeout=120)


def read_summary_or_none(run_dir: Path) -> dict:
    """The run's summary.json, or {} before it has one."""
    try:
        return read_summary(run_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_an_optuna_study_keeps_n_jobs_trials_in_flight_each_its_own_job(tmp_path,
                                                                        python_docs_tokens):
    # hparams_search=optuna on SLURM: four trials of a language model, two in flight, each
    # trial one SLURM job submitted as the study asks for it, every trial reporting to the
    # study's journal file in the sweep folder from its node at each validation step.
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    proc = subprocess.Popen(sweep_args(tmp_path, "hparams_search=optuna",
                                       "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
                                       *LM_STEPS, f"dataset.path={python_docs_tokens}"),
                            cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    # Asynchronous, not in batches: trial 1 is held still from its start (before its data
    # loads, so outside the journal's lock) while trials 2 and 3 take trial 0's freed slot one
    # after the other and end. A batched sweeper would wait for trial 1 before starting 2.
    [held] = freeze_as_they_start([tmp_path / "1"], proc, timeout=300)
    try:
        deadline = time.time() + 300  # two tiny trials after trial 0, one at a time
        while read_summary_or_none(tmp_path / "3").get("status") not in ("completed",
                                                                        "pruned"):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.time() < deadline, "trial 3 did not end while trial 1 was held"
            time.sleep(0.5)
        assert read_summary_or_none(tmp_path / "1").get("status") != "completed"
    finally:
        os.kill(held, signal.SIGCONT)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    trials = optuna.load_study(study_name="train", storage=storage).trials
    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert [t.number for t in trials] == list(range(4))
    assert all(t.state in finished for t in trials)
    # Every trial reported at each validation step from its SLURM job (the pruner needs them).
    assert all(sorted(t.intermediate_values) == [2, 4] for t in trials
               if t.state == optuna.trial.TrialState.COMPLETE)
    rows = manifest(tmp_path)["jobs"]
    assert [row["num"] for row in rows] == list(range(4))
    assert len({row["job_id"].split("_")[0] for row in rows}) == 4  # a job each
    # Never more than n_jobs trials in SLURM's queue: each was submitted once an earlier one
    # was seen to end (the launcher's own times: submitted, seen ended).
    intervals = [(row["submitted_at"], row["ended_at"]) for row in rows]
    assert all(start < end for start, end in intervals), intervals
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    assert max(itertools.accumulate(change for _, change in events)) == 2
    for row, trial in zip(rows, trials, strict=True):
        summary = read_summary(Path(row["dir"]))
        assert summary["status"] == row["state"] == trial.state.name.lower().replace(
            "complete", "completed")
        assert f"optimizer.lr={trial.params['optimizer.lr']}" in row["overrides"]


def test_a_detached_study_runs_by_itself_and_its_requeued_controller_continues_it(tmp_path):
    """The controller is requeued by USR2, what SLURM sends a job whose time limit nears
    (submitit's --signal=USR2@90): submitit checkpoints it and requeues it, the case every long
    study meets. A node failing under it is SLURM requeuing the same job, whose start is then
    the same as here (a node failing under a training job: test_cluster_lab's NodeFailure)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    result = run_sweep(tmp_path, "hparams_search=optuna", "cluster.detach=true",
                       "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                       "trainer.max_epochs=2", "trainer.limit_train_batches=3",
                       "trainer.limit_val_batches=2", "cluster.controller.cpus_per_task=2",
                       "cluster.controller.timeout_min=25")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"labrun status {tmp_path}" in result.stdout
    assert f"labrun cancel {tmp_path}" in result.stdout
    controller = manifest(tmp_path)["controller"]["job_id"]
    # cluster.controller's keys reached the controller's sbatch, as SLURM holds the job.
    shown = subprocess.run(["scontrol", "show", "job", controller], capture_output=True,
                           text=True, timeout=30, check=True).stdout
    for field in ("Partition=dev", "TimeLimit=00:25:00", "NumCPUs=2"):
        assert re.search(rf"\b{field}\b", shown), (field, shown)
    # The terminal is gone (the command returned). Mid-study, while trial 1 trains, the
    # controller gets USR2. Submission, start-up and a trial: under two minutes loaded; 300 s
    # only stops a hang.
    # Trial 1 is held still (SIGSTOP; SLURM still runs it) from the moment its run-folder lock
    # names it (before its data loads) until the requeued controller has attached to it: a
    # trial that ended meanwhile is only told, not attached to, and a trial of 6 steps trains
    # in under a second.
    deadline = time.time() + 300
    while not (tmp_path / "1" / ".lock").exists():
        assert time.time() < deadline, Path(manifest(tmp_path)["controller"]["log"]).read_text()
        time.sleep(0.02)
    trial = holder_pid(tmp_path / "1")
    freeze_outside_the_journal_lock(trial, tmp_path / "optuna.journal")
    try:
        subprocess.run(["scancel", "--signal=USR2", controller], check=True, timeout=30)
        log = Path(manifest(tmp_path)["controller"]["log"])
        # The requeued controller starts again seconds after USR2; 300 s: a hang.
        deadline = time.time() + 300
        while "continuing study train: 1 trials finished, 1 running" not in log.read_text():
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        os.kill(trial, signal.SIGCONT)
    assert sacct_state(controller) == "COMPLETED"  # waits for the study to end
    # SLURM ran it twice: the attempt it requeued, then the one that completed.
    attempts = subprocess.run(["sacct", "-n", "-P", "-D", "-X", "-o", "State", "-j", controller],
                              capture_output=True, text=True, timeout=30).stdout.split()
    assert len(attempts) == 2 and attempts[-1] == "COMPLETED", attempts
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    trials = optuna.load_study(study_name="train", storage=storage).trials
    # Every trial number ended exactly once: none failed and was tried again, none ran twice.
    assert [t.number for t in trials] == [0, 1, 2]
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
               for t in trials), [t.state for t in trials]
    rows = manifest(tmp_path)["jobs"]
    assert [(row["num"], row["attempts"]) for row in rows] == [(0, []), (1, []), (2, [])]
    # Each trial was a job of its own, not a step of the controller's (whose SLURM variables
    # it would have inherited): its recorded SLURM job is its own row's.
    for row in rows:
        recorded = json.loads((Path(row["dir"]) / "provenance" / "environment.json").read_text())
        own = recorded["slurm"].get("SLURM_ARRAY_JOB_ID") or recorded["slurm"]["SLURM_JOB_ID"]
        assert own == row["job_id"].split("_")[0] != controller, recorded["slurm"]
    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    # No pruning before five trials (the default MedianPruner): all three completed.
    assert ("study train: 3 trials wanted; 3 finished, 0 running, 0 pruned, 0 failed"
            in status.stdout), status.stdout
    # The best so far with its parameters, as the study itself has it.
    best = optuna.load_study(study_name="train", storage=storage).best_trial
    assert (f"best so far: trial {best.number}, {best.value:.4g} with "
            f"optimizer.lr={best.params['optimizer.lr']}") in status.stdout, status.stdout
    assert f"controller: SLURM job {controller}, completed" in status.stdout, status.stdout
    # Its end is in jobs.json too, for when SLURM has forgotten the job.
    assert manifest(tmp_path)["controller"]["state"] == "completed"


def test_a_held_sweep_larger_than_the_screen_is_summed_up_and_cancelled_in_ranges(tmp_path):
    """Twelve held jobs on a ten-row screen: `labrun status` counts them by state instead of
    listing them, `labrun cancel` names them as one range, `--all` lists every row."""
    result = run_sweep(tmp_path, "cluster.detach=true", "+cluster.extra_sbatch.hold=true",
                       "+variant=range(0,12)")
    assert result.returncode == 0, result.stdout + result.stderr
    small_screen = {**os.environ, "LINES": "20"}
    try:
        # `labrun status --wait` interrupted (Ctrl-C) while it waits (it has asked SLURM: a
        # logging squeue on its PATH says so) cancels nothing: the jobs still wait.
        shim = tmp_path / "shim"
        shim.mkdir()
        real = shutil.which("squeue")
        (shim / "squeue").write_text(f'#!/bin/sh\ntouch "{shim}/asked"\nexec {real} "$@"\n')
        (shim / "squeue").chmod(0o755)
        waiting = subprocess.Popen([LABRUN, "status", "--wait", str(tmp_path)],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"})
        deadline = time.monotonic() + 60
        while not (shim / "asked").exists():
            assert waiting.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        waiting.send_signal(signal.SIGINT)
        assert waiting.wait(timeout=60) == 130, waiting.communicate()[0]
        ids = [row["job_id"] for row in manifest(tmp_path)["jobs"]]
        states = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%T"],
                                capture_output=True, text=True, timeout=30).stdout.split()
        assert states == ["PENDING"] * 12, states
        status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True,
                                text=True, timeout=120, env=small_screen)
        assert status.stdout.splitlines()[0] == "12 jobs: 12 pending", status.stdout
        assert "┃ job" not in status.stdout  # nothing needs a look: no rows at all
        assert f"every row: labrun status {tmp_path} --all" in status.stdout
    finally:
        cancel = subprocess.run([LABRUN, "cancel", str(tmp_path)], capture_output=True,
                                text=True, timeout=120)
    assert cancel.stdout.strip() == f"cancelled 12 jobs of {tmp_path}: 0-11", cancel.stdout
    every = subprocess.run([LABRUN, "status", "--all", str(tmp_path)], capture_output=True,
                           text=True, timeout=120, env=small_screen).stdout
    assert sum(1 for line in every.splitlines() if "│ cancelled" in line) == 12, every


def test_cancel_of_a_running_job_lets_it_save_a_checkpoint(tmp_path):
    """`labrun cancel SWEEP_DIR` of a job that trains: SLURM's SIGTERM reaches the training
    process (its data workers leave it to it), which saves a checkpoint and ends interrupted."""
    result = run_sweep(tmp_path, "cluster.detach=true", "trainer.max_epochs=500",
                       "checkpoint.every_n_steps=5", "dataset.num_workers=2")
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "0"
    deadline = time.time() + 180  # queued, started, five steps
    while not (run / "checkpoints" / "step-00000005.pt").is_file():
        assert time.time() < deadline, "the job never checkpointed"
        time.sleep(0.5)
    cancel = subprocess.run([LABRUN, "cancel", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert cancel.stdout.strip() == f"cancelled 1 jobs of {tmp_path}: 0", cancel.stdout
    job_id = manifest(tmp_path)["jobs"][0]["job_id"]
    assert sacct_state(job_id).startswith("CANCELLED")
    summary = summary_once_ended(run)
    assert summary["status"] == "interrupted", summary
    assert (run / "checkpoints" / f"step-{summary['step']:08d}.pt").is_file()


def test_cancel_stops_a_detached_studys_controller_first_then_its_trial(tmp_path):
    """`labrun cancel` of a detached study while a trial trains: the controller is cancelled
    first, so that it cannot start another trial once the one in flight ends (failures are
    allowed here, so a live controller would go on); then the trial, which saves a checkpoint.
    `labrun status` then says so without asking SLURM."""
    result = run_sweep(tmp_path, "hparams_search=optuna", "cluster.detach=true",
                       "hydra.sweeper.n_trials=3", "hydra.sweeper.max_failure_rate=1.0",
                       "trainer.max_epochs=500", "checkpoint.every_n_steps=5")
    assert result.returncode == 0, result.stdout + result.stderr
    controller = manifest(tmp_path)["controller"]["job_id"]
    trial = tmp_path / "0"
    deadline = time.time() + 300  # the controller queued and started, the trial too, 5 steps
    while not (trial / "checkpoints" / "step-00000005.pt").is_file():
        assert time.time() < deadline, Path(manifest(tmp_path)["controller"]["log"]).read_text()
        time.sleep(0.5)
    try:
        cancel = subprocess.run([LABRUN, "cancel", str(tmp_path)], capture_output=True,
                                text=True, timeout=120)
        assert cancel.returncode == 0, cancel.stderr
        assert cancel.stdout.strip() == f"cancelled 1 jobs of {tmp_path}: 0", cancel.stdout
    finally:
        subprocess.run(["scancel", controller], timeout=30)
    assert sacct_state(controller).startswith("CANCELLED")
    record, rows = manifest(tmp_path)["controller"], manifest(tmp_path)["jobs"]
    assert record["state"] == "cancelled", record
    assert [(row["num"], row["state"]) for row in rows] == [(0, "cancelled")], rows
    assert record["cancelled_at"] <= rows[0]["cancelled_at"]  # the controller first
    assert sacct_state(rows[0]["job_id"]).startswith("CANCELLED")
    summary = summary_once_ended(trial)
    assert summary["status"] == "interrupted", summary
    assert (trial / "checkpoints" / f"step-{summary['step']:08d}.pt").is_file()
    # The controller has ended (above): it started no trial after the one cancelled.
    assert not (tmp_path / "1").exists()
    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert f"controller: SLURM job {controller}, cancelled" in status.stdout, status.stdout


