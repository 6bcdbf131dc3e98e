"""cluster=local sweeps: labrun's launcher runs each job through submitit's LocalExecutor, at
most max_parallel at once, each with its own GPUs; a failing job leaves the others; a re-run
finishes only what is left; Ctrl-C stops the jobs with a checkpoint; USR2 requeues a job.
(`python train.py trainer.devices=2`, two local processes: tests/test_distributed.py.)

No GPU is here: the GPU ids are handed out through CUDA_VISIBLE_DEVICES all the same (each job
records what it got), and the jobs train on the CPU.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import FAST, LABRUN, PROJECT, PYTHON, manifest, nvml_stand_in, read_summary

TINY = ["trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2"]


def sweep(sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, *overrides, f"hydra.sweep.dir={sweep_dir}"]
    # A sweep here is at most four TINY jobs (each well under a minute, even two at a time on a
    # loaded 2-core machine); 600 s only stops a hung sweep from blocking the suite.
    return subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=600)


def job_rows(sweep_dir: Path) -> list[dict]:
    """The rows of the sweep's jobs.json, the launcher's own record of each job."""
    return manifest(sweep_dir)["jobs"]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals [start, end] that share one moment."""
    # At equal times an end (-1) sorts before a start (+1): touching intervals do not overlap.
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = alive = 0
    for _, change in events:
        alive += change
        most = max(most, alive)
    return most


def test_four_jobs_two_at_a_time_on_distinct_gpus(tmp_path):
    result = sweep(tmp_path, "optimizer.lr=0.001,0.002,0.003,0.004", "cluster.max_parallel=2",
                   "cluster.gpu_ids=[0,1,2,3]", "trainer.devices=1")
    assert result.returncode == 0, result.stderr
    assert f"sweep in {tmp_path.resolve()}: at most 2 jobs at once on GPUs [0, 1, 2, 3]" \
        in result.stdout
    rows = job_rows(tmp_path)
    assert [row["num"] for row in rows] == [0, 1, 2, 3]
    for row in rows:
        summary = read_summary(Path(row["dir"]))
        env = json.loads((Path(row["dir"]) / "provenance" / "environment.json").read_text())
        assert row["state"] == summary["status"] == "completed" and row["returncode"] == 0
        assert env["cuda_visible_devices"] == row["gpus"]  # what the job got is what was given
        # The job's own record of its training lies inside the launcher's record of its process:
        # the launcher's times really bracket the process that ran.
        assert row["started_at"] < summary["started_at"] <= summary["ended_at"] < row["ended_at"]
        # A sweep job's checkpoint.on_finish is best_last: its step files went once it finished.
        config = (Path(row["dir"]) / ".hydra" / "config.yaml").read_text()
        assert "on_finish: best_last" in config
        assert sorted(p.name for p in (Path(row["dir"]) / "checkpoints").iterdir()) == \
            ["best.pt", "last.pt"]

    # Counted on the launcher's record of each job's whole process, not on the jobs' training
    # windows (a job spends most of its life starting up, so two jobs that run at the same time
    # need not be training at the same time). No timing luck is involved either way round:
    # - started_at is taken before the process exists and ended_at after the launcher saw it
    #   gone, and a job is started only while fewer than max_parallel are running: at most 2
    #   intervals overlap, however slow or loaded the machine is;
    # - jobs 0 and 1 are started in the same pass, before the launcher looks for ended jobs, so
    #   job 1's started_at precedes job 0's ended_at however short the jobs are: 2 overlap.
    #   A launcher that ran the jobs one by one would show 1; one that ignored max_parallel, 4.
    intervals = [(row["started_at"], row["ended_at"]) for row in rows]
    assert max_overlap(intervals) == 2
    for a, b in itertools.combinations(rows, 2):
        if max_overlap([(a["started_at"], a["ended_at"]), (b["started_at"], b["ended_at"])]) > 1:
            assert not set(a["gpus"].split(",")) & set(b["gpus"].split(",")), \
                f"jobs {a['num']} and {b['num']} ran at the same time on the same GPU"
    assert {row["gpus"] for row in rows} <= {"0", "1", "2", "3"}


