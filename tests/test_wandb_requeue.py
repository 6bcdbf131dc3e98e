"""W&B history without holes across a SLURM requeue (needs the test cluster: `make test` as
root starts it). A one-job sweep logging to W&B offline is preempted (USR2, as in
test_cluster_slurm.py), requeued and resumed; all its offline segments, read back with
`wandb leet inspect`, hold every step of metrics.jsonl exactly once with the same values."""

from __future__ import annotations

import os
import subprocess

import pytest
from test_cluster_slurm import (  # noqa: F401 - slurm: the fixture fails without a cluster
    requeue_with_usr2,
    slurm,
    sweep_args,
)
from test_tracking import OFFLINE
from test_wandb_history import WANDB_RUN, history_problems

from conftest import PROJECT

pytestmark = pytest.mark.slurm


def test_a_requeued_job_resumes_into_a_whole_wandb_history(tmp_path):
    # A one-value sweep: one job, 0/. max_epochs=3: time for the USR2 to land mid-training.
    overrides = [*WANDB_RUN, "trainer.max_epochs=3", "+variant=preempted"]
    # The job inherits the submitting environment (submitit's sbatch): W&B offline there too.
    proc = subprocess.Popen(sweep_args(tmp_path, *overrides), cwd=PROJECT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, **OFFLINE})
    requeue_with_usr2(tmp_path, proc, job=0)
    assert history_problems(tmp_path / "0") == []
