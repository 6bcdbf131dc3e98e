"""What labrun's launchers share on the Hydra side: planning a sweep's jobs (skipping those
already completed with the same config) and handing each job's outcome back to Hydra.

The sweep folder itself (jobs.json, each job's result, the final table) belongs to
labrun.runs.sweepdir.
"""

from __future__ import annotations

import os
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict

from labrun.config import validation
from labrun.core.errors import LabrunError
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job


class JobFailed(LabrunError):
    """A sweep job did not complete; the message names the job, its error and its log."""


def plan(hydra_context: HydraContext, master: DictConfig,
         job_overrides: list[list[str]] | tuple, initial_job_idx: int) -> list[Job]:
    """One Job per override list, in the sweep folder; jobs that already completed with the
    same config are marked skipped (a re-run sweep finishes only what is left)."""
    jobs = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = hydra_context.config_loader.load_sweep_config(master, list(overrides))
        # Each job's own monitor (a sweep may vary it), before any job is submitted: a typo
        # would otherwise train every job to the end for nothing.
        validation.check_checkpoint_monitor(cfg)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        job_dir = Path(str(master.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        job = Job(num=num, overrides=list(overrides), dir=str(job_dir.resolve()), config=cfg)
        if completed_with_same_config(job_dir, cfg):
            job.state = "skipped"
        jobs.append(job)
    return jobs


def job_dir(config: DictConfig) -> Path:
    """A job's run folder, as run_job will make it (hydra.sweep.dir / hydra.sweep.subdir), for
    taking its lock before run_job writes there."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(config)  # as run_job does first: ${hydra:...} resolves
    return Path(os.path.abspath(os.path.join(str(config.hydra.sweep.dir),
                                             str(config.hydra.sweep.subdir))))


def completed_with_same_config(job_dir: Path, cfg: DictConfig) -> bool:
    run_dir = RunDir(job_dir)
    if not (run_dir.summary_path.is_file() and run_dir.config_path.is_file()):
        return False
    if run_dir.read_summary().get("status") != "completed":
        return False
    current = OmegaConf.to_container(cfg, resolve=False)
    current.pop("hydra", None)
    return OmegaConf.to_container(run_dir.saved_config_node(), resolve=False) == current


def job_return(job: Job) -> JobReturn:
    """The JobReturn Hydra's sweepers expect: the objective, or the failure."""
    ret = JobReturn(overrides=job.overrides, cfg=job.config, working_dir=job.dir,
                    task_name="train")
    if job.state in ("completed", "skipped", "pruned"):  # a pruned trial ended as planned
        ret.status, ret.return_value = JobStatus.COMPLETED, job.metric
    else:
        ret.status = JobStatus.FAILED
        ret.return_value = JobFailed(f"job {job.num} {job.state}: {job.error or 'no error recorded'}"
                                     f"; log: {job.log or job.dir}")
    return ret
