"""One writer per run folder: the lock RUN/.lock, held by the process that trains in RUN.

Who holds it: global rank 0 of a run takes it before anything in the folder is written (the
Hydra callback `RunLockCallback` in cli/hydra_app.py for `python train.py` and `labrun resume`,
the local and SLURM launchers before Hydra's run_job for a sweep's jobs, and train/job.py for
any other path in). Its child processes (`trainer.devices=N`) inherit the right through the
environment ($LABRUN_RUN_LOCK: the folder and the lock's random token). The other ranks of a
torchrun/srun launch wait for a holder from their own launch (same SLURM job and restart
count, or same torchrun rendezvous) and exit if another process holds the folder.

The holder checks that the lock file still carries its token before every write of a
checkpoint, metrics.jsonl, summary.json and the rank files (`ensure_owner`, called by RunDir
and CheckpointManager), and stops without writing (LockLost) when it does not.

The lock file is JSON: host, PID, the PID's start time in clock ticks since boot (so that a
reused PID is not taken for the holder), its scheduler's job id and restart count, the launch,
the wall-clock start, the token, and the scheduler's name. A second process is refused in one
line naming the holder. A lock is taken over, with one line saying why, when it is stale:
  - same host: the PID is gone, a zombie (exited, not yet reaped), or another process now;
  - the holder's scheduler job no longer runs (asked of the scheduler the holder names, through
    labrun.core.scheduler; SLURM for a holder that names none; where it cannot be asked, this
    is unknown and the heartbeat decides);
  - another host and no scheduler's answer: the heartbeat (the lock file's mtime, touched every
    HEARTBEAT_S by a thread of the holder) is older than STALE_AFTER_S;
  - or it is displaced: a requeued SLURM job keeps its job id, so the same job id with a higher
    SLURM_RESTART_COUNT takes the lock from the older attempt, which may still be running on a
    failed node; that attempt stops at its next write check.

A flaky or slow file system (NFS under load) does not end a healthy run: a read of the lock
that fails (an OSError other than "no such file", or bytes that are no complete lock) is tried
again with back-off, by the heartbeat and by the write check alike. Another token in the lock,
or no lock file at all, is LockLost at once; a lock that could not be read for STALE_AFTER_S / 2
since it was last read as this process's is LockLost too (the heartbeat stops beating then), so a
holder whose beats fail stops writing well before another host may rightly judge it stale. A
claimant never replaces a lock it cannot read: it tries again, then refuses. (A file that reads
whole but is no lock of labrun's is replaced, through the gate below.)

Taking over, so that no loser can disturb the winner: the lock file is never absent while it is
taken over, and only one process may change a given lock. A claimant that judged the lock with
bytes B stale takes the gate RUN/.lock.take.<digest of B>.0, created exclusively (like the lock
itself: a unique file, then link(2)) with its own lock as content. Whoever holds that gate is the
only process that may replace or remove that lock: it reads .lock again, and if it still is B
renames the gate over .lock (rename(2) replaces atomically: readers see B, then the new lock,
never nothing); if it is not B any more (another claimant won meanwhile) it removes its gate and
judges again from fresh data. The holder itself removes its lock at release through the same
gate (created as a hard link to the lock, whose content is the holder's own), so B can only
change through the gate's holder. The gate of a lock that no longer exists
can be taken by a late claimant, which then only finds .lock changed. A claimant that crashed
holding a gate leaves it behind: when the gate's own process is judged gone by the rules above
(PID, SLURM job, the gate's mtime; not the requeue rule, which would pass a live releaser), the
next claimant takes the next level (.lock.take.<digest>.1, ...), and the winner removes the
levels below its own. Limit: a holder of a gate judged gone wrongly (a process on another host
frozen for STALE_AFTER_S between two system calls) could still rename its gate over a newer lock.

Why not flufl.lock, which implements the same link(2) and link-count creation: its lock file's
content is the claim file's name, where labrun's .lock is JSON that status, monitor targets and
rerun read (read_holder); it keeps that claim file linked beside the lock for the lock's life and
tests ownership by a link count of 2; its lifetime is an mtime set into the future, where
labrun's heartbeat is the mtime of the last beat; lock() breaks a lock only when that lifetime
has passed (its `state` reports a dead PID on the same host, but nothing acts on it: no PID start
time, no zombie, no SLURM job, no requeue); and breaking a lock unlinks it after a read, which
its own comment says "reduces but does not eliminate" the race in which a breaker with old data
removes a fresh winner's lock -- the race this module must exclude. Its creation step is seven
lines (_create below); the take-over, the staleness policy and the flaky-read handling labrun
needs are none of it, so it is not a dependency.

What it relies on, on NFS (lab output roots are NFS): fcntl/flock are not used, since their
NFS behaviour depends on the lock daemon and mount options. It relies on
  - link(2) being atomic on the server: the lock (and a gate) is created by writing a file with
    a unique name, then hard-linking it to .lock (fails with EEXIST when it exists). A lost
    reply to a retried link is detected as open(2)'s man page describes: the unique file's link
    count is 2. The content is complete before the name exists, so no reader sees half a lock;
  - rename(2) being atomic, replacing the target: a take-over renames the gate over .lock;
  - close-to-open consistency: every check opens and reads the file (a stat alone could be
    answered from the client's attribute cache, seconds old);
  - clocks of the nodes agreeing to well within STALE_AFTER_S (NTP), for the heartbeat.
NFS itself could not be tested here; the tests run on a local file system.
Limits: the check runs before each write, so between a check and its write (microseconds; for a
checkpoint the check is made after torch.save, right before the rename) a displaced holder can
still complete one write. Log lines (train.log) of a displaced holder may appear until its
next write check. Hosts are told apart by hostname: two containers with one hostname and
separate PID namespaces would see each other's PIDs as gone.

The lock file's content, the judging of its holder (the staleness policy above) and whether a
live process holds a folder (live_holder) are runs/lock_holder.py's, which never calls back
here; this module takes, keeps and gives back the lock. Callers import each name from its own.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path

from labrun.core import environment
from labrun.core.errors import LabrunError
from labrun.runs.lock_holder import (
    STALE_AFTER_S,
    Holder,
    busy_message,
    gone_reason,
    launch_id,
    look,
    me,
    read_holder,
    stale_reason,
)

log = logging.getLogger(__name__)

TOKEN_ENV = "LABRUN_RUN_LOCK"  # "TOKEN PATH": the right to write in PATH, for child processes
HEARTBEAT_S = 30.0
# A rank other than 0 waits this long for its rank 0 to take the lock (its start-up and a
# take-over fit in it with room).
FOLLOW_TIMEOUT_S = 300
# Rounds of acquire's loop: each looks at the lock once and either takes it, refuses, or waits
# out another claimant's take-over or an unreadable lock; with the back-off below, about 10 s.
TAKE_TRIES = 20
# Levels of a take-over's gate: each further level is taken only when the claimant that holds
# the level below crashed in its microseconds there, so more than one is already rare.
GATE_LEVELS = 4


class RunLocked(LabrunError):
    """Another process trains in the run folder; the message names it."""


class LockLost(LabrunError):
    """This process held the run folder's lock and another took it over."""


