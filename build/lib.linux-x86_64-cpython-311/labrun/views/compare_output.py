"""`labrun compare`'s output: the terminal table (rich), CSV, Markdown and the plot.

The rows come from labrun.views.compare (which reads and ranks the run folders); this module
only formats them.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from labrun.runs.rundir import is_metric_value

if TYPE_CHECKING:  # compare imports this module; the types alone come back
    from labrun.views.aggregate import Aggregate
    from labrun.views.compare import Comparison, Run

STATUS_STYLE = {"completed": "green", "pruned": "blue", "failed": "red", "running": "yellow",
                "interrupted": "magenta"}


# ---------------------------------------------------------------------------------------------
# The table: raw values per row, formatted for the terminal and Markdown; CSV keeps numbers


def table(runs: list[Run], keys: list[str], metric: str) -> tuple[list[str], list[list[Any]]]:
    columns = ["run", *keys, "status", f"best {metric}", f"final {metric}", "epochs", "time"]
    rows = [[one.name, *(one.overrides.get(key) for key in keys), one.status, one.best,
             one.final, one.epochs, one.seconds] for one in runs]
    if any(one.weights for one in runs):  # fine-tuned runs: what each started from
        columns.append("weights")
        for row, one in zip(rows, runs, strict=True):
            row.append(one.weights)
    return columns, rows


def aggregate_table(agg: Aggregate) -> tuple[list[str], list[list[Any]]]:
    """One row per configuration of the keys not folded away: n, then each metric's Stats."""
    columns = [*agg.keys, "n", *agg.columns]
    rows = [[*group.values.values(), group.count, *(group.stats[c] for c in agg.columns)]
            for group in agg.groups]
    return columns, rows


def fmt(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if hasattr(value, "text"):  # aggregate.Stats: mean ± std
        return value.text()
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
    return column.startswith(("best ", "final ")) or column in ("epochs", "time", "n")


def print_table(title: str, columns: list[str], rows: list[list[Any]], runs: list[Run]) -> None:
    view = Table(title=title, title_justify="left")
    for column in columns:
        view.add_column(column, justify="right" if is_numeric(column) else "left",
                        overflow="fold")
    status_at = columns.index("status") if "status" in columns else None  # none: aggregated
    for row in rows:
        cells = [escape(fmt(value, column)) for value, column in zip(row, columns, strict=True)]
        if status_at is not None:
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
    """Numbers stay numbers (full precision; time in seconds) for spreadsheets and pandas; an
    aggregated metric is five columns: mean, std, min, max, n."""
    stats = {i for i, value in enumerate(rows[0] if rows else []) if hasattr(value, "text")}
    header = []
    for i, column in enumerate(columns):
        names = [f"{column} {part}" for part in STATS_PARTS] if i in stats else [column]
        header += ["time_s" if column == "time" else name for name in names]

    def cells(row: list[Any]) -> list[Any]:
        out = []
        for i, value in enumerate(row):
            out += [getattr(value, part) for part in STATS_PARTS] if i in stats else [value]
        return ["" if value is None else value for value in out]

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([cells(row) for row in rows])


STATS_PARTS = ("mean", "std", "min", "max", "n")


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

LABELLED = 10  # curves named in the legend; the rest are drawn thin and grey
PANELS_A_ROW = 3
LINE_STYLE = {"completed": "-", "running": "-", "pruned": "--"}  # failed, interrupted: ":"
MARKER = {"completed": "o", "running": "o", "pruned": "v"}  # failed, interrupted: "x"


def plot(path: Path, ranked: Comparison, importances: dict[str, float] | None) -> str:
    """The figure() as a PNG; returns what it drew."""
    import matplotlib.pyplot as plt

    fig, drawn = figure(ranked, importances)
    fig.savefig(path)
    plt.close(fig)
    return drawn


def figure(ranked: Comparison, importances: dict[str, float] | None) -> tuple[Any, str]:
    """Learning curves labelled by the overrides that vary (the top LABELLED runs; the others
    thin and grey), one panel of the best value against each numeric parameter that varies,
    and the study's parameter importances when given. Pruned and failed runs are drawn
    dashed and dotted, and marked in the legend and the parameter panels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    parameters = ranked.parameters
    count = 1 + len(parameters) + bool(importances)
    columns = min(count, PANELS_A_ROW)
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4.5 * rows), squeeze=False,
                             dpi=100)
    panels = list(axes.flat)
    for spare in panels[count:]:
        spare.set_visible(False)
    drawn = [_plot_curves(panels[0], ranked, parameters)]
    for ax, parameter in zip(panels[1:], parameters, strict=False):
        _plot_parameter(ax, ranked, parameter)
        drawn.append(f"best {ranked.metric} vs {parameter}")
    if importances:
        _plot_importances(panels[len(parameters) + 1], importances)
        drawn.append("parameter importances")
    fig.tight_layout()
    return fig, "; ".join(drawn)


def plot_aggregate(path: Path, agg: Aggregate) -> str:
    """The ranked metric's mean curve per row, with a band of one standard deviation, at the
    steps every completed run of the row logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    short = short_names(agg.keys)
    for group in agg.groups[:LABELLED]:
        curves = [dict(_points(one, agg.metric)) for one in group.completed]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if not steps:
            continue
        values = [[curve[step] for curve in curves] for step in steps]
        means = [sum(v) / len(v) for v in values]
        spread = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
        name = " ".join(f"{short[k]}={_value(v)}" for k, v in group.values.items()) or "all"
        line, = ax.plot(steps, means, marker="o", markersize=3,
                        label=f"{name} (n={len(curves)})")
        ax.fill_between(steps, [m - s for m, s in zip(means, spread, strict=True)],
                        [m + s for m, s in zip(means, spread, strict=True)],
                        color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel=agg.metric,
           title=f"{agg.metric}: mean ± std over {', '.join(agg.over)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"mean curves with a band of one std, over {', '.join(agg.over)}"


def _plot_curves(ax, ranked: Comparison, parameters: list[str]) -> str:
    metric = ranked.metric
    with_points = [(one, _points(one, metric)) for one in ranked.runs]
    with_points = [(one, points) for one, points in with_points if points]
    named = with_points[:LABELLED]  # the runs are ranked best first
    if len(parameters) == 1 and len(with_points) <= LABELLED:
        # Every run named: the legend reads in the swept values' order (lr 0.001, 0.01, 0.1).
        named.sort(key=lambda pair: float(pair[0].overrides.get(parameters[0], math.inf)))
    for _, points in with_points[LABELLED:]:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, color="0.75", linewidth=0.6, zorder=1, label="_nolegend_")
    for one, points in named:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, marker="o", markersize=3, zorder=2,
                linestyle=LINE_STYLE.get(one.status, ":"), label=label(one, ranked.keys))
    others = len(with_points) - len(named)
    title = f"{metric} per run" + (f" (top {len(named)}; {others} more in grey)" if others else "")
    ax.set(xlabel="step", ylabel=metric, title=title)
    ax.grid(alpha=0.3)
    if named:
        ax.legend(fontsize="small")
    return "learning curves" + (f" of the top {len(named)}" if others else "")