def test_a_failing_job_leaves_the_others_and_a_rerun_skips_completed(tmp_path):
    first = sweep(tmp_path, "optimizer.lr=0.001,-1,0.003")
    assert first.returncode != 0
    assert "1 of 3 jobs did not complete" in first.stdout
    assert "optimizer.lr=-1.0 must be greater than 0" in first.stdout + first.stderr
    assert [read_summary(tmp_path / n)["status"] for n in ("0", "2")] == ["completed"] * 2
    finished = {n: (tmp_path / n / "summary.json").stat().st_mtime_ns for n in ("0", "2")}

    # jobs.json records each job as it ran: its overrides, folder, log, outcome and exit code.
    rows = job_rows(tmp_path)
    assert [row["num"] for row in rows] == [0, 1, 2]
    for row, lr in zip(rows, ("0.001", "-1", "0.003"), strict=True):
        num = row["num"]
        assert row["overrides"] == [*FAST, *TINY, f"optimizer.lr={lr}"]
        assert row["dir"] == str((tmp_path / str(num)).resolve())
        assert row["log"] == str(Path(row["dir"]) / "job.log") and Path(row["log"]).is_file()
        assert row["started_at"] < row["ended_at"]
        if num == 1:
            assert row["state"] == "failed" and row["returncode"] == 2  # a user error's code
            assert "optimizer.lr=-1.0 must be greater than 0" in row["error"]
            assert row["metric"] is None
        else:
            summary = read_summary(Path(row["dir"]))
            assert row["state"] == "completed" and row["returncode"] == 0
            assert row["error"] is None
            assert row["metric"] == summary["best/val/acc"]

    status = subprocess.run([LABRUN, "status", str(tmp_path)], capture_output=True, text=True,
                            timeout=120)  # reads a few small files; 120 s: a hang fails
    assert status.returncode == 0 and "failed" in status.stdout and "completed" in status.stdout

    again = sweep(tmp_path, "optimizer.lr=0.001,-1,0.003")
    assert "completed (earlier)" in again.stdout
    for num, mtime in finished.items():  # not run again
        assert (tmp_path / num / "summary.json").stat().st_mtime_ns == mtime
    log = (tmp_path / "1" / "job.log").read_text()
    assert log.count("must be greater than 0") == 2  # only the failed job ran again
    rows = job_rows(tmp_path)  # ... and the launcher started no process for the others
    assert [(row["state"], row["returncode"]) for row in rows] == [
        ("skipped", None), ("failed", 2), ("skipped", None)]


@pytest.mark.parametrize("devices", [8])
def test_more_devices_than_gpus_is_refused_at_once(tmp_path, devices):
    result = sweep(tmp_path, "optimizer.lr=0.1,0.2", f"trainer.devices={devices}",
                   "cluster.gpu_ids=[0,1]")
    assert result.returncode == 2
    assert "trainer.devices=8 but only 2 GPUs" in result.stderr


def test_an_interrupted_optuna_search_continues_its_study(tmp_path):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    # Ctrl-C must land while trial 2 trains: after its summary.json appears (training started)
    # and before its last epoch ends (a stop requested after that is too late: it completes).
    # One TINY epoch of training is about a second on an idle machine, too narrow a window;
    # three epochs make it several seconds, against the milliseconds the signal takes to get
    # from this test through the launcher (SIGTERM) to the trial. The asserts below check that
    # it did land in time (trial 2 interrupted, not completed).
    args = [PYTHON, "train.py", "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3",
            *FAST, *TINY, "trainer.max_epochs=3", f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # Two whole trials come first, each well under two minutes on a loaded 2-core machine;
    # 300 s only keeps a hung search from blocking the suite.
    deadline = time.time() + 300
    while not (tmp_path / "2" / "summary.json").exists():  # trials 0 and 1 are done
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.1)  # small next to the seconds-wide window above
    proc.send_signal(signal.SIGINT)  # Ctrl-C during trial 2
    # The trial stops at its next step boundary with a checkpoint, then the search exits: a
    # matter of seconds; 120 s only catches a stop that never comes.
    proc.communicate(timeout=120)
    trial = job_rows(tmp_path)[2]  # the launcher waited for it and recorded how it ended
    assert (trial["state"], trial["returncode"]) == ("interrupted", 130)
    assert trial["started_at"] < trial["ended_at"]

    # The rest of the search: one retried trial, well under two minutes (see above).
    result = subprocess.run(args, cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "continuing study train: 2 trials finished, 0 running, 1 to go" in result.stdout
    # The study is a journal file in the sweep folder (Optuna's storage for many processes on a
    # shared file system), not the SQLite file of hydra-optuna-sweeper.
    assert not (tmp_path / "optuna.db").exists()
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "optuna.journal")))
    study = optuna.load_study(study_name="train", storage=storage)
    assert study.metric_names == ["val/acc"]  # the objective's name in optuna-dashboard
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3
    assert study.trials[2].state == optuna.trial.TrialState.FAIL  # the one cut off...
    assert study.trials[3].params == study.trials[2].params  # ...was tried again
    assert read_summary(tmp_path / "3")["status"] == "completed"
    assert read_summary(tmp_path / "2")["status"] == "interrupted"
    # Each trial's folder names its trial, for the pruning callback (train/pruning.py).
    assert "+callbacks.optuna.trial=3" in (tmp_path / "3" / ".hydra" / "overrides.yaml").read_text()