def _backoff(attempt: int, cap: float) -> float:
    """The wait before retry `attempt` (0, 1, ...): doubling from 1 ms up to `cap`, with jitter
    so that claimants that collided do not collide again in step."""
    return min(cap, 0.001 * 2 ** attempt) * random.uniform(0.5, 1.5)


# -- taking, checking, giving back ---------------------------------------------------------------

_held: dict[str, RunLock] = {}
# Lock file -> time.monotonic() when this process last read its own token there: how long a
# lock that cannot be read has been so (an inherited lock's children keep their own).
_confirmed: dict[str, float] = {}


def _key(path: str | Path) -> str:
    return os.path.abspath(path)


def _token_for(path: str | Path) -> str | None:
    """This process's token for lock file `path`: its own, or one inherited from its parent."""
    key = _key(path)
    if key in _held:
        return _held[key].holder.token
    token, _, path = os.environ.get(TOKEN_ENV, "").partition(" ")
    return token if token and path == key else None


def _create(path: Path, holder: Holder) -> bool:
    """Create `path` with `holder` as content, atomically and exclusively (see the docstring)."""
    unique = path.with_name(f"{path.name}.{holder.host}.{holder.pid}.{holder.token}")
    fd = os.open(unique, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, (json.dumps(asdict(holder)) + "\n").encode())
        os.fsync(fd)  # after a crash, no name holds an empty file (a gate could not be judged)
    finally:
        os.close(fd)
    try:
        os.link(unique, path)
        return True
    except FileExistsError:
        return os.stat(unique).st_nlink == 2  # a retried link whose first reply was lost
    finally:
        unique.unlink(missing_ok=True)