def _points(run: Run, metric: str) -> list[tuple[float, float]]:
    return [(row["step"], row[metric]) for row in run.history
            if is_metric_value(row.get(metric)) and is_metric_value(row.get("step"))]


def _plot_parameter(ax, ranked: Comparison, parameter: str) -> None:
    """Best value against one parameter: completed runs as dots (joined when this is the only
    parameter that varies), pruned and failed runs marked apart."""
    by_status: dict[str, list[tuple[float, float]]] = {}
    for one in ranked.runs:
        if parameter in one.overrides and one.best is not None:
            point = (float(one.overrides[parameter]), one.best)
            by_status.setdefault(one.status, []).append(point)
    alone = len(ranked.keys) == 1
    for status, points in sorted(by_status.items(), key=lambda item: item[0] != "completed"):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker=MARKER.get(status, "x"), markersize=4 if alone else 3,
                linestyle="-" if alone and status == "completed" else "none",
                label=status, color=STATUS_COLOR.get(status, "tab:red"))
    xs = [x for points in by_status.values() for x, _ in points]
    if xs and min(xs) > 0 and max(xs) / min(xs) > 10:
        ax.set_xscale("log")  # learning rates and weight decays are swept in decades
    ax.set(xlabel=parameter, ylabel=f"best {ranked.metric} ({ranked.mode})",
           title=f"best {ranked.metric} vs {parameter}")
    ax.grid(alpha=0.3)
    if len(by_status) > 1:
        ax.legend(fontsize="small")


def _plot_importances(ax, importances: dict[str, float]) -> None:
    """Optuna's importances (optuna.importance, fANOVA by default), largest on top."""
    names = list(importances)[::-1]
    ax.barh(names, [importances[name] for name in names], color="tab:blue")
    ax.set(xlabel="importance (Optuna, fANOVA)", title="parameter importances")
    ax.grid(alpha=0.3, axis="x")


STATUS_COLOR = {"completed": "tab:blue", "running": "tab:olive", "pruned": "tab:gray"}


def label(run: Run, keys: list[str]) -> str:
    """The run by the overrides that vary (`lr=0.003 wd=0.05`), its status when it did not
    complete; its folder's name when nothing varies."""
    short = short_names(keys)
    parts = [f"{short[key]}={_value(run.overrides[key])}" for key in keys
             if key in run.overrides]
    text = " ".join(parts) or run.name
    return text if run.status == "completed" else f"{text} ({run.status})"


def short_names(keys: list[str]) -> dict[str, str]:
    """Each key by its last part (optimizer.lr -> lr) unless two keys would read the same."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: name if last.count(name) == 1 else key
            for key, name in zip(keys, last, strict=True)}


def _value(text: str) -> str:
    """Optuna's floats (0.0031622776601683794) as a person reads them (0.00316)."""
    try:
        number = float(text)
    except ValueError:
        return text
    return text if len(text) <= 7 or number.is_integer() else f"{number:.3g}"
