"""The run folder's lock (labrun.runs.lock): one writer per run folder.

Real files and real processes: a holder is another Python process (or a `sleep` standing in for
one), a dead holder is a process killed with SIGKILL, another host is a lock file naming one.
The whole-run cases (two resumes at once, kill -9, a requeue) are in
tests/faults/test_concurrent_writers.py.

A flaky file system is a real one made unreadable for a while: a symbolic link to itself is
renamed over the lock file, so that open(2) fails (ELOOP stands in for NFS's EIO or ESTALE; as
root, permissions would not stop a read), and the lock file is renamed back over it. The SLURM
branch runs on the test cluster, in tests/test_run_lock_slurm.py."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import lock_race
import pytest

from conftest import run_train
from labrun.runs import lock, lock_holder
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


def write_lock(path: Path, **facts) -> lock_holder.Holder:
    """A lock file as another process would have written it."""
    holder = lock_holder.Holder(**{"host": socket.gethostname(), "pid": 1, "pid_start": None,
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
    before = time.time()
    held = lock.acquire(path)
    after = time.time()
    facts = json.loads(path.read_text())
    assert (facts["host"], facts["pid"], facts["job_id"], facts["restart"]) == (
        socket.gethostname(), os.getpid(), "4242", 3)
    assert facts["pid_start"] == lock_holder.pid_start(os.getpid()) is not None
    assert before <= facts["started_at"] <= after  # taken when acquire() took it
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
    write_lock(path, pid=os.getpid(), pid_start=lock_holder.pid_start(os.getpid()) - 1)
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
    old = time.time() - lock_holder.STALE_AFTER_S - 60
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
    holder = write_lock(path, pid=os.getppid(), job_id="55", launch=lock_holder.launch_id())
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


# -- a slow or flaky file system ---------------------------------------------------------------


def make_unreadable(path: Path) -> Path:
    """Make lock file `path` fail to open, keeping the file aside. Never absent for a moment:
    a missing lock file is a lock lost at once, not a hiccup."""
    aside = path.with_name(".lock.aside")
    os.link(path, aside)
    loop = path.with_name(".lock.loop")
    os.symlink(path.name, loop)  # .lock -> .lock: ELOOP
    os.rename(loop, path)
    return aside


def make_readable(path: Path, aside: Path) -> None:
    os.rename(aside, path)


def wait_until(condition, what: str, timeout: float = 10) -> None:
    # A deadline only for a test that fails: each condition holds within a few beats.
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_heartbeat_survives_a_lock_file_unreadable_for_longer_than_a_beat(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.02)
    path = lock_file(tmp_path)
    held = lock.acquire(path)
    unreadable_at = time.monotonic()
    aside = make_unreadable(path)

    def tried_again_for_a_while():
        # The old heartbeat returned at its first failed read, for good.
        assert held._beat.is_alive(), "the heartbeat ended at a failed read"
        warned = any("cannot read the lock file" in r.getMessage() for r in caplog.records)
        return warned and time.monotonic() - unreadable_at > 10 * lock.HEARTBEAT_S

    with caplog.at_level("WARNING", logger="labrun.runs.lock"):
        wait_until(tried_again_for_a_while, "the heartbeat never found the lock unreadable")
    make_readable(path, aside)
    old = time.time() - 3600
    os.utime(path, (old, old))
    wait_until(lambda: path.stat().st_mtime > time.time() - 60,
               "the heartbeat did not beat again once the lock could be read")
    assert held._beat.is_alive()
    lock.ensure_owner(path)


def test_a_transient_read_error_does_not_stop_a_write(tmp_path):
    """The first read of the lock before the write fails; it is read again, and the write is
    made. The lock is put back by the warning the failed read logs, so no timing is involved."""
    folder = RunDir(tmp_path / "run", writer=True)
    lock.acquire(folder.lock_path)
    folder.update_summary(status="running")
    aside = make_unreadable(folder.lock_path)
    warnings = []

    class PutBackOnWarning(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
            make_readable(folder.lock_path, aside)

    handler = PutBackOnWarning(logging.WARNING)
    logging.getLogger("labrun.runs.lock").addHandler(handler)
    try:
        folder.update_summary(status="completed")  # the old ensure_owner raised LockLost here
    finally:
        logging.getLogger("labrun.runs.lock").removeHandler(handler)
    assert folder.read_summary()["status"] == "completed"
    assert len(warnings) == 1 and "cannot read the lock file" in warnings[0], warnings


def test_a_lock_unreadable_for_half_the_stale_time_is_lost_for_good(tmp_path, monkeypatch):
    """Past STALE_AFTER_S / 2 without a good read, the holder stops: another host may judge its
    heartbeat stale at STALE_AFTER_S, and the holder must have stopped writing by then."""
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.02)
    monkeypatch.setattr(lock, "STALE_AFTER_S", 0.5)
    path = lock_file(tmp_path)
    held = lock.acquire(path)
    aside = make_unreadable(path)
    with pytest.raises(lock.LockLost, match=r"lost the run folder \(its lock file could not be "
                                            r"read for \d+ s"):
        lock.ensure_owner(path)
    held._beat.join(timeout=10)
    assert not held._beat.is_alive()  # it stopped beating
    make_readable(path, aside)
    with pytest.raises(lock.LockLost):  # readable again, but another host may have judged it
        lock.ensure_owner(path)


# -- taking a stale lock over ------------------------------------------------------------------


def stale_lock(path: Path) -> lock_holder.Holder:
    """A lock whose holder is gone: this process's PID, with another start time (a reused
    PID), so judged stale at once and the same way by every claimant."""
    return write_lock(path, pid=os.getpid(), pid_start=lock_holder.pid_start(os.getpid()) - 1,
                      token="stale")


def test_a_claimant_with_old_data_never_removes_a_fresh_holders_lock(tmp_path):
    """The put-back window: a claimant judges the lock stale, another process takes it over
    before the claimant acts, and the claimant acts on its old judgement. The old take-over
    renamed the fresh lock aside and back; an observer that looks after each rename, link and
    unlink of the claimant (the moments a lock can change) saw the run folder without a lock."""
    path = lock_file(tmp_path)
    stale_lock(path)
    fresh: list[subprocess.Popen] = []
    judgements: list[str] = []
    seen: list[str | None] = []  # the lock's token after each call; None: no lock
    since_fresh = []  # where in `seen` the fresh holder's time begins
    judged = lock.stale_reason

    def overtaken_after_judging(holder, at, mine):
        why = judged(holder, at, mine)
        judgements.append(holder.token)
        # acquire judges before it tries (nothing created yet) and again in its loop, just
        # before it takes over: there, another process takes the stale lock first.
        if holder.token == "stale" and judgements.count("stale") == 2:
            fresh.append(hold_in_process(path))
            since_fresh.append(len(seen))
        return why

    def observed(call):
        def after(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            finally:
                seen.append(getattr(lock_holder.read_holder(path), "token", None))
        return after

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lock, "stale_reason", overtaken_after_judging)
            for name in ("rename", "link", "unlink"):
                patch.setattr(os, name, observed(getattr(os, name)))
            with pytest.raises(lock.RunLocked) as refused:
                lock.acquire(path)
        assert fresh, "the fresh holder never took over"
        assert f"by PID {fresh[0].pid} on" in str(refused.value)
        token = json.loads(path.read_text())["token"]
        after = seen[since_fresh[0]:]
        assert after and after == [token] * len(after), \
            f"the fresh lock {token} was seen as {after}"
    finally:
        for proc in fresh:
            proc.kill()
            proc.wait()


DIES_IN_ITS_TAKE_OVER = """
import os, sys
from labrun.runs import lock
os.rename = lambda *args: os._exit(9)  # dies where it would replace the stale lock
lock.acquire(sys.argv[1])
"""


def test_a_claimant_that_died_in_its_take_over_does_not_block_the_folder(tmp_path):
    """A claimant that holds the take-over's gate and dies before it replaces the lock leaves
    the gate behind; the next claimant judges that claimant gone and goes on past it."""
    path = lock_file(tmp_path)
    stale_lock(path)
    died = subprocess.run([sys.executable, "-c", DIES_IN_ITS_TAKE_OVER, str(path)],
                          capture_output=True, text=True)
    assert died.returncode == 9, died.stderr
    assert json.loads(path.read_text())["token"] == "stale"  # the stale lock is still there
    left = sorted(p.name for p in path.parent.iterdir())
    assert len(left) == 2 and left[1].startswith(".lock.take."), left  # and its gate
    assert lock.acquire(path) is not None
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in path.parent.iterdir()) == [".lock"]  # the dead gate removed


ROUNDS = 200


@pytest.mark.parametrize("claimants", ["threads", "processes"])
def test_three_claimants_over_a_stale_lock_exactly_one_wins_and_keeps_it(tmp_path, claimants):
    """Each round, three claimants call lock.acquire on a stale lock at once (lock_race.py):
    exactly one wins, and it holds the lock while the others make their moves."""
    for round_ in range(ROUNDS):
        stale_lock(lock_file(tmp_path / "runs" / str(round_)))
    # Each claimant reaches the folders through a path of its own (a symbolic link, as a lab
    # reaches its output root under two names): acquire's bookkeeping is per process and per
    # path, so threads of one process claim as separate processes would.
    paths = []
    for claimant in range(3):
        (tmp_path / f"claimant-{claimant}").symlink_to(tmp_path / "runs")
        paths.append([str(lock_file(tmp_path / f"claimant-{claimant}" / str(round_)))
                      for round_ in range(ROUNDS)])
    if claimants == "threads":
        results, done = queue.Queue(), multiprocessing.Array("i", ROUNDS)
        barrier = threading.Barrier(3)
        workers = [threading.Thread(target=lock_race.claim_rounds,
                                    args=(mine, barrier, done, results)) for mine in paths]
    else:
        # Forked from a fresh server process, not from this one: a fork of pytest's process
        # would copy its threads' state in their middle. The server imports the claimants once.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["lock_race"])
        results, done = context.Queue(), context.Array("i", ROUNDS)
        barrier = context.Barrier(3)
        workers = [context.Process(target=lock_race.claim_in_process,
                                   args=(mine, barrier, done, results)) for mine in paths]
    for worker in workers:
        worker.start()
    # 120 s: 200 rounds take a few seconds; only a hung claimant reaches it.
    outcomes = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    wins = sorted(round_ for won, _ in outcomes for round_ in won)
    problems = [problem for _, found in outcomes for problem in found]
    assert problems == []
    assert wins == list(range(ROUNDS)), "a round had no winner, or two"


def test_a_zombie_holder_counts_as_dead(tmp_path):
    """A holder that exited but whose parent has not reaped it yet: /proc/PID is still there,
    with its start time, in state Z."""
    path = lock_file(tmp_path)
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # the child: exit at once, not reaped until the end of the test
    try:
        def stat() -> list[str]:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()

        wait_until(lambda: stat()[0] == "Z", "the child did not exit")
        write_lock(path, pid=pid, pid_start=int(stat()[19]))
        assert lock.acquire(path) is not None
        assert json.loads(path.read_text())["pid"] == os.getpid()
    finally:
        os.waitpid(pid, 0)
