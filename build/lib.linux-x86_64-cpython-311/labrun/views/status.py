"""`labrun status SWEEP_DIR|RUN_DIR [--json]`: each job of a sweep, or the one run of a run
folder: its state, its metric and how well it uses its hardware, now.

Works for detached SLURM sweeps (`cluster.detach=true`) and for local ones: the job list comes
from the sweep's jobs.json, the state from each job's own summary.json, and, for jobs that
have not written a result yet, from the sweep's scheduler (core/scheduler: one query for all of
them). The figures (the rate in the task's unit: images/s, tokens/s; the data-wait fraction,
GPU utilisation) and the verdict with its fix come from each run folder (views/efficiency.py).
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrun.config.objective import DEFAULT_MODE, maximizes
from labrun.core import scheduler
from labrun.core.errors import LabrunError
from labrun.core.scheduler import LIVE_STATES
from labrun.runs.lock_holder import live_holder
from labrun.runs.rundir import Objective, RunDir
from labrun.runs.sweepdir import (
    ENDED,
    FINISHED,
    MANIFEST,
    Job,
    SweepDir,
    ended_without_result,
    has_ended,
    open_storage,
    print_table,
    read_result,
)
from labrun.views.efficiency import Efficiency, measure

# How often `labrun status --wait` looks again: a sweep's jobs take minutes to hours.
WAIT_POLL_S = 5.0
# A job's state (lower-case, as the table shows it) while it may still run.
NOT_ENDED = frozenset({"submitted", "running"} | {s.lower() for s in LIVE_STATES})


@dataclass
class Status:
    path: Path
    kind: str  # "sweep" | "run"
    backend: str | None  # the sweep's launcher: local | slurm (None for a run folder)
    jobs: list[Job]
    efficiency: dict[int, Efficiency]  # job num -> its figures

    @property
    def title(self) -> str:
        if self.kind == "sweep":
            return f"sweep {self.path} ({self.backend})"
        return f"run {self.path}" + (f" ({self.backend})" if self.backend else "")

    def as_dict(self) -> dict[str, Any]:
        jobs = []
        for job in self.jobs:
            summary = job.run_dir.read_summary()
            jobs.append({"num": job.num, "overrides": job.overrides, "run_dir": job.dir,
                         "state": job.state, "monitor": Objective.of(summary).monitor,
                         "metric": job.metric, "error": job.error, "job_id": job.job_id,
                         **self.efficiency[job.num].as_dict()})
        disk = SweepDir(self.path).disk_use() if self.kind == "sweep" else None
        return {"path": str(self.path), "kind": self.kind, "backend": self.backend,
                "jobs": jobs, "disk_bytes": disk[0] if disk else None,
                "checkpoint_bytes": disk[1] if disk else None}


def scheduler_states(manifest: dict[str, Any], job_ids: list[str]) -> dict[str, str]:
    """The state of each job id (array elements as 12_3), lower-case, from the scheduler that
    jobs.json names; {} where it cannot be asked (this machine is no client of it, or its
    controller is down)."""
    try:
        states = scheduler.named(manifest["backend"], manifest.get("scheduler")
                                 ).job_states(job_ids)
    except LabrunError:
        return {}
    return {job_id: state.lower() for job_id, state in states.items()}


def sweep_jobs(sweep_dir: Path) -> tuple[list[Job], str]:
    """The sweep's jobs with their state now, and the sweep's backend."""
    manifest = SweepDir(sweep_dir).read_jobs()
    jobs = manifest["jobs"]
    summaries = {job.num: job.run_dir.read_summary() for job in jobs}
    # Only jobs without a result are asked about: a finished sweep costs no query.
    unfinished = [job.job_id for job in jobs
                  if job.job_id and not has_ended(job, summaries[job.num])]
    states = scheduler_states(manifest, unfinished) if unfinished else {}
    for job in jobs:
        summary = summaries[job.num]
        state = states.get(job.job_id or "", "")
        if has_ended(job, summary):  # pruned included: an Optuna search stopped it
            read_result(job)
        elif state == "running" or (state not in NOT_ENDED
                                    and live_holder(job.run_dir.lock_path)):
            # The scheduler says so, or a live process holds its run folder (a local job whose
            # controller is gone; a cluster whose controller does not answer now): never
            # "failed" while it trains.
            job.state = "running"
            job.metric = Objective.of(summary).best
        elif state:
            job.state = state  # pending, requeued, or ended without a result (failed, timeout)
            if state not in NOT_ENDED:  # what it printed before it stopped, Python's or not
                job.error = ended_without_result(job, state.upper())
        elif summary.get("status") == "running" and job.job_id:
            read_result(job)  # its process is gone without a result: failed
        if summary.get("requeued"):  # preempted or its node failed, then resumed
            job.state = f"{job.state} (requeued {summary['requeued']}x)"
    return jobs, manifest["backend"]


def run_folder_as_job(run_dir: RunDir) -> Job:
    """A run folder as a sweep's job would show: its state and metric from its summary."""
    job = Job(num=0, overrides=run_dir.try_overrides() or [], dir=str(run_dir.path))
    summary = run_dir.read_summary()
    if summary.get("status") in ENDED or run_dir.rank_errors():
        read_result(job)
    else:  # running, or started without a summary yet (it may have stopped at a config error)
        job.state = summary.get("status") or "no summary"
        job.metric = Objective.of(summary).best
    if summary.get("requeued"):
        job.state = f"{job.state} (requeued {summary['requeued']}x)"
    return job


