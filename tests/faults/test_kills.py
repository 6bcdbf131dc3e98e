"""kill -9 at seeded random moments (start-up, mid-epoch, mid-checkpoint-write), SIGINT and
SIGTERM: the run resumes each time and ends bit-identical to an uninterrupted run; no
checkpoint that exists under its final name is ever half-written."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

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

KILLS = 10


def start(run_dir: Path) -> subprocess.Popen:
    return start_train(*DETERMINISTIC, run_dir=run_dir, output=subprocess.DEVNULL)


def every_checkpoint_loads(run_dir: Path) -> list[str]:
    """The names of final checkpoint files that do not load (must stay empty)."""
    broken = []
    for path in (run_dir / "checkpoints").glob("*.pt") if (run_dir / "checkpoints").exists() \
            else []:
        try:
            torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001
            broken.append(path.name)
    return broken


def kill_while_writing(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """SIGKILL the moment a checkpoint's temporary file appears; True if that was caught."""
    folder = run_dir / "checkpoints"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if folder.exists() and any(p.name.endswith(".tmp") for p in os.scandir(folder)):
            proc.kill()
            return True
    proc.kill()
    return False


def test_kill_9_at_ten_random_moments(tmp_path, reference_weights, fault):
    record = fault("kill -9 (random moment)")
    writing = fault("kill -9 while writing a checkpoint")
    rng = random.Random(20261129)
    run_dir = tmp_path / "run"
    for trial in range(KILLS):
        proc = start(run_dir)
        if trial == 4:
            caught = kill_while_writing(run_dir, proc)
            proc.wait()
            broken = every_checkpoint_loads(run_dir)
            writing.trial(not broken, lost=bool(broken),
                          note=f"kill during a checkpoint write caught={caught}; "
                               f"unreadable final files: {broken or 'none'}")
            assert not broken
            continue
        delay = rng.uniform(1.0, 7.0)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        summary = read_summary(run_dir) if (run_dir / "summary.json").exists() else {}
        broken = every_checkpoint_loads(run_dir)
        record.trial(not broken, lost=bool(broken),
                     note=f"killed after {delay:.1f}s at step {summary.get('step', 'start-up')}"
                          f"; unreadable final files: {broken or 'none'}")
        assert not broken
    run_train(*DETERMINISTIC, run_dir=run_dir)
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), reference_weights)
    steps = [p["step"] for p in read_metrics(run_dir) if "train/loss" in p]
    assert len(steps) == len(set(steps)), "a step was logged twice after a resume"
    print(f"[kill -9] after {KILLS} kills the run ends bit-identical to the uninterrupted one")


def test_ctrl_c_checkpoints_then_resumes_identically(tmp_path, reference_weights, fault):
    record = fault("SIGINT (Ctrl-C)")
    run_dir = tmp_path / "run"
    proc = start_train(*DETERMINISTIC, run_dir=run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000015.pt", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    summary = read_summary(run_dir)
    interrupted = proc.returncode == 130 and summary["status"] == "interrupted"
    assert interrupted and f"resume with: labrun resume {run_dir}" in stderr
    run_train(*DETERMINISTIC, run_dir=run_dir)
    identical = all(torch.equal(a, b) for a, b in zip(final_weights(run_dir).values(),
                                                      reference_weights.values(), strict=True))
    record.trial(identical, lost=not identical,
                 note=f"SIGINT at step {summary['step']}: status interrupted, resumed, "
                      f"identical={identical}")
    assert identical
