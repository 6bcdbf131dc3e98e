"""Where a run's numbers go: the run folder's own files, plus one logger backend.

The run folder always gets metrics.jsonl (one JSON object per logged point) and summary.json
(status, last and best values), whatever `logger=` says. Backends implement the small Tracker
interface: `log(metrics, step)` and `finish(status, summary)`.

`logger._target_` names the backend's class. Its constructor takes, by name, any of the logger
section's keys (`project`, `tags`...) and of `run_dir` (the run folder) and `run` (RunInfo:
the whole config, the sweep, provenance, the W&B id to resume); it takes only what it needs.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig, OmegaConf

from labrun.core import probes
from labrun.core.errors import one_line
from labrun.data import call_target
from labrun.runs.rundir import Objective, RunDir, is_metric_value
from labrun.runs.sweepdir import parse_overrides
from labrun.track import wandb_history
from labrun.track.hparams import hparam_value, metric_tags

log = logging.getLogger(__name__)


@dataclass
class RunInfo:
    """What a logger backend may want to know about the run beyond its own config section."""

    cfg: DictConfig  # the whole composed config
    resume_id: str | None = None  # the W&B run to continue (from the checkpoint)
    provenance: dict[str, Any] = field(default_factory=dict)
    # {"dir": sweep folder, "overrides": [...], "experiment": name or None} from Hydra
    sweep: dict[str, Any] = field(default_factory=dict)

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

    def __init__(self, run_dir: Path, run: RunInfo, project: str, entity: str | None = None,
                 mode: str = "auto", group: str | None = None, tags: list[str] | None = None):
        self.run = None
        self.run_id = run.resume_id
        # Steps W&B already holds (an uploaded segment, an online run's server): not logged again.
        self.held: set[int] = set()
        self.history = True  # False: which steps W&B holds is unknown, none is logged
        mode = wandb_mode(mode)
        if mode == "disabled":
            return
        from labrun.core.secrets import redact, redact_tree

        config = redact_tree(OmegaConf.to_container(run.cfg, resolve=True))
        config["overrides"] = [redact(o) for o in run.sweep.get("overrides", [])]
        config["provenance"] = run.provenance
        if group is None and run.sweep.get("dir"):
            sweep_dir = Path(run.sweep["dir"])
            group = f"{sweep_dir.parent.name}_{sweep_dir.name}"
        tags = list(tags or [])
        if run.sweep.get("experiment"):
            tags.append(run.sweep["experiment"])
        try:
            import wandb

            self.run = wandb.init(
                project=project, entity=entity, dir=str(run_dir), mode=mode,
                config=config, group=group, job_type="sweep" if run.sweep.get("dir") else "run",
                tags=sorted(set(tags)), name=f"{run_dir.parent.name}/{run_dir.name}",
                id=run.resume_id, resume="allow",
                # labrun prints its own progress; W&B's banners would only repeat it.
                settings=wandb.Settings(silent=True))
        except Exception as error:  # noqa: BLE001 - any W&B failure must not stop training
            _warn(f"W&B could not start ({one_line(error)}); continuing with local metrics")
            return
        self.run_id = self.run.id
        self.rows = wandb_history.StepRows(self.run)
        try:
            wandb_history.declare_step(self.run)
            self.held = wandb_history.prepare(self.run, run_dir, run.resume_id is not None,
                                              self.rows)
        except wandb_history.Unreadable as error:
            # Any step logged now may be one W&B holds already: log none (the summary is still
            # updated at the end, less its `step`).
            self.history = False
            _warn(f"W&B: {error}; which steps W&B already holds is unknown, so this attempt "
                  f"logs no history to W&B, so that none is there twice (W&B will lack this "
                  f"attempt's steps; metrics.jsonl has them all)")
        except Exception as error:  # noqa: BLE001
            _warn(f"W&B could not log the earlier points again ({one_line(error)}); its history "
                  f"may have holes, metrics.jsonl has them all")
        if mode == "offline":
            saved = self.run.dir.rsplit("/files", 1)[0]
            log.info(f"W&B offline: the run is saved in {saved}; upload it with: "
                     f"wandb sync {saved}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None or not self.history or step in self.held:
            return
        try:
            # The x-axis is labrun's `step` (define_metric), not W&B's `_step`: a resumed run can
            # then log points below the last step W&B holds (track/wandb_history.py).
            self.rows.add(metrics, step)
        except Exception as error:  # noqa: BLE001
            _warn(f"W&B logging failed ({one_line(error)}); continuing with local metrics")
            self.run = None

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self.rows.flush()
            # Without history, the summary's `step` would tell a later online resume that W&B
            # holds every step up to it (wandb_history.prepare).
            self.run.summary.update({k: v for k, v in summary.items() if v is not None
                                     and (self.history or k != wandb_history.STEP)})
            self.run.finish(exit_code=0 if status == "completed" else 1)
        except Exception as error:  # noqa: BLE001
            _warn(f"W&B finish failed ({one_line(error)})")
        self.run = None


def wandb_mode(mode: str) -> str:
    if mode == "auto":
        return "online" if probes.wandb_login().logged_in else "offline"
    return mode


def _warn(message: str) -> None:
    log.warning(message)  # the console handler shows it as "warning: ..." on stderr


class TensorBoardTracker:
    """Event files in the run folder: `tensorboard --logdir outputs/`. At the end of the run
    it adds the run's HParams (its overrides, its status, best/ and final/ of
    checkpoint.monitor), so that TensorBoard's HParams tab lays a sweep's runs side by side
    with no conversion step (`labrun dashboard` does that step for runs of other loggers)."""

    run_id = None

    def __init__(self, run_dir: Path, run: RunInfo):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            from labrun.core.errors import ConfigError

            raise ConfigError("logger=tensorboard needs the tensorboard package: "
                              "pip install -e '.[tensorboard]'") from error
        self.writer = SummaryWriter(log_dir=str(RunDir(run_dir).tensorboard_dir))
        self.overrides = parse_overrides(run.sweep.get("overrides") or [])

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        objective = Objective.of(summary)  # the trainer's: it records monitor and mode
        values = {"status": status, **{key: hparam_value(value)
                                       for key, value in self.overrides.items()}}
        metrics = {tag: value for tag, value in zip(metric_tags(objective.monitor),
                                                    (objective.best, objective.final),
                                                    strict=True) if is_metric_value(value)}
        try:
            # run_name ".": the session is this run's own event folder, beside its scalars.
            self.writer.add_hparams(values, metrics, run_name=".", global_step=summary.get("step"))
        except Exception as error:  # noqa: BLE001 - the run's result is already saved
            _warn(f"TensorBoard: could not write the run's hparams ({one_line(error)})")
        self.writer.close()


def build(cfg: DictConfig, run_dir: Path, *, is_main: bool, resume_id: str | None = None,
          provenance: dict[str, Any] | None = None, sweep: dict[str, Any] | None = None
          ) -> Tracker:
    """The backend `logger._target_` names (rank 0 only; the others log nothing).

    `sweep` is {"dir": sweep folder, "overrides": [...], "experiment": name or None} from Hydra.
    """
    if not is_main:
        return NoTracker()
    run = RunInfo(cfg, resume_id=resume_id, provenance=provenance or {}, sweep=sweep or {})
    return call_target(cfg.logger, run_dir=Path(run_dir), run=run)
