"""Callbacks: code that runs at fixed points of training, chosen with the `callbacks` group.

    callbacks:                      # a dict: any number, each a `_target_` node
      early_stopping:
        _target_: labrun.train.callbacks.EarlyStopping
        patience: 3
      my_probe:                     # a lab's own class, importable from its repository
        _target_: mylab.callbacks.GradientProbe

A callback subclasses `Callback` and overrides the hooks it needs; each hook gets the Trainer,
whose attributes (epoch, step, best, model, optimizer, cfg, folder) it may read. A callback
that wants training to end calls `trainer.request_stop(reason)` at a validation: training stops
there, with status "completed" and the reason in summary.json (`stopped_early`);
`request_stop(reason, status="pruned")` ends it as "pruned" instead (a search gave up on it:
train/pruning.py, Optuna's pruning).

What `state_dict()` returns is saved in every checkpoint (plain numbers, strings, lists and
dicts: checkpoints load with weights_only=True) and handed back to `load_state_dict()` when
the run resumes, before `on_fit_start`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from labrun.config.objective import better, to_beat
from labrun.core.errors import ConfigError

if TYPE_CHECKING:
    from labrun.train.trainer import Trainer

log = logging.getLogger(__name__)


class Callback:
    """The user-callback interface: every hook does nothing unless overridden."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first epoch (and after a resumed run's state is loaded)."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After each optimizer step; trainer.step counts them."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each validation (at each epoch's end, or every trainer.val_every_n_steps
        steps); `metrics` holds val/loss, val/acc, ...; trainer.point says where training
        stands (("epoch", epochs done) or ("step", steps done)). Runs before that
        validation's checkpoint. A callback written for epochs alone may override
        on_epoch_end instead, which this calls."""
        self.on_epoch_end(trainer, metrics)

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """See on_validation_end."""

    def on_fit_end(self, trainer: Trainer, status: str) -> None:
        """Once, whatever happened: status is completed, pruned, failed or interrupted."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def build(cfg: DictConfig | None) -> dict[str, Callback]:
    """One callback per entry of `cfg.callbacks` (a dict of `_target_` nodes), by name."""
    if not cfg:
        return {}
    return {str(name): instantiate(node) for name, node in cfg.items() if node is not None}


class EarlyStopping(Callback):
    """Stop when checkpoint.monitor has not improved by `min_delta` for `patience` validations
    (epochs, when validation comes at each epoch's end).

    The monitored key and its direction are checkpoint.monitor and checkpoint.mode, so what
    stops training is what picks best.pt. Once it has stopped a run, its state says so: the
    same folder run again (checkpoint.resume=auto) stays completed instead of training on.
    """

    def __init__(self, patience: int = 3, min_delta: float = 0.0):
        if patience < 1 or min_delta < 0:
            raise ConfigError(f"early stopping needs patience >= 1 and min_delta >= 0 "
                              f"(got patience={patience}, min_delta={min_delta})")
        self.patience, self.min_delta = patience, min_delta
        self.best: float | None = None
        self.best_epoch = 0  # where it was: an epoch or a step, in the unit of trainer.point
        self.wait = 0  # validations since the last improvement
        self.reason: str | None = None  # set once it has stopped the run

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.reason is not None:
            trainer.request_stop(self.reason)

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        monitor, mode = trainer.cfg.checkpoint.monitor, trainer.cfg.checkpoint.mode
        unit, at = trainer.point
        value = metrics.get(monitor)
        if value is None or not math.isfinite(value):
            self.wait += 1
        elif self.best is None or better(mode)(value, to_beat(self.best, self.min_delta, mode)):
            self.best, self.best_epoch, self.wait = value, at, 0
        else:
            self.wait += 1
        if self.wait >= self.patience:
            best = "none" if self.best is None else f"{self.best:.4g} at {unit} {self.best_epoch}"
            counted = "epoch" if unit == "epoch" else "validation"
            self.reason = (f"{monitor} did not improve by {self.min_delta:g} for "
                           f"{self.patience} {counted}{'s' if self.patience > 1 else ''} "
                           f"(best {best})")
            trainer.request_stop(self.reason)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "reason": self.reason}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state["best"], state["best_epoch"]
        self.wait, self.reason = state["wait"], state["reason"]
