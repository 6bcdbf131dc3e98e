"""`labrun status SWEEP_DIR`: each job of a sweep, its state and its metric, now.

Works for detached SLURM sweeps (`cluster.detach=true`) and for local ones: the job list comes
from the sweep's jobs.json, the state from each job's own summary.json, and, for SLURM jobs
that have not written a result yet, from sacct.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from labrun.runs.sweepdir import ENDED, SweepDir, print_table, read_result


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """SLURM's state of each job id (array elements as 12_3), from sacct."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                         capture_output=True, text=True, timeout=60)
    states = {}
    for line in out.stdout.splitlines():
        job_id, _, state = line.partition("|")
        states[job_id] = state.split()[0] if state else "UNKNOWN"
    return states


def show(sweep_dir: Path) -> None:
    """Print the table of the sweep's jobs as they are now."""
    manifest = SweepDir(sweep_dir).read_jobs()
    jobs = manifest["jobs"]
    scheduler = {}
    if manifest["backend"] == "slurm":
        scheduler = slurm_states([job.job_id for job in jobs if job.job_id])
    for job in jobs:
        summary = job.run_dir.read_summary()
        slurm = scheduler.get(job.job_id or "", "").lower()
        if summary.get("status") in ENDED:  # pruned included: an Optuna search stopped it
            read_result(job)
        elif summary.get("status") == "running" and slurm in ("", "running", "requeued"):
            job.state = "running"  # its summary says so, and SLURM does not contradict it
            job.metric = summary.get(f"best/{summary.get('monitor', 'val/acc')}")
        elif slurm:
            job.state = slurm  # pending, or ended without a result (failed, cancelled, timeout)
        if summary.get("requeued"):  # preempted or its node failed, then resumed
            job.state = f"{job.state} (requeued {summary['requeued']}x)"
    print_table(jobs, f"sweep {sweep_dir.resolve()} ({manifest['backend']})")
