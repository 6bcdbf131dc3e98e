"""Each benchmark's targets and the verdicts on its figures: `labrun bench NAME --check` (and
`make bench`) exits 1 when a required target is missed, naming it.

report() prints one table of every verdict: the judged figure, the two figures it compares
(measured and baseline, when the target names them with `of`), its target and whether it is
met, so that a reader sees at a glance what is met.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """`figure` `op` `bound`, e.g. speedup >= 3.0. A stretch target (required=False) is shown
    with the others, but --check fails only on required ones.

    of: the (measured, baseline) figures that `figure` compares, e.g. ("hdf5", "baseline") for
    speedup = hdf5 / baseline; the table shows them beside it. note: why a target is or is not
    required in this run (e.g. "required on CUDA only; this run: cpu").
    """

    figure: str
    op: str  # ">=" (at least) or "<" (under)
    bound: float
    required: bool = True
    of: tuple[str, str] | None = None
    note: str = ""

    def met(self, value: float) -> bool:
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<":
            return value < self.bound
        raise ValueError(f"unknown target operator {self.op!r}")


@dataclass(frozen=True)
class Verdict:
    bench: str
    target: Target
    measured: float
    # The figures named by target.of, for the table.
    figures: Mapping[str, float] = field(default_factory=dict, compare=False)
    # Why there is no figure (the benchmark could not run here): a required target is missed.
    reason: str = ""

    @property
    def met(self) -> bool:
        return self.target.met(self.measured)  # NaN meets nothing

    @property
    def missed(self) -> bool:
        return self.target.required and not self.met

    @property
    def kind(self) -> str:
        return self.target.note or ("required" if self.target.required else "stretch")


def judge(bench: str, figures: Mapping[str, float], targets: Iterable[Target]) -> list[Verdict]:
    """One verdict per target, from the measured figures (a missing figure is a bug)."""
    return [Verdict(bench, target, float(figures[target.figure]),
                    {name: float(figures[name]) for name in target.of or ()})
            for target in targets]


def unmeasured(bench: str, targets: Iterable[Target], reason: str) -> list[Verdict]:
    """The verdicts of a benchmark that could not run here: no figure, so every required
    target is missed, with `reason`; leaving it out is the caller's choice (`--skip NAME`)."""
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
                          ("value", "right"), ("target", "right"), ("checked", "left"),
                          ("verdict", "left")):
        grid.add_column(name, justify=justify, no_wrap=True)  # one line per figure
    for verdict in verdicts:
        target = verdict.target
        parts = [f"{name} {number(verdict.figures[name])}" for name in target.of or ()]
        measured, baseline = parts or ("-", "-")
        grid.add_row(f"{verdict.bench} {target.figure}", measured, baseline,
                     number(verdict.measured), f"{target.op} {target.bound:g}", verdict.kind,
                     "met" if verdict.met else ("NOT met" if target.required
                                                else "NOT met (not checked)"))
    return grid


def report(verdicts: list[Verdict], check: bool, skipped: Iterable[str] = ()) -> int:
    """Print the table of every verdict, then (with check) one line per missed required target
    (one not measured among them, with why). `skipped`: the benchmarks left out on the command
    line, which the summary names. Exit status: 1 when checking and a required target is
    missed, else 0."""
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
        print(f"target missed: {verdict.bench} {target.figure}: {measured}, target "
              f"{target.op} {target.bound:g}")
    left_out = f"; left out on the command line: {', '.join(skipped)}" if skipped else ""
    if not missed:
        print(f"all {sum(v.target.required for v in verdicts)} required targets met{left_out}")
    elif left_out:
        print(left_out[2:])
    return 1 if missed else 0
