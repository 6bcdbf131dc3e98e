"""`labrun compare SWEEP_DIR|RUN_DIR...`: one row per run, from the run folders alone.

Each row shows the overrides that differ between the runs (.hydra/overrides.yaml), the status,
the best and final value of the metric, epochs and wall time; rows are sorted best first by
--metric/--mode (default: the runs' checkpoint.monitor and checkpoint.mode), and runs that did
not complete (pruned by an Optuna search, failed, running, interrupted) come last with their
status. The same table goes to the terminal (rich), to --csv and to --markdown; --plot draws
learning curves labelled by the overrides that vary, the best value against each numeric one,
and an Optuna study's parameter importances (compare_output.py).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labrun.config.objective import DEFAULT_MONITOR, best_first, best_of
from labrun.core.errors import LabrunError
from labrun.runs import provenance
from labrun.runs.rundir import ROW_BOOKKEEPING, RunDir, best_key, is_metric_value
from labrun.runs.sweepdir import SweepDir, parse_overrides
from labrun.views import compare_output as output

log = logging.getLogger(__name__)


@dataclass
class Comparison:
    """The runs best first by `metric` (`mode`), the override keys that vary among them, and
    those of the keys whose values are numbers (the plot's parameters)."""

    runs: list[Run]
    metric: str
    mode: str
    keys: list[str]
    parameters: list[str] = field(default_factory=list)


def compare(paths: list[Path], *, metric: str | None = None, mode: str | None = None,
            csv_file: Path | None = None, markdown: Path | None = None,
            plot_file: Path | None = None) -> list[Run]:
    """The whole command: read, rank, print the table, write the files asked for."""
    ranked = rank(paths, metric, mode)
    runs, metric = ranked.runs, ranked.metric
    columns, rows = output.table(runs, ranked.keys, metric)
    title = f"{len(runs)} run(s), sorted by best {metric} ({ranked.mode})"
    output.print_table(title, columns, rows, runs)
    write_tables(title, columns, rows, csv_file, markdown)
    if plot_file:
        importances = study_importances(paths, ranked)
        panels = output.plot(plot_file, ranked, importances)
        log.info("wrote %s (%s)", plot_file, panels)
    return runs


def write_tables(title: str, columns: list[str], rows: list[list[Any]],
                 csv_file: Path | None, markdown: Path | None) -> None:
    """The table as the files asked for: CSV (numbers as numbers) and Markdown."""
    if csv_file:
        output.write_csv(csv_file, columns, rows)
        log.info("wrote %s", csv_file)
    if markdown:
        output.write_markdown(markdown, title, columns, rows)
        log.info("wrote %s", markdown)


def rank(paths: list[Path], metric: str | None = None, mode: str | None = None) -> Comparison:
    """Read the run folders among `paths` and rank them (what compare and dashboard share)."""
    runs = [load_run(path) for path in find_runs(paths)]
    name_runs(runs)
    metric, mode = choose_metric(runs, metric, mode)
    for one in runs:
        one.best, one.final = best_and_final(one, metric, mode)
    runs.sort(key=lambda one: sort_key(one, mode))
    keys = differing_overrides(runs)
    return Comparison(runs, metric, mode, keys, numeric_parameters(runs, keys))


# ---------------------------------------------------------------------------------------------
# Reading run folders


@dataclass
class Run:
    path: Path
    name: str = ""
    overrides: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    monitor: str | None = None  # checkpoint.monitor and .mode of the run's config
    mode: str | None = None
    seconds: float | None = None
    best: float | None = None
    final: float | None = None
    weights: str | None = None  # where its starting weights came from, and their sha256

    @property
    def status(self) -> str:
        # No summary.json: the job stopped before training started (a config error, say).
        return self.summary.get("status") or "unknown"

    @property
    def epochs(self) -> int | None:
        if isinstance(self.summary.get("epoch"), int):
            return self.summary["epoch"]
        epochs = [row["epoch"] for row in self.history if isinstance(row.get("epoch"), int)]
        return max(epochs, default=None)


def find_runs(paths: list[Path]) -> list[Path]:
    """The run folders among `paths` and below them (a sweep, or a folder of sweeps)."""
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise LabrunError(f"{path}: no such folder")
        if RunDir(path).is_run():
            found.append(path)
            continue
        below = []
        for folder, subfolders, _ in os.walk(path):
            subfolders.sort(key=natural_key)
            if RunDir(folder).is_run() and Path(folder) != path:
                below.append(Path(folder))
                subfolders.clear()  # a run's own folders (checkpoints/, wandb/) are not runs
            else:
                subfolders[:] = [s for s in subfolders if not s.startswith(".")]
        if not below:
            raise LabrunError(f"{path}: no run folders in it (a run folder holds .hydra/ or "
                              f"summary.json)")
        found += below
    return list(dict.fromkeys(path.resolve() for path in found))


def natural_key(name: str | Path) -> list:
    """Sweep job folders in numeric order: 2 before 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(name))]


def load_run(path: Path) -> Run:
    folder = RunDir(path)
    # A summary half-written by a crash reads as {}: the status shows as unknown.
    run = Run(path=path, history=folder.read_metrics(), summary=folder.read_summary())
    run.overrides = parse_overrides(folder.try_overrides() or [])
    run.monitor, run.mode = run.summary.get("monitor"), run.summary.get("mode")
    if not (run.monitor and run.mode):  # a run from before summary.json recorded its mode
        checkpoint = (folder.try_saved_config() or {}).get("checkpoint") or {}
        run.monitor = checkpoint.get("monitor") or run.monitor
        run.mode = checkpoint.get("mode")
    run.seconds = wall_time(run, folder.config_path)
    for stem, metrics in folder.read_evals().items():  # `labrun eval`'s results
        run.summary.update({f"eval/{stem}/{name}": value for name, value in metrics.items()})
    started = provenance.read_weights(folder.provenance_dir)
    if started:
        run.weights = f"{started.get('source')} sha256:{str(started.get('sha256'))[:12]}"
    return run


def wall_time(run: Run, config_file: Path) -> float | None:
    """Seconds from the run's start to its end, or to its last logged point while it runs.

    The start is the earliest of: summary.json's started_at, when Hydra wrote the config, and
    the first logged point (which comes only after log_every_n_steps steps). Taking the
    earliest keeps a resumed run's first start, and a copied folder's later file times out.
    """
    times = [row["time"] for row in run.history if is_metric_value(row.get("time"))]
    starts = times[:1]
    if is_metric_value(run.summary.get("started_at")):
        starts.append(run.summary["started_at"])
    if config_file.is_file():
        starts.append(config_file.stat().st_mtime)
    ended = run.summary.get("ended_at")
    end = ended if is_metric_value(ended) else max(times, default=None)
    if end is None or not starts:
        return None
    return max(end - min(starts), 0.0)


def name_runs(runs: list[Run]) -> None:
    """Name each run by its path below the runs' common folder (a sweep's 0, 1, 2...)."""
    paths = [str(one.path) for one in runs]
    common = os.path.commonpath(paths) if len(paths) > 1 else str(runs[0].path.parent)
    for one in runs:
        one.name = os.path.relpath(one.path, common)


# ---------------------------------------------------------------------------------------------
# The metric and the ranking


def choose_metric(runs: list[Run], metric: str | None, mode: str | None) -> tuple[str, str]:
    monitors = {one.monitor for one in runs if one.monitor}
    if metric is None:
        if len(monitors) > 1:
            raise LabrunError(f"the runs monitor different metrics ({', '.join(sorted(monitors))})"
                              f"; choose one with --metric")
        metric = monitors.pop() if monitors else DEFAULT_MONITOR
    known = known_metrics(runs)
    if metric not in known:
        hint = difflib.get_close_matches(metric, sorted(known), n=1)
        did_you_mean = f"did you mean {hint[0]}? " if hint else ""
        raise LabrunError(f"metric {metric} is in none of the {len(runs)} run(s); {did_you_mean}"
                          f"known metrics: {', '.join(sorted(known)) or 'none yet'}")
    return metric, mode or default_mode(runs, metric)


def known_metrics(runs: list[Run]) -> set[str]:
    names = set()
    for one in runs:
        for row in one.history:  # metrics.jsonl holds only metrics (null for a NaN) and
            names.update(row)    # its bookkeeping columns
        names.update(key for key, value in one.summary.items() if is_metric_value(value))
    return names - ROW_BOOKKEEPING


def default_mode(runs: list[Run], metric: str) -> str:
    """The runs' checkpoint.mode when they monitor `metric`; else a guess from the name."""
    modes = {one.mode for one in runs if one.monitor == metric and one.mode}
    if len(modes) == 1:
        return modes.pop()
    lower_is_better = ("loss", "error", "err", "time", "wait")
    return "min" if any(word in metric.split("/")[-1] for word in lower_is_better) else "max"


