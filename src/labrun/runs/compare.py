"""`labrun compare SWEEP_DIR|RUN_DIR...`: one row per run, from the run folders alone.

Each row shows the overrides that differ between the runs (.hydra/overrides.yaml), the status,
the best and final value of the metric, epochs and wall time; rows are sorted best first by
--metric/--mode (default: the runs' checkpoint.monitor and checkpoint.mode), and runs that did
not complete (failed, running, interrupted) come last with their status. The same table goes
to the terminal (rich), to --csv and to --markdown; --plot draws learning curves and, for a
sweep over one numeric parameter, the metric against that parameter.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from labrun.core.errors import LabrunError
from labrun.core.files import read_jsonl

NOT_METRICS = {"step", "epoch", "time"}  # bookkeeping columns of metrics.jsonl
STATUS_STYLE = {"completed": "green", "failed": "red", "running": "yellow",
                "interrupted": "magenta"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="run folders, or folders with run folders below them (a sweep)")
    parser.add_argument("--metric", help="the metric to rank by (default: the runs' "
                                         "checkpoint.monitor, e.g. val/acc)")
    parser.add_argument("--mode", choices=("max", "min"),
                        help="max or min is best (default: the runs' checkpoint.mode for their "
                             "monitor; otherwise min for losses and errors, max for the rest)")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV")
    parser.add_argument("--markdown", type=Path, metavar="FILE",
                        help="write the table as Markdown (for a pull request)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="learning curves (and metric vs the swept parameter) as a PNG")


def run(args: argparse.Namespace) -> int:
    runs = [load_run(path) for path in find_runs(args.paths)]
    name_runs(runs)
    metric, mode = choose_metric(runs, args.metric, args.mode)
    for one in runs:
        one.best, one.final = best_and_final(one, metric, mode)
    runs.sort(key=lambda one: sort_key(one, mode))
    keys = differing_overrides(runs)
    columns, rows = table(runs, keys, metric)
    title = f"{len(runs)} run(s), sorted by best {metric} ({mode})"
    print_table(title, columns, rows, runs)
    if args.csv:
        write_csv(args.csv, columns, rows)
        print(f"wrote {args.csv}")
    if args.markdown:
        write_markdown(args.markdown, title, columns, rows)
        print(f"wrote {args.markdown}")
    if args.plot:
        panels = plot(args.plot, runs, metric, mode, numeric_parameter(runs, keys))
        print(f"wrote {args.plot} ({panels})")
    return 0


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


def is_run_folder(path: Path) -> bool:
    return (path / ".hydra").is_dir() or (path / "summary.json").is_file()


def find_runs(paths: list[Path]) -> list[Path]:
    """The run folders among `paths` and below them (a sweep, or a folder of sweeps)."""
    found: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise LabrunError(f"{path}: no such folder")
        if is_run_folder(path):
            found.append(path)
            continue
        below = []
        for folder, subfolders, _ in os.walk(path):
            subfolders.sort(key=natural_key)
            if is_run_folder(Path(folder)) and Path(folder) != path:
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
    run = Run(path=path, history=read_jsonl(path / "metrics.jsonl"))
    summary_file = path / "summary.json"
    if summary_file.is_file():
        try:
            run.summary = json.loads(summary_file.read_text())
        except json.JSONDecodeError:
            run.summary = {}  # half-written by a crash: status shows as unknown
    hydra = path / ".hydra"
    run.overrides = parse_overrides(_load_yaml(hydra / "overrides.yaml") or [])
    checkpoint = (_load_yaml(hydra / "config.yaml") or {}).get("checkpoint") or {}
    run.monitor = checkpoint.get("monitor") or run.summary.get("monitor")
    run.mode = checkpoint.get("mode")
    run.seconds = wall_time(run, hydra / "config.yaml")
    return run


def _load_yaml(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    """`optimizer.lr=0.01` -> {"optimizer.lr": "0.01"}; Hydra's own settings are left out."""
    parsed = {}
    for override in overrides:
        key, _, value = str(override).partition("=")
        key = key.lstrip("+")
        if not key.startswith("hydra."):
            parsed[key] = value
    return parsed


def wall_time(run: Run, config_file: Path) -> float | None:
    """Seconds from the run's start to its end, or to its last logged point while it runs.

    The start is the earliest of: summary.json's started_at, when Hydra wrote the config, and
    the first logged point (which comes only after log_every_n_steps steps). Taking the
    earliest keeps a resumed run's first start, and a copied folder's later file times out.
    """
    times = [row["time"] for row in run.history if _is_number(row.get("time"))]
    starts = times[:1]
    if _is_number(run.summary.get("started_at")):
        starts.append(run.summary["started_at"])
    if config_file.is_file():
        starts.append(config_file.stat().st_mtime)
    ended = run.summary.get("ended_at")
    end = ended if _is_number(ended) else max(times, default=None)
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
        metric = monitors.pop() if monitors else "val/acc"
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
        for row in one.history:
            names.update(key for key, value in row.items() if _is_number(value))
        names.update(key for key, value in one.summary.items() if _is_number(value))
    return names - NOT_METRICS


def default_mode(runs: list[Run], metric: str) -> str:
    """The runs' checkpoint.mode when they monitor `metric`; else a guess from the name."""
    modes = {one.mode for one in runs if one.monitor == metric and one.mode}
    if len(modes) == 1:
        return modes.pop()
    lower_is_better = ("loss", "error", "err", "time", "wait")
    return "min" if any(word in metric.split("/")[-1] for word in lower_is_better) else "max"


