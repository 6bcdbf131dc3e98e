"""`labrun cancel SWEEP_DIR`: stop a sweep's waiting and running jobs from any terminal, and
record it in jobs.json. Nothing else cancels a sweep's jobs but Ctrl-C in the terminal of a
launcher that waits for them: SIGHUP (the terminal gone) never does.

A cancelled job stops as a preempted one does (SIGTERM: it saves a checkpoint); its row in
jobs.json gets `cancelled_at`, `labrun status` shows it as cancelled, and running the sweep's
command again submits it again (it resumes from that checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from labrun.core import scheduler
from labrun.core.scheduler import LIVE_STATES, LocalScheduler
from labrun.runs import lock as run_lock
from labrun.runs.sweepdir import ENDED, Job, SweepDir

log = logging.getLogger(__name__)


def stop(job: Job) -> None:
    """SIGTERM to a local job: to its controller, which passes it on (submitit's own cancel
    sends SIGINT, on which the controller kills the job a second later, too soon for a
    checkpoint), or, where the controller is gone, to the process holding its run folder."""
    if LocalScheduler().job_alive(job.job_id or ""):
        LocalScheduler().cancel([job.job_id])
        return
    holder = run_lock.live_holder(job.run_dir.lock_path)
    if holder is not None and holder.pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGTERM)


def not_ended(backend: str, scheduler_path: str | None, jobs: list[Job]) -> list[Job]:
    """The jobs that wait or run now: their scheduler says so, or their run folder's lock."""
    candidates = [job for job in jobs if job.job_id
                  and job.run_dir.read_summary().get("status") not in ENDED]
    states = scheduler.named(backend, scheduler_path).job_states(
        [job.job_id for job in candidates]) if candidates else {}
    return [job for job in candidates if states.get(job.job_id) in LIVE_STATES
            or run_lock.live_holder(job.run_dir.lock_path) is not None]


def cancel(sweep_dir: Path) -> list[Job]:
    """Cancel the sweep's jobs that have not ended, a detached study's controller first (it
    would submit more trials); return the jobs cancelled (recorded in jobs.json)."""
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
        for job in live:
            stop(job)
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
