"""Optuna pruning from inside a trial: report checkpoint.monitor at each validation, stop as
"pruned".

labrun's Optuna sweeper (labrun.launch.optuna_sweeper) adds this callback to every trial it
launches, as overrides that name the study and the trial:

    +callbacks.optuna._target_=labrun.train.pruning.OptunaPruning
    +callbacks.optuna.storage=SWEEP_DIR/optuna.journal   (or the study's database URL)
    +callbacks.optuna.study_name=train
    +callbacks.optuna.trial=3

After each validation, rank 0 reports checkpoint.monitor to the trial in the study's storage
(by epoch when validation comes at epochs' ends, else by step: Trainer.point; the sweeper runs
elsewhere: on SLURM, the trial is an array task on another node) and asks the study's pruner
whether to go on. On "prune", every rank stops there and the run ends with status "pruned" in
summary.json (the reason in stopped_early); the sweeper then tells the study the trial was pruned. The pruner is the sweeper's
(`hydra.sweeper.pruner`, a MedianPruner by default), which the sweeper stores in the study's
user attributes so that every trial judges with the same one.

A trial that is no longer running in the study (a folder resumed or rerun by hand after its
search ended) trains to the end without reporting.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from labrun.runs.sweepdir import open_storage
from labrun.train.callbacks import Callback

if TYPE_CHECKING:
    import optuna

    from labrun.train.trainer import Trainer

log = logging.getLogger(__name__)

# The study's user attribute holding the pruner's config (a `_target_` dict, or None).
PRUNER_ATTR = "labrun.pruner"


def build_pruner(config: dict[str, Any] | None) -> optuna.pruners.BasePruner:
    """The pruner from its `_target_` config; no config: no pruning (NopPruner)."""
    import optuna
    from hydra.utils import instantiate

    return instantiate(config) if config else optuna.pruners.NopPruner()


class OptunaPruning(Callback):
    def __init__(self, storage: str, study_name: str, trial: int):
        self.storage, self.study_name, self.number = storage, study_name, int(trial)
        self.reason: str | None = None  # set once it has pruned the run
        self.trial: optuna.trial.Trial | None = None  # rank 0's handle, while the trial runs

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.reason is not None:  # pruned before a requeue or a resume: stays pruned
            trainer.request_stop(self.reason, status="pruned")
            return
        if trainer.dist.is_main:
            self.trial = self._connect()

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        prune, value = False, None
        unit, at = trainer.point  # by epoch when validation comes at epochs' ends, else step
        if self.trial is not None:
            monitor = trainer.cfg.checkpoint.monitor
            value = metrics.get(monitor)
            if value is not None:
                # NaN is reported as such: the pruners prune a trial whose value is NaN.
                self.trial.report(float(value), at)
                prune = self.trial.should_prune()
        if _on_every_rank(prune, trainer):
            monitor = trainer.cfg.checkpoint.monitor
            shown = "" if value is None or not math.isfinite(value) else f" {value:.4g}"
            self.reason = (f"pruned by the study's {type(self.trial.study.pruner).__name__} "
                           f"after {unit} {at} ({monitor}{shown})"
                           if self.trial is not None else "pruned by the study's pruner")
            trainer.request_stop(self.reason, status="pruned")

    def state_dict(self) -> dict[str, Any]:
        return {"reason": self.reason}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reason = state.get("reason")

    def _connect(self) -> optuna.trial.Trial | None:
        """The running trial in the study's storage, with the study's pruner; None when the
        trial is not running there (a finished search, a folder resumed by hand)."""
        import optuna

        storage = optuna.storages.get_storage(open_storage(self.storage))
        try:
            study_id = storage.get_study_id_from_name(self.study_name)
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, self.number)
        except KeyError:
            log.warning("optuna: no trial %d in study %s (%s): not reporting to it",
                        self.number, self.study_name, self.storage)
            return None
        state = storage.get_trial(trial_id).state
        if state != optuna.trial.TrialState.RUNNING:
            log.info("optuna: trial %d of study %s is %s, not running: training without "
                     "pruning", self.number, self.study_name, state.name.lower())
            return None
        study = optuna.load_study(study_name=self.study_name, storage=storage)
        study.pruner = build_pruner(study.user_attrs.get(PRUNER_ATTR))
        return optuna.trial.Trial(study, trial_id)


def _on_every_rank(decision: bool, trainer: Trainer) -> bool:
    """Rank 0's decision, on every rank: all stop at the same epoch (the others never ask)."""
    if not trainer.dist.enabled:
        return decision
    import torch

    flag = torch.tensor(float(decision), device=trainer.device)
    torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())
