"""Each benchmark's targets and the verdicts on its figures: `labrun bench NAME --check` (and
`make bench`) exits 1 when a figure is past its floor, naming it.

A target has two lines: its floor, the required one (set from runs of the benchmark on the
machine it guards, so that `make bench` is green when nothing regressed and red when something
did), and its goal, the stretch figure (what the benchmark was written to reach; its distance
is printed, and missing it fails nothing). report() prints one table of every verdict: the
judged figure, the two figures it compares (measured and baseline, when the target names them
with `of`), its floor, its goal and how far the figure is from it, the runs that set the floor
(lowest to highest, and their spread), and the verdict on the floor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# The two directions a figure can be better in, by the operator its floor and goal use.
HIGHER_IS_BETTER, LOWER_IS_BETTER = ">=", "<"

# How a measured floor is set (floor_from_runs): the worst of at least three runs of the
# benchmark with its defaults (what `make bench` runs) on this project's machine, moved by
# MARGIN to the bad side, by WIDE_MARGIN where the runs spread by WIDE_SPREAD or more of the
# worst (the load of the machine, 2 cores shared with other engineers' test suites, moves such
# a figure that far, and a floor must hold whatever the load), then rounded to two significant
# figures on the loose side. Each *_TARGETS records its runs and says what its floor catches.
MARGIN, WIDE_MARGIN, WIDE_SPREAD = 0.15, 0.25, 0.25


def floor_from_runs(op: str, runs: tuple[float, ...]) -> float:
    """The floor the runs here give a figure judged with `op` (see MARGIN)."""
    low, high = min(runs), max(runs)
    margin = WIDE_MARGIN if (high - low) / low >= WIDE_SPREAD else MARGIN
    if op == HIGHER_IS_BETTER:
        line, round_to = low * (1 - margin), math.floor
    else:
        line, round_to = high * (1 + margin), math.ceil
    step = 10.0 ** (math.floor(math.log10(line)) - 1)  # two significant figures
    return round(round_to(round(line / step, 9)) * step, 12)


@dataclass(frozen=True)
class Target:
    """`figure` `op` `floor` is required, `figure` `op` `goal` is the stretch, e.g. speedup >= 2.0
    (floor) and >= 3.0 (goal); for a figure where lower is better (op "<") the floor is the most
    it may be, e.g. startup_ratio < 1.1, goal < 1.5. A goal can lie on the near side of its floor:
    a benchmark that passed its goal long ago keeps a floor set by what it measures now, so that
    a regression fails it before it falls back to the goal.

    required=False: the floor is shown but --check does not fail on it (a target that binds
    only on some devices, with `note` saying so). of: the (measured, baseline) figures that
    `figure` compares, e.g. ("hdf5", "baseline") for speedup = hdf5 / baseline; the table shows
    them beside it. runs: the figure in the runs on this project's machine that set the floor
    (at least three; none for a floor that is no measurement: a count, or a target of a device
    this machine lacks); the table shows their range and spread.
    """

    figure: str
    op: str  # HIGHER_IS_BETTER (">=") or LOWER_IS_BETTER ("<")
    floor: float
    goal: float
    required: bool = True
    of: tuple[str, str] | None = None
    note: str = ""
    runs: tuple[float, ...] = ()

    def __post_init__(self):
        if self.op not in (HIGHER_IS_BETTER, LOWER_IS_BETTER):
            raise ValueError(f"unknown target operator {self.op!r}")

    def passes(self, value: float, line: float) -> bool:
        return value >= line if self.op == HIGHER_IS_BETTER else value < line  # NaN: False

    def met(self, value: float) -> bool:
        """Whether `value` is on the good side of the floor (what --check requires)."""
        return self.passes(value, self.floor)

    def reached(self, value: float) -> bool:
        """Whether `value` is on the good side of the goal."""
        return self.passes(value, self.goal)

    def to_goal(self, value: float) -> str:
        """How far `value` is from the goal: the difference and the factor still needed, e.g.
        "+0.7 (x1.30)" for 2.3 against >= 3, or "reached"."""
        if not math.isfinite(value):
            return "-"
        if self.reached(value):
            return "reached"
        factor = f" (x{self.goal / value:.2f})" if value else ""
        return f"{self.goal - value:+.3g}{factor}"

    def spread(self) -> str:
        """The runs that set the floor: lowest-highest and their spread as a share of the
        lowest, e.g. "2.31-2.45 (6%)"; "-" when the floor is no measurement."""
        if not self.runs:
            return "-"
        low, high = min(self.runs), max(self.runs)
        share = f" ({(high - low) / low:.0%})" if low else ""
        return f"{number(low)}-{number(high)}{share}"


@dataclass(frozen=True)
class Verdict:
    bench: str
    target: Target
    measured: float
    # The figures named by target.of, for the table.
    figures: Mapping[str, float] = field(default_factory=dict, compare=False)
    # Why there is no figure (the benchmark could not run here): a required floor is missed.
    reason: str = ""

    @property
    def met(self) -> bool:
        """The figure is on the good side of its floor (NaN is on neither)."""
        return self.target.met(self.measured)

    @property
    def reached(self) -> bool:
        return self.target.reached(self.measured)

    @property
    def missed(self) -> bool:
        return self.target.required and not self.met

    @property
    def kind(self) -> str:
        return self.target.note or ("required" if self.target.required else "shown only")


def judge(bench: str, figures: Mapping[str, float], targets: Iterable[Target]) -> list[Verdict]:
    """One verdict per target, from the measured figures (a missing figure is a bug)."""
    return [Verdict(bench, target, float(figures[target.figure]),
                    {name: float(figures[name]) for name in target.of or ()})
            for target in targets]


def unmeasured(bench: str, targets: Iterable[Target], reason: str) -> list[Verdict]:
    """The verdicts of a benchmark that could not run here: no figure, so every required
    floor is missed, with `reason`; leaving it out is the caller's choice (`--skip NAME`)."""
    return [Verdict(bench, target, math.nan, dict.fromkeys(target.of or (), math.nan),
                    reason=reason) for target in targets]


