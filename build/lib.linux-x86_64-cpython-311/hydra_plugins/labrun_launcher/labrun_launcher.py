"""Hydra finds launchers and sweepers only inside the `hydra_plugins` package: these names make
labrun's (src/labrun/launch/) visible to it. `cluster=...` picks a launcher (conf/cluster/),
`hparams_search=optuna` the sweeper (conf/hparams_search/optuna.yaml)."""

from dataclasses import dataclass, field
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
from hydra.core.config_store import ConfigStore

from labrun.launch import grid_sweeper, local, optuna_sweeper, slurm


class LabrunLocalLauncher(local.LocalLauncher):
    """cluster=local: each of the sweep's jobs a submitit LocalExecutor job with its own
    GPUs, started as GPUs become free."""


class LabrunSlurmLauncher(slurm.SlurmLauncher):
    """cluster=lab / slurm_dev: a SLURM job array through submitit."""


class LabrunGridSweeper(grid_sweeper.GridSweeper):
    """hydra/sweeper=labrun_basic, the default: Hydra's basic (grid) sweeper, whose per-job
    composition check the launcher's own makes redundant."""


@dataclass
class LabrunGridSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.labrun_launcher.labrun_launcher.LabrunGridSweeper"


class LabrunOptunaSweeper(optuna_sweeper.OptunaSweeper):
    """hparams_search=optuna: an Optuna study in the sweep folder, its trials run through the
    launcher with n_jobs in flight at once, each started as another ends, pruned from the
    values they log; a re-run continues it."""


@dataclass
class LabrunOptunaSweeperConf:
    """hydra/sweeper=labrun_optuna: the keys of labrun.launch.optuna_sweeper (typed: Hydra
    refuses a misspelt key or a wrong type in one line)."""

    _target_: str = "hydra_plugins.labrun_launcher.labrun_launcher.LabrunOptunaSweeper"
    storage: str | None = None  # null: SWEEP_DIR/optuna.journal
    study_name: str | None = None  # null: the job name (train)
    direction: str | None = None  # maximize | minimize; null: checkpoint.mode's (max: maximize)
    n_trials: int = 20
    n_jobs: int = 1
    max_failure_rate: float = 0.0
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler"})
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.MedianPruner"})
    params: dict[str, Any] = field(default_factory=dict)


# Stored when Hydra scans its plugins, before it composes a config.
ConfigStore.instance().store(group="hydra/sweeper", name="labrun_basic",
                             node=LabrunGridSweeperConf, provider="labrun")
ConfigStore.instance().store(group="hydra/sweeper", name="labrun_optuna",
                             node=LabrunOptunaSweeperConf, provider="labrun")