def best_and_final(run: Run, metric: str, mode: str) -> tuple[float | None, float | None]:
    values = [row[metric] for row in run.history if is_metric_value(row.get(metric))]
    if values:
        return best_of(values, mode), values[-1]
    # No history (metrics.jsonl lost): the summary keeps the last and the monitored best.
    final = run.summary.get(metric) if is_metric_value(run.summary.get(metric)) else None
    best = run.summary.get(best_key(metric))
    return (best if is_metric_value(best) else final), final


def sort_key(run: Run, mode: str) -> tuple:
    """Completed runs first, best first; then the rest, also best first; no value last."""
    if run.best is None:
        return (run.status != "completed", 1, 0.0)
    return (run.status != "completed", 0, best_first(mode)(run.best))


def differing_overrides(runs: list[Run]) -> list[str]:
    """The override keys whose value is not the same in every run, in first-seen order."""
    keys = list(dict.fromkeys(key for one in runs for key in one.overrides))
    return [key for key in keys if len({one.overrides.get(key) for one in runs}) > 1]


def numeric_parameters(runs: list[Run], keys: list[str]) -> list[str]:
    """The varying overrides whose values are all numbers (one panel each in the plot)."""
    numeric = []
    for key in keys:
        try:
            numbers = {float(one.overrides[key]) for one in runs if key in one.overrides}
        except ValueError:
            continue
        if len(numbers) > 1:
            numeric.append(key)
    return numeric


def study_importances(paths: list[Path], ranked: Comparison) -> dict[str, float] | None:
    """Optuna's parameter importances when the one folder compared is a study's sweep folder
    (its jobs.json names the study); None otherwise, or while fewer than two trials have
    completed (Optuna needs them to say anything)."""
    if len(paths) != 1:
        return None
    study = SweepDir(paths[0]).study()
    if study is None:
        return None
    import optuna

    finished = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(finished) < 2 or not any(trial.params for trial in finished):
        return None
    return optuna.importance.get_param_importances(study)
