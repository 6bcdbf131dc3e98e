"""`labrun compare SWEEP --over seed`: the runs that differ only in the keys folded away (seeds,
folds) as one row each, with the mean, the sample standard deviation (n-1), min, max and n of
every validation metric, best and final, and of the test metrics (evaluated once, on best.pt).

A row is a configuration of the other keys that vary; its statistics are over its completed
runs, and a row some of whose runs did not complete says so (n of N).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from labrun.config.objective import best_first
from labrun.core.errors import LabrunError
from labrun.views import compare_output as output
from labrun.views.compare import (
    Comparison,
    Run,
    best_and_final,
    default_mode,
    known_metrics,
    rank,
    write_tables,
)

log = logging.getLogger(__name__)


def compare_over(paths: list[Path], over: list[str], *, metric: str | None = None,
                 mode: str | None = None, csv_file: Path | None = None,
                 markdown: Path | None = None, plot_file: Path | None = None) -> Aggregate:
    """`labrun compare --over KEYS`: read and rank as compare does, fold, print, write."""
    ranked = rank(paths, metric, mode)
    folded = aggregate(ranked, over)
    columns, rows = output.aggregate_table(folded)
    title = (f"{len(ranked.runs)} run(s) in {len(rows)} row(s) over {', '.join(over)}: mean ± "
             f"std, sorted by the mean of best {ranked.metric} ({ranked.mode})")
    output.print_table(title, columns, rows, [])
    write_tables(title, columns, rows, csv_file, markdown)
    if plot_file:
        log.info("wrote %s (%s)", plot_file, output.plot_aggregate(plot_file, folded))
    return folded


@dataclass
class Stats:
    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        """The sample standard deviation (n-1): none for fewer than two runs."""
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def min(self) -> float | None:
        return min(self.values, default=None)

    @property
    def max(self) -> float | None:
        return max(self.values, default=None)

    def text(self) -> str:
        """mean ± std to the digits the spread allows: two significant digits of the std, the
        mean to the same place (0.9123 ± 0.0042); four decimals without a spread."""
        if self.mean is None:
            return "-"
        if not self.std:
            return f"{self.mean:.4f}"
        digits = max(0, 1 - math.floor(math.log10(self.std)))
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


@dataclass
class Group:
    values: dict[str, str]  # the value of each key that varies and is not folded away
    runs: list[Run]
    stats: dict[str, Stats] = field(default_factory=dict)  # "best val/acc" -> its Stats

    @property
    def completed(self) -> list[Run]:
        return [one for one in self.runs if one.status == "completed"]

    @property
    def count(self) -> str:
        done, total = len(self.completed), len(self.runs)
        return str(total) if done == total else f"{done} of {total}"


@dataclass
class Aggregate:
    over: list[str]
    keys: list[str]  # the keys that vary between the rows
    columns: list[str]  # "best val/acc", "final val/acc", ..., "test/acc"
    groups: list[Group]
    metric: str
    mode: str


def aggregate(ranked: Comparison, over: list[str]) -> Aggregate:
    """The ranked runs grouped by every varying key but `over`, best mean first."""
    runs = ranked.runs
    unknown = [key for key in over if not any(key in one.overrides for one in runs)]
    if unknown:
        raise LabrunError(f"--over {','.join(unknown)}: no run sets it; the keys that vary "
                          f"between these runs: {', '.join(ranked.keys) or 'none'}")
    keys = [key for key in ranked.keys if key not in over]
    groups: dict[tuple, Group] = {}
    for one in runs:
        values = {key: one.overrides.get(key, "-") for key in keys}
        groups.setdefault(tuple(values.values()), Group(values, [])).runs.append(one)
    metrics = metric_names(runs, ranked.metric)
    columns = []
    for metric in metrics:
        columns += [f"final {metric}"] if metric.startswith("test/") else [f"best {metric}",
                                                                            f"final {metric}"]
    for group in groups.values():
        for metric in metrics:
            mode = ranked.mode if metric == ranked.metric else default_mode(runs, metric)
            pairs = [best_and_final(one, metric, mode) for one in group.completed]
            group.stats[f"best {metric}"] = Stats([b for b, _ in pairs if b is not None])
            group.stats[f"final {metric}"] = Stats([f for _, f in pairs if f is not None])
    ordered = sorted(groups.values(), key=lambda g: _sort_key(g, f"best {ranked.metric}",
                                                              ranked.mode))
    return Aggregate(over, keys, columns, ordered, ranked.metric, ranked.mode)


def metric_names(runs: list[Run], metric: str) -> list[str]:
    """The ranked metric first, then the other validation and test metrics the runs report."""
    others = sorted((name for name in known_metrics(runs)
                     if name.startswith(("val/", "test/")) and name != metric),
                    key=lambda name: (name.startswith("test/"), name))  # val/ first
    return [metric, *others]


def _sort_key(group: Group, column: str, mode: str) -> tuple:
    mean = group.stats[column].mean
    if mean is None:
        return (1, 0.0)
    return (0, best_first(mode)(mean))
