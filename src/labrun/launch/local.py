"""cluster=local with -m: the sweep's jobs as subprocesses on this machine, one per free GPU.

Each job is the plain single-run command (`python train.py <overrides> hydra.run.dir=JOB_DIR`),
started when enough GPUs are free, with CUDA_VISIBLE_DEVICES set to its own GPUs; the rest wait
in a queue. At most `cluster.max_parallel` jobs run at once (default: the GPUs divided by
trainer.devices; 1 on a machine without GPUs). A failed job does not stop the others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from labrun.core.errors import ConfigError
from labrun.launch import sweep
from labrun.launch.sweep import Job

# How often the launcher looks for ended jobs: a free slot waits at most this long, which is
# nothing next to a training job, and polling costs nothing noticeable at 5 times a second.
POLL_S = 0.2


def visible_gpus() -> list[int]:
    """The GPU ids this process may hand out."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        return [int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if i.strip()]
    import torch

    return list(range(torch.cuda.device_count()))


class LocalLauncher(Launcher):
    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
               ) -> Sequence[JobReturn]:
        cluster = self.config.cluster
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        jobs = sweep.plan(self.hydra_context, self.config, job_overrides, initial_job_idx)
        gpus = list(cluster.gpu_ids) if cluster.gpu_ids is not None else visible_gpus()

        def needs(job: Job) -> int:  # GPUs of one job: its own trainer.devices (may be swept)
            return job.config.cluster.devices if gpus else 0

        for job in jobs:
            if needs(job) > len(gpus):
                raise ConfigError(f"trainer.devices={needs(job)} but only {len(gpus)} GPUs are "
                                  f"available ({gpus}); lower trainer.devices or set "
                                  f"cluster.gpu_ids")
        max_parallel = cluster.max_parallel or (len(gpus) // cluster.devices if gpus else 1)
        print(f"sweep: {len(jobs)} jobs in {sweep_dir}, at most {max_parallel} at once"
              + (f" on GPUs {gpus}" if gpus else ""), flush=True)

        queue = [job for job in jobs if job.state == "pending"]
        free, running = list(gpus), {}
        try:
            while queue or running:
                while queue and len(running) < max_parallel and len(free) >= needs(queue[0]):
                    job = queue.pop(0)
                    mine, free = free[:needs(job)], free[needs(job):]
                    running[self._start(job, mine, sweep_dir)] = (job, mine)
                    sweep.write_manifest(sweep_dir, "local", jobs)
                for proc in [p for p in running if p.poll() is not None]:
                    job, mine = running.pop(proc)
                    job.ended_at, job.returncode = time.time(), proc.returncode
                    free.extend(mine)
                    if proc.returncode != 0:
                        job.error = f"exit code {proc.returncode}"
                    sweep.read_result(job)
                    print(f"job {job.num} {job.state}", flush=True)
                    sweep.write_manifest(sweep_dir, "local", jobs)  # `labrun status` sees it
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            print(f"interrupted: stopping {len(running)} running jobs (each saves a checkpoint)",
                  file=sys.stderr, flush=True)
            for proc in running:
                proc.send_signal(signal.SIGTERM)
            for proc, (job, _) in running.items():
                proc.wait()
                job.ended_at, job.returncode = time.time(), proc.returncode
                sweep.read_result(job)
            for job in queue:
                job.state = "cancelled"
            raise
        finally:
            sweep.write_manifest(sweep_dir, "local", jobs)
        for job in jobs:
            if job.state == "skipped":
                sweep.read_result(job)
        sweep.print_table(jobs, f"sweep {sweep_dir}")
        return [sweep.job_return(job) for job in jobs]

    def _start(self, job: Job, gpus: list[int], sweep_dir: Path) -> subprocess.Popen:
        job.path.mkdir(parents=True, exist_ok=True)
        job.log = str(job.path / "job.log")
        env = {**os.environ, **{k: str(v) for k, v in self.config.cluster.env.items()},
               "LABRUN_SWEEP_DIR": str(sweep_dir), "LABRUN_JOB_NUM": str(job.num)}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = job.gpus = ",".join(map(str, gpus))
        command = [sys.executable, str(Path(sys.argv[0]).resolve()), *job.overrides,
                   f"hydra.run.dir={job.dir}"]
        # Taken before the process exists (and ended_at after it is gone): the recorded interval
        # covers the job's whole life, which is what "at most max_parallel at once" is about.
        job.started_at = time.time()
        with open(job.log, "ab") as log:
            # A session of its own: Ctrl-C in the terminal reaches the launcher, which then
            # stops each job cleanly with SIGTERM.
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        job.state, job.job_id = "running", str(proc.pid)
        print(f"job {job.num} started (pid {proc.pid}"
              + (f", GPUs {job.gpus}" if gpus else "") + f"): {job.log}", flush=True)
        return proc
