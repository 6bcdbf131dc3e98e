"""Where this process runs, read from its environment: its ranks, its node, its scheduler's job,
its launch, the rendezvous of its process group and the container around it.

    from labrun.core import environment
    here = environment.read()     # here.rank, here.node_rank, here.job_id, here.container...

The one place that reads torchrun's variables (RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR...)
and, through the scheduler whose job this is (core/scheduler: SLURM_PROCID, SLURM_JOB_ID...),
the scheduler's. Torch-free, so that runs/lock.py and track/ may ask without importing torch.

Read afresh on every call, never cached: tests change the variables with monkeypatch, and
train.distributed.setup sets MASTER_ADDR/PORT for torch at run time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from labrun.core import scheduler
from labrun.core.scheduler import SchedulerJob

# torchrun's rendezvous, which torch.distributed's env:// initialisation reads.
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
# submitit's mark in the jobs it starts (its executor's name).
SUBMITIT_EXECUTOR = "SUBMITIT_EXECUTOR"
# Where nobody set MASTER_PORT, a scheduler's job takes a port derived from its id, so that
# two jobs sharing a node never pick the same one.
PORT_BASE, PORT_SPAN = 20000, 20000

# The container runtimes' own marks, asked in this order: (variable, its runtime) and
# (file at the root, its runtime). `container=NAME` is the convention of systemd-nspawn, LXC
# and podman; Kubernetes puts its service variables into every pod.
CONTAINER_VARIABLES = (("APPTAINER_CONTAINER", "apptainer"),
                       ("SINGULARITY_CONTAINER", "singularity"),
                       ("container", None), ("KUBERNETES_SERVICE_HOST", "kubernetes"))
CONTAINER_FILES = (("run/.containerenv", "podman"), (".dockerenv", "docker"),
                   (".singularity.d", "singularity"))


@dataclass(frozen=True)
class Environment:
    rank: int = 0  # global rank
    local_rank: int = 0  # rank on this node: the GPU it uses
    world_size: int = 1
    node_rank: int | None = None  # None: nobody said (a single process is node 0)
    num_nodes: int = 1
    scheduler: str | None = None  # whose job this process is: "slurm"; None: none's
    job_id: str | None = None  # the scheduler's id of the job (SLURM_JOB_ID)
    queue_id: str = ""  # the job as the queue lists it (ARRAYJOB_TASK); "" outside a job
    restart_count: int = 0  # the scheduler's requeues of this job
    # What the processes of one launch share (the run lock lets them into one run folder):
    # the scheduler's job and attempt, or torchrun's rendezvous; None for a process alone.
    launch_id: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: str = str(PORT_BASE)
    container: str | None = None  # docker, podman, apptainer, kubernetes...; None: none seen
    # The scheduler's variables a run records in provenance (its ids, never anything else).
    scheduler_variables: Mapping[str, str] = field(default_factory=dict)
    # The job's tasks in all (None: unknown) and its GPUs on this node (0: none given).
    job_tasks: int | None = None
    job_gpus_on_node: int = 0
    # Whether submitit started this process (a job labrun submitted: a sweep's, or a run's
    # that `python train.py cluster=lab` sent), rather than a person in their allocation.
    submitted_by_labrun: bool = False
    # An allocation this process holds but does not run in: the shell salloc leaves on a
    # login host, outside the allocation's nodes. Nothing of it applies here (this process is
    # in no job: scheduler is None); a cluster run goes into it (launch/cluster_run.py).
    allocation_elsewhere: SchedulerJob | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rendezvous(self) -> dict[str, str]:
        """The variables torch.distributed's env:// initialisation reads."""
        return {MASTER_ADDR: self.master_addr, MASTER_PORT: self.master_port}


def read(env: Mapping[str, str] | None = None, root: str | Path = "/") -> Environment:
    """This process's Environment (or that of `env`, a process's variables; `root`: the file
    system whose container marks are looked at)."""
    env = os.environ if env is None else env
    found = scheduler.of_job(env)
    job = found[1] if found is not None else None
    elsewhere = None
    if job is not None and not job.on_job_node:
        # A job is where its nodes are: this host is none of them, so this process has no
        # rank, node or launch of the job, and what trains here would train outside it.
        job, elsewhere = None, job
    ranks = _torchrun_ranks(env) or (job.ranks if job else None) or (0, 0, 1)
    node_rank = _digits(env.get("GROUP_RANK"))  # torchrun's node
    if node_rank is None and job is not None:
        node_rank = job.node_rank
    num_nodes = _digits(env.get("GROUP_WORLD_SIZE")) or (job.num_nodes if job else 1)
    if MASTER_ADDR in env:
        master_addr = env[MASTER_ADDR]
    else:
        master_addr = job.first_node if job and job.first_node else "127.0.0.1"
    if MASTER_PORT in env:
        master_port = env[MASTER_PORT]
    else:
        master_port = str(PORT_BASE + (_digits(job.job_id) or 0) % PORT_SPAN if job
                          else PORT_BASE)
    if job is not None:
        launch = f"{job.scheduler}:{job.job_id}:{job.restart_count}"
    elif env.get("TORCHELASTIC_RUN_ID") and env.get(MASTER_PORT):
        launch = (f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get(MASTER_ADDR, '')}:"
                  f"{env[MASTER_PORT]}")
    else:
        launch = None
    return Environment(
        rank=ranks[0], local_rank=ranks[1], world_size=ranks[2], node_rank=node_rank,
        num_nodes=num_nodes, scheduler=job.scheduler if job else None,
        job_id=job.job_id if job else None, queue_id=job.queue_id if job else "",
        restart_count=job.restart_count if job else 0, launch_id=launch,
        master_addr=master_addr, master_port=master_port, container=container(env, root),
        scheduler_variables=dict(job.recorded) if job else {},
        job_tasks=job.tasks if job else None, job_gpus_on_node=job.gpus_on_node if job else 0,
        submitted_by_labrun=bool(env.get(SUBMITIT_EXECUTOR)), allocation_elsewhere=elsewhere)


def _torchrun_ranks(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """torchrun's (or any launcher's that follows it) RANK, LOCAL_RANK and WORLD_SIZE."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    return None


def container(env: Mapping[str, str], root: str | Path = "/") -> str | None:
    """The container runtime this process runs in, from the runtime's own marks; None where
    none is seen (a bare machine, or a runtime that leaves no mark)."""
    for variable, runtime in CONTAINER_VARIABLES:
        if env.get(variable):
            return runtime or env[variable]
    for path, runtime in CONTAINER_FILES:
        if (Path(root) / path).exists():
            return runtime
    return None


def _digits(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None
