"""How well a finished Optuna study kept its slots busy, from its trials' own summary.json:

    python benchmarks/dispatch_gap.py SWEEP_DIR --n-jobs 2

- the dispatch gap: from each trial's end to the next trial's start (summary started_at, taken
  as training begins): a slot idles that long, start-up included;
- slot occupancy: the sum of the trials' wall times over n_jobs times the study's wall time
  (1.0: no slot ever idle).

It measures a study that has run (issue 25's before/after figures); it sets no target.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def trials(sweep_dir: Path) -> list[tuple[float, float]]:
    """(started_at, ended_at) of every trial folder N/ with a summary, by start."""
    spans = []
    for summary in sweep_dir.glob("[0-9]*/summary.json"):
        data = json.loads(summary.read_text())
        if data.get("started_at") and data.get("ended_at"):
            spans.append((data["started_at"], data["ended_at"]))
    return sorted(spans)


def measure(spans: list[tuple[float, float]], n_jobs: int) -> dict[str, float]:
    """Gaps: for each trial's end, the wait until the next trial after it starts (ends after
    the last start are the study's tail: no trial was left to start)."""
    starts = sorted(start for start, _ in spans)
    gaps = []
    for _, end in spans:
        later = [start for start in starts if start > end]
        if later:
            gaps.append(later[0] - end)
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    busy = sum(end - start for start, end in spans)
    return {"trials": len(spans), "gap_median_s": statistics.median(gaps) if gaps else 0.0,
            "gap_max_s": max(gaps, default=0.0), "occupancy": busy / (n_jobs * wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--n-jobs", type=int, required=True)
    args = parser.parse_args()
    figures = measure(trials(args.sweep_dir), args.n_jobs)
    print(json.dumps({key: round(value, 3) for key, value in figures.items()}))


if __name__ == "__main__":
    main()
