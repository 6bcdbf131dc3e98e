"""`labrun cancel SWEEP_DIR|RUN_DIR`: stop a sweep's waiting and running jobs from any terminal,
and record it in jobs.json; a run folder's run likewise (a run sent to a cluster records its
job there too; a run training on this machine gets SIGTERM). Nothing else cancels a sweep's
jobs but Ctrl-C in the terminal of a launcher that waits for them: SIGHUP (the terminal gone)
never does.

A cancelled job stops as a preempted one does (SIGTERM: it saves a checkpoint); its row in
jobs.json gets `cancelled_at`, `labrun status` shows it as cancelled, and running the sweep's
command again submits it again (it resumes from that checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path

from labrun.core import scheduler
from labrun.core.errors import LabrunError
from labrun.core.scheduler import LIVE_STATES, LocalScheduler
from labrun.launch.local import stop_job
from labrun.runs.lock_holder import live_holder
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job, SweepDir, has_ended

log = logging.getLogger(__name__)


def not_ended(backend: str, scheduler_path: str | None, jobs: list[Job]) -> list[Job]:
    """The jobs that wait or run now: their scheduler says so, or their run folder's lock."""
    candidates = [job for job in jobs if job.job_id
                  and not has_ended(job, job.run_dir.read_summary())]
    states = scheduler.named(backend, scheduler_path).job_states(
        [job.job_id for job in candidates]) if candidates else {}
    return [job for job in candidates if states.get(job.job_id) in LIVE_STATES
            or live_holder(job.run_dir.lock_path) is not None]


def cancel(sweep_dir: Path) -> list[Job]:
    """Cancel the sweep's jobs that have not ended, a detached study's controller first (it
    would submit more trials); return the jobs cancelled (recorded in jobs.json). A run
    folder without jobs.json: its run, where it trains on this machine."""
    if not SweepDir(sweep_dir).jobs_path.is_file():
        return cancel_run_here(sweep_dir.resolve())
    sweep = SweepDir(sweep_dir.resolve())
    manifest = sweep.read_jobs()
    backend, jobs = manifest["backend"], manifest["jobs"]
    controller = manifest.get("controller")
    if controller and controller.get("job_id"):
        named = scheduler.named(backend, manifest.get("scheduler"))
        if named.job_states([controller["job_id"]]).get(controller["job_id"]) in LIVE_STATES:
            named.cancel([controller["job_id"]])
            manifest["controller"] = {**controller, "state": "cancelled",
                                      "cancelled_at": time.time()}
            log.info("the study's controller (%s): cancelled", controller["job_id"])
        manifest = {**manifest, "jobs": sweep.read_jobs()["jobs"]}  # what it recorded last
        jobs = manifest["jobs"]
    live = not_ended(backend, manifest.get("scheduler"), jobs)
    if backend == LocalScheduler.name:
        for job in live:  # its controller, or where that is gone the process holding its folder
            stop_job(job)
    elif live:
        scheduler.named(backend, manifest.get("scheduler")).cancel([job.job_id for job in live])
    now = time.time()
    for job in live:
        job.state, job.cancelled_at = "cancelled", now
    extra = {key: value for key, value in manifest.items() if key not in ("backend", "jobs")}
    sweep.write_jobs(backend, live, **extra)  # the other rows are kept as they are
    for job in live:
        log.info("job %d (%s): cancelled", job.num, job.job_id)
    return live


def cancel_run_here(run_dir: Path) -> list[Job]:
    """SIGTERM to the process training `run_dir` on this machine (it saves a checkpoint and
    ends "interrupted"); [] when none does."""
    if not RunDir(run_dir).is_run():
        raise LabrunError(f"{run_dir} is neither a sweep folder (no jobs.json) nor a run folder "
                          f"(no .hydra/ or summary.json); give multirun/DATE/TIME-XXXX or "
                          f"outputs/DATE/TIME-XXXX")
    holder = live_holder(RunDir(run_dir).lock_path)
    if holder is None:
        return []
    if holder.host != socket.gethostname():
        raise LabrunError(f"{run_dir} is trained by {holder.who()}, not on this machine; "
                          f"cancel it there")
    job = Job(num=0, overrides=RunDir(run_dir).try_overrides() or [], dir=str(run_dir),
              job_id=str(holder.pid), state="cancelled", cancelled_at=time.time())
    with contextlib.suppress(ProcessLookupError):
        os.kill(holder.pid, signal.SIGTERM)
    return [job]
