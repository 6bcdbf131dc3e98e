"""What every scheduler answers, whatever runs the jobs: the Scheduler protocol and the types
of its answers.

Job states use SLURM's names (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...) whatever
the scheduler: they are the names jobs.json, `labrun status` and the run lock already speak,
and a scheduler of another kind maps its own states onto them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

# States in which a job's processes may still be running (so it may still write its run folder).
ACTIVE_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED",
                           "SIGNALING", "RESIZING", "STAGE_OUT"})
# States in which a job waits to start (again): queued, held, requeued after preemption.
WAITING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                            "RESV_DEL_HOLD"})
# A job in one of these has not ended: a sweep attaches to it rather than submitting it again.
LIVE_STATES = ACTIVE_STATES | WAITING_STATES


@dataclass(frozen=True)
class SchedulerJob:
    """What a scheduler tells the processes of one of its jobs, read from their environment."""

    scheduler: str  # the Scheduler's name: "slurm"
    job_id: str  # this process's job, as the scheduler's commands take it (SLURM_JOB_ID)
    queue_id: str  # the same job as the queue lists it: ARRAYJOB_TASK for an array element
    restart_count: int = 0  # how often the scheduler requeued the job (preemption, node failure)
    node_rank: int | None = None  # which of the job's nodes this process is on
    num_nodes: int = 1
    # (rank, local rank, world size) when the scheduler itself started one process per rank
    # (srun with several tasks); None when it started one process.
    ranks: tuple[int, int, int] | None = None
    first_node: str | None = None  # the job's first host: the rendezvous where nobody set one
    # The scheduler's own variables a run records in provenance/environment.json.
    recorded: Mapping[str, str] = field(default_factory=dict)
    # What the job was given: its tasks in all (None: the scheduler did not say) and GPUs on
    # this node (0: none), which a run started inside a person's allocation checks it fits.
    tasks: int | None = None
    gpus_on_node: int = 0
    # Whether this process runs on one of the job's nodes. False: an allocation this process
    # holds from another host (the shell salloc leaves on a login host), where a run that
    # trained here would train outside it; `nodelist` names where it is (node[1-2]).
    on_job_node: bool = True
    nodelist: str = ""


@dataclass(frozen=True)
class NodeLimits:
    """The largest node of a partition: what one job may ask for per node."""

    cpus: int
    mem_mb: int
    gpus: int


@dataclass(frozen=True)
class QosLimits:
    """A QOS's limits on submitted and running jobs; None: no limit."""

    max_submit_per_user: int | None = None
    max_submit_per_account: int | None = None
    max_jobs_per_user: int | None = None


@dataclass(frozen=True)
class ClusterLimits:
    partitions: dict[str, NodeLimits]  # each partition's largest node
    default_partition: str | None  # where a job that names no partition goes
    max_array_size: int | None  # array indices must be below it; None: no arrays or no limit
    qos: dict[str, QosLimits]
    max_job_count: int | None = None  # jobs the controller holds at once, all users; None: any


@dataclass(frozen=True)
class FairShare:
    """One user's share of one account: 1.0 has used nothing of it, towards 0 far more."""

    account: str
    user: str
    share: float  # the normalised share
    usage: int  # raw usage (CPU-seconds weighted by the TRES billing)
    effective_usage: float
    fairshare: float | None  # the factor; None when the scheduler gives none


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    user: str
    account: str
    qos: str
    priority: int
    reason: str  # why it waits: Priority, Resources, JobHeldUser, QOSMaxSubmitJobPerUser...
    expected_start: str  # "N/A" when the scheduler cannot tell
    name: str
    jobs: int = 1  # how many jobs the row stands for: a waiting job array's every task
    gpus: int = 0  # the GPUs they ask for, all of them together


class Scheduler(Protocol):
    """Where a cluster type's jobs run, as labrun's modules ask about it. Implementations:
    slurm.SlurmScheduler, local.LocalScheduler; another is registered with
    labrun.core.scheduler.register."""

    name: ClassVar[str]  # jobs.json's "backend", the first word of a launch id

    @staticmethod
    def read_job(env: Mapping[str, str]) -> SchedulerJob | None:
        """This process's job, from the variables the scheduler sets; None: not one of its
        jobs."""

    def job_alive(self, job_id: str) -> bool | None:
        """Whether the job may still have processes running; None: the scheduler cannot tell."""

    def job_states(self, job_ids: Iterable[str]) -> dict[str, str]:
        """The state of each job the scheduler knows, asked in one query whatever the number
        of jobs (array elements as ARRAYJOB_TASK); ids it does not know are left out."""

    def cancel(self, job_ids: Iterable[str]) -> None:
        """Stop these jobs, waiting or running, as the scheduler's own cancel does (a running
        job gets SIGTERM first, on which it saves a checkpoint); ids that ended are no error."""

    def node_address(self) -> tuple[str | None, str]:
        """(this node's address on the route to the scheduler's controller, "") or (None, why
        there is none): where a monitoring server beside the controller reaches this node."""

    def limits(self) -> ClusterLimits:
        """Partitions and their largest node, the largest job array, the QOS submit limits."""

    def queued(self, user: str | None = None, account: str | None = None,
               qos: str | None = None) -> int:
        """How many jobs (array elements each) wait or run now, of `user`, `account` and `qos`
        where given: what a submit limit counts. One query."""

    def fair_share(self) -> list[FairShare]:
        """Every user's share of every account, for `labrun queue`."""

    def pending(self) -> list[PendingJob]:
        """Jobs waiting to start, highest priority first, with the reason each waits."""
