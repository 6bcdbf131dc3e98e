"""SweepDir: the one owner of a sweep folder's jobs.json, and what a sweep's jobs show.

    SWEEP/
      jobs.json       {"backend": "local"|"slurm", "jobs": [Job, ...], ...extra (snapshot)}
                      each Job row: its current attempt (job_id, state, log, times) and
                      `attempts`, the earlier ones, so a job submitted again loses no record
      0/, 1/, ...     one run folder per job (RunDir)
      optuna.journal  an Optuna study's storage (hparams_search=optuna; open_storage)
      .dashboard/     `labrun dashboard`'s own files (views/dashboard.py)

The launchers (labrun.launch) write jobs.json as jobs start and end; `labrun status` reads it.
Each job's outcome comes from its own run folder (read_result), never from the launcher's
memory, so a table printed by the launcher and one printed later by `labrun status` agree.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from stat import S_ISREG
from typing import TYPE_CHECKING, Any

from hydra.core.utils import filter_overrides
from rich.console import Console
from rich.table import Table
from rich.text import Text

from labrun.core.errors import LabrunError
from labrun.core.files import write_json_atomic
from labrun.runs.rundir import Objective, RunDir

if TYPE_CHECKING:
    from labrun.views.efficiency import Efficiency

MANIFEST = "jobs.json"
# The summary.json statuses of a run that has ended ("pruned": an Optuna search stopped it early,
# train/pruning.py; an outcome, not a failure).
ENDED = ("completed", "pruned", "failed", "interrupted")
# Jobs in these states need not run again.
FINISHED = ("completed", "skipped", "pruned")
# The `+callbacks.optuna.*` overrides an Optuna trial gets for its pruning callback
# (train/pruning.py): its storage, study and trial number. Plumbing, not parameters: the tables
# and plots of a sweep leave them out.
TRIAL_CALLBACK = "callbacks.optuna"


@dataclass
class Job:
    num: int
    overrides: list[str]
    dir: str
    # pending | skipped | submitted | running | completed | pruned | failed | interrupted | ...
    state: str = "pending"
    job_id: str | None = None  # SLURM job id, or the local job's submitit id (its controller's pid)
    log: str | None = None
    gpus: str | None = None
    error: str | None = None
    metric: float | None = None
    # The launcher's own record of the job: wall-clock epoch seconds just before it started
    # the job's process (local) and just after it saw the job end, and its exit code (local).
    started_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    submitted_at: float | None = None  # when this attempt was submitted (epoch seconds)
    submitit_dir: str | None = None  # submitit's files of this attempt: the call, its result
    cancelled_at: float | None = None  # when `labrun cancel` cancelled it
    # Earlier attempts of this job, oldest first: {job_id, state, log, submitted_at, ended_at}.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    config: Any = field(default=None, repr=False)  # the job's composed config (not saved)

    def attempt(self) -> dict[str, Any]:
        """This attempt as a row of `attempts`, before the job is submitted again."""
        return {"job_id": self.job_id, "state": self.state, "log": self.log,
                "submitted_at": self.submitted_at or self.started_at, "ended_at": self.ended_at,
                "cancelled_at": self.cancelled_at}

    @property
    def path(self) -> Path:
        return Path(self.dir)

    @property
    def run_dir(self) -> RunDir:
        return RunDir(self.dir)


class SweepDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"SweepDir({str(self.path)!r})"

    @property
    def jobs_path(self) -> Path:
        return self.path / MANIFEST

    def write_jobs(self, backend: str, jobs: list[Job], **extra: Any) -> None:
        """jobs.json with these jobs' rows (the other rows, and the other keys, stay: a search
        records its trials one by one, a detached study its controller)."""
        self.path.mkdir(parents=True, exist_ok=True)
        old = json.loads(self.jobs_path.read_text()) if self.jobs_path.is_file() else {}
        rows = {row["num"]: row for row in old.get("jobs", [])}
        # Not asdict(), which deep-copies every field, the job's whole config included.
        rows.update({job.num: {f.name: getattr(job, f.name) for f in fields(job)
                               if f.name != "config"} for job in jobs})
        data = {**old, "backend": backend, "jobs": [rows[num] for num in sorted(rows)], **extra}
        # Atomic: the local launcher rewrites it as each job ends, while `labrun status` may read.
        write_json_atomic(self.jobs_path, data)

    def update_controller(self, **values: Any) -> None:
        """A detached study's "controller" record in jobs.json, with `values` added."""
        data = json.loads(self.jobs_path.read_text())
        data["controller"] = {**data.get("controller", {}), **values}
        write_json_atomic(self.jobs_path, data)

    def earlier_jobs(self) -> dict[int, Job]:
        """job num -> the Job an earlier launch into this folder recorded ({} if none)."""
        if not self.jobs_path.is_file():
            return {}
        return {job.num: job for job in self.read_jobs()["jobs"]}

    def disk_use(self) -> tuple[int, int]:
        """Bytes the sweep folder holds on disk, and of those its jobs' checkpoints/ folders;
        a file under several names (best.pt and last.pt are hard links to a step file)
        counts once."""
        seen: set[tuple[int, int]] = set()
        total = checkpoints = 0
        for path in self.path.rglob("*"):
            try:
                stat = path.lstat()
            except FileNotFoundError:  # removed while walking (a job's rotation)
                continue
            if not S_ISREG(stat.st_mode) or (stat.st_dev, stat.st_ino) in seen:
                continue
            seen.add((stat.st_dev, stat.st_ino))
            total += stat.st_size
            checkpoints += stat.st_size if RunDir.of_checkpoint(path) is not None else 0
        return total, checkpoints

    def study_record(self) -> dict[str, str] | None:
        """{"name", "storage"} of the Optuna study this sweep folder runs (jobs.json), or None
        (a grid sweep, or no jobs.json)."""
        try:
            study = json.loads(self.jobs_path.read_text()).get("study")
        except (OSError, ValueError):
            return None
        return study if isinstance(study, dict) and study.get("storage") else None

    def study(self) -> Any:
        """The Optuna study of study_record(), loaded from its storage; None without one or
        when its journal file is gone (a sweep folder copied without it)."""
        record = self.study_record()
        if record is None or ("://" not in record["storage"]
                              and not Path(record["storage"]).is_file()):
            return None
        import optuna

        return optuna.load_study(study_name=record["name"], storage=open_storage(record["storage"]))

    def read_jobs(self) -> dict[str, Any]:
        """jobs.json with its "jobs" as Job objects; LabrunError when the folder has none."""
        if not self.jobs_path.is_file():
            raise LabrunError(f"{self.path} is not a labrun sweep folder (no {MANIFEST})")
        data = json.loads(self.jobs_path.read_text())
        data["jobs"] = [Job(**row) for row in data["jobs"]]
        return data


