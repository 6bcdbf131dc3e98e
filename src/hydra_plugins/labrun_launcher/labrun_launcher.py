"""Hydra finds launchers only inside the `hydra_plugins` package: these names make labrun's
launchers (src/labrun/launch/) visible to it. `cluster=...` picks one; see conf/cluster/."""

from labrun.launch import local, optuna_sweeper, slurm


class LabrunLocalLauncher(local.LocalLauncher):
    """cluster=local: each of the sweep's jobs a submitit LocalExecutor job with its own
    GPUs, started as GPUs become free."""


class LabrunSlurmLauncher(slurm.SlurmLauncher):
    """cluster=lab / slurm_dev: a SLURM job array through submitit."""


class LabrunOptunaSweeper(optuna_sweeper.ResumableOptunaSweeper):
    """hparams_search=optuna: an Optuna study that a re-run continues."""
