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
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus, run_job
from omegaconf import DictConfig, open_dict

from labrun.core.errors import ConfigError
from labrun.core.scheduler import LocalScheduler
from labrun.launch import sweep
from labrun.runs import lock as run_lock
from labrun.runs.sweepdir import Job, read_result

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
    """The GPU ids this process may hand out."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
    import torch

    return list(range(torch.cuda.device_count()))


class LocalLauncher(sweep.SweepLauncher):
    scheduler = LocalScheduler
    POLL_S = POLL_S

    # -- in the launching process --------------------------------------------------------------

    def run(self, todo: list[Job], jobs: list[Job], sweep_dir: Path) -> None:
        cluster = self.config.cluster
        gpus = list(cluster.gpu_ids) if cluster.gpu_ids is not None else visible_gpus()

        def needs(job: Job) -> int:  # GPUs of one job: its own trainer.devices (may be swept)
            return job.config.cluster.devices if gpus else 0

        for job in jobs:
            if needs(job) > len(gpus):
                raise ConfigError(f"trainer.devices={needs(job)} but only {len(gpus)} GPUs are "
                                  f"available ({gpus}); lower trainer.devices or set "
                                  f"cluster.gpu_ids")
        max_parallel = cluster.max_parallel or (len(gpus) // cluster.devices if gpus else 1)
        log.info("sweep: %d jobs in %s, at most %d at once%s", len(jobs), sweep_dir,
                 max_parallel, f" on GPUs {gpus}" if gpus else "")

        submitit_dir = sweep_dir / ".submitit" / time.strftime("%Y%m%d-%H%M%S")
        queue = list(todo)
        free, running = list(gpus), {}
        given: dict[Any, list[int]] = {}  # each running job's GPUs

        def start() -> bool:
            nonlocal free
            while queue and len(running) < max_parallel and len(free) >= needs(queue[0]):
                job = queue.pop(0)
                mine, free = free[:needs(job)], free[needs(job):]
                with _ctrl_c_deferred():  # a started job is always in `running`
                    handle = self._start(job, mine, sweep_dir, submitit_dir)
                    running[handle], given[handle] = job, mine
                self.record(sweep_dir, jobs)
            return bool(queue)

        def on_end(handle: Any, job: Job) -> None:
            _collect(job, handle)
            free.extend(given.pop(handle))
            log.info("job %d %s", job.num, job.state)
            self.record(sweep_dir, jobs)  # `labrun status` sees it

        try:
            self.poll(running, lambda handles: [h for h in handles if h.done()], on_end, start)
        except KeyboardInterrupt:
            log.warning("interrupted: stopping %d running jobs (each saves a checkpoint)",
                        len(running))
            for handle in running:
                # To the job's controller, which passes SIGTERM on to the job: a stop request
                # (submitit's cancel() sends SIGINT, on which the controller kills the job 1 s
                # later, too soon for a checkpoint).
                os.kill(int(handle.job_id), signal.SIGTERM)
            for handle, job in running.items():
                while not handle.done():
                    time.sleep(POLL_S)
                _collect(job, handle, stopped=True)
            for job in queue:
                job.state = "cancelled"
            raise
        finally:
            self.record(sweep_dir, jobs)
        return None

    def _start(self, job: Job, gpus: list[int], sweep_dir: Path, submitit_dir: Path) -> Any:
        import submitit

        job.path.mkdir(parents=True, exist_ok=True)
        job.log = str(job.path / "job.log")
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
        executor = submitit.LocalExecutor(folder=submitit_dir)
        executor.update_parameters(visible_gpus=gpus, gpus_per_node=len(gpus),
                                   timeout_min=NO_TIME_LIMIT_MIN)
        # Taken before the process exists (and ended_at after it is gone): the recorded interval
        # covers the job's whole life, which is what "at most max_parallel at once" is about.
        job.started_at = time.time()
        handle = executor.submit(self, config, job.log, env, Singleton.get_state())
        job.state, job.job_id = "running", handle.job_id
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


def _collect(job: Job, handle: Any, stopped: bool = False) -> None:
    """Record how a job ended: its exit code from submitit's result, then its own files.
    `stopped`: the launcher stopped it (Ctrl-C); its exit code is then no error of its own."""
    job.ended_at = time.time()
    if handle.paths.result_pickle.exists():  # else killed: no result, and no exit code
        try:
            job.returncode = handle.result()
        except Exception as error:  # noqa: BLE001 - submitit's own failure, with its trace
            job.returncode, job.error = 1, str(error).strip().splitlines()[-1][:200]
    if job.returncode != 0 and not stopped:
        job.error = job.error or (f"exit code {job.returncode}" if job.returncode is not None
                                  else f"ended without a result (submitit: {handle.state})")
    read_result(job)


@contextlib.contextmanager
def _ctrl_c_deferred():
    """SIGINT blocked while a job starts. Its controller inherits the mask, so a terminal's
    Ctrl-C reaches neither the controller (on SIGINT it would kill the job a second later) nor
    the job until the job has a session of its own; the launcher gets it once the job is
    recorded as running, and stops it with the others."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
