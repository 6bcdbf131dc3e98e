"""Where a run's numbers go: the run folder's own files, plus one logger backend.

The run folder always gets metrics.jsonl (one JSON object per logged point) and summary.json
(status, last and best values), whatever `logger=` says. Backends implement the small Tracker
interface: `log(metrics, step)` and `finish(status, summary)`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file (a line cut short by a crash is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunFolder:
    """metrics.jsonl and summary.json of one run. Only rank 0 writes (enabled=False elsewhere)."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"
        self.summary: dict[str, Any] = {}
        if enabled:
            self.path.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop the points logged after `step`: a resumed run logs them again, once."""
        if not self.enabled or not self.metrics_path.exists():
            return
        keep = [row for row in read_jsonl(self.metrics_path) if row.get("step", 0) <= step]
        tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in keep))
        os.replace(tmp, self.metrics_path)

    def log(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, "epoch": epoch, "time": round(time.time(), 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def update_summary(self, **values: Any) -> None:
        self.summary.update({k: _clean(v) for k, v in values.items()})
        if self.enabled:
            write_json_atomic(self.summary_path, self.summary)


# ---------------------------------------------------------------------------------------------
# Logger backends


class Tracker(Protocol):
    run_id: str | None

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, status: str, summary: dict[str, Any]) -> None: ...


class NoTracker:
    """logger=none, and every rank but 0."""

    run_id = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        pass


class CSVTracker:
    """metrics.csv: one row per logged point, one column per metric name seen so far."""

    run_id = None

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.csv"
        # Start from metrics.jsonl, already cut back to the resumed step.
        self.rows = read_jsonl(run_dir / "metrics.jsonl")
        self.columns: list[str] = []
        for row in self.rows:
            self._add_columns(row)
        self._rewrite()

    def _add_columns(self, row: dict[str, Any]) -> bool:
        new = [k for k in row if k not in self.columns]
        self.columns.extend(new)
        return bool(new)

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        self.rows.append(row)
        if self._add_columns(row):
            self._rewrite()  # a new metric: the header changes
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        pass


def build(cfg: DictConfig, run_dir: Path, *, is_main: bool, resume_id: str | None = None
          ) -> Tracker:
    """The backend `logger.name` asks for (rank 0 only)."""
    name = cfg.logger.name
    if not is_main or name == "none":
        return NoTracker()
    if name == "csv":
        return CSVTracker(run_dir)
    raise NotImplementedError(f"logger={name}")
