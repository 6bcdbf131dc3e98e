"""One run on the cluster: `python train.py model=resnet50 cluster=lab`, without -m.

Hydra uses the configured launcher only for -m. With a SLURM cluster config, a single run is
submitted all the same, exactly as a sweep's job would be (slurm.SlurmLauncher: the cluster's
resources, the checks before anything is submitted, a code snapshot, containers, requeue on
preemption), as a sweep of one job whose run folder is the run's own, outputs/DATE/TIME-XXXX/:

    RUN/jobs.json     the job: its SLURM id, its log, earlier attempts (SweepDir)
    RUN/.code/STAMP   the code snapshot the job runs (labrun gc leaves it)
    RUN/.submitit/    submitit's files and the job's logs

In the job, the same config trains (the job runs inside its own allocation, so nothing is
submitted twice). This process follows the job as a local run is followed: its state while it
waits (SLURM's pending reason), then the run's own lines as the job writes them, and exits
with the run's outcome. Ctrl-C cancels the job (a running one saves a checkpoint first);
SIGHUP, the terminal gone, leaves it running; the same command with the same folder attaches
to the job the folder records instead of submitting another, and submits it again (it
resumes) once that job has ended without completing.

From a shell that holds an allocation on other hosts (salloc's on a login host, where SLURM
leaves it unless LaunchParameters=use_interactive_step), nothing is submitted and nothing
trains on the login host: the same command goes into that allocation with srun
(into_allocation), as an salloc user would have typed it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import _save_config
from hydra.types import HydraContext, TaskFunction
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict

from labrun.core import environment, probes, scheduler
from labrun.core.errors import ConfigError
from labrun.core.scheduler import ACTIVE_STATES, SchedulerJob
from labrun.launch import sweep
from labrun.runs import lock as run_lock
from labrun.runs.lock_holder import busy_message, live_holder
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import Job, read_result

# How often the follower asks SLURM about the job, at first and at most (a long run costs one
# query every POLL_MAX_S; once the job's result is written, one at once and then every POLL_S),
# and how often it reads the job's log for new lines.
POLL_S, POLL_MAX_S, TAIL_S = 2.0, 10.0, 0.5
# After Ctrl-C: how long to wait for the cancelled job to save its checkpoint and end
# (SLURM's KillWait, 30 s by default, then SIGKILL; with room for the controller).
CANCEL_WAIT_S = 90.0
EXIT_INTERRUPTED = 130


def goes_to_cluster(config: DictConfig) -> bool:
    """Whether `python train.py` without -m sends this run to its cluster: its cluster's
    launcher submits single runs too (SLURM), and this process is not inside a job of that
    cluster already (a submitted run's own job, or a person's salloc / srun --pty on one of
    the allocation's nodes, where it trains in place). An allocation held from another host
    is no inside: the run goes into it (run)."""
    target = OmegaConf.select(config, "hydra.launcher._target_", default=None)
    launcher = get_class(target) if target else None
    return bool(getattr(launcher, "SUBMITS_SINGLE_RUNS", False)
                and environment.read().scheduler is None)


def run(config: DictConfig, task_function: TaskFunction) -> int:
    """Submit the run of `config` (Hydra's RUN-mode config, hydra node included) to its
    cluster, or attach to the job its folder records; follow it unless cluster.detach.
    Returns the exit code: the run's outcome. From a shell that holds an allocation on other
    hosts, the run goes into that allocation instead, and this process becomes srun."""
    held = environment.read().allocation_elsewhere
    if held is not None:
        into_allocation(config, held)
    run_dir = Path(str(config.hydra.run.dir)).resolve()
    config = job_config(config, run_dir)
    launcher = get_class(config.hydra.launcher._target_)()
    # The job runs Hydra's run_job, which calls the callbacks' job hooks; no composition is
    # left to do (there is one job, composed already), so no config loader.
    from hydra._internal.callbacks import Callbacks

    launcher.setup(hydra_context=HydraContext(config_loader=None, callbacks=Callbacks(config)),
                   task_function=task_function, config=config)
    overrides = list(config.hydra.overrides.task)
    job = Job(num=0, overrides=overrides, dir=str(run_dir), config=config)
    attached = sweep.attach(launcher.scheduler(), [job], run_dir)
    if attached:
        launcher.adopt(job)
        say(f"attached to SLURM job {job.job_id}, which trains this run folder; log "
            f"{job.log}")
    else:
        holder = live_holder(RunDir(run_dir).lock_path)
        if holder is not None:  # a run in this folder that is no job of this cluster
            raise run_lock.RunLocked(busy_message(RunDir(run_dir).lock_path, holder))
        task_config = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        if sweep.completed_with_same_config(run_dir, task_config):
            read_result(job)
            say(f"{run_dir} already completed with this config (best {job.metric}); nothing "
                f"submitted")
            return 0
        # Its own line below says what the launcher's lines for a sweep's jobs would.
        with quiet(logging.getLogger("labrun.launch")):
            launcher.begin([job])
        save_hydra_files(config, run_dir)
        say(f"submitted SLURM job {job.job_id} ({config.cluster.name}); log {job.log}")
    launcher.record([job])
    if config.cluster.get("detach"):
        say(f"detached; its state: labrun status {run_dir} (--wait to wait for it); to stop "
            f"it: labrun cancel {run_dir}")
        return 0
    return follow(launcher, job)


def into_allocation(config: DictConfig, allocation: SchedulerJob) -> NoReturn:
    """Run this same command on the nodes of `allocation`, which this process holds from
    another host (salloc's shell on a login host), as `srun python train.py ...` typed there
    would: srun replaces this process, so the run's output, Ctrl-C and exit code are srun's.
    On the nodes the run is inside its allocation and trains in place, where check_single_run
    counts the GPUs the step is given (an salloc shell is told none)."""
    # GPUs only where the run asks for them, as check_single_run counts them in a job.
    gpus = (scheduler.named(allocation.scheduler).job_gpus(allocation.job_id)
            if config.cluster.get("gpus_per_node") else None)
    command = allocation_command(config, allocation, sys.orig_argv, gpus)
    probes.require_slurm_client(command[0])
    say(f"this shell holds {allocation.scheduler} job {allocation.job_id} on "
        f"{allocation.nodelist}, not this host ({socket.gethostname()}): running the run "
        f"there with {command[0]}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(command[0], command)


def allocation_command(config: DictConfig, allocation: SchedulerJob, argv: list[str],
                       gpus: int | None = None) -> list[str]:
    """The command that runs the run `argv` (this process's command line, interpreter first)
    started, as a step of `allocation`: one task per GPU of trainer.devices on each of
    trainer.num_nodes nodes. What the allocation holds is checked first, one line each, as
    srun would fail in its own words: its nodes and tasks (its variables here), its `gpus` on
    all nodes together (asked of the scheduler; None: not checked), and cluster.detach, which
    a step cannot honour. A GPU refusal inside the step would come from every task, and a step
    is no place to refuse: nothing should start that cannot run."""
    trainer = config.trainer
    held = (f"{allocation.scheduler} job {allocation.job_id}, the allocation this shell holds "
            f"on {allocation.nodelist},")
    if config.cluster.get("detach"):
        raise ConfigError(f"cluster.detach=true: {held} takes the run with srun, which does "
                          f"not detach; leave the allocation to submit a detached job, or drop "
                          f"cluster.detach")
    if allocation.num_nodes < trainer.num_nodes:
        raise ConfigError(f"{held} has {allocation.num_nodes} node(s): trainer.num_nodes="
                          f"{trainer.num_nodes}; ask salloc for --nodes={trainer.num_nodes}, "
                          f"or leave the allocation to submit a job")
    processes = trainer.devices * trainer.num_nodes
    if allocation.tasks is not None and allocation.tasks < processes:
        raise ConfigError(f"{held} has {allocation.tasks} task(s): trainer.devices="
                          f"{trainer.devices} x trainer.num_nodes={trainer.num_nodes} needs "
                          f"{processes}; ask salloc for --ntasks={processes}, or lower "
                          f"trainer.devices")
    if gpus is not None and gpus // allocation.num_nodes < trainer.devices:
        raise ConfigError(f"{held} has {gpus // allocation.num_nodes} GPU(s) a node: "
                          f"trainer.devices={trainer.devices} needs {trainer.devices}; ask "
                          f"salloc for --gpus-per-node={trainer.devices}, or lower "
                          f"trainer.devices")
    command = [sys.executable, *argv[1:]]
    if not any(re.fullmatch(r"[+~]*hydra\.run\.dir", override.split("=", 1)[0])
               for override in config.hydra.overrides.hydra):
        # The folder this command named: the step's own clock would name another.
        run_dir = Path(str(config.hydra.run.dir)).resolve()
        command.append(f"hydra.run.dir={hydra_value(run_dir)}")
    return scheduler.named(allocation.scheduler).step_command(command, trainer.num_nodes,
                                                               trainer.devices)


def hydra_value(path: Path) -> str:
    """`path` as a value of Hydra's override grammar: bare where its characters allow, else
    quoted."""
    text = str(path)
    if re.fullmatch(r"[\w/.:@%+-]+", text):
        return text
    return "'" + text.replace("'", "\\'") + "'"


def job_config(config: DictConfig, run_dir: Path) -> DictConfig:
    """The config the job gets: a sweep's job whose sweep folder is the run folder itself (its
    run folder is hydra.sweep.dir/hydra.sweep.subdir: the same folder), with the folder
    written out, not `${now:...}` that the job would resolve to its own start."""
    config = copy.deepcopy(config)
    OmegaConf.set_readonly(config, False)
    with open_dict(config):
        config.hydra.run.dir = str(run_dir)
        config.hydra.sweep.dir = str(run_dir)
        config.hydra.sweep.subdir = "."
        config.hydra.job.num = 0
    return config


def save_hydra_files(config: DictConfig, run_dir: Path) -> None:
    """RUN/.hydra/ as Hydra's run_job writes it, from submission on: `labrun status`, `resume`
    and `rerun` read the run's overrides while the job still waits. The job writes the same
    files again when it starts."""
    HydraConfig.instance().set_config(config)
    task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    folder = RunDir(run_dir)
    for node, path in ((task, folder.config_path),
                       (OmegaConf.masked_copy(config, ["hydra"]), folder.hydra_config_path),
                       (config.hydra.overrides.task, folder.overrides_path)):
        _save_config(node, path.name, path.parent)


def follow(launcher: sweep.SweepLauncher, job: Job) -> int:
    """Show the job until it ends: its state while it waits or changes, the run's lines as
    its log grows; the exit code of its outcome. Ctrl-C cancels it."""
    log_tail = JobLog(job.log)
    try:
        ended = watch(launcher, job, log_tail)
    except KeyboardInterrupt:
        say(f"interrupted: cancelling SLURM job {job.job_id} (a running job saves a checkpoint "
            f"first)")
        launcher.stop([job])
        launcher.record([job])
        deadline = time.monotonic() + CANCEL_WAIT_S
        while not launcher.ended([job]) and time.monotonic() < deadline:
            log_tail.show()
            time.sleep(POLL_S)
        log_tail.show()
        summary = job.run_dir.read_summary()
        step = summary.get("step")
        say(f"cancelled; the run is {summary.get('status', 'not started')}"
            + (f" at step {step}" if step is not None else "")
            + f"; to continue it: labrun resume {job.dir}")
        return EXIT_INTERRUPTED
    log_tail.show()
    launcher.read_results([ended])
    launcher.record([ended])
    if ended.state in ("completed", "pruned"):
        return 0
    print(f"error: the run {ended.state}: {ended.error or 'no error recorded'}; log: "
          f"{ended.log}", file=sys.stderr)
    return 1


def watch(launcher: sweep.SweepLauncher, job: Job, log_tail: JobLog) -> Job:
    """Poll until the job has ended (launcher.ended: SLURM's word, or its run folder's); print
    each new state with its reason or nodes, and the log's new lines."""
    scheduler = launcher.scheduler()
    shown, interval, next_ask, ending = None, POLL_S, 0.0, False
    while True:
        now = time.monotonic()
        if not ending and launcher.ended_soon(job):  # asked at once, then every POLL_S
            ending, next_ask = True, now
        if now >= next_ask:
            if launcher.ended([job]):
                return job
            with contextlib.suppress(probes.SlurmError):  # asked again at the next pass
                line = state_line(job, scheduler.job_whereabouts(str(job.job_id)))
                if line != shown:
                    say(line)
                    shown, interval = line, POLL_S
                else:
                    interval = POLL_S if ending else min(interval * 1.5, POLL_MAX_S)
            next_ask = now + interval
        log_tail.show()
        time.sleep(TAIL_S)


def state_line(job: Job, where: tuple[str, str, str] | None) -> str:
    """`SLURM job 12: PENDING (Priority)` / `SLURM job 12: RUNNING on node1`."""
    if where is None:
        return f"SLURM job {job.job_id}: not listed by squeue"
    state, reason, nodes = where
    if state in ACTIVE_STATES and nodes:
        return f"SLURM job {job.job_id}: {state} on {nodes}"
    if reason and reason != "None":
        return f"SLURM job {job.job_id}: {state} ({reason})"
    return f"SLURM job {job.job_id}: {state}"


class JobLog:
    """The job's output as it grows (submitit's stdout of task 0: the run's progress lines,
    what a local run prints), without submitit's own lines, which say nothing about the run."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.offset = 0
        self.partial = ""
        self.last_submitit = ""

    def show(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            if f.seek(0, 2) < self.offset:  # started again (a requeue) over a new file
                self.offset, self.partial = 0, ""
            f.seek(self.offset)
            data = f.read()
        if not data:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data.decode(errors="replace")).split("\n")
        for line in lines:
            # "submitit INFO (date) - Job completed successfully", which submitit also prints
            # bare right after.
            if line.startswith("submitit "):
                self.last_submitit = line.partition(") - ")[2]
                continue
            if line and line == self.last_submitit:
                continue
            print(line, flush=True)


@contextlib.contextmanager
def quiet(logger: logging.Logger):
    """`logger`'s INFO lines left out (its warnings stay)."""
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def say(line: str) -> None:
    """One line of the follower's own, told apart from the run's lines."""
    print(f"labrun: {line}", flush=True)

