"""What a sweep's submitter holds per job (issue 54): a held 5,000-job grid peaked at 2 GB
resident, every job's composed config (about 200 kB) kept until all were submitted, and torch
imported (650 MB) by a task's config check. In this process, without SLURM: the launcher's
launch() of a grid with its submission (begin) left out, judged by tracemalloc's peak against
the size of one composed config, and no clock."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tracemalloc

import pytest

from conftest import sweep_in_process
from labrun.launch.slurm import SlurmLauncher

# A job's overrides hold the command line's (Hydra's sweeper gives each job all of them).
COMMAND = ["cluster=lab", "cluster.detach=true", "cluster.snapshot=false", "logger=csv"]


@pytest.fixture
def hydra_parts(tmp_path):
    with sweep_in_process(tmp_path, *COMMAND) as parts:
        yield parts


def traced_peak(context, master, jobs: int) -> int:
    """tracemalloc's peak while a detached grid of `jobs` seeds is planned and returned, its
    submission left out (the jobs as begin() gets them, and Hydra's returns, kept)."""
    launcher = SlurmLauncher()
    launcher.setup(hydra_context=context, task_function=None, config=master)
    launcher.composer([*COMMAND, f"seed={jobs}"])  # the composer's caches, outside the figure
    tracemalloc.start()
    try:
        returns = launcher.launch([[*COMMAND, f"seed={seed}"] for seed in range(jobs)], 0)
        assert len(returns) == jobs
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_grid_keeps_far_less_than_a_composed_config_per_job(hydra_parts, monkeypatch):
    context, master = hydra_parts
    monkeypatch.setattr(SlurmLauncher, "begin", lambda self, jobs: None)  # no SLURM
    small, large = 15, 90
    traced_peak(context, master, 2)  # what the first sweep imports (a task's checks), outside
    per_job = (traced_peak(context, master, large) - traced_peak(context, master, small)) / (
        large - small)
    # One composed config, as planning makes each (unpickled from the composition it shares).
    launcher = SlurmLauncher()
    launcher.setup(hydra_context=context, task_function=None, config=master)
    payload = pickle.dumps(launcher.composer([*COMMAND, "seed=0"]))
    tracemalloc.start()
    try:
        config = pickle.loads(payload)
        config_size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del config
    # Before: more than one config a job (each kept live, then pickled too). Now: its pickle
    # (about an eighth of it) and the job's record.
    assert per_job < config_size / 3, (per_job, config_size)
    print(f"kept per job: {per_job:.0f} B; a composed config: {config_size} B")


def test_planning_a_sweep_imports_no_torch(tmp_path):
    """Classification's config check imported torch through labrun.data and fine_tuning for
    every sweep (650 MB resident); now only for a job with folds or fine-tuning keys."""
    script = f"""
import sys
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import HydraContext, RunMode
from labrun.config import schema
from labrun.core.project import LABRUN_CONF
from labrun.launch import sweep
schema.register()
with initialize_config_dir(config_dir=str(LABRUN_CONF), version_base="1.3"):
    hydra = GlobalHydra.instance().hydra
    master = hydra.compose_config("train", overrides=[
        "hydra.mode=MULTIRUN", "cluster=lab", "hydra.sweep.dir={tmp_path}"],
        run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    context = HydraContext(config_loader=hydra.config_loader, callbacks=None)
    jobs = sweep.plan(context, master, [["cluster=lab", "seed=1"],
                                        ["cluster=lab", "seed=2", "dataset=digits"]], 0)
    assert len(jobs) == 2
    assert "torch" not in sys.modules, "torch imported"
    jobs = sweep.plan(context, master, [["cluster=lab", "seed=1", "model.freeze=[head.*]"]], 0)
    assert "torch" in sys.modules, "fine-tuning keys checked without their model"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
