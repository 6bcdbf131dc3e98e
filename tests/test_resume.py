"""Resume: an interrupted run continues from its newest checkpoint and ends with weights
bit-identical to an uninterrupted run (deterministic CPU, with data workers)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("kill_after", ["step-00000022.pt", "step-00000035.pt"],
                         ids=["after-epoch-1", "mid-epoch-2"])
def test_killed_run_resumes_to_identical_weights(tmp_path, reference_weights, kill_after):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for(run_dir / "checkpoints" / kill_after, proc)
    proc.kill()  # SIGKILL: no chance to save anything more
    proc.communicate()

    result = run_train(*RUN, run_dir=run_dir)  # checkpoint.resume=auto is the default
    assert "resuming from" in result.stdout
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), reference_weights)
    steps = [p["step"] for p in read_metrics(run_dir) if "train/loss" in p]
    assert len(steps) == len(set(steps)), "a resumed run logged some steps twice"


def test_sigterm_saves_at_the_next_step_and_resume_command_finishes(tmp_path, reference_weights):
    run_dir = tmp_path / "run"
    proc = start(run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000010.pt", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert f"resume with: labrun resume {run_dir}" in stderr
    assert read_summary(run_dir)["status"] == "interrupted"

    from conftest import run_labrun
    run_labrun("resume", str(run_dir))
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), reference_weights)


def test_resume_refuses_a_changed_config(tmp_path):
    run_dir = tmp_path / "run"
    run_train("trainer.max_epochs=1", "trainer.limit_train_batches=2", run_dir=run_dir)
    result = run_train("trainer.max_epochs=1", "trainer.limit_train_batches=2",
                       "optimizer.lr=0.5", run_dir=run_dir, check=False)
    assert result.returncode == 2
    assert "optimizer.lr" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