def _through_gate(path: Path, key: str, mine: Holder, replace: bool) -> bool | Holder:
    """Replace lock file `path` by `mine` (replace=False: remove it) if it still is the lock
    read with digest `key`, through that lock's gate (the module docstring). True: done; False:
    the lock is another one now (judge it again); a Holder: that process is taking it over."""
    for level in range(GATE_LEVELS):
        gate = path.with_name(f"{path.name}.take.{key}.{level}")
        there = look(gate)  # a look first: creating writes and syncs a file
        if there.gone:
            if _open_gate(gate, path, mine, replace):
                break
            there = look(gate)
        if there.holder is None:
            return False  # renamed over the lock or given up just now: the lock changed
        if there.holder.token == mine.token:
            break  # this process's own: a retried link whose first reply was lost
        # Whether the gate's process still runs, not the requeue rule: a live holder that is
        # releasing its lock, or a live claimant, is never passed.
        if gone_reason(there.holder, gate, mine.host) is None:
            return there.holder
        # Its holder crashed while it held the gate: the next level decides who goes on.
    else:
        return False
    done = False
    try:
        # Read again now that no one else can change this lock: the judgement was made from
        # data read before, and a winner may have replaced the lock since.
        if look(path).key != key:
            return False
        if replace:
            try:
                os.rename(gate, path)  # atomic: readers see the old lock, then this one
            except FileNotFoundError:  # NFS: a retried rename whose first reply was lost
                if getattr(read_holder(path), "token", None) != mine.token:
                    raise
        else:
            os.unlink(path)
        done = True
    finally:
        if not (done and replace):
            gate.unlink(missing_ok=True)
    for below in range(level):  # left by crashed claimants; the lock they guard is gone
        path.with_name(f"{path.name}.take.{key}.{below}").unlink(missing_ok=True)
    return True


def _open_gate(gate: Path, path: Path, mine: Holder, replace: bool) -> bool:
    """Create `gate` exclusively: for a take-over with `mine` as content (it becomes the lock);
    for a release as a hard link to the lock itself, whose content is the releaser's already
    (nothing to write; if the lock changed just before, the check after finds it changed)."""
    if replace:
        return _create(gate, mine)
    try:
        os.link(path, gate)
    except (FileExistsError, FileNotFoundError):  # taken by a claimant; or no lock to remove
        return False
    try:
        os.utime(gate)  # a fresh mtime: another host judges a gate's holder by it
    except OSError:
        pass  # a hiccup: the lock's last heartbeat, which it keeps, is recent enough
    return True


class RunLock:
    """The lock this process holds on one run folder (`acquire` makes it)."""

    def __init__(self, path: Path, holder: Holder):
        self.path, self.holder = path, holder
        self.lost: str | None = None  # why the heartbeat gave the lock up ("to PID ...")
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="labrun-run-lock",
                                      daemon=True)

    def _heartbeat(self) -> None:
        wait, failures = HEARTBEAT_S, 0
        while not self._stop.wait(wait):
            state, why = _ownership(self.path, self.holder.token)
            if state == "mine":
                wait, failures = HEARTBEAT_S, 0
                try:
                    os.utime(self.path)
                except OSError:
                    pass  # a server hiccup: the next beat tries again
                continue
            if state == "unreadable":
                if failures == 0:
                    log.warning("%s: cannot read the lock file (%s); trying again", self.path,
                                why)
                # Sooner than a beat at first: a hiccup usually passes within a second.
                wait, failures = _backoff(failures + 7, HEARTBEAT_S), failures + 1
                continue
            self.lost = why  # taken over, removed, or unreadable too long: the next write
            return           # check stops the run

    def release(self) -> None:
        """Give the folder back (only if the lock is still this process's)."""
        self._stop.set()
        _held.pop(_key(self.path), None)
        _confirmed.pop(_key(self.path), None)
        if os.environ.get(TOKEN_ENV, "").startswith(self.holder.token + " "):
            os.environ.pop(TOKEN_ENV, None)
        seen = look(self.path)
        if seen.holder is not None and seen.holder.token == self.holder.token:
            # Through the gate: a claimant that judged this lock stale may be replacing it.
            _through_gate(self.path, seen.key, self.holder, replace=False)


def _ownership(path: str | Path, token: str) -> tuple[str, str]:
    """One read of lock file `path` by the process with `token`: ("mine", ""), ("lost", how)
    or ("unreadable", what went wrong) while that may still pass."""
    key = _key(path)
    seen = look(path)
    now = time.monotonic()
    if seen.holder is not None and seen.holder.token == token:
        _confirmed[key] = now
        return "mine", ""
    if seen.holder is not None:
        return "lost", f"to {seen.holder.who()}"
    if seen.gone:
        return "lost", "(its lock file is gone)"
    # An error, or bytes that are no whole lock (a short read): the file server's hiccup, as
    # long as it passes before another host may judge the lock stale by its heartbeat.
    unreadable_s = now - _confirmed.setdefault(key, now)
    if unreadable_s > STALE_AFTER_S / 2:
        return "lost", (f"(its lock file could not be read for {unreadable_s:.0f} s, and another "
                        f"host may take it over after {STALE_AFTER_S:.0f} s)")
    return "unreadable", str(seen.error) if seen.error else "not a whole lock file"