def collect(path: Path) -> Status:
    """The jobs of a sweep folder, or the run of a run folder, with their figures."""
    path = path.resolve()
    if (path / MANIFEST).is_file():
        jobs, backend = sweep_jobs(path)
        # A run sent to a cluster without -m: its folder records its one job, itself.
        kind = "run" if [Path(job.dir) for job in jobs] == [path] else "sweep"
    elif RunDir(path).is_run():
        jobs, backend, kind = [run_folder_as_job(RunDir(path))], None, "run"
    elif not path.exists():
        raise LabrunError(f"{path} does not exist; give a sweep folder "
                          f"(multirun/DATE/TIME-XXXX) or a run folder")
    else:
        raise LabrunError(f"{path} is neither a sweep folder (no {MANIFEST}) nor a run folder "
                          f"(no .hydra/ or summary.json); give multirun/DATE/TIME-XXXX, one of "
                          f"its job folders, or outputs/DATE/TIME-XXXX")
    return Status(path, kind, backend, jobs, {job.num: measure(job.run_dir) for job in jobs})


def study_lines(path: Path) -> list[str]:
    """An Optuna study's progress, for a sweep folder that holds one (jobs.json's "study"):
    its trials by state, the best so far with its parameters, and a detached study's
    controller job and its state."""
    manifest = SweepDir(path).read_jobs()
    study_record = manifest.get("study")
    if not study_record:
        return []
    import optuna

    storage = optuna.storages.get_storage(open_storage(study_record["storage"]))
    try:
        study = optuna.load_study(study_name=study_record["name"], storage=storage)
    except KeyError:  # not created yet: a detached study's controller has not started
        lines = [f"study {study_record['name']}: no trial yet"]
    else:
        lines = study_progress(study, study_record)
    controller = manifest.get("controller")
    if controller:
        state = controller.get("state", "")
        if state != "cancelled":
            state = scheduler_states(manifest, [controller["job_id"]]).get(
                controller["job_id"], state)
        lines.append(f"controller: SLURM job {controller['job_id']}, {state} "
                     f"(log {controller['log']})")
    return lines


def study_progress(study: Any, study_record: dict[str, Any]) -> list[str]:
    """The study's trials by state, and the best so far with its parameters."""
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name.lower()] = counts.get(trial.state.name.lower(), 0) + 1
    lines = [f"study {study_record['name']}: {study_record['n_trials']} trials wanted; "
             + ", ".join(f"{counts.get(k, 0)} {name}" for k, name in (
                 ("complete", "finished"), ("running", "running"), ("pruned", "pruned"),
                 ("fail", "failed")))]
    try:
        best = study.best_trial
        params = " ".join(f"{key}={value}" for key, value in best.params.items())
        lines.append(f"best so far: trial {best.number}, {best.value:.4g} with {params}")
    except ValueError:  # no trial completed yet
        lines.append("best so far: none (no trial completed yet)")
    return lines


