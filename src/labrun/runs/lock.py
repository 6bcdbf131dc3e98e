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
reused PID is not taken for the holder), SLURM job id and restart count, the launch, the
wall-clock start, and the token. A second process is refused in one line naming the holder.
A lock is taken over, with one line saying why, when it is stale:
  - same host: the PID is gone (or is another process now);
  - the holder's SLURM job no longer runs (asked with squeue through labrun.core.probes; where
    SLURM cannot be asked, this is unknown and the heartbeat decides);
  - another host and no SLURM answer: the heartbeat (the lock file's mtime, touched every
    HEARTBEAT_S by a thread of the holder) is older than STALE_AFTER_S;
  - or it is displaced: a requeued SLURM job keeps its job id, so the same job id with a higher
    SLURM_RESTART_COUNT takes the lock from the older attempt, which may still be running on a
    failed node; that attempt stops at its next write check.

What it relies on, on NFS (lab output roots are NFS): fcntl/flock are not used, since their
NFS behaviour depends on the lock daemon and mount options. It relies on
  - link(2) being atomic on the server: the lock is created by writing a file with a unique
    name, then hard-linking it to .lock (fails with EEXIST when it exists). A lost reply to a
    retried link is detected as open(2)'s man page describes: the unique file's link count is
    2. The content is complete before the name exists, so no reader sees half a lock;
  - rename(2) being atomic: a stale lock is moved aside to a unique name, and the mover
    checks it moved the lock it judged stale (else it puts it back);
  - close-to-open consistency: every check opens and reads the file (a stat alone could be
    answered from the client's attribute cache, seconds old);
  - clocks of the nodes agreeing to well within STALE_AFTER_S (NTP), for the heartbeat.
NFS itself could not be tested here; the tests run on a local file system.
Limits: the check runs before each write, so between a check and its write (microseconds; for a
checkpoint the check is made after torch.save, right before the rename) a displaced holder can
still complete one write. Log lines (train.log) of a displaced holder may appear until its
next write check. Hosts are told apart by hostname: two containers with one hostname and
separate PID namespaces would see each other's PIDs as gone.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from labrun.core import probes
from labrun.core.errors import LabrunError

log = logging.getLogger(__name__)

TOKEN_ENV = "LABRUN_RUN_LOCK"  # "TOKEN PATH": the right to write in PATH, for child processes
HEARTBEAT_S = 30.0
# 10 minutes without a heartbeat: 20 missed beats, far above an NFS server's hiccup or clock
# skew between NTP-synchronised nodes, short enough next to a requeue's wait.
STALE_AFTER_S = 600.0
# A rank other than 0 waits this long for its rank 0 to take the lock (its start-up and a
# take-over fit in it with room).
FOLLOW_TIMEOUT_S = 300
# SLURM states in which a job's processes may still be running.
SLURM_ACTIVE = {"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "SIGNALING",
                "RESIZING", "STAGE_OUT"}


class RunLocked(LabrunError):
    """Another process trains in the run folder; the message names it."""


class LockLost(LabrunError):
    """This process held the run folder's lock and another took it over."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_start: int | None  # /proc/PID/stat start time (ticks since boot); None: unknown
    job_id: str | None  # SLURM_JOB_ID
    restart: int  # SLURM_RESTART_COUNT
    launch: str | None  # what the ranks of one launch share (see launch_id)
    started_at: float
    token: str

    def who(self) -> str:
        job = f" (SLURM job {self.job_id}" + (f", restart {self.restart})" if self.restart
                                               else ")") if self.job_id else ""
        return f"PID {self.pid} on {self.host}{job}"

    def since(self) -> str:
        at = time.localtime(self.started_at)
        same_day = time.strftime("%Y-%m-%d", at) == time.strftime("%Y-%m-%d")
        return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", at)


def _pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def launch_id() -> str | None:
    """What the processes of one launch share: SLURM's job id and restart count, or torchrun's
    rendezvous; None for a process started alone."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}:{env.get('SLURM_RESTART_COUNT', '0')}"
    if env.get("TORCHELASTIC_RUN_ID") and env.get("MASTER_PORT"):
        return (f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('MASTER_ADDR', '')}:"
                f"{env['MASTER_PORT']}")
    return None


def me() -> Holder:
    return Holder(host=socket.gethostname(), pid=os.getpid(), pid_start=_pid_start(os.getpid()),
                  job_id=os.environ.get("SLURM_JOB_ID") or None,
                  restart=int(os.environ.get("SLURM_RESTART_COUNT") or 0), launch=launch_id(),
                  started_at=time.time(), token=secrets.token_hex(8))


def read_holder(path: str | Path) -> Holder | None:
    """Who holds the lock file `path` now (None: nobody, or a file that is no lock)."""
    try:
        with open(path) as f:  # open + read: fresh data on NFS (close-to-open)
            data = json.load(f)
        # Keys a later labrun adds are ignored; a file without these keys is no lock.
        return Holder(**{f.name: data[f.name] for f in fields(Holder)})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def busy_message(path: str | Path, holder: Holder) -> str:
    return (f"{Path(path).parent} is being trained by {holder.who()} since {holder.since()}; wait for it, "
            f"or stop it first")