def number(value: float) -> str:
    """A figure as a reader wants it: 2411, 41.3, 0.957, 3.2e-05."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def table(verdicts: list[Verdict]):
    """Every verdict as one row of a rich Table."""
    from rich.table import Table

    grid = Table(title="benchmark targets", title_justify="left")
    for name, justify in (("figure", "left"), ("measured", "right"), ("baseline", "right"),
                          ("value", "right"), ("floor", "right"), ("goal", "right"),
                          ("to goal", "right"), ("runs here", "right"), ("checked", "left"),
                          ("verdict", "left")):
        grid.add_column(name, justify=justify, no_wrap=True)  # one line per figure
    for verdict in verdicts:
        target = verdict.target
        parts = [f"{name} {number(verdict.figures[name])}" for name in target.of or ()]
        measured, baseline = parts or ("-", "-")
        grid.add_row(f"{verdict.bench} {target.figure}", measured, baseline,
                     number(verdict.measured), f"{target.op} {target.floor:g}",
                     f"{target.op} {target.goal:g}", target.to_goal(verdict.measured),
                     target.spread(), verdict.kind,
                     "met" if verdict.met else ("NOT met" if target.required
                                                else "NOT met (not checked)"))
    return grid


def report(verdicts: list[Verdict], check: bool, skipped: Iterable[str] = ()) -> int:
    """Print the table of every verdict, then (with check) one line per missed required floor
    (one not measured among them, with why) and a summary naming the goals reached.
    `skipped`: the benchmarks left out on the command line, which the summary names. Exit
    status: 1 when checking and a required floor is missed, else 0."""
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    if not console.is_terminal:  # a log or a pipe: no terminal width to fit the table into
        console.width = max(console.width, 200)
    console.print(table(verdicts))
    missed = [v for v in verdicts if v.missed]
    if not check:
        return 0
    for verdict in missed:
        target = verdict.target
        measured = (f"not measured ({verdict.reason})" if verdict.reason
                    else f"measured {verdict.measured:.3g}")
        print(f"target missed: {verdict.bench} {target.figure}: {measured}, floor "
              f"{target.op} {target.floor:g} (goal {target.op} {target.goal:g})")
    left_out = f"; left out on the command line: {', '.join(skipped)}" if skipped else ""
    goals = f"; goals reached: {sum(v.reached for v in verdicts)} of {len(verdicts)}"
    if not missed:
        print(f"all {sum(v.target.required for v in verdicts)} required floors met{goals}"
              f"{left_out}")
    else:
        print(f"{len(missed)} required floor(s) missed{goals}{left_out}")
    return 1 if missed else 0