def _take(path: Path, mine: Holder) -> None:
    """Make `mine` the holder of lock file `path`, taking a stale lock over; raise RunLocked
    when a live process holds it (or it cannot be read, or others keep taking it)."""
    problem = (f"{path.parent}: could not take the lock ({path}) in {TAKE_TRIES} tries; other "
               f"processes keep taking it: stop them")
    for attempt in range(TAKE_TRIES):
        if attempt:
            time.sleep(_backoff(attempt, 1.0))
        seen = look(path)
        if seen.gone:
            if _create(path, mine):
                return
            continue  # another process created it first: judge that one
        if seen.error is not None:
            # Who holds it cannot be told: never replace a lock that may be a live holder's.
            problem = (f"{path.parent}: its lock file {path} cannot be read ({seen.error}); try "
                       f"again when the file system answers")
            continue
        if seen.holder is not None:
            why = stale_reason(seen.holder, path, mine)
            if why is None:
                raise RunLocked(busy_message(path, seen.holder))
            news = f"{path.parent}: taking over from {seen.holder.who()}: {why}"
        else:
            news = f"{path}: replacing an unreadable lock file"  # no lock of labrun's
        outcome = _through_gate(path, seen.key, mine, replace=True)
        if outcome is True:
            log.warning("%s", news)  # only the one that took it over says so
            return
        if isinstance(outcome, Holder):  # another claimant is replacing it: look again
            problem = (f"{path.parent} is being taken over by {outcome.who()}; wait for it, or "
                       f"stop it first")
    raise RunLocked(problem)


def acquire(path: str | Path) -> RunLock | None:
    """Take lock file `path` (RunDir.lock_path) for this process; None when this process (or its
    parent) holds it already. Raises RunLocked, naming the holder, when another process trains
    in the folder."""
    path = Path(_key(path))
    token = _token_for(path)
    found = read_holder(path)
    if token is not None and found is not None and found.token == token:
        return None
    mine = me()
    if found is not None and stale_reason(found, path, mine) is None:
        # Refused without creating anything in the folder (not even the unique file).
        raise RunLocked(busy_message(path, found))
    path.parent.mkdir(parents=True, exist_ok=True)
    _take(path, mine)
    lock = RunLock(path, mine)
    _held[_key(path)] = lock
    _confirmed[_key(path)] = time.monotonic()
    os.environ[TOKEN_ENV] = f"{mine.token} {path}"
    lock._beat.start()
    atexit.register(lock.release)
    return lock


def follow(path: str | Path, timeout: float = FOLLOW_TIMEOUT_S) -> None:
    """For a rank other than 0: wait until rank 0 of this launch holds lock file `path`; raise
    RunLocked when another process holds it past `timeout` (rank 0 was refused)."""
    if _token_for(path) is not None:
        return  # a child of the holder
    launch = launch_id()
    deadline = time.monotonic() + timeout
    while True:
        holder = read_holder(path)
        if holder is not None and launch is not None and holder.launch == launch:
            return
        if time.monotonic() > deadline:
            if holder is None:
                raise RunLocked(f"{Path(path).parent}: rank 0 of this launch did not take the "
                                f"run folder's lock within {timeout:.0f} s; see rank 0's log")
            raise RunLocked(busy_message(path, holder))
        time.sleep(0.5)


def global_rank() -> int:
    """This process's global rank as torchrun or srun set it (core.environment, as
    train.distributed reads it)."""
    return environment.read().rank


def claim(path: str | Path, rank: int | None = None) -> RunLock | None:
    """What each rank does before writing in the run folder of lock file `path`: rank 0 takes
    the lock, the others follow it. Returns the lock when this call took it (the caller
    releases it; an exit releases it too)."""
    if (global_rank() if rank is None else rank) == 0:
        return acquire(path)
    follow(path)
    return None


def ensure_owner(path: str | Path) -> None:
    """Before a write into the run folder of lock file `path`: raise LockLost if this process
    held the lock and another process took it over (or it was removed, or could not be read
    for STALE_AFTER_S / 2). A lock that cannot be read now is read again with back-off: the
    write waits for the file system. A process that holds no lock there (a tool writing to a
    finished run, a test) is not checked."""
    token = _token_for(path)
    if token is None:
        return
    lock = _held.get(_key(path))
    how = lock.lost if lock is not None else None
    attempt = 0
    while how is None:
        state, why = _ownership(path, token)
        if state == "mine":
            return
        if state == "lost":
            how = why
            break
        if attempt == 0:
            log.warning("%s: cannot read the lock file (%s); waiting for it before writing",
                        path, why)
        time.sleep(_backoff(attempt + 5, HEARTBEAT_S))
        attempt += 1
    if lock is not None:
        lock.lost = lock.lost or how
        lock._stop.set()
    raise LockLost(f"{Path(path).parent}: this process lost the run folder {how}; stopped "
                   f"without writing")
