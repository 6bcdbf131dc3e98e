"""Resume: an interrupted run continues from its newest checkpoint and ends with weights
bit-identical to an uninterrupted run (deterministic CPU, with data workers)."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (
    DETERMINISTIC,
    assert_identical,
    final_weights,
    read_metrics,
    read_summary,
    run_train,
    start_train,
    wait_for,
)

RUN = DETERMINISTIC


def start(run_dir: Path) -> subprocess.Popen:
    return start_train(*RUN, run_dir=run_dir)


def test_killed_run_resumes_to_identical_weights_from_an_epochs_end(tmp_path, reference_weights):
    """kill -9 just after the checkpoint at the end of epoch 1 (step 12): the resumed run starts
    epoch 2 from its first sample. (Kills at random moments, mid-epoch among them, and where
    each resumed from: tests/faults/test_kills.py.)"""
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000012.pt", proc)
    # The kill lands a moment after that checkpoint, possibly a few steps later on a loaded
    # machine; wherever it lands, the resumed run must end identical. It only has to land
    # before the run ends (24 steps and two evaluations later), and the exit code shows it did.
    proc.kill()  # SIGKILL: no chance to save anything more
    # Its data workers see their parent gone within seconds and close the pipes; 60 s: a hang.
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run had ended before the kill"

    result = run_train(*RUN, run_dir=run_dir)  # checkpoint.resume=auto is the default
    assert "resuming from" in result.stdout
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), reference_weights)
    steps = [p["step"] for p in read_metrics(run_dir) if "train/loss" in p]
    assert len(steps) == len(set(steps)), "a resumed run logged some steps twice"


def test_sigterm_saves_at_the_next_step_and_resume_command_finishes(tmp_path, reference_weights):
    """With checkpoint.on_finish=best_last: the interrupted run keeps its step files, which it
    resumes from; the completed run keeps best.pt and last.pt alone."""
    run_dir = tmp_path / "run"
    proc = start_train(*RUN, "checkpoint.on_finish=best_last", run_dir=run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000010.pt", proc)
    # Any moment before the run ends will do (26 steps are left: seconds, even idle).
    proc.send_signal(signal.SIGTERM)
    # It stops at the next step boundary with a checkpoint: seconds; 60 s: a stop that hangs.
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert f"resume with: labrun resume {run_dir}" in stderr
    assert read_summary(run_dir)["status"] == "interrupted"
    assert list((run_dir / "checkpoints").glob("step-*.pt")), "an interrupted run lost its steps"

    from conftest import run_labrun
    run_labrun("resume", str(run_dir))
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), reference_weights)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["best.pt", "last.pt"]


def test_resume_refuses_a_changed_config(tmp_path, short_run):
    run_dir = tmp_path / "run"
    shutil.copytree(short_run, run_dir)  # a finished run of its own
    result = run_train(*SHORT, "optimizer.lr=0.5", run_dir=run_dir, check=False)
    assert result.returncode == 2
    assert "optimizer.lr" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# Two epochs of 4 steps, a checkpoint every 2 steps (all kept), every step logged. The schedule
# is constant so that a shorter run (checkpoint.resume=never below) gets the same learning rates.
SHORT = ["trainer.max_epochs=2", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
         "trainer.deterministic=true", "schedule=constant", "checkpoint.every_n_steps=2",
         "checkpoint.keep_last=10", "trainer.log_every_n_steps=1"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("short") / "run"
    run_train(*SHORT, run_dir=run_dir)
    return run_dir


def train_steps(run_dir: Path) -> list[int]:
    return [p["step"] for p in read_metrics(run_dir) if "train/loss" in p]


def test_resume_from_a_given_checkpoint_continues_from_its_step(tmp_path, short_run):
    """checkpoint.resume=PATH in a new folder: a mid-epoch checkpoint of another run folder."""
    path = short_run / "checkpoints" / "step-00000002.pt"
    run_dir = tmp_path / "continued"
    result = run_train(*SHORT, f"checkpoint.resume={path}", run_dir=run_dir)
    assert train_steps(run_dir) == [3, 4, 5, 6, 7, 8]  # from scratch it would log 1 and 2 too
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and (summary["epoch"], summary["step"]) == (2, 8)
    # Continued exactly: the same weights as the run that went through step 2 itself.
    assert_identical(final_weights(run_dir), final_weights(short_run))
    assert f"resuming from {path} (step 2)" in result.stdout


def test_resume_never_starts_over_in_a_folder_with_checkpoints(tmp_path, short_run):
    """checkpoint.resume=never ignores the folder's checkpoints (auto would resume from step 8,
    past max_epochs=1, and train nothing): a fresh one-epoch run, logged from step 1 again."""
    run_dir = tmp_path / "again"
    shutil.copytree(short_run, run_dir)
    result = run_train(*SHORT, "trainer.max_epochs=1", "checkpoint.resume=never",
                       run_dir=run_dir)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and (summary["epoch"], summary["step"]) == (1, 4)
    # metrics.jsonl describes this run only: the earlier run's points are gone.
    assert train_steps(run_dir) == [1, 2, 3, 4]
    assert [p["step"] for p in read_metrics(run_dir) if "val/acc" in p] == [4]
    # The same weights as the first epoch of the earlier (equally seeded) run.
    fresh = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert fresh["step"] == 4
    before = torch.load(short_run / "checkpoints" / "step-00000004.pt", weights_only=True)
    assert_identical(fresh["model"], before["model"])
    assert "resuming" not in result.stdout
