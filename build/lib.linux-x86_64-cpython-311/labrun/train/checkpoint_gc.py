"""`labrun gc SWEEP_DIR [--keep-best K] [--dry-run]`: a sweep's checkpoint budget, applied to
its folder on disk.

Each finished job (summary.json "completed" or "pruned") keeps what its saved
checkpoint.on_finish says ("auto", in a sweep job's config, is best_last). With keep_best=K the
jobs outside the top K by their checkpoint.monitor keep no checkpoint at all; their metrics,
summary and config stay, so `labrun compare` and `labrun rerun` still work. A job that has not
finished (failed, interrupted, waiting, running) keeps everything it would resume from, and a run
folder whose lock a live process holds is not touched. Each folder is cleaned with its lock held,
by CheckpointManager, the checkpoint folder's one owner: a resume cannot start in it meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from labrun.config.objective import DEFAULT_MODE, best_first
from labrun.runs import lock as run_lock
from labrun.runs.lock_holder import live_holder
from labrun.runs.sweepdir import Job, SweepDir, read_result
from labrun.train.checkpoint import CheckpointManager


@dataclass
class Collection:
    removed: list[tuple[Path, int]] = field(default_factory=list)  # each file, bytes freed
    kept: list[str] = field(default_factory=list)  # why a job's folder was left as it is

    @property
    def freed(self) -> int:
        return sum(size for _, size in self.removed)


def collect(sweep_dir: Path, keep_best: int | None = None, dry_run: bool = False
            ) -> Collection:
    """Remove (dry_run: list) what the sweep's finished jobs need not keep."""
    jobs = SweepDir(sweep_dir).read_jobs()["jobs"]
    finished = []
    result = Collection()
    for job in jobs:
        status = job.run_dir.read_summary().get("status")
        if status in ("completed", "pruned"):
            read_result(job)  # its metric, for keep_best
            finished.append(job)
        else:
            result.kept.append(f"job {job.num}: {status or 'not started'}, kept whole to "
                               f"resume from")
    best = set(top(finished, keep_best)) if keep_best is not None else None
    for job in finished:
        config = job.run_dir.saved_config_node()
        policy = config.checkpoint.get("on_finish", "auto") if config is not None else "auto"
        policy = "best_last" if policy == "auto" else policy
        if best is not None and job.num not in best:
            policy = "none"
        holder = live_holder(job.run_dir.lock_path)
        if holder is not None:
            result.kept.append(f"job {job.num}: {holder.who()} holds its folder; not touched")
            continue
        lock = None if dry_run else run_lock.acquire(job.run_dir.lock_path)
        try:
            checkpoints = CheckpointManager(job.run_dir.checkpoints_dir)
            result.removed += checkpoints.keep_on_finish(policy, dry_run)
        finally:
            if lock is not None:
                lock.release()
    return result


def top(jobs: list[Job], k: int) -> list[int]:
    """The numbers of the `k` best jobs by their metric (checkpoint.monitor, in its mode);
    a job without a metric ranks last."""
    def rank(job: Job) -> tuple[bool, float]:
        config = job.run_dir.saved_config_node()
        mode = DEFAULT_MODE if config is None else config.checkpoint.get("mode", DEFAULT_MODE)
        return job.metric is None, best_first(mode)(job.metric or 0.0)

    return [job.num for job in sorted(jobs, key=rank)[:k]]
