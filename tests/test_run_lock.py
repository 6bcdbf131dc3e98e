"""The run folder's lock (labrun.runs.lock): one writer per run folder.

Real files and real processes: a holder is another Python process (or a `sleep` standing in for
one), a dead holder is a process killed with SIGKILL, another host is a lock file naming one.
The whole-run cases (two resumes at once, kill -9, a requeue) are in
tests/faults/test_concurrent_writers.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import run_train
from labrun.runs import lock
from labrun.runs.rundir import RunDir

HOLD = """
import sys, time
from labrun.runs import lock
held = lock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture(autouse=True)
def no_inherited_lock(monkeypatch):
    """Each test starts holding nothing, and gives back what it took."""
    monkeypatch.delenv(lock.TOKEN_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    yield
    for held in list(lock._held.values()):
        held.release()


def lock_file(tmp_path: Path) -> Path:
    return RunDir(tmp_path / "run").lock_path


def hold_in_process(path: Path, seconds: float = 60, env: dict | None = None
                    ) -> subprocess.Popen:
    """Another process that takes the lock and keeps it (until killed or `seconds` pass)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout.readline().strip() == "held"
    return proc


def write_lock(path: Path, **facts) -> lock.Holder:
    """A lock file as another process would have written it."""
    holder = lock.Holder(**{"host": socket.gethostname(), "pid": 1, "pid_start": None,
                            "job_id": None, "restart": 0, "launch": None,
                            "started_at": time.time(), "token": "theirs", **facts})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(holder)))
    return holder


def dead_pid() -> int:
    proc = subprocess.Popen(["sleep", "60"])
    proc.kill()
    proc.wait()
    return proc.pid


def test_the_lock_records_who_trains_and_goes_away_on_release(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    path = lock_file(tmp_path)
    held = lock.acquire(path)
    facts = json.loads(path.read_text())
    assert (facts["host"], facts["pid"], facts["job_id"], facts["restart"]) == (
        socket.gethostname(), os.getpid(), "4242", 3)
    assert facts["pid_start"] == lock._pid_start(os.getpid()) is not None
    assert abs(facts["started_at"] - time.time()) < 60
    assert lock.acquire(path) is None  # taken again by its holder: nothing new
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock"]  # no temporary left
    held.release()
    assert not path.exists()


def test_a_second_process_is_refused_with_the_holder_named(tmp_path):
    path = lock_file(tmp_path)
    holder = hold_in_process(path, env={"SLURM_JOB_ID": "88"})
    try:
        with pytest.raises(lock.RunLocked) as refused:
            lock.acquire(path)
        message = str(refused.value)
        assert message.startswith(f"{path.parent} is being trained by PID {holder.pid} on "
                                  f"{socket.gethostname()} (SLURM job 88) since ")
        assert message.endswith("; wait for it, or stop it first")
        assert "\n" not in message
        assert json.loads(path.read_text())["pid"] == holder.pid  # untouched
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_holders_lock_is_taken_over_in_one_line(tmp_path, caplog):
    path = lock_file(tmp_path)
    holder = hold_in_process(path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads(path.read_text())["pid"] == holder.pid  # a kill -9 leaves it behind
    with caplog.at_level("WARNING", logger="labrun.runs.lock"):
        lock.acquire(path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{path.parent}: taking over from PID {holder.pid} on "
                     f"{socket.gethostname()}: PID {holder.pid} is gone"]


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path):
    path = lock_file(tmp_path)
    # This very PID is alive, but it started at another time than the lock says.
    write_lock(path, pid=os.getpid(), pid_start=lock._pid_start(os.getpid()) - 1)
    assert lock.acquire(path) is not None


@pytest.mark.parametrize("restart, taken", [(1, True), (0, False)])
def test_a_requeued_slurm_job_takes_the_lock_from_its_older_attempt(tmp_path, monkeypatch,
                                                                     restart, taken):
    """Same job id: only a higher restart count takes it while the old attempt still runs."""
    path = lock_file(tmp_path)
    old = hold_in_process(path, env={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        if taken:
            lock.acquire(path)
            assert json.loads(path.read_text())["restart"] == 1
        else:
            with pytest.raises(lock.RunLocked, match="SLURM job 77"):
                lock.acquire(path)
    finally:
        old.kill()
        old.wait()


def test_another_hosts_lock_goes_stale_when_its_heartbeat_stops(tmp_path):
    """No SLURM job to ask: the heartbeat decides (here the machine has no SLURM client)."""
    path = lock_file(tmp_path)
    write_lock(path, host="node-elsewhere", pid=os.getpid())
    with pytest.raises(lock.RunLocked, match="on node-elsewhere since"):
        lock.acquire(path)
    old = time.time() - lock.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    assert lock.acquire(path) is not None


def test_an_unreadable_lock_file_is_replaced(tmp_path):
    path = lock_file(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert lock.acquire(path) is not None


def test_the_holder_beats_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    path = lock_file(tmp_path)
    lock.acquire(path)
    old = time.time() - 3600
    os.utime(path, (old, old))
    deadline = time.time() + 10
    while path.stat().st_mtime < time.time() - 60:
        assert time.time() < deadline, "the heartbeat never touched the lock"
        time.sleep(0.05)


def test_a_displaced_holder_stops_before_writing(tmp_path):
    """Summary, metrics and checkpoints: LockLost, and the file is not written."""
    import torch

    from labrun.train.checkpoint import CheckpointManager

    folder = RunDir(tmp_path / "run", writer=True)
    held = lock.acquire(folder.lock_path)
    folder.update_summary(status="running")
    write_lock(folder.lock_path, pid=dead_pid(), token="a-newer-attempt")  # taken over
    before = folder.summary_path.read_bytes()
    with pytest.raises(lock.LockLost, match="lost the run folder to PID"):
        folder.update_summary(status="completed")
    with pytest.raises(lock.LockLost):
        folder.log_metrics({"train/loss": 1.0}, step=1, epoch=0)
    with pytest.raises(lock.LockLost):
        CheckpointManager(folder.checkpoints_dir).save({"model": {"w": torch.zeros(1)}}, 1)
    assert folder.summary_path.read_bytes() == before
    assert not folder.metrics_path.exists()
    assert not folder.checkpoints_dir.exists() or not any(folder.checkpoints_dir.iterdir())
    held.release()  # not its lock any more: left in place
    assert json.loads(folder.lock_path.read_text())["token"] == "a-newer-attempt"


def test_a_process_without_the_lock_writes_as_before(tmp_path):
    """Tools that write to a run they do not train (and other ranks) are not checked."""
    folder = RunDir(tmp_path / "run", writer=True)
    write_lock(folder.lock_path, token="someone")
    folder.update_summary(status="completed")
    assert folder.read_summary()["status"] == "completed"


def test_a_rank_follows_its_launchs_rank_0_and_ends_when_another_holds_it(tmp_path,
                                                                         monkeypatch):
    path = lock_file(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "55")
    holder = write_lock(path, pid=os.getppid(), job_id="55", launch=lock.launch_id())
    lock.follow(path, timeout=1)  # its rank 0 holds it
    write_lock(path, **{**asdict(holder), "launch": "slurm:54:0", "job_id": "54"})
    with pytest.raises(lock.RunLocked, match=r"\(SLURM job 54\)"):
        lock.follow(path, timeout=0.5)


def test_children_of_the_holder_share_its_right(tmp_path):
    """trainer.devices=N: the processes the holder starts inherit $LABRUN_RUN_LOCK."""
    path = lock_file(tmp_path)
    lock.acquire(path)
    child = subprocess.run(
        [sys.executable, "-c", "import sys; from labrun.runs import lock; "
         "print(lock.acquire(sys.argv[1])); lock.ensure_owner(sys.argv[1])", str(path)],
        capture_output=True, text=True, env=os.environ.copy())
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "None"


def test_train_py_refuses_a_held_folder_before_writing_anything(tmp_path):
    """The Hydra callback refuses before Hydra saves .hydra/ or opens train.log."""
    run_dir = tmp_path / "run"
    holder = hold_in_process(RunDir(run_dir).lock_path)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        result = run_train("trainer.max_epochs=1", run_dir=run_dir, check=False)
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(errors) == 1, errors
        assert errors[0].startswith(f"error: {run_dir} is being trained by PID {holder.pid} "
                                    f"on {socket.gethostname()} since "), errors
        assert sorted(p.name for p in run_dir.iterdir()) == before == [".lock"]
    finally:
        holder.kill()
        holder.wait()