def wait_until_training(proc: subprocess.Popen, run_dirs: list[Path]) -> None:
    # The jobs start one after another, each well under two minutes on a loaded 2-core machine;
    # 300 s only keeps a hung sweep from blocking the suite.
    deadline = time.time() + 300
    while not all((run_dir / "summary.json").exists() for run_dir in run_dirs):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.1)


def job_process(controller_pid: int) -> int:
    """The job's own process: the one child of its submitit controller (jobs.json's id)."""
    children = Path(f"/proc/{controller_pid}/task/{controller_pid}/children").read_text()
    return int(children.split()[0])


# Three TINY epochs: the signal must land while the job trains (see the Optuna test below).
LONGER = ["trainer.max_epochs=3"]


def test_ctrl_c_in_a_terminal_stops_each_job_with_a_checkpoint(tmp_path):
    # A terminal's Ctrl-C goes to its whole foreground process group: the launcher and the
    # controllers submitit starts. The jobs must stop as the launcher asks (SIGTERM, then a
    # checkpoint), not be killed by their controllers, and not see the SIGINT themselves.
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, *LONGER, "optimizer.lr=0.001,0.002",
            "cluster.gpu_ids=[0,1]", f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # its own group, as in a terminal
    wait_until_training(proc, [tmp_path / "0", tmp_path / "1"])
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)  # each job stops at its next step: seconds
    assert proc.returncode == 130
    # A controller that got the SIGINT would die with a KeyboardInterrupt traceback, after
    # passing SIGINT on and SIGKILL a second later (too soon for a step of real training).
    assert "KeyboardInterrupt" not in out
    for row in job_rows(tmp_path):
        assert (row["state"], row["returncode"]) == ("interrupted", 130)
        assert read_summary(Path(row["dir"]))["status"] == "interrupted"
        log = Path(row["log"]).read_text()
        assert "interrupted: SIGTERM at step" in log and "SIGINT" not in log
    # Interrupted jobs keep what they resume from, even from `labrun gc --keep-best 0`.
    before = {row["num"]: sorted(p.name for p in (Path(row["dir"]) / "checkpoints").iterdir())
              for row in job_rows(tmp_path)}
    gc = subprocess.run([LABRUN, "gc", str(tmp_path), "--keep-best", "0"], capture_output=True,
                        text=True, timeout=120)
    assert gc.returncode == 0, gc.stderr
    assert "job 0: interrupted, kept whole to resume from" in gc.stdout
    assert f"freed 0 bytes in 0 files of {tmp_path}" in gc.stdout
    for row in job_rows(tmp_path):
        kept = sorted(p.name for p in (Path(row["dir"]) / "checkpoints").iterdir())
        assert kept == before[row["num"]] and "last.pt" in kept
        assert any(name.startswith("step-") for name in kept)


def test_usr2_checkpoints_and_requeues_a_job_which_then_completes(tmp_path):
    # What SLURM sends before a time limit or a preemption, and what submitit's local controller
    # sends before cluster time-outs: the job saves a checkpoint, submitit starts it again, and
    # it resumes from that checkpoint.
    args = [PYTHON, "train.py", "-m", *FAST, *TINY, *LONGER, f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.Popen(args, cwd=PROJECT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    wait_until_training(proc, [tmp_path / "0"])
    os.kill(job_process(int(job_rows(tmp_path)[0]["job_id"])), signal.SIGUSR2)
    out, _ = proc.communicate(timeout=300)  # the rest of the job, as above
    assert proc.returncode == 0, out
    row = job_rows(tmp_path)[0]
    assert (row["state"], row["returncode"]) == ("completed", 0)
    log = Path(row["log"]).read_text()
    assert "checkpoint saved, requeueing" in log and "resuming from" in log
    assert read_summary(tmp_path / "0")["status"] == "completed"


def test_the_launcher_counts_gpus_without_importing_torch(tmp_path):
    # Seconds of every local sweep's start (import torch) for a count NVML gives at once; the
    # launcher process never trains. The stand-in reports GPUs: a count of zero (what a
    # failing NVML gives too) cannot pass.
    env = nvml_stand_in(tmp_path, gpus=3)  # on the path of the launcher's process only
    check = ("import sys; from labrun.launch.local import visible_gpus; "
             "gpus = visible_gpus(); assert 'torch' not in sys.modules, 'torch imported'; "
             "print(gpus)")
    result = subprocess.run([PYTHON, "-c", check], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 1, 2]"
