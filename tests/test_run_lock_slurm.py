"""The run folder's lock and SLURM, on the test cluster (scripts/slurm_up.sh): a lock whose
holder is on another host is judged by its SLURM job, asked with squeue. A real job stands in
for the holder's (`sleep` on partition dev); the lock file names it and a host that is not this
one, as a rank 0 on a compute node would have written it."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict

import pytest

# The cluster's own check: without a cluster these tests fail, they never skip silently.
from test_cluster_slurm import slurm  # noqa: F401
from test_run_lock import no_inherited_lock  # noqa: F401 - autouse: holds nothing, no SLURM job

from labrun.core.scheduler import ACTIVE_STATES
from labrun.runs import lock, lock_holder
from labrun.runs.rundir import RunDir

pytestmark = pytest.mark.slurm


def job_state(job_id: str) -> str:
    """squeue's state of the job; "" once the controller no longer lists it."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                         text=True, timeout=30)
    return out.stdout.strip() if out.returncode == 0 else ""


def wait_for_state(job_id: str, done, what: str) -> str:
    # 120 s: the test cluster starts and ends a job within seconds; only a broken one waits.
    deadline = time.monotonic() + 120
    while not done(state := job_state(job_id)):
        assert time.monotonic() < deadline, f"SLURM job {job_id} {what}: still {state!r}"
        time.sleep(0.5)
    return state


def test_a_foreign_hosts_lock_is_kept_while_its_slurm_job_runs_and_taken_once_cancelled(
        tmp_path, caplog):
    job_id = subprocess.run(["sbatch", "--parsable", "-p", "dev", "-t", "10", "-J",
                             "labrun-lock-holder", "--wrap", "sleep 300"], capture_output=True,
                            text=True, check=True, timeout=30).stdout.strip().split(";")[0]
    try:
        wait_for_state(job_id, lambda state: state == "RUNNING", "did not start")
        path = RunDir(tmp_path / "run").lock_path
        path.parent.mkdir(parents=True)
        holder = lock_holder.Holder(host="node-elsewhere", pid=os.getpid(), pid_start=None,
                                    job_id=job_id, restart=0, launch=f"slurm:{job_id}:0",
                                    started_at=time.time(), token="theirs")
        path.write_text(json.dumps(asdict(holder)))
        # A heartbeat far older than STALE_AFTER_S: only SLURM's answer keeps the lock.
        old = time.time() - lock_holder.STALE_AFTER_S - 600
        os.utime(path, (old, old))
        with pytest.raises(lock.RunLocked, match=rf"PID {os.getpid()} on node-elsewhere "
                                                 rf"\(SLURM job {job_id}\)"):
            lock.acquire(path)
        assert json.loads(path.read_text())["token"] == "theirs"  # untouched

        subprocess.run(["scancel", job_id], check=True, timeout=30)
        wait_for_state(job_id, lambda state: state not in ACTIVE_STATES, "did not end")
        os.utime(path)  # a fresh heartbeat: only SLURM's answer makes the lock stale
        with caplog.at_level("WARNING", logger="labrun.runs.lock"):
            assert lock.acquire(path) is not None
        assert json.loads(path.read_text())["pid"] == os.getpid()
        assert json.loads(path.read_text())["host"] != "node-elsewhere"
        assert [r.getMessage() for r in caplog.records] == [
            f"{path.parent}: taking over from PID {os.getpid()} on node-elsewhere (SLURM job "
            f"{job_id}): SLURM job {job_id} is no longer running"]
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
