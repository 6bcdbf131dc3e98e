"""CheckpointManager: atomic writes, keep-last-N, best by metric, skipping broken files, and
refusing checkpoints that would run code when loaded."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from labrun.train.checkpoint import CheckpointError, CheckpointManager, load


def state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "step": step}


def test_keep_last_best_and_last(tmp_path):
    manager = CheckpointManager(tmp_path, monitor="val/acc", mode="max", keep_last=2)
    values = [0.5, 0.9, 0.7, 0.8]
    best = None
    for step, value in enumerate(values, start=1):
        improved = manager.is_better(value, best)
        best = value if improved else best
        manager.save(state(step), step, is_best=improved)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best.pt", "last.pt", "step-00000003.pt", "step-00000004.pt"]
    assert load(tmp_path / "best.pt")["step"] == 2  # 0.9, although its step file was pruned
    assert load(tmp_path / "last.pt")["step"] == 4


def test_min_mode_and_non_finite_values():
    manager = CheckpointManager("unused", monitor="val/loss", mode="min")
    assert manager.is_better(0.3, 0.5) and not manager.is_better(0.6, 0.5)
    assert manager.is_better(1.0, None)
    assert not manager.is_better(float("nan"), None) and not manager.is_better(None, 0.5)


def test_truncated_newest_checkpoint_is_skipped(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        manager.save(state(step), step)
    newest = tmp_path / "step-00000003.pt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # also truncates last.pt: the same file
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        path, loaded = manager.load_latest_valid()
    assert path.name == "step-00000002.pt" and loaded["step"] == 2


def test_a_kill_between_the_step_file_and_last_pt_resumes_from_the_step_file(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        manager.save(state(step), step)
    # What save() leaves when killed after renaming step 3 into place, before last.pt follows.
    manager._write_atomic(state(3), tmp_path / "step-00000003.pt")
    assert load(tmp_path / "last.pt")["step"] == 2
    path, loaded = manager.load_latest_valid()
    assert path.name == "step-00000003.pt" and loaded["step"] == 3


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(state(1), 1)
    for path in tmp_path.glob("*.pt"):
        path.write_bytes(b"garbage")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="resume=never"):
        manager.load_latest_valid()
    assert CheckpointManager(tmp_path / "empty").load_latest_valid() is None


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/labrun-pwned",))


def test_a_pickle_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": RunsCode()}, path)
    with pytest.raises(CheckpointError, match="refused"):
        load(path)
    assert not os.path.exists("/tmp/labrun-pwned")


def test_disk_full_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    manager.save(state(1), 1)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left.*step-00000001.pt is intact"):
        manager.save(state(2), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "step-00000001.pt"]
    assert load(tmp_path / "last.pt")["step"] == 1
