"""This machine as a scheduler: where cluster=local runs a sweep's jobs, each a submitit
LocalExecutor job whose id is the pid of its controller process.

Nothing queues here at the scheduler's level (the local launcher keeps its waiting jobs in its
own memory), nobody else shares the machine's account, and the machine is its own only node.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Mapping

from labrun.core import probes
from labrun.core.scheduler.base import (
    ClusterLimits,
    FairShare,
    NodeLimits,
    PendingJob,
    SchedulerJob,
)

# What the controller of a submitit local job runs: `python -m submitit.local._local FOLDER`.
# A pid is only taken for a job when its process is that, not another process that reused it.
CONTROLLER = b"submitit.local._local"
PARTITION = "local"


class LocalScheduler:
    name = "local"

    @staticmethod
    def read_job(env: Mapping[str, str]) -> SchedulerJob | None:
        # A local job is a plain process of this machine: no scheduler variables name it (its
        # ranks, if any, come from torchrun's).
        return None

    def job_alive(self, job_id: str) -> bool | None:
        return _is_controller(job_id)

    def job_states(self, job_ids: Iterable[str]) -> dict[str, str]:
        """RUNNING for each job whose controller runs; an ended job is left out (its own run
        folder says how it ended)."""
        return {i: "RUNNING" for i in dict.fromkeys(job_ids) if i and _is_controller(i)}

    def cancel(self, job_ids: Iterable[str]) -> None:
        """SIGTERM to each job's controller, which passes it on to the job: a stop request, on
        which the job saves a checkpoint (submitit's own cancel sends SIGINT, on which the
        controller kills the job a second later, too soon for one)."""
        for job_id in dict.fromkeys(job_ids):
            if job_id and _is_controller(job_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(job_id), signal.SIGTERM)

    def node_address(self) -> tuple[str | None, str]:
        return None, "this machine is no node of a cluster (no scheduler's controller to route to)"

    def limits(self) -> ClusterLimits:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        node = NodeLimits(len(os.sched_getaffinity(0)), memory, probes.gpu_count())
        return ClusterLimits({PARTITION: node}, PARTITION, max_array_size=None, qos={})

    def queued(self, user: str | None = None, account: str | None = None,
               qos: str | None = None) -> int:
        return 0  # no queue: a local job starts when a GPU is free

    def fair_share(self) -> list[FairShare]:
        return []

    def pending(self) -> list[PendingJob]:
        return []


def _is_controller(pid: str) -> bool:
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            return CONTROLLER in f.read()
    except (OSError, ValueError):  # gone, or no pid at all
        return False
