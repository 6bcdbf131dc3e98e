"""RunDir: the one owner of a run folder's layout. No other code builds these paths.

    RUN/
      .hydra/config.yaml      the composed config, as Hydra saved it (unresolved)
      .hydra/overrides.yaml   the command-line overrides the run was started with
      .hydra/hydra.yaml       Hydra's own settings for the run (the `hydra` section)
      train.log               Hydra's per-run log file
      job.log                 a local sweep job's stdout and stderr (launch.local)
      summary.json            status (STATUSES), started_at/ended_at, last/*, best/*, error,
                              requeued, stopped_early
      metrics.jsonl           one JSON object per logged point: step, epoch, time, metrics
      metrics.csv             logger=csv only
      checkpoints/            step-NNNNNNNN.pt, last.pt, best.pt (train.checkpoint owns them)
      provenance/             code and environment (runs.provenance owns it)
      export/                 `labrun export`'s default output (deploy.export)
      eval/DATASET-SPLIT-CHECKPOINT.json   `labrun eval`'s results: checkpoint, dataset,
                              split, world_size, metrics (never in metrics.jsonl or
                              summary.json)
      errors/rank-N.txt       how a rank other than 0 failed
      ranks/rank-N.json       which process each rank was and the steps it took
      monitor/node-N.json     where node N's Prometheus endpoint listens (monitoring.metrics_endpoint)
      .lock                   who trains here now (runs.lock owns its content)

Writers: only global rank 0 writes summary.json and metrics.jsonl (`writer=False` on the other
ranks makes every write a no-op); each rank writes its own errors/ and ranks/ file, and the
rank serving a node's metrics endpoint its monitor/ file. Every write first checks that this
process still owns the folder (runs.lock.ensure_owner): a process whose lock was taken over
stops without writing.
The contracts (keys of summary.json, metric names) are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from labrun.config.objective import DEFAULT_MODE, DEFAULT_MONITOR
from labrun.core.files import read_jsonl, write_json_atomic, write_text_atomic
from labrun.runs.lock import ensure_owner

# summary.json "status" values
STATUSES = ("running", "completed", "pruned", "failed", "interrupted")
# libyaml's safe loader where PyYAML has it: 8x faster than the pure-Python one on a saved
# config, which `labrun compare` and `labrun dashboard` read for each of a sweep's runs.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# The columns of a metrics.jsonl row that say when it was logged; the rest are metrics.
ROW_BOOKKEEPING = frozenset({"step", "epoch", "time"})


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def is_metric_value(value: Any) -> bool:
    """A value that counts as a metric: a finite number (not a bool, not null)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def best_key(metric: str) -> str:
    """The summary.json key of the best value of `metric` so far: best/METRIC (the trainer
    writes it for checkpoint.monitor)."""
    return f"best/{metric}"


@dataclass(frozen=True)
class Objective:
    """What a run's summary.json says it is judged by (checkpoint.monitor and checkpoint.mode,
    recorded as "monitor" and "mode") and how it fares: its best value so far and its last.
    A summary from before "monitor" and "mode" were recorded reads as DEFAULT_MONITOR and
    DEFAULT_MODE."""

    monitor: str
    mode: str
    best: Any  # best/MONITOR: a number, or None before the first finite value
    final: Any  # MONITOR's last value

    @classmethod
    def of(cls, summary: dict[str, Any]) -> Objective:
        monitor = summary.get("monitor", DEFAULT_MONITOR)
        return cls(monitor=monitor, mode=summary.get("mode", DEFAULT_MODE),
                   best=summary.get(best_key(monitor)), final=summary.get(monitor))