def show(path: Path, as_json: bool = False, every_row: bool = False) -> None:
    """Print the table (or JSON) of the jobs as they are now, then each verdict's fix. More
    jobs than a screen holds (and not `every_row`): the counts by state, then only the rows
    that need a look."""
    status = collect(path)
    if as_json:
        print(json.dumps(status.as_dict(), indent=2))
        return
    rows = status.jobs
    if not every_row and len(rows) > screenful():
        print(state_counts(rows))
        rows = needing_a_look(rows)
    if rows:
        print_table(rows, status.title, efficiency=status.efficiency,
                    sweep=status.kind == "sweep")
    if len(rows) < len(status.jobs):
        print(f"{len(rows)} of {len(status.jobs)} jobs shown (failed, running, the best); "
              f"every row: labrun status {status.path} --all")
    if status.kind == "sweep":
        for line in study_lines(status.path):
            print(line)
        print(disk_line(status.path))
    for job in status.jobs:
        figures = status.efficiency[job.num]
        if figures.fix:
            who = f"job {job.num}: " if status.kind == "sweep" else ""
            # Plain print: one unwrapped line per fix, whatever the terminal's width.
            print(f"{who}{figures.verdict}: {figures.reason}; {figures.fix}")


def screenful() -> int:
    """How many rows `labrun status` shows before it sums up: the terminal's height less the
    lines around the table (50 lines where there is no terminal)."""
    return max(10, shutil.get_terminal_size((200, 50)).lines - 10)


def state_counts(jobs: list[Job]) -> str:
    """`5000 jobs: 4990 pending, 8 running, 2 failed`, the most frequent state first."""
    counts = Counter(job.state.split(" (")[0] for job in jobs)
    return f"{len(jobs)} jobs: " + ", ".join(f"{n} {state}" for state, n in counts.most_common())


# The rows of each kind that a summed-up status shows, at most.
LOOK_ROWS = 10


def needing_a_look(jobs: list[Job]) -> list[Job]:
    """The jobs that did not complete and have ended (failed, cancelled, timed out...), those
    running, and the best completed ones by their monitor, LOOK_ROWS of each at most, in job
    order; waiting and completed jobs are counted only."""
    ended_badly = [job for job in jobs if job.job_id and not not_ended(job)
                   and job.state.split(" (")[0] not in FINISHED]
    running = [job for job in jobs if job.state.split(" (")[0] == "running"]
    done = [job for job in jobs if job.state in FINISHED and job.metric is not None]
    # The monitor's direction, as the runs' summaries record it (one for the whole sweep).
    mode = done[0].run_dir.read_objective().mode if done else DEFAULT_MODE
    best = sorted(done, key=lambda job: job.metric, reverse=maximizes(mode))
    shown = {job.num: job for job in [*ended_badly[:LOOK_ROWS], *running[:LOOK_ROWS],
                                      *best[:LOOK_ROWS]]}
    return [shown[num] for num in sorted(shown)]


def disk_line(path: Path) -> str:
    """What the sweep folder holds on disk, for `labrun status` (`labrun gc` frees some)."""
    from rich.filesize import decimal

    total, checkpoints = SweepDir(path).disk_use()
    return (f"disk: {decimal(total)}, of which checkpoints {decimal(checkpoints)} "
            f"(labrun gc {path} --dry-run: what the finished jobs need not keep)")


def not_ended(job: Job) -> bool:
    """Whether the job, as collect() found it, may still run ("running (requeued 1x)" too);
    a job never submitted (no id) will not run unless the sweep is run again."""
    return bool(job.job_id) and job.state.split(" (")[0] in NOT_ENDED


def wait(path: Path, poll_s: float = WAIT_POLL_S) -> int:
    """`labrun status SWEEP_DIR|RUN_DIR --wait`: wait until every job has ended, then print the table;
    0 when every job completed, 1 when some did not. Waiting cancels nothing (Ctrl-C: 130)."""
    while any(not_ended(job) for job in collect(path).jobs):
        time.sleep(poll_s)
    show(path)
    return 0 if all(job.state.split(" (")[0] in FINISHED for job in collect(path).jobs) else 1