def open_storage(spec: str) -> Any:
    """The study's storage: a database URL as Optuna takes it (sqlite:///..., postgresql://...),
    or else the path of a journal file, the storage Optuna made for many processes on a shared
    file system (appends under a lock file made with symlink(), which NFS performs
    atomically)."""
    if "://" in spec:
        return spec
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(spec))


def has_ended(job: Job, summary: dict[str, Any]) -> bool:
    """Whether the run folder's `summary` tells how the job's current attempt ended: it says
    ended, and not before the attempt was submitted (a job submitted again, to resume, still
    finds its earlier attempt's "interrupted" there until it starts)."""
    return summary.get("status") in ENDED and (
        job.submitted_at is None or summary.get("ended_at", job.submitted_at) >= job.submitted_at)


def read_result(job: Job) -> None:
    """Fill the job's state, metric and error from what the job itself wrote."""
    run_dir = job.run_dir
    summary = run_dir.read_summary()
    job.metric = Objective.of(summary).best
    status = summary.get("status")
    rank_errors = run_dir.rank_errors()
    if job.cancelled_at and status != "completed":  # stopped by `labrun cancel`
        job.state = "cancelled"
        return
    if rank_errors:  # a rank other than 0 failed: SLURM may still say COMPLETED
        job.state = "failed"
        job.error = "; ".join(rank_errors)
    elif status in ENDED:
        if job.state != "skipped" or status != "completed":
            job.state = status
        job.error = summary.get("error") or job.error
    elif job.state not in ("skipped", "cancelled"):
        job.state = "failed"
        job.error = last_error_line(job.log) or job.error or "the job ended without a result"