def best_and_final(run: Run, metric: str, mode: str) -> tuple[float | None, float | None]:
    values = [row[metric] for row in run.history if _is_number(row.get(metric))]
    if values:
        return (max(values) if mode == "max" else min(values)), values[-1]
    # No history (metrics.jsonl lost): the summary keeps the last and the monitored best.
    final = run.summary.get(metric) if _is_number(run.summary.get(metric)) else None
    best = run.summary.get(f"best/{metric}")
    return (best if _is_number(best) else final), final


def sort_key(run: Run, mode: str) -> tuple:
    """Completed runs first, best first; then the rest, also best first; no value last."""
    if run.best is None:
        return (run.status != "completed", 1, 0.0)
    return (run.status != "completed", 0, -run.best if mode == "max" else run.best)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def differing_overrides(runs: list[Run]) -> list[str]:
    """The override keys whose value is not the same in every run, in first-seen order."""
    keys = list(dict.fromkeys(key for one in runs for key in one.overrides))
    return [key for key in keys if len({one.overrides.get(key) for one in runs}) > 1]


# ---------------------------------------------------------------------------------------------
# The table: raw values per row, formatted for the terminal and Markdown; CSV keeps numbers


def table(runs: list[Run], keys: list[str], metric: str) -> tuple[list[str], list[list[Any]]]:
    columns = ["run", *keys, "status", f"best {metric}", f"final {metric}", "epochs", "time"]
    rows = [[one.name, *(one.overrides.get(key) for key in keys), one.status, one.best,
             one.final, one.epochs, one.seconds] for one in runs]
    return columns, rows


def fmt(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if column == "time":
        return duration(value)
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.4g}"
    return str(value)


def duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def is_numeric(column: str) -> bool:
    """Columns of numbers, right-aligned in the table and the Markdown."""
    return column.startswith(("best ", "final ")) or column in ("epochs", "time")


def print_table(title: str, columns: list[str], rows: list[list[Any]], runs: list[Run]) -> None:
    view = Table(title=title, title_justify="left")
    for column in columns:
        view.add_column(column, justify="right" if is_numeric(column) else "left",
                        overflow="fold")
    status_at = columns.index("status")
    for row in rows:
        cells = [escape(fmt(value, column)) for value, column in zip(row, columns, strict=True)]
        style = STATUS_STYLE.get(row[status_at], "dim")
        cells[status_at] = f"[{style}]{cells[status_at]}[/]"
        view.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=1000)  # a log or a pipe: the whole table, never cut to 80
    console.print(view)
    for one in runs:
        if one.summary.get("error"):
            console.print(f"{one.name}: {one.status}: {one.summary['error']}", markup=False,
                          highlight=False)


def write_csv(path: Path, columns: list[str], rows: list[list[Any]]) -> None:
    """Numbers stay numbers (full precision; time in seconds) for spreadsheets and pandas."""
    header = ["time_s" if column == "time" else column for column in columns]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([["" if value is None else value for value in row] for row in rows])


def write_markdown(path: Path, title: str, columns: list[str], rows: list[list[Any]]) -> None:
    def cell(text: str) -> str:
        return text.replace("|", r"\|")

    right = {i for i, c in enumerate(columns) if is_numeric(c)}
    lines = [f"**{title}**", "",
             "| " + " | ".join(cell(c) for c in columns) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(columns))) + " |"]
    for row in rows:
        cells = [cell(fmt(value, column)) for value, column in zip(row, columns, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------
# The plot


def numeric_parameter(runs: list[Run], keys: list[str]) -> str | None:
    """The swept parameter when exactly one override differs and its values are numbers."""
    if len(keys) != 1:
        return None
    values = [one.overrides[keys[0]] for one in runs if keys[0] in one.overrides]
    try:
        numbers = {float(value) for value in values}
    except ValueError:
        return None
    return keys[0] if len(numbers) > 1 else None


def plot(path: Path, runs: list[Run], metric: str, mode: str, parameter: str | None) -> str:
    """Learning curves, and best metric vs `parameter` when given. Returns what it drew."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    panels = 2 if parameter else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False, dpi=100)
    curves = axes[0][0]
    for one in _in_parameter_order(runs, parameter):
        points = [(row["step"], row[metric]) for row in one.history
                  if _is_number(row.get(metric)) and _is_number(row.get("step"))]
        if points:
            steps, values = zip(*points, strict=True)
            curves.plot(steps, values, marker="o", markersize=3, label=_label(one, parameter))
    curves.set(xlabel="step", ylabel=metric, title=f"{metric} per run")
    curves.grid(alpha=0.3)
    if curves.lines:
        curves.legend(fontsize="small")
    drawn = "learning curves"
    if parameter:
        _plot_parameter(axes[0][1], runs, metric, mode, parameter)
        drawn += f"; best {metric} vs {parameter}"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


def _plot_parameter(ax, runs: list[Run], metric: str, mode: str, parameter: str) -> None:
    points = sorted((float(one.overrides[parameter]), one.best) for one in runs
                    if parameter in one.overrides and one.best is not None)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o")
        if min(xs) > 0 and max(xs) / min(xs) > 10:
            ax.set_xscale("log")  # learning rates and weight decays are swept in decades
    ax.set(xlabel=parameter, ylabel=f"best {metric} ({mode})",
           title=f"best {metric} vs {parameter}")
    ax.grid(alpha=0.3)


def _in_parameter_order(runs: list[Run], parameter: str | None) -> list[Run]:
    """The legend reads in the order of the swept values (lr 0.001, 0.01, 0.1)."""
    if not parameter:
        return runs
    return sorted(runs, key=lambda one: float(one.overrides.get(parameter, math.inf)))


def _label(run: Run, parameter: str | None) -> str:
    if parameter and parameter in run.overrides:
        label = f"{parameter}={run.overrides[parameter]}"
    else:
        label = run.name
    return label if run.status == "completed" else f"{label} ({run.status})"
