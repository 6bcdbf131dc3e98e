"""Each benchmark's targets and the verdicts on its figures: `labrun bench NAME --check` (and
`make bench`) exits 1 when a required target is missed, naming it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """`figure` `op` `bound`, e.g. speedup >= 3.0. A stretch target (required=False) is shown
    with the others, but --check fails only on required ones."""

    figure: str
    op: str  # ">=" (at least) or "<" (under)
    bound: float
    required: bool = True

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

    @property
    def met(self) -> bool:
        return self.target.met(self.measured)  # NaN meets nothing

    @property
    def missed(self) -> bool:
        return self.target.required and not self.met

    def line(self) -> str:
        kind = "required" if self.target.required else "stretch, not checked"
        return (f"{self.bench} {self.target.figure}: measured {self.measured:.3g}, target "
                f"{self.target.op} {self.target.bound:g} ({kind}): "
                f"{'met' if self.met else 'NOT met'}")


def judge(bench: str, figures: dict[str, float], targets: Iterable[Target]) -> list[Verdict]:
    """One verdict per target, from the measured figures (a missing figure is a bug)."""
    return [Verdict(bench, target, float(figures[target.figure])) for target in targets]


def report(verdicts: list[Verdict], check: bool) -> int:
    """Print every verdict, then (with check) one line per missed required target.
    Exit status: 1 when checking and a required target is missed, else 0."""
    for verdict in verdicts:
        print(f"  target {verdict.line()}")
    missed = [v for v in verdicts if v.missed]
    if not check:
        return 0
    for verdict in missed:
        print(f"target missed: {verdict.bench} {verdict.target.figure}: measured "
              f"{verdict.measured:.3g}, target {verdict.target.op} {verdict.target.bound:g}")
    if not missed:
        print(f"all {sum(v.target.required for v in verdicts)} required targets met")
    return 1 if missed else 0