def submitit_result_path(job: Job) -> Path | None:
    """Where submitit writes the result of the job's call (its first task's), once made."""
    if not job.submitit_dir or not job.job_id:
        return None
    from submitit.core.utils import JobPaths

    return JobPaths(job.submitit_dir, job.job_id, 0).result_pickle


def submitit_result(job: Job) -> tuple[str, Any] | None:
    """What submitit recorded of the job's call: ("success", its return value) or ("error",
    the traceback as text); None when there is no result (killed, cancelled, still running)."""
    path = submitit_result_path(job)
    if path is None:
        return None
    from submitit.core.utils import pickle_load

    try:
        return pickle_load(path)
    except (OSError, EOFError, ValueError):
        return None


# The lines of a job's stderr that say why it failed: a Python exception's last line,
# labrun's one-line `error: ...`, and the words of what ran before Python (a container
# runtime's `Error: ...`, srun's and slurmstepd's `error: ...`).
ERROR_LINE = re.compile(r"^([\w.]+(Error|Exception|Interrupt)|[Ee]rror|srun: error|"
                        r"slurmstepd: error): ")
# srun's own line after any task's failure, which says no more than the state does.
SRUN_TASK_EXIT = re.compile(r"^srun: error: \S+: tasks? [\d,-]+: Exited with exit code")


def ended_without_result(job: Job, state: str) -> str:
    """Why a scheduler's job that left no result ended: its state, and the last error line of
    its stderr (submitit's ID_0_log.err beside job.log, the stdout)."""
    stderr = Path(job.log).with_suffix(".err") if job.log else None
    return f"SLURM state {state}{last_stderr_error(stderr) if stderr else ''}"


def last_stderr_error(stderr: Path) -> str:
    """`: ValueError: ...`, the last error line of a job's stderr (ERROR_LINE), srun's generic
    task-exit line only when nothing else says more; nothing when none is there."""
    if not stderr.is_file():
        return ""
    lines = [line for line in stderr.read_text(errors="replace").splitlines()
             if ERROR_LINE.match(line)]
    telling = [line for line in lines if not SRUN_TASK_EXIT.match(line)] or lines
    return f": {telling[-1][:200]}" if telling else ""


def last_error_line(log: str | None) -> str | None:
    """The one-line `error: ...` a job printed before it stopped (a config mistake, say)."""
    if not log or not Path(log).is_file():
        return None
    lines = Path(log).read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1][len("error: "):] if errors else None


# ---------------------------------------------------------------------------------------------
# The table a sweep ends with, and `labrun status` prints


def num_ranges(nums: list[int]) -> str:
    """Job numbers as ranges, `0-4999,5002`: a cancelled 5,000-job sweep in one short line
    (python-hostlist's ranges of node numbers, without the brackets around them)."""
    import hostlist

    return hostlist.collect_hostlist([str(num) for num in nums]).strip("[]")


