"""What labrun's launchers share: SweepLauncher, the steps every launcher takes with a sweep
(plan the jobs, skipping those already completed with the same config; record them in
jobs.json; poll them; read each job's result from its own run folder; print one table; hand
each outcome back to Hydra), and the steps of a job before it trains (its config, its run
folder's lock). A launcher adds how its jobs start, end and stop: local.LocalLauncher and
slurm.SlurmLauncher.

The sweep folder itself (jobs.json, each job's result, the final table) belongs to
labrun.runs.sweepdir.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from labrun.config import validation
from labrun.core import environment
from labrun.core.errors import LabrunError
from labrun.core.scheduler import Scheduler, path_of
from labrun.runs import lock as run_lock
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job, SweepDir, print_table, read_result


class SweepLauncher(Launcher):
    """A Hydra launcher for labrun's sweeps. A subclass names its `scheduler` (its name is
    jobs.json's backend, and `labrun status` asks it about the jobs later) and implements
    `run`: start the pending jobs and, unless it detaches, wait for them (`poll`)."""

    scheduler: ClassVar[type[Scheduler]]
    POLL_S: ClassVar[float]  # how often poll() looks for ended jobs

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.task_function = task_function

    # -- in the launching process --------------------------------------------------------------

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        jobs = plan(self.hydra_context, self.config, job_overrides, initial_job_idx)
        returned = self.run([job for job in jobs if job.state == "pending"], jobs, sweep_dir)
        return returned if returned is not None else self.finish(jobs, sweep_dir)

    @abc.abstractmethod
    def run(self, todo: list[Job], jobs: list[Job], sweep_dir: Path
            ) -> list[JobReturn] | None:
        """Start `todo` (the jobs of `jobs` not completed before) and wait for them; None once
        they have ended, or Hydra's returns for a sweep left running (detached)."""

    def record(self, sweep_dir: Path, jobs: list[Job], **extra: Any) -> None:
        """jobs.json, for `labrun status`, which asks the scheduler named there about the jobs;
        `extra`: keys of the launcher's own."""
        SweepDir(sweep_dir).write_jobs(self.scheduler.name, jobs,
                                       scheduler=path_of(self.scheduler), **extra)

    def poll(self, running: dict[Any, Job], ended: Callable[[list[Any]], list[Any]],
             on_end: Callable[[Any, Job], None], start: Callable[[], bool] = lambda: False
             ) -> None:
        """Every POLL_S until no job runs or waits: `start()` starts the jobs that may start
        now and says whether any still waits; `ended(handles)` gives those of the running
        jobs' handles (the keys of `running`) whose jobs have ended, all asked at once (one
        scheduler query a round, not one a job); `on_end(handle, job)` records each."""
        while True:
            waiting = start()
            for handle in ended(list(running)):
                on_end(handle, running.pop(handle))
            if not running and not waiting:
                return
            time.sleep(self.POLL_S)

    def finish(self, jobs: list[Job], sweep_dir: Path) -> list[JobReturn]:
        """Every job's result from its own run folder, jobs.json, the table, Hydra's returns."""
        for job in jobs:
            read_result(job)
        self.record(sweep_dir, jobs)
        print_table(jobs, f"sweep {sweep_dir}")
        return [job_return(job) for job in jobs]

    # -- in the job ----------------------------------------------------------------------------

    @staticmethod
    def job_config(config: DictConfig, singleton_state: dict[Any, Any]) -> DictConfig:
        """In the job, before run_job: Hydra's state as the launcher had it, and the job's own
        copy of its config, with the scheduler's id of the job."""
        import submitit

        Singleton.set_state(singleton_state)
        setup_globals()
        # A requeued job gets the same pickled config, which the first attempt made read-only.
        config = copy.deepcopy(config)
        OmegaConf.set_readonly(config, False)
        with open_dict(config.hydra):
            config.hydra.job.id = submitit.JobEnvironment().job_id
        return config

    @staticmethod
    @contextlib.contextmanager
    def run_folder_held(config: DictConfig):
        """While the job runs: global rank 0 holds its run folder, taken before run_job writes
        there; the other ranks wait for it and end if another process holds the folder
        (runs/lock.py: RunLocked). A requeued job takes it from an attempt still ending."""
        held = run_lock.claim(RunDir(job_dir(config)).lock_path, environment.read().rank)
        try:
            yield
        finally:
            if held is not None:
                held.release()

    def checkpoint(self, *args: Any) -> Any:
        """submitit calls it on USR2 (see labrun.train.trainer): requeue the same call; the job
        resumes from the checkpoint it just saved."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


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
