"""Bookkeeping shared by labrun's launchers: where each job runs, which jobs are already done,
the final table, and jobs.json for `labrun status`."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console
from rich.table import Table

from labrun.core.errors import LabrunError
from labrun.core.files import write_json_atomic

MANIFEST = "jobs.json"


class JobFailed(LabrunError):
    """A sweep job did not complete; the message names the job, its error and its log."""


@dataclass
class Job:
    num: int
    overrides: list[str]
    dir: str
    state: str = "pending"  # pending | skipped | submitted | running | completed | failed | ...
    job_id: str | None = None  # SLURM job id, or the local process id
    log: str | None = None
    gpus: str | None = None
    error: str | None = None
    metric: float | None = None
    # The local launcher's own record of the job's process: wall-clock epoch seconds just
    # before it started the process and just after it saw the process end, and its exit code.
    started_at: float | None = None
    ended_at: float | None = None
    returncode: int | None = None
    config: Any = field(default=None, repr=False)  # the job's composed config (not saved)

    @property
    def path(self) -> Path:
        return Path(self.dir)


def plan(hydra_context: HydraContext, master: DictConfig,
         job_overrides: list[list[str]] | tuple, initial_job_idx: int) -> list[Job]:
    """One Job per override list, in the sweep folder; jobs that already completed with the
    same config are marked skipped (a re-run sweep finishes only what is left)."""
    jobs = []
    for num, overrides in enumerate(job_overrides, start=initial_job_idx):
        cfg = hydra_context.config_loader.load_sweep_config(master, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = num
        job_dir = Path(str(master.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        job = Job(num=num, overrides=list(overrides), dir=str(job_dir.resolve()), config=cfg)
        if completed_with_same_config(job_dir, cfg):
            job.state = "skipped"
        jobs.append(job)
    return jobs


def completed_with_same_config(job_dir: Path, cfg: DictConfig) -> bool:
    summary, saved = job_dir / "summary.json", job_dir / ".hydra" / "config.yaml"
    if not (summary.is_file() and saved.is_file()):
        return False
    if json.loads(summary.read_text()).get("status") != "completed":
        return False
    current = OmegaConf.to_container(cfg, resolve=False)
    current.pop("hydra", None)
    return OmegaConf.to_container(OmegaConf.load(saved), resolve=False) == current


def read_summary(job_dir: Path) -> dict[str, Any]:
    path = job_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_result(job: Job) -> None:
    """Fill the job's state, metric and error from what the job itself wrote."""
    summary = read_summary(job.path)
    monitor = summary.get("monitor", "val/acc")
    job.metric = summary.get(f"best/{monitor}")
    status = summary.get("status")
    rank_errors = sorted((job.path / "errors").glob("rank-*.txt"))
    if rank_errors:  # a rank other than 0 failed: SLURM may still say COMPLETED
        job.state = "failed"
        job.error = "; ".join(p.read_text().strip() for p in rank_errors)
    elif status in ("completed", "failed", "interrupted"):
        if job.state != "skipped" or status != "completed":
            job.state = status
        job.error = summary.get("error") or job.error
    elif job.state not in ("skipped", "cancelled"):
        job.state = "failed"
        job.error = last_error_line(job.log) or job.error or "the job ended without a result"


def last_error_line(log: str | None) -> str | None:
    """The one-line `error: ...` a job printed before it stopped (a config mistake, say)."""
    if not log or not Path(log).is_file():
        return None
    lines = Path(log).read_text(errors="replace").splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    return errors[-1][len("error: "):] if errors else None


def job_return(job: Job) -> JobReturn:
    """The JobReturn Hydra's sweepers expect: the objective, or the failure."""
    ret = JobReturn(overrides=job.overrides, cfg=job.config, working_dir=job.dir,
                    task_name="train")
    if job.state in ("completed", "skipped"):
        ret.status, ret.return_value = JobStatus.COMPLETED, job.metric
    else:
        ret.status = JobStatus.FAILED
        ret.return_value = JobFailed(f"job {job.num} {job.state}: {job.error or 'no error recorded'}"
                                     f"; log: {job.log or job.dir}")
    return ret


def write_manifest(sweep_dir: Path, backend: str, jobs: list[Job], **extra: Any) -> None:
    """jobs.json: every job of the sweep so far (a search launches its trials in batches)."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / MANIFEST
    rows = {row["num"]: row for row in
            (json.loads(path.read_text())["jobs"] if path.is_file() else [])}
    rows.update({job.num: {k: v for k, v in asdict(job).items() if k != "config"}
                 for job in jobs})
    data = {"backend": backend, "jobs": [rows[num] for num in sorted(rows)], **extra}
    # Atomic: the local launcher rewrites it as each job ends, while `labrun status` may read.
    write_json_atomic(path, data)


def read_manifest(sweep_dir: Path) -> dict[str, Any]:
    path = sweep_dir / MANIFEST
    if not path.is_file():
        raise LabrunError(f"{sweep_dir} is not a labrun sweep folder (no {MANIFEST})")
    data = json.loads(path.read_text())
    data["jobs"] = [Job(**row) for row in data["jobs"]]
    return data


def varying_overrides(jobs: list[Job]) -> dict[int, str]:
    """Per job, only the overrides that differ between the sweep's jobs."""
    lists = [filter_overrides(job.overrides) for job in jobs]
    # One job alone (a search launches trials one by one): show all of its overrides.
    common = set.intersection(*(set(o) for o in lists)) if len(lists) > 1 else set()
    return {job.num: " ".join(o for o in overrides if o not in common) or "(defaults)"
            for job, overrides in zip(jobs, lists, strict=True)}


STYLE = {"completed": "green", "skipped": "green", "failed": "red", "interrupted": "yellow",
         "cancelled": "yellow", "running": "cyan", "submitted": "cyan", "pending": "dim"}


def print_table(jobs: list[Job], title: str, console: Console | None = None) -> None:
    # Not a terminal (a log file, CI): wide enough that paths stay on one line.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=title, title_justify="left")
    for column in ("job", "overrides", "state", "best", "id"):
        table.add_column(column, no_wrap=column in ("state", "best", "id"))
    table.add_column("log / error", overflow="fold")
    labels = varying_overrides(jobs)
    for job in jobs:
        state = "completed (earlier)" if job.state == "skipped" else job.state
        detail = job.error if job.error and job.state not in ("completed", "skipped") else ""
        where = job.log or job.dir
        table.add_row(str(job.num), labels[job.num], f"[{STYLE.get(job.state, '')}]{state}",
                      "" if job.metric is None else f"{job.metric:.4f}", job.job_id or "",
                      f"{where}\n{detail}" if detail else where)
    console.print(table)
    failed = [j for j in jobs if j.state not in ("completed", "skipped")]
    if failed:
        console.print(f"{len(failed)} of {len(jobs)} jobs did not complete; run the same "
                      f"command again (same hydra.sweep.dir) to finish only those.")