# -- judging a holder --------------------------------------------------------------------------


def slurm_job_active(job_id: str) -> bool | None:
    """Whether SLURM job `job_id` may still have processes running; None: SLURM cannot tell."""
    try:
        rows = probes.slurm_rows("squeue", "-h", "-j", job_id, "-o", "%T", timeout=15)
    except probes.SlurmError as error:
        if error.kind == "failed" and "invalid job id" in str(error).lower():
            return False  # ended long enough ago that the controller forgot it
        return None
    return bool(rows) and rows[0][0] in SLURM_ACTIVE


def stale_reason(holder: Holder, path: str | Path, mine: Holder) -> str | None:
    """Why `holder` no longer trains (or must give way to `mine`); None: it is live."""
    if holder.job_id and holder.job_id == mine.job_id and mine.restart > holder.restart:
        return (f"SLURM job {holder.job_id} was requeued (restart {mine.restart} > "
                f"{holder.restart})")
    if holder.host == mine.host:
        if not os.path.exists(f"/proc/{holder.pid}") or (
                holder.pid_start is not None and _pid_start(holder.pid) not in
                (None, holder.pid_start)):
            return f"PID {holder.pid} is gone"
        return None
    if holder.job_id:
        active = slurm_job_active(holder.job_id)
        if active is not None:
            return None if active else f"SLURM job {holder.job_id} is no longer running"
    try:
        age = time.time() - Path(path).stat().st_mtime
    except OSError:
        return None  # gone meanwhile: the next attempt creates it
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age / 60:.0f} min"
    return None


# -- taking, checking, giving back ---------------------------------------------------------------

_held: dict[str, RunLock] = {}


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
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(unique, path)
        return True
    except FileExistsError:
        return os.stat(unique).st_nlink == 2  # a retried link whose first reply was lost
    finally:
        unique.unlink(missing_ok=True)


def _move_aside(path: Path, judged: Holder, mine: Holder) -> None:
    """Remove the lock `judged` stale, and only that one: rename is atomic, and a lock that
    another process created meanwhile is put back."""
    aside = path.with_name(f"{path.name}.stale.{mine.token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    try:
        moved = json.loads(aside.read_text()).get("token")
    except (OSError, ValueError):
        moved = None
    if moved is not None and moved != judged.token:
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


class RunLock:
    """The lock this process holds on one run folder (`acquire` makes it)."""

    def __init__(self, path: Path, holder: Holder):
        self.path, self.holder = path, holder
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="labrun-run-lock",
                                      daemon=True)

    def owned(self) -> bool:
        found = read_holder(self.path)
        return found is not None and found.token == self.holder.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.owned():
                return  # taken over: the next write check stops the run
            try:
                os.utime(self.path)
            except OSError:
                pass  # a server hiccup: the next beat tries again

    def release(self) -> None:
        """Give the folder back (only if the lock is still this process's)."""
        self._stop.set()
        _held.pop(_key(self.path), None)
        if os.environ.get(TOKEN_ENV, "").startswith(self.holder.token + " "):
            os.environ.pop(TOKEN_ENV, None)
        if self.owned():
            _move_aside(self.path, self.holder, self.holder)


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
    for _ in range(20):  # each round either takes the lock or removes one stale lock
        if _create(path, mine):
            lock = RunLock(path, mine)
            _held[_key(path)] = lock
            os.environ[TOKEN_ENV] = f"{mine.token} {path}"
            lock._beat.start()
            atexit.register(lock.release)
            return lock
        holder = read_holder(path)
        if holder is None:
            if path.exists():  # no lock of labrun's (empty, or not JSON): replaced
                log.warning("%s: replacing an unreadable lock file", path)
                _move_aside(path, Holder("", 0, None, None, 0, None, 0.0, ""), mine)
            continue
        why = stale_reason(holder, path, mine)
        if why is None:
            raise RunLocked(busy_message(path, holder))
        log.warning("%s: taking over from %s: %s", path.parent, holder.who(), why)
        _move_aside(path, holder, mine)
    raise RunLocked(f"{path.parent}: could not take the lock ({path}) in 20 tries; other "
                    f"processes keep taking it: stop them")


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
    """This process's global rank as torchrun or srun set it (train.distributed reads the same
    variables; this room cannot import it, and it needs torch)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return 0


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
    held the lock and another process took it over. A process that holds no lock there (a tool
    writing to a finished run, a test) is not checked."""
    token = _token_for(path)
    if token is None:
        return
    holder = read_holder(path)
    if holder is not None and holder.token == token:
        return
    lock = _held.get(_key(path))
    if lock is not None:
        lock._stop.set()
    taker = f"to {holder.who()}" if holder is not None else "(its lock file is gone)"
    raise LockLost(f"{Path(path).parent}: this process lost the run folder {taker}; stopped "
                   f"without writing")
