"""cluster=local with -m: the sweep's jobs on this machine, each a submitit job with its own GPUs.

Each job goes through submitit's LocalExecutor with `visible_gpus` set to the GPUs it was given
(CUDA_VISIBLE_DEVICES), so local and SLURM sweeps share one job interface: the job is the same
pickled call into Hydra's run_job with the config composed at planning time, its result comes
back through submitit, and USR2 checkpoints and requeues it (the launcher's `checkpoint`).
What submitit's local executor lacks stays here: a job starts only when enough GPUs are free
(the rest wait in a queue), at most `cluster.max_parallel` run at once (default: the GPUs
divided by trainer.devices; 1 on a machine without GPUs), jobs that already completed with the
same config are skipped, and the sweep ends with one table. A failed job does not stop the
others.

Files: each job's output (stdout and stderr) goes to JOB_DIR/job.log, as with a plain run;
submitit's own files (the pickled call, its result, a few lines of submitit's log) go to
SWEEP_DIR/.submitit/STAMP/ (file names start with the job's id, its controller's pid).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, run_job
from omegaconf import DictConfig, open_dict

from labrun.core import probes
from labrun.core.errors import ConfigError
from labrun.core.scheduler import LocalScheduler
from labrun.launch import sweep
from labrun.runs import lock as run_lock
from labrun.runs.lock_holder import live_holder
from labrun.runs.sweepdir import Job, read_result, submitit_result

log = logging.getLogger(__name__)

# How often the launcher looks for ended jobs: a free slot waits at most this long, which is
# nothing next to a training job, and polling costs nothing noticeable at 5 times a second.
POLL_S = 0.2
# submitit's local default is a 2-minute limit; a local job, as before, has none (ten years).
NO_TIME_LIMIT_MIN = 10 * 365 * 24 * 60
# The exit code with which submitit's local job asks its controller to start it again (requeue).
REQUEUE_EXIT_CODE = 144
# A user error's exit code, as `python train.py` ends with (cli/hydra_app.py; not imported: cli
# is above launch).
EXIT_USER_ERROR = 2


def visible_gpus() -> list[int]:
    """The GPU ids this process may hand out (NVML's count, not torch's: the launcher never
    imports torch, seconds of every sweep's start)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
    return list(range(probes.gpu_count()))


class LocalLauncher(sweep.SweepLauncher):
    scheduler = LocalScheduler
    POLL_S = POLL_S

    def __init__(self) -> None:
        super().__init__()
        self._machine: Machine | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The launcher goes to each job pickled: without the launcher's own bookkeeping (its
        # other jobs, their processes).
        return {**self.__dict__, "_machine": None}

    # -- in the launching process --------------------------------------------------------------

    def machine(self) -> Machine:
        """This machine's GPUs and job slots, found at the first job this launcher starts."""
        if self._machine is None:
            cluster = self.config.cluster
            gpus = list(cluster.gpu_ids) if cluster.gpu_ids is not None else visible_gpus()
            max_parallel = cluster.max_parallel or (len(gpus) // cluster.devices if gpus else 1)
            self._machine = Machine(gpus, max_parallel, free=list(gpus), submitit_dir=(
                self.sweep_dir / ".submitit" / time.strftime("%Y%m%d-%H%M%S")))
            log.info("sweep in %s: at most %d jobs at once%s", self.sweep_dir, max_parallel,
                     f" on GPUs {gpus}" if gpus else "")
        return self._machine

    def begin(self, jobs: list[Job]) -> None:
        machine = self.machine()
        for job in jobs:  # all refused before any starts
            if machine.needs(job) > len(machine.gpus):
                raise ConfigError(f"trainer.devices={machine.needs(job)} but only "
                                  f"{len(machine.gpus)} GPUs are available ({machine.gpus}); "
                                  f"lower trainer.devices or set cluster.gpu_ids")
        machine.queue += jobs
        self._start_queued()

    def adopt(self, job: Job) -> None:
        machine = self.machine()
        mine = job_gpus(job)
        machine.free = [gpu for gpu in machine.free if gpu not in mine]
        machine.running[job.num] = (Attached(job), mine)

    def _start_queued(self) -> None:
        """Start the queued jobs that fit now: a free slot and enough free GPUs."""
        machine = self.machine()
        while (machine.queue and len(machine.running) < machine.max_parallel
               and len(machine.free) >= machine.needs(machine.queue[0])):
            job = machine.queue.pop(0)
            count = machine.needs(job)
            mine, machine.free = machine.free[:count], machine.free[count:]
            with _ctrl_c_deferred():  # a started job is always in `running`
                machine.running[job.num] = (self._start(job, mine), mine)
            self.record([job])

    def ended(self, jobs: list[Job]) -> list[Job]:
        machine, done = self.machine(), []
        for job in jobs:
            if job.num in machine.running and machine.running[job.num][0].done():
                handle, mine = machine.running.pop(job.num)
                _collect(job, handle)
                machine.free.extend(mine)
                done.append(job)
        self._start_queued()  # a freed slot gets the next job at once
        return done

    def stop(self, jobs: list[Job]) -> None:
        machine = self.machine()
        started = [job for job in jobs if job.num in machine.running]
        log.warning("interrupted: stopping %d running jobs (each saves a checkpoint)",
                    len(started))
        for job in started:
            stop_job(job)
        for job in started:
            handle, _ = machine.running.pop(job.num)
            while not handle.done():
                time.sleep(POLL_S)
            _collect(job, handle, stopped=True)
        for job in machine.queue:
            job.state = "cancelled"
        machine.queue.clear()

    def _start(self, job: Job, gpus: list[int]) -> Any:
        import submitit

        sweep_dir = self.sweep_dir

        job.path.mkdir(parents=True, exist_ok=True)
        job.log = str(job.run_dir.job_log_path)
        env = {**{k: str(v) for k, v in self.config.cluster.env.items()},
               "LABRUN_SWEEP_DIR": str(sweep_dir), "LABRUN_JOB_NUM": str(job.num),
               # submitit sets CUDA_VISIBLE_DEVICES="" for a job without GPUs; such a job sees
               # what the launcher sees, as a plain run would.
               "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if gpus:
            job.gpus = ",".join(map(str, gpus))
            env["CUDA_VISIBLE_DEVICES"] = job.gpus
        config = copy.deepcopy(job.config)
        with open_dict(config):
            # Resolved here: `${now:...}` in the sweep folder's name would differ in the job.
            config.hydra.sweep.dir = str(sweep_dir)
        executor = submitit.LocalExecutor(folder=self.machine().submitit_dir)
        executor.update_parameters(visible_gpus=gpus, gpus_per_node=len(gpus),
                                   timeout_min=NO_TIME_LIMIT_MIN)
        # Taken before the process exists (and ended_at after it is gone): the recorded interval
        # covers the job's whole life, which is what "at most max_parallel at once" is about.
        job.started_at = time.time()
        handle = executor.submit(self, config, job.log, env, Singleton.get_state())
        job.state, job.job_id = "running", handle.job_id
        job.submitit_dir = str(handle.paths.folder)
        log.info("job %d started (pid %s%s): %s", job.num, handle.job_id,
                 f", GPUs {job.gpus}" if gpus else "", job.log)
        return handle

    # -- in the job ----------------------------------------------------------------------------

    def __call__(self, config: DictConfig, log_path: str, env: dict[str, str | None],
                 singleton_state: dict[Any, Any]) -> int:
        """Run one job; return its exit code, the one `python train.py` would end with."""
        # A session of its own, as a terminal's Ctrl-C reaches the launcher only, which then
        # stops each job cleanly with SIGTERM. submitit ignores SIGTERM in the job; a job that
        # has not yet started training ends on it, as a plain run would.
        os.setsid()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        config = self.job_config(config, singleton_state)
        with _output_to(log_path):
            try:
                with self.run_folder_held(config):
                    return self._run_job(config)
            except run_lock.RunLocked as error:
                print(f"error: {error}", file=sys.stderr)
                return EXIT_USER_ERROR

    def _run_job(self, config: DictConfig) -> int:
        try:
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                          config=config, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir")
        except SystemExit as stop:  # a user error (2) or a stop (130): its line is printed
            if stop.code == REQUEUE_EXIT_CODE:
                raise  # submitit's requeue: its controller starts the job again
            code = stop.code  # as Python's own exit: None is 0, a message is 1
            return code if isinstance(code, int) else 0 if code is None else 1
        if ret.status == JobStatus.FAILED:  # a bug: the traceback, as a plain run shows it
            error = ret._return_value
            traceback.print_exception(type(error), error, error.__traceback__)
            return 1
        return 0


@dataclass
class Machine:
    """What the local launcher hands out: GPUs and at most max_parallel job slots."""

    gpus: list[int]
    max_parallel: int
    free: list[int]  # GPUs no running job has
    submitit_dir: Path  # submitit's files of this launcher's jobs
    running: dict[int, tuple[Any, list[int]]] = field(default_factory=dict)  # num: handle, GPUs
    queue: list[Job] = field(default_factory=list)  # jobs waiting for a slot, in order

    def needs(self, job: Job) -> int:
        """GPUs of one job: its own trainer.devices (which a sweep may vary); none without."""
        return job.config.cluster.devices if self.gpus else 0


class Attached:
    """A job an earlier launcher of this sweep started that still runs (that launcher went with
    its terminal). This process has no submitit handle on it: the job has ended once its
    controller is gone and its run folder's lock has no live holder."""

    def __init__(self, job: Job):
        self.job, self.job_id = job, job.job_id

    def done(self) -> bool:
        return (not LocalScheduler().job_alive(self.job_id)
                and live_holder(self.job.run_dir.lock_path) is None)


def job_gpus(job: Job) -> list[int]:
    return [int(gpu) for gpu in job.gpus.split(",")] if job.gpus else []


def _collect(job: Job, handle: Any, stopped: bool = False) -> None:
    """Record how a job ended: its exit code from submitit's result, then its own files.
    `stopped`: the launcher stopped it (Ctrl-C); its exit code is then no error of its own."""
    job.ended_at = time.time()
    result = submitit_result(job)  # None: killed, so no result and no exit code
    if result is not None:
        outcome, value = result
        if outcome == "success":
            job.returncode = value
        else:  # submitit's own failure, with its trace
            job.returncode, job.error = 1, str(value).strip().splitlines()[-1][:200]
    if job.returncode != 0 and not stopped:
        job.error = job.error or (f"exit code {job.returncode}" if job.returncode is not None
                                  else "ended without a result (killed?)")
    read_result(job)


@contextlib.contextmanager
def _ctrl_c_deferred():
    """SIGINT and SIGHUP blocked while a job starts. Its controller inherits the mask, so a
    terminal's Ctrl-C reaches neither the controller (on SIGINT it would kill the job a second
    later) nor the job until the job has a session of its own; the launcher gets it once the
    job is recorded as running, and stops it with the others. SIGHUP (the terminal gone) stays
    blocked in the controller, which keeps running, and requeueing, its job; the launcher
    gets it and ends, and the same command again attaches to the jobs."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGHUP})


@contextlib.contextmanager
def _output_to(log_path: str):
    """The job's stdout and stderr (and those of processes it starts) append to job.log;
    submitit's own lines before and after go to its files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "ab") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy_of_it in zip((1, 2), saved, strict=True):
            os.dup2(copy_of_it, fd)
            os.close(copy_of_it)


def stop_job(job: Job) -> None:
    """SIGTERM to a local job: to its controller, which passes it on (submitit's own cancel
    sends SIGINT, on which the controller kills the job a second later, too soon for a
    checkpoint), or, where the controller is gone, to the process holding its run folder."""
    if LocalScheduler().job_alive(job.job_id or ""):
        LocalScheduler().cancel([job.job_id])
        return
    holder = live_holder(job.run_dir.lock_path)
    if holder is not None and holder.pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGTERM)
