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
import logging
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

from labrun.config import facts, keys, validation
from labrun.core import environment
from labrun.core.errors import ConfigError, LabrunError
from labrun.core.scheduler import LIVE_STATES, Scheduler, path_of
from labrun.launch.compose import JobComposer, python_gc_kept_off
from labrun.runs import lock as run_lock
from labrun.runs.lock_holder import live_holder
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job, SweepDir, print_table, read_result

log = logging.getLogger(__name__)


class SweepLauncher(Launcher):
    """A Hydra launcher for labrun's sweeps. A subclass names its `scheduler` (its name is
    jobs.json's backend, and `labrun status` asks it about the jobs later) and implements the
    non-blocking steps: `begin` (start jobs), `ended` (which have ended, one query for all),
    `stop` (Ctrl-C) and `adopt` (a job an earlier launch started). Two ways use them:
    - Hydra's blocking `launch(overrides)`: a grid sweep's jobs all at once, then a wait for
      every one (or, detached, none);
    - `start(overrides, num)` and `wait_any(jobs)`: a job at a time, each waited for as it
      ends, which the Optuna sweeper uses to keep n_jobs trials in flight."""

    scheduler: ClassVar[type[Scheduler]]
    POLL_S: ClassVar[float]  # how often wait_any() asks which jobs have ended, at first
    # ... and at most, the interval growing by half each pass in which nothing ended: a sweep
    # of long jobs costs its scheduler a query every POLL_MAX_S seconds.
    POLL_MAX_S: ClassVar[float | None] = None  # None: POLL_S always
    # Between two questions, how often wait_any() looks for a job's own sign that it has ended
    # (ended_soon), for GLANCE_JOBS jobs a look, in turn: a job that ends is asked about at
    # once, not up to POLL_MAX_S later, and a sweep of thousands costs a few file checks a
    # second. None: no sign to look for (the launcher asks its scheduler often anyway).
    GLANCE_S: ClassVar[float | None] = None
    GLANCE_JOBS: ClassVar[int] = 32
    CAN_DETACH: ClassVar[bool] = False  # whether cluster.detach=true returns after submission
    # Whether a run without -m goes through this launcher too (launch/cluster_run.py): on a
    # cluster, where the run must not train on the machine it was typed on.
    SUBMITS_SINGLE_RUNS: ClassVar[bool] = False

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self._composer: JobComposer | None = None
        self._signs_seen: set[str | None] = set()  # jobs whose sign of an end nap() has seen

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.task_function = task_function
        self._composer = None  # a new config: a new composer

    def __getstate__(self) -> dict[str, Any]:
        # What a job needs of its launcher (it is pickled with every job): not the configs
        # the composer keeps.
        return {**self.__dict__, "_composer": None}

    @property
    def composer(self) -> JobComposer:
        """Composes this launch's jobs (each distinct config-group choice once)."""
        if self._composer is None:
            self._composer = JobComposer(self.hydra_context, self.config)
        return self._composer

    @property
    def sweep_dir(self) -> Path:
        return Path(str(self.config.hydra.sweep.dir)).resolve()

    # -- in the launching process: what a launcher implements -----------------------------------

    @abc.abstractmethod
    def begin(self, jobs: list[Job]) -> None:
        """Start these jobs (or queue them, where they must wait for a free slot) and return
        at once; each gets its id and log."""

    @abc.abstractmethod
    def ended(self, jobs: list[Job]) -> list[Job]:
        """Those of these started jobs that have ended, without waiting."""

    @abc.abstractmethod
    def stop(self, jobs: list[Job]) -> None:
        """Ctrl-C: stop these jobs (each saves a checkpoint where it can) and mark them."""

    def prepare(self, job: Job) -> None:
        """Called by plan for each job as soon as it is planned, its config composed and
        checked: a launcher that drops the config here (job.config None), keeping only what
        starting the job needs, holds one job's composed config at a time, not every job's
        (about 200 kB each: 1 GB resident for a 5,000-job grid)."""

    def adopt(self, job: Job) -> None:
        """Take over waiting for `job`, which an earlier launch started and that still runs."""

    def manifest_extra(self) -> dict[str, Any]:
        """The launcher's own keys in jobs.json."""
        return {}

    def check_controller(self) -> None:
        """Refuse, in one line, a detached study's controller that could not be submitted or
        would never run; called before the study writes or submits anything."""
        raise ConfigError(f"cluster.detach=true for an Optuna study needs a SLURM cluster "
                          f"(cluster=lab), where the study runs as a job of its own; "
                          f"cluster={self.config.cluster.name} runs it in this terminal")

    def submit_controller(self, argv: list[str]) -> dict[str, Any]:
        """Submit a detached study's controller, a job running `train.py ARGV` (the study's
        own command, attached), once check_controller has passed; returns its record for
        jobs.json's "controller"."""
        self.check_controller()
        raise NotImplementedError(f"{type(self).__name__} has no controller to submit")

    # -- in the launching process: the sweep -----------------------------------------------------

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        with python_gc_kept_off():
            jobs = plan(self.hydra_context, self.config, job_overrides, initial_job_idx,
                        self.composer, self.prepare)
        attached = self._attach(jobs)
        todo = [job for job in jobs if job.state == "pending"]
        if todo:
            self.begin(todo)
        self.record(jobs)
        if self.CAN_DETACH and self.config.cluster.get("detach"):
            log.info("detached: %d jobs submitted; see their state with: labrun status %s",
                     len(todo), self.sweep_dir)
            return [job_return(job) if job.state == "skipped" else _detached_return(job)
                    for job in jobs]
        waiting = todo + attached
        try:
            while waiting:
                ended = self.wait_any(waiting)
                waiting = [job for job in waiting if job not in ended]
        except KeyboardInterrupt:
            self.stop(waiting)
            self.record(jobs)
            raise
        return self.finish(jobs)

    def start(self, overrides: list[str], num: int) -> Job:
        """Job `num` with `overrides`, started now without waiting: attached to where an
        earlier launch's is still running, skipped where it completed with the same config."""
        job = plan(self.hydra_context, self.config, [overrides], num, self.composer,
                   self.prepare)[0]
        if not self._attach([job]) and job.state == "pending":
            self.begin([job])
        self.record([job])
        return job

    def reattach(self, overrides: list[str], num: int) -> Job | None:
        """Job `num`, if an earlier launch started it and it still runs: attached to (waited
        for from now on); None otherwise, with nothing started."""
        job = plan(self.hydra_context, self.config, [overrides], num, self.composer)[0]
        return job if self._attach([job]) else None

    def wait_any(self, jobs: list[Job]) -> list[Job]:
        """Wait until at least one of `jobs` has ended (a skipped one has); return those that
        have, with their results read from their own run folders and recorded."""
        interval = self.POLL_S
        while True:
            ended = [job for job in jobs if job.state == "skipped"]
            ended += self.ended([job for job in jobs if job.state != "skipped"])
            if ended:
                self.read_results(ended)
                for job in ended:
                    log.info("job %d %s", job.num, job.state)
                self.record(ended)  # `labrun status` sees them
                return ended
            if self.nap(jobs, interval):
                interval = self.POLL_S  # its scheduler may not have seen the end yet
            else:
                interval = min(interval * 1.5, self.POLL_MAX_S or self.POLL_S)

    def ended_soon(self, job: Job) -> bool:
        """Whether the job has left its own sign that it has ended or is ending (a scheduler's
        job: the result its Python left), before its scheduler says so. Only for GLANCE_S."""
        return False

    def nap(self, jobs: list[Job], seconds: float) -> bool:
        """Sleep `seconds`, or less: True as soon as a job shows a sign that it has ended
        (ended_soon) which no earlier nap has seen."""
        if self.GLANCE_S is None:
            time.sleep(seconds)
            return False
        deadline, turn = time.monotonic() + seconds, 0
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(self.GLANCE_S, left))
            look = jobs[turn:turn + self.GLANCE_JOBS]
            turn = turn + self.GLANCE_JOBS if turn + self.GLANCE_JOBS < len(jobs) else 0
            new = {job.job_id for job in look
                   if job.job_id not in self._signs_seen and self.ended_soon(job)}
            if new:
                self._signs_seen |= new
                return True
        return False

    def read_results(self, ended: list[Job]) -> None:
        """Each ended job's result from its run folder. `labrun cancel` from another terminal
        records itself in jobs.json: a job it stopped ends cancelled, not interrupted."""
        recorded = SweepDir(self.sweep_dir).earlier_jobs()
        for job in ended:
            if job.num in recorded and job.job_id == recorded[job.num].job_id:
                job.cancelled_at = job.cancelled_at or recorded[job.num].cancelled_at
            read_result(job)

    def _attach(self, jobs: list[Job]) -> list[Job]:
        attached = attach(self.scheduler(), jobs, self.sweep_dir)
        for job in attached:
            self.adopt(job)
        if attached:
            log.info("attached to %d jobs an earlier launch started that still run: %s",
                     len(attached), ", ".join(f"{job.num} ({job.job_id})" for job in attached))
        return attached

    def record(self, jobs: list[Job], **extra: Any) -> None:
        """These jobs' rows of jobs.json (the other rows and keys stay), for `labrun status`,
        which asks the scheduler named there about the jobs; `extra`: keys of the caller's."""
        SweepDir(self.sweep_dir).write_jobs(self.scheduler.name, jobs,
                                            scheduler=path_of(self.scheduler),
                                            **self.manifest_extra(), **extra)

    def finish(self, jobs: list[Job]) -> list[JobReturn]:
        """Every job's result from its own run folder, jobs.json, the table, Hydra's returns."""
        for job in jobs:
            read_result(job)
        self.record(jobs)
        print_table(jobs, f"sweep {self.sweep_dir}")
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
         job_overrides: list[list[str]] | tuple, initial_job_idx: int,
         compose: JobComposer | None = None,
         prepare: Callable[[Job], None] | None = None) -> list[Job]:
    """One Job per override list, in the sweep folder; jobs that already completed with the
    same config are marked skipped (a re-run sweep finishes only what is left). `compose`: a
    JobComposer the caller keeps (a search plans its trials one at a time). `prepare`: called
    with each job once planned (SweepLauncher.prepare), before the next is composed."""
    compose = compose or JobComposer(hydra_context, master)
    job_overrides = [list(overrides) for overrides in job_overrides]
    shared = compose.shared_values(job_overrides)
    jobs = []
    # The target sections' keys of each distinct choice of options and of those sections'
    # own overrides, checked once: no other override adds or removes a key there, and the
    # check costs a millisecond a job (a 5,000-job grid over seeds checks one config).
    sections_checked: set[tuple[str, ...]] = set()
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = compose(overrides, shared)
        shaping = tuple(line for line in overrides
                        if keys.in_target_section(line) or compose.chooses_option(line))
        if shaping not in sections_checked:
            keys.check_target_sections(cfg)
            sections_checked.add(shaping)
        # Each job's own monitor (a sweep may vary it), before any job is submitted: a typo
        # would otherwise train every job to the end for nothing.
        validation.check_checkpoint_monitor(cfg)
        validation.check_cluster(cfg)
        validation.check_task(cfg)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        if cfg.checkpoint.on_finish == "auto":  # a sweep's jobs keep best.pt and last.pt
            cfg.checkpoint.on_finish = "best_last"
        job_dir = Path(str(master.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        job = Job(num=num, overrides=list(overrides), dir=str(job_dir.resolve()), config=cfg)
        if completed_with_same_config(job_dir, cfg):
            job.state = "skipped"
        del cfg  # the job's own reference, which prepare may drop
        if prepare is not None:
            prepare(job)
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
    """Whether the job's folder holds a completed run of the same config, where "same" counts
    only the keys whose facts say they change what a run computes (config/facts.py): a
    re-run with another cluster.detach, say, or after labrun gained a key, redoes nothing."""
    run_dir = RunDir(job_dir)
    if not (run_dir.summary_path.is_file() and run_dir.config_path.is_file()):
        return False
    if run_dir.read_summary().get("status") != "completed":
        return False
    current = OmegaConf.to_container(cfg, resolve=False)
    current.pop("hydra", None)
    saved = OmegaConf.to_container(run_dir.saved_config_node(), resolve=False)
    return not result_keys_differ(saved, current)


def result_keys_differ(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Keys present in both configs, with values that differ, whose facts say they affect the
    result. A key only one of them has is no difference: it came or went with a labrun
    version, and its default keeps the old behaviour."""
    differ = []
    for name in old.keys() & new.keys():
        dotted = f"{prefix}{name}"
        if not facts.facts_of(dotted).affects_result:
            continue
        a, b = old[name], new[name]
        if isinstance(a, dict) and isinstance(b, dict):
            differ += result_keys_differ(a, b, dotted + ".")
        elif a != b:
            differ.append(dotted)
    return differ


def attach(scheduler: Scheduler, jobs: list[Job], sweep_dir: Path) -> list[Job]:
    """Jobs an earlier launch into this sweep folder started that have not ended, by jobs.json:
    the scheduler has them waiting or running, or their run folder's lock has a live holder
    (a local job whose controller is gone). They are marked running and returned, to be
    waited for rather than started twice. Every job keeps its earlier attempts; one to be
    started again gets its last attempt added to them."""
    earlier = SweepDir(sweep_dir).earlier_jobs()
    recorded = [earlier[job.num] for job in jobs
                if job.state == "pending" and job.num in earlier and earlier[job.num].job_id]
    try:
        states = scheduler.job_states([old.job_id for old in recorded]) if recorded else {}
    except LabrunError as error:  # SlurmError included: nothing is submitted on a guess
        raise LabrunError(f"cannot tell whether this sweep's earlier jobs still run ({error}); "
                          f"try again once the scheduler answers") from None
    live = {old.num for old in recorded if states.get(str(old.job_id)) in LIVE_STATES
            or live_holder(old.run_dir.lock_path) is not None}
    attached = []
    for job in jobs:
        old = earlier.get(job.num)
        if old is None:
            continue
        job.attempts = list(old.attempts)
        if job.num in live:
            job.state = "running"
            for name in ("job_id", "log", "gpus", "submitted_at", "started_at",
                         "submitit_dir"):
                setattr(job, name, getattr(old, name))
            attached.append(job)
        elif job.state == "skipped":
            job.job_id, job.log = old.job_id, old.log  # the attempt that completed it
        elif old.job_id:
            job.attempts.append(old.attempt())
    return attached


def _detached_return(job: Job) -> JobReturn:
    """A detached job's return: started, no result yet (`labrun status` follows it)."""
    ret = JobReturn(overrides=job.overrides, cfg=job.config, working_dir=job.dir)
    ret.status, ret.return_value = JobStatus.COMPLETED, None
    return ret


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
