"""Schedulers: what labrun asks about the place a cluster type runs its jobs. Is this job
alive, what states are these jobs in, what is this node's address towards the controller,
what are the cluster's limits, who has used how much of their share and why do jobs wait.

Modules ask here (and core.environment, for the variables a job's processes get) instead of
reading a scheduler's variables or running its commands themselves; tests/test_where_jobs_run.py
holds them to it. A cluster type is one Scheduler class (base.Scheduler is the protocol),
registered with `register`, a launcher in launch/ and a conf/cluster/NAME.yaml.

    named("slurm")       the scheduler behind jobs.json's "backend" (or a launch id's first word)
    of_job(env)          the scheduler whose job this process is, and that job
    here()               the scheduler this process works with: its job's, else SLURM where this
                         machine is a SLURM client, else this machine
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

from labrun.core import probes
from labrun.core.errors import LabrunError, one_line
from labrun.core.scheduler.base import (  # noqa: F401 - the package's interface
    ACTIVE_STATES,
    LIVE_STATES,
    WAITING_STATES,
    ClusterLimits,
    FairShare,
    NodeLimits,
    PendingJob,
    QosLimits,
    Scheduler,
    SchedulerJob,
)
from labrun.core.scheduler.local import LocalScheduler
from labrun.core.scheduler.slurm import SlurmScheduler

# name -> class. SLURM first: a process is asked in this order whose job it is.
SCHEDULERS: dict[str, type[Scheduler]] = {"slurm": SlurmScheduler, "local": LocalScheduler}


def register(cls: type[Scheduler]) -> type[Scheduler]:
    """Make a scheduler of another cluster type known by its `name` (usable as a decorator);
    its module is imported by its launcher's, in the submitting process and in the jobs."""
    SCHEDULERS[cls.name] = cls
    return cls


def named(name: str, defined_in: str | None = None) -> Scheduler:
    """The scheduler `name`; `defined_in` (jobs.json's "scheduler": module.Class) is imported
    for one that this process has not met yet (a lab's own, in `labrun status`)."""
    if name not in SCHEDULERS and defined_in:
        module, _, cls = defined_in.rpartition(".")
        try:
            register(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError) as error:
            raise LabrunError(f"scheduler {name!r}: cannot import {defined_in} "
                              f"({one_line(error)})") from None
    if name not in SCHEDULERS:
        raise LabrunError(f"no scheduler named {name!r}; known: {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]()


def path_of(cls: type[Scheduler]) -> str:
    """Where `named` finds the class again: module.Class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def of_job(env: Mapping[str, str] | None = None) -> tuple[Scheduler, SchedulerJob] | None:
    """(the scheduler, this process's job) for a process one of them started; else None."""
    env = os.environ if env is None else env
    for cls in SCHEDULERS.values():
        job = cls.read_job(env)
        if job is not None:
            return cls(), job
    return None


def here() -> Scheduler:
    found = of_job()
    if found is not None:
        return found[0]
    if probes.is_slurm_client():
        return SlurmScheduler()
    return LocalScheduler()