class RunDir:
    def __init__(self, path: str | Path, *, writer: bool = False):
        self.path = Path(path)
        self.writer = writer
        self._summary: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- paths -------------------------------------------------------------------------------
    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def metrics_csv_path(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def hydra_dir(self) -> Path:
        return self.path / ".hydra"

    @property
    def config_path(self) -> Path:
        return self.hydra_dir / "config.yaml"

    @property
    def overrides_path(self) -> Path:
        return self.hydra_dir / "overrides.yaml"

    @property
    def hydra_config_path(self) -> Path:
        return self.hydra_dir / "hydra.yaml"

    @property
    def log_path(self) -> Path:
        return self.path / "train.log"

    @property
    def job_log_path(self) -> Path:
        """Where the local launcher sends a sweep job's stdout and stderr."""
        return self.path / "job.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def provenance_dir(self) -> Path:
        return self.path / "provenance"

    @property
    def errors_dir(self) -> Path:
        return self.path / "errors"

    @property
    def ranks_dir(self) -> Path:
        return self.path / "ranks"

    @property
    def monitor_dir(self) -> Path:
        return self.path / "monitor"

    def monitor_endpoint_path(self, node_rank: int) -> Path:
        return self.monitor_dir / f"node-{node_rank}.json"

    @property
    def lock_path(self) -> Path:
        return self.path / ".lock"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def export_dir(self) -> Path:
        """Where `labrun export RUN_DIR` writes the exported model by default."""
        return self.path / "export"

    @property
    def eval_dir(self) -> Path:
        """`labrun eval`'s results: eval/<dataset>-<split>-<checkpoint>.json."""
        return self.path / "eval"

    def eval_path(self, dataset: str, split: str, checkpoint: str) -> Path:
        return self.eval_dir / f"{dataset}-{split}-{checkpoint}.json"

    def write_eval(self, path: Path, record: dict[str, Any]) -> None:
        """One evaluation's record, written whole or not at all; metrics.jsonl and
        summary.json stay the training's."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, record)

    def read_evals(self) -> dict[str, dict[str, float]]:
        """Each eval file's metrics by its stem: {"synthetic-test-best": {"test/acc": ...}}."""
        found = {}
        for path in sorted(self.eval_dir.glob("*.json")) if self.eval_dir.is_dir() else []:
            try:
                found[path.stem] = dict(json.loads(path.read_text())["metrics"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-copied or foreign: not a result
        return found

    def checkpoint_path(self, which: str) -> Path:
        """checkpoints/<which>.pt: "best", "last" or a step file's stem."""
        return self.checkpoints_dir / f"{which}.pt"

    @classmethod
    def of_checkpoint(cls, checkpoint: str | Path) -> RunDir | None:
        """The run folder a checkpoint file lies in (None: it lies outside a checkpoints/)."""
        checkpoint = Path(checkpoint)
        if checkpoint.parent.name != "checkpoints":
            return None
        return cls(checkpoint.parent.parent)

    def is_run(self) -> bool:
        """A folder a run has started in (Hydra saved its config, or it has a summary)."""
        return self.hydra_dir.is_dir() or self.summary_path.is_file()

    # -- summary.json ------------------------------------------------------------------------
    @property
    def summary(self) -> dict[str, Any]:
        """What summary.json says (read once; updates go through update_summary)."""
        if self._summary is None:
            self._summary = self.read_summary()
        return self._summary

    def read_summary(self) -> dict[str, Any]:
        """summary.json as it is on disk now ({} when there is none, or it is unreadable)."""
        try:
            return json.loads(self.summary_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def read_objective(self) -> Objective:
        """The run's objective, as summary.json says it now (Objective.of(read_summary()))."""
        return Objective.of(self.read_summary())

    def _ensure_owner(self) -> None:
        ensure_owner(self.lock_path)

    def update_summary(self, **values: Any) -> None:
        self.summary.update({k: _clean(v) for k, v in values.items()})
        if self.writer:
            self._ensure_owner()
            self.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.summary_path, self.summary, durable=True)

    # -- metrics.jsonl -----------------------------------------------------------------------
    def read_metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def log_metrics(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        if not self.writer:
            return
        row = {"step": step, "epoch": epoch, "time": round(time.time(), 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._ensure_owner()
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def truncate_metrics_after(self, step: int) -> None:
        """Drop the points logged after `step`: a resumed run logs them again, once."""
        if not self.writer or not self.metrics_path.exists():
            return
        keep = [row for row in self.read_metrics() if row.get("step", 0) <= step]
        self._ensure_owner()
        write_text_atomic(self.metrics_path, "".join(json.dumps(row) + "\n" for row in keep))

    # -- what Hydra saved --------------------------------------------------------------------
    def overrides(self) -> list[str] | None:
        """The overrides the run was started with (None: no .hydra/overrides.yaml)."""
        if not self.overrides_path.is_file():
            return None
        return list(yaml.load(self.overrides_path.read_text(), Loader=YAML_LOADER) or [])

    def saved_config(self) -> dict[str, Any] | None:
        """The composed config Hydra saved (unresolved; None when there is none)."""
        if not self.config_path.is_file():
            return None
        return yaml.load(self.config_path.read_text(), Loader=YAML_LOADER) or {}

    def saved_config_node(self) -> DictConfig | None:
        """The saved config as OmegaConf reads it (YAML 1.2 numbers such as 1e-3 are floats, as
        in a composed config), for comparing with one; None when there is none."""
        if not self.config_path.is_file():
            return None
        return OmegaConf.load(self.config_path)

    def try_overrides(self) -> list[str] | None:
        """overrides(), or None when the file is unreadable (a folder copied half-way)."""
        try:
            return self.overrides()
        except (OSError, yaml.YAMLError):
            return None

    def try_saved_config(self) -> dict[str, Any] | None:
        """saved_config(), or None when the file is unreadable."""
        try:
            return self.saved_config()
        except (OSError, yaml.YAMLError):
            return None

    # -- per-rank records --------------------------------------------------------------------
    def clear_rank_errors(self) -> None:
        self._ensure_owner()
        for path in self.rank_error_files():
            path.unlink(missing_ok=True)

    def write_rank_error(self, rank: int, text: str) -> None:
        self._ensure_owner()
        self.errors_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.errors_dir / f"rank-{rank}.txt", text.rstrip("\n") + "\n")

    def rank_error_files(self) -> list[Path]:
        return sorted(self.errors_dir.glob("rank-*.txt"))

    def rank_errors(self) -> list[str]:
        return [p.read_text().strip() for p in self.rank_error_files()]

    def write_rank_record(self, rank: int, **facts: Any) -> None:
        """ranks/rank-N.json: which process rank N was (host, PID) and how many optimizer steps
        it took itself in this segment. Every rank writes its own, so a run shows that all its
        processes trained; a resumed run replaces it with the new segment's."""
        self._ensure_owner()
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.ranks_dir / f"rank-{rank}.json", {
            "host": socket.gethostname(), "pid": os.getpid(), "rank": rank, **facts,
            "ended_at": time.time()})

    def rank_records(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.ranks_dir.glob("rank-*.json"))]

    # -- monitor/ ----------------------------------------------------------------------------
    def write_monitor_endpoint(self, node_rank: int, endpoint: dict[str, Any]) -> None:
        """monitor/node-N.json: where node N's metrics endpoint listens (its content is
        monitoring.metrics_endpoint's, the contract in docs/ARCHITECTURE.md). Written by the rank
        that serves it, which is not always rank 0: like ranks/, whatever `writer` says."""
        self._ensure_owner()
        self.monitor_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.monitor_endpoint_path(node_rank), endpoint)

    def monitor_endpoints(self) -> list[dict[str, Any]]:
        """Every monitor/node-N.json, in node order (an unreadable one is left out)."""
        found = []
        for path in sorted(self.monitor_dir.glob("node-*.json")):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        return sorted(found, key=lambda e: e.get("node_rank", 0))


# The names whose presence marks a folder as a run folder, for a walk that looks for runs by
# listing folders (monitoring.targets): the lock, monitor/, Hydra's .hydra/ and summary.json.
_LAYOUT = RunDir(".")
RUN_MARKERS = tuple(path.name for path in (_LAYOUT.lock_path, _LAYOUT.monitor_dir,
                                           _LAYOUT.hydra_dir, _LAYOUT.summary_path))
