"""W&B history without holes across a SLURM requeue (needs the test cluster: `make test` as
root starts it). A one-job sweep logging to W&B offline is preempted (USR2, as in
test_cluster_slurm.py), requeued and resumed; all its offline segments, read back with
`wandb leet inspect`, hold every step of metrics.jsonl exactly once with the same values."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_cluster_slurm import slurm, sweep_args  # noqa: F401 - the fixture fails without a cluster
from test_tracking import OFFLINE
from test_wandb_history import WANDB_RUN, history_problems

from conftest import PROJECT, manifest, wait_for

pytestmark = pytest.mark.slurm


def test_a_requeued_job_resumes_into_a_whole_wandb_history(tmp_path):
    # A one-value sweep: one job, 0/. max_epochs=3: time for the USR2 to land mid-training.
    overrides = [*WANDB_RUN, "trainer.max_epochs=3", "+variant=preempted"]
    # The job inherits the submitting environment (submitit's sbatch): W&B offline there too.
    proc = subprocess.Popen(sweep_args(tmp_path, *overrides), cwd=PROJECT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **OFFLINE})
    # 180 s: submission, start-up and 10 steps, under a minute on a loaded machine, 3x that.
    wait_for(tmp_path / "0" / "checkpoints" / "step-00000010.pt", proc, timeout=180)
    job_id = manifest(tmp_path)["jobs"][0]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    # 300 s: the requeued job starts again and finishes three epochs, with room for load.
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    log = Path(manifest(tmp_path)["jobs"][0]["log"]).read_text()
    assert "SIGUSR2" in log and "resuming from" in log  # it was requeued, then resumed
    assert history_problems(tmp_path / "0") == []
