"""`labrun compare`'s output: the terminal table (rich), CSV, Markdown and the plot.

The rows come from labrun.runs.compare (which reads and ranks the run folders); this module
only formats them.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from labrun.runs.rundir import is_metric_value

if TYPE_CHECKING:  # compare imports this module; the type alone comes back
    from labrun.runs.compare import Run

STATUS_STYLE = {"completed": "green", "pruned": "blue", "failed": "red", "running": "yellow",
                "interrupted": "magenta"}


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
                  if is_metric_value(row.get(metric)) and is_metric_value(row.get("step"))]
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
