"""cluster=local sweeps: labrun's launcher runs jobs as subprocesses, at most max_parallel at
once, each with its own GPUs; a failing job leaves the others; a re-run finishes only what is
left. Also `python train.py trainer.devices=2`: two local processes (gloo on the CPU).

No GPU is here: the GPU ids are handed out through CUDA_VISIBLE_DEVICES all the same (each job
records what it got), and the jobs train on the CPU.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, LABRUN, PROJECT, PYTHON, read_metrics, read_summary, run_train

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]


def sweep(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=600)


def test_four_jobs_two_at_a_time_on_distinct_gpus(tmp_path):
    result = sweep(tmp_path, "optimizer.lr=0.001,0.002,0.003,0.004", "cluster.max_parallel=2",
                   "cluster.gpu_ids=[0,1,2,3]", "trainer.devices=1")
    assert result.returncode == 0, result.stderr
    jobs = []
    for num in range(4):
        summary = read_summary(tmp_path / str(num))
        env = json.loads((tmp_path / str(num) / "provenance" / "environment.json").read_text())
        assert summary["status"] == "completed"
        jobs.append((summary["started_at"], summary["ended_at"], env["cuda_visible_devices"]))
    for start, end, _ in jobs:
        overlapping = [j for j in jobs if j[0] < end and j[1] > start]  # includes itself
        assert len(overlapping) <= 2, "more than max_parallel jobs ran at once"
        assert len({j[2] for j in overlapping}) == len(overlapping), "two jobs shared a GPU"
    assert {gpus for _, _, gpus in jobs} <= {"0", "1", "2", "3"}
    assert any(len([j for j in jobs if j[0] < e and j[1] > s]) == 2 for s, e, _ in jobs)
    assert "completed" in result.stdout and "sweep" in result.stdout


def test_a_failing_job_leaves_the_others_and_a_rerun_skips_completed(tmp_path):
    first = sweep(tmp_path, "optimizer.lr=0.001,-1,0.003")
    assert first.returncode != 0
    assert "1 of 3 jobs did not complete" in first.stdout
    assert "optimizer.lr=-1.0 must be greater than 0" in first.stdout + first.stderr
    assert [read_summary(tmp_path / n)["status"] for n in ("0", "2")] == ["completed"] * 2
    finished = {n: (tmp_path / n / "summary.json").stat().st_mtime_ns for n in ("0", "2")}

    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True)
    assert status.returncode == 0 and "failed" in status.stdout and "completed" in status.stdout

    again = sweep(tmp_path, "optimizer.lr=0.001,-1,0.003")
    assert "completed (earlier)" in again.stdout
    for num, mtime in finished.items():  # not run again
        assert (tmp_path / num / "summary.json").stat().st_mtime_ns == mtime
    log = (tmp_path / "1" / "job.log").read_text()
    assert log.count("must be greater than 0") == 2  # only the failed job ran again


def test_two_local_processes_train_one_run(tmp_path):
    run_train("trainer.devices=2", "trainer.max_epochs=1", "trainer.limit_train_batches=3",
              run_dir=tmp_path / "run")
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "completed" and summary["step"] == 3
    steps = [p["step"] for p in read_metrics(tmp_path / "run") if "train/loss" in p]
    assert steps == sorted(set(steps)), "a rank other than 0 wrote metrics too"
    assert not (tmp_path / "run" / "errors").exists()


@pytest.mark.parametrize("devices", [8])
def test_more_devices_than_gpus_is_refused_at_once(tmp_path, devices):
    result = sweep(tmp_path, "optimizer.lr=0.1,0.2", f"trainer.devices={devices}",
                   "cluster.gpu_ids=[0,1]")
    assert result.returncode == 2
    assert "trainer.devices=8 but only 2 GPUs" in result.stderr


def test_an_interrupted_optuna_search_continues_its_study(tmp_path):
    import os
    import signal
    import time

    import optuna

    args = [PYTHON, "train.py", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3",
            *FAST, *TINY, f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 300
    while not (tmp_path / "2" / "summary.json").exists():  # trials 0 and 1 are done
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # Ctrl-C during trial 2
    proc.communicate(timeout=120)

    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "continuing study train: 2 trials finished, 1 to go" in result.stdout
    study = optuna.load_study(study_name="train", storage=f"sqlite:///{tmp_path}/optuna.db")
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3
    assert study.trials[2].state == optuna.trial.TrialState.FAIL  # the one cut off...
    assert study.trials[3].params == study.trials[2].params  # ...was tried again
    assert read_summary(tmp_path / "3")["status"] == "completed"
    assert read_summary(tmp_path / "2")["status"] == "interrupted"


def test_a_user_error_in_two_local_processes_is_one_line(tmp_path):
    result = run_train("trainer.devices=2", "dataset=synthetic", "dataset.num_train=4",
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert "fewer than one optimizer step" in lines[-1] and "Traceback" not in result.stderr