def varying_overrides(jobs: list[Job]) -> dict[int, str]:
    """Per job, only the overrides that differ between the sweep's jobs."""
    lists = [[o for o in filter_overrides(job.overrides)
              if not o.lstrip("+").startswith(f"{TRIAL_CALLBACK}.")] for job in jobs]
    # One job alone (a search launches trials one by one): show all of its overrides.
    common = set.intersection(*(set(o) for o in lists)) if len(lists) > 1 else set()
    return {job.num: " ".join(o for o in overrides if o not in common) or "(defaults)"
            for job, overrides in zip(jobs, lists, strict=True)}


STYLE = {"completed": "green", "skipped": "green", "pruned": "blue", "failed": "red",
         "interrupted": "yellow",
         "cancelled": "yellow", "running": "cyan", "submitted": "cyan", "pending": "dim"}


def print_table(jobs: list[Job], title: str, console: Console | None = None,
                efficiency: dict[int, Efficiency] | None = None, sweep: bool = True) -> None:
    """The jobs' table; with `efficiency` (job num -> its figures, `labrun status`), columns
    for the rate (img/s, tok/s: the unit in the header when every job has the same), data
    wait, GPU utilisation and the verdict. `sweep`: a sweep's jobs (a run
    folder alone gets no advice about re-running the sweep)."""
    # Not a terminal (a log file, CI): wide enough that paths stay on one line.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=title, title_justify="left")
    for column in ("job", "overrides", "state", "best"):
        table.add_column(column, no_wrap=column in ("state", "best"))
    units = {figures.unit for figures in (efficiency or {}).values()}
    unit = units.pop() if len(units) == 1 else None  # None: each cell says its own
    if efficiency is not None:
        for column in (unit or "rate", "data wait", "GPU"):
            table.add_column(column, no_wrap=True, justify="right")
        table.add_column("verdict", no_wrap=True)
    table.add_column("id", no_wrap=True)
    table.add_column("log / error", overflow="fold")
    labels = varying_overrides(jobs)
    for job in jobs:
        state = "completed (earlier)" if job.state == "skipped" else job.state
        detail = job.error if job.error and job.state not in FINISHED else ""
        where = job.log or job.dir
        figures = [] if efficiency is None else _efficiency_cells(efficiency[job.num], unit)
        # Overrides, paths and errors as text, not rich markup: mounts=[/opt/lab] is no tag.
        table.add_row(str(job.num), Text(labels[job.num]),
                      f"[{STYLE.get(job.state, '')}]{state}",
                      "" if job.metric is None else f"{job.metric:.4f}", *figures,
                      job.job_id or "", Text(f"{where}\n{detail}" if detail else str(where)))
    console.print(table)
    failed = [j for j in jobs if j.state not in FINISHED]
    if failed and sweep:
        console.print(f"{len(failed)} of {len(jobs)} jobs did not complete; run the same "
                      f"command again (same hydra.sweep.dir) to finish only those.")


VERDICT_STYLE = {"healthy": "green", "data-bound": "red", "GPU idle": "yellow",
                 "underused": "yellow", "no data yet": "dim"}


def _efficiency_cells(figures: Efficiency, unit: str | None) -> list[str]:
    """The rate (with its unit unless the header has it), data wait, GPU, verdict; "-" for a
    figure not measured."""
    def percent(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    rate = figures.rate
    rate = "-" if rate is None else f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
    if unit is None and figures.rate is not None:
        rate = f"{rate} {figures.unit}"
    verdict = f"[{VERDICT_STYLE.get(figures.verdict, '')}]{figures.verdict}"
    return [rate, percent(figures.data_wait_frac), percent(figures.gpu_util), verdict]


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    """`optimizer.lr=0.01` -> {"optimizer.lr": "0.01"}. Hydra's own settings and the plumbing
    of an Optuna trial's pruning callback (its storage, study and trial number) are left out:
    neither is something a person varied."""
    parsed = {}
    for override in overrides:
        key, _, value = str(override).partition("=")
        key = key.lstrip("+")
        if not key.startswith(("hydra.", f"{TRIAL_CALLBACK}.")):
            parsed[key] = value
    return parsed
