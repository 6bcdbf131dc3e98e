"""Where a run's numbers go: the run folder's own files, plus one logger backend.

The run folder always gets metrics.jsonl (one JSON object per logged point) and summary.json
(status, last and best values), whatever `logger=` says. Backends implement the small Tracker
interface: `log(metrics, step)` and `finish(status, summary)`.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from labrun.core.errors import one_line
from labrun.runs.rundir import RunDir

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
        run = RunDir(run_dir)
        self.path = run.metrics_csv_path
        # Start from metrics.jsonl, already cut back to the resumed step.
        self.rows = run.read_metrics()
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


class WandbTracker:
    """Weights & Biases: online when this machine is logged in, otherwise offline.

    A W&B problem (no network, a bad key, a full disk) never stops training: one warning line,
    then the run goes on with its local files.
    """

    def __init__(self, logger: DictConfig, run_dir: Path, *, config: dict[str, Any],
                 group: str | None, job_type: str, tags: list[str], resume_id: str | None):
        self.run = None
        self.run_id = resume_id
        mode = wandb_mode(logger.mode)
        if mode == "disabled":
            return
        try:
            import wandb

            self.run = wandb.init(
                project=logger.project, entity=logger.entity, dir=str(run_dir), mode=mode,
                config=config, group=group, job_type=job_type, tags=tags,
                name=f"{run_dir.parent.name}/{run_dir.name}",
                id=resume_id, resume="allow",
                # labrun prints its own progress; W&B's banners would only repeat it.
                settings=wandb.Settings(silent=True))
        except Exception as error:  # noqa: BLE001 - any W&B failure must not stop training
            _warn(f"W&B could not start ({one_line(error)}); continuing with local metrics")
            return
        self.run_id = self.run.id
        if mode == "offline":
            print(f"W&B offline: the run is saved in {self.run.dir.rsplit('/files', 1)[0]}; "
                  f"upload it with: wandb sync {self.run.dir.rsplit('/files', 1)[0]}", flush=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as error:  # noqa: BLE001
            _warn(f"W&B logging failed ({one_line(error)}); continuing with local metrics")
            self.run = None

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update({k: v for k, v in summary.items() if v is not None})
            self.run.finish(exit_code=0 if status == "completed" else 1)
        except Exception as error:  # noqa: BLE001
            _warn(f"W&B finish failed ({one_line(error)})")
        self.run = None


def wandb_host() -> str:
    """The W&B server's host name, as ~/.netrc names it."""
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return url.split("://")[-1].split("/")[0].split(":")[0]


def wandb_logged_in() -> bool:
    """An API key in the environment or in ~/.netrc, where `wandb login` puts it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = wandb_host()
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode(mode: str) -> str:
    if mode == "auto":
        return "online" if wandb_logged_in() else "offline"
    return mode


def _warn(message: str) -> None:
    import sys

    print(f"warning: {message}", file=sys.stderr, flush=True)


class TensorBoardTracker:
    """Event files in the run folder: `tensorboard --logdir outputs/`."""

    run_id = None

    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            from labrun.core.errors import ConfigError

            raise ConfigError("logger=tensorboard needs the tensorboard package: "
                              "pip install -e '.[tensorboard]'") from error
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        self.writer.close()


def build(cfg: DictConfig, run_dir: Path, *, is_main: bool, resume_id: str | None = None,
          provenance: dict[str, Any] | None = None, sweep: dict[str, Any] | None = None
          ) -> Tracker:
    """The backend `logger.name` asks for (rank 0 only).

    `sweep` is {"dir": sweep folder, "overrides": [...], "experiment": name or None} from Hydra.
    """
    name = cfg.logger.name
    if not is_main or name == "none":
        return NoTracker()
    if name == "csv":
        return CSVTracker(run_dir)
    if name == "tensorboard":
        return TensorBoardTracker(run_dir)
    sweep = sweep or {}
    from labrun.runs.provenance import redact, redact_tree

    config = redact_tree(OmegaConf.to_container(cfg, resolve=True))
    config["overrides"] = [redact(o) for o in sweep.get("overrides", [])]
    config["provenance"] = provenance or {}
    group = cfg.logger.group
    if group is None and sweep.get("dir"):
        sweep_dir = Path(sweep["dir"])
        group = f"{sweep_dir.parent.name}_{sweep_dir.name}"
    tags = list(cfg.logger.tags)
    if sweep.get("experiment"):
        tags.append(sweep["experiment"])
    return WandbTracker(cfg.logger, run_dir, config=config, group=group,
                        job_type="sweep" if sweep.get("dir") else "run",
                        tags=sorted(set(tags)), resume_id=resume_id)
