"""Who holds a run folder's lock, and whether that holder still trains, read and never written:
the lock file's content (Holder; `me`, this process as one), one read of it (look), the
staleness policy a claimant judges a holder by (stale_reason, gone_reason: its process, the job
of the scheduler it names, its heartbeat), and the one answer to "does a live process hold
this folder" (live_holder), which `labrun status`, cancel, gc, eval, resume, the monitor's
targets and the launchers ask. Taking, keeping and giving back the lock, and the protocol on a
shared file system, are runs/lock.py's: it calls into this module, never the reverse."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from labrun.core import environment, scheduler
from labrun.core.errors import LabrunError

# 10 minutes without a heartbeat: 20 missed beats, far above an NFS server's hiccup or clock
# skew between NTP-synchronised nodes, short enough next to a requeue's wait.
STALE_AFTER_S = 600.0
# Whose job a holder written before holders named their scheduler is: SLURM's, the scheduler
# such a holder was judged by then, and still is (a job running through the upgrade keeps its
# folder).
UNNAMED_SCHEDULER = "slurm"


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    pid_start: int | None  # /proc/PID/stat start time (ticks since boot); None: unknown
    job_id: str | None  # its scheduler's job (SLURM_JOB_ID)
    restart: int  # its scheduler's requeues of the job (SLURM_RESTART_COUNT)
    launch: str | None  # what the ranks of one launch share (see launch_id)
    started_at: float
    token: str
    # The scheduler whose job it is ("slurm"; core.scheduler.named); None: none's, or a holder
    # written before holders named it.
    scheduler: str | None = None

    def who(self) -> str:
        job = f" (SLURM job {self.job_id}" + (f", restart {self.restart})" if self.restart
                                               else ")") if self.job_id else ""
        return f"PID {self.pid} on {self.host}{job}"

    def since(self) -> str:
        at = time.localtime(self.started_at)
        same_day = time.strftime("%Y-%m-%d", at) == time.strftime("%Y-%m-%d")
        return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", at)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The process's state letter and start time in clock ticks since boot (fields 3 and 22 of
    /proc/PID/stat); None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
        return after_name[0], int(after_name[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def launch_id() -> str | None:
    """What the processes of one launch share: the scheduler's job id and restart count, or
    torchrun's rendezvous; None for a process started alone (core.environment)."""
    return environment.read().launch_id


def me() -> Holder:
    here = environment.read()
    return Holder(host=socket.gethostname(), pid=os.getpid(), pid_start=pid_start(os.getpid()),
                  job_id=here.job_id, restart=here.restart_count, launch=here.launch_id,
                  started_at=time.time(), token=secrets.token_hex(8), scheduler=here.scheduler)


@dataclass(frozen=True)
class Seen:
    """What one read of a lock file found: a holder, bytes that are no lock (`junk`), an error
    that may pass (`error`: the file server's hiccup), or none of these (no such file)."""
    holder: Holder | None = None
    junk: bytes | None = None
    error: OSError | None = None
    key: str | None = None  # a digest of the bytes read: which lock this is, for the gate

    @property
    def gone(self) -> bool:
        return self.holder is None and self.junk is None and self.error is None


def look(path: str | Path) -> Seen:
    try:
        with open(path, "rb") as f:  # open + read: fresh data on NFS (close-to-open)
            raw = f.read()
    except FileNotFoundError:
        return Seen()
    except OSError as error:  # EIO, ESTALE, a timed-out soft mount...: may pass
        return Seen(error=error)
    key = hashlib.sha256(raw).hexdigest()[:16]
    try:
        data = json.loads(raw)
        # Keys a later labrun adds are ignored; a file without these keys is no lock (one
        # without a key added since, written by an earlier labrun, takes its default).
        return Seen(holder=Holder(**{f.name: data[f.name] for f in fields(Holder)
                                     if f.name in data or f.default is MISSING}), key=key)
    except (ValueError, TypeError, KeyError):
        return Seen(junk=raw, key=key)


def read_holder(path: str | Path) -> Holder | None:
    """Who holds the lock file `path` now (None: nobody, a file that is no lock, or one that
    cannot be read now)."""
    return look(path).holder


def live_holder(path: str | Path, claimant: Holder | None = None) -> Holder | None:
    """The holder of lock file `path` while it still trains (its process alive on this host,
    its scheduler's job running elsewhere); None when nobody holds it or the holder is gone.
    With `claimant`, judged as that process would judge it before taking the folder
    (stale_reason: a later attempt of the holder's own job does not see it live)."""
    holder = read_holder(path)
    if holder is None:
        return None
    why = (gone_reason(holder, path, socket.gethostname()) if claimant is None
           else stale_reason(holder, path, claimant))
    return holder if why is None else None


def busy_message(path: str | Path, holder: Holder) -> str:
    return (f"{Path(path).parent} is being trained by {holder.who()} since {holder.since()}; wait for it, "
            f"or stop it first")



# -- judging a holder --------------------------------------------------------------------------


def job_alive(holder: Holder) -> bool | None:
    """Whether the holder's job may still have processes running, asked of the scheduler that
    ran it (the one it names); None: that scheduler cannot tell, or this process does not
    know it. (SLURM answers within 15 s: judging a lock waits no longer for the controller.)"""
    try:
        ran_it = scheduler.named(holder.scheduler or UNNAMED_SCHEDULER)
    except LabrunError:
        return None
    return ran_it.job_alive(holder.job_id)


def stale_reason(holder: Holder, path: str | Path, mine: Holder) -> str | None:
    """Why `holder` no longer trains (or must give way to `mine`); None: it is live."""
    if holder.job_id and holder.job_id == mine.job_id and mine.restart > holder.restart:
        return (f"SLURM job {holder.job_id} was requeued (restart {mine.restart} > "
                f"{holder.restart})")
    return gone_reason(holder, path, mine.host)


def gone_reason(holder: Holder, path: str | Path, host: str) -> str | None:
    """Why the process `holder` no longer runs, as seen from `host`, with `path`'s mtime as its
    heartbeat; None: it may still run."""
    if holder.host == host:
        stat = _proc_stat(holder.pid)
        if stat is None or (holder.pid_start is not None and stat[1] != holder.pid_start):
            return f"PID {holder.pid} is gone"
        if stat[0] in ("Z", "X"):  # exited; its parent has not reaped it yet
            return f"PID {holder.pid} is gone (exited, not yet reaped)"
        return None
    if holder.job_id:
        active = job_alive(holder)
        if active is not None:
            return None if active else f"SLURM job {holder.job_id} is no longer running"
    try:
        age = time.time() - Path(path).stat().st_mtime
    except OSError:
        return None  # gone meanwhile: the next attempt creates it
    if age > STALE_AFTER_S:
        return f"no heartbeat for {age / 60:.0f} min"
    return None
