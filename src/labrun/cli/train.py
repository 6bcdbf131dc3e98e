"""`labrun train [group=option ...] [key=value ...]` (and `-m` for a sweep): the one training app,
which `python train.py` runs too. Hydra composes labrun's config groups, packaged with it
(pkg://labrun.conf), from any folder.

    labrun train                                   the default job (digits, small CNN, CPU)
    labrun train model=resnet18 optimizer.lr=0.1   any key of the config can be overridden
    labrun train cluster=lab                       one run, submitted to SLURM and followed
    labrun train -m optimizer.lr=0.1,0.01          a sweep
    labrun train --help | --cfg job                config groups / the composed config
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from labrun.cli.hydra_app import run_hydra_app, train_task
from labrun.config import schema as config
from labrun.core.project import LABRUN_CONF_MODULE


@hydra.main(version_base="1.3", config_path=f"pkg://{LABRUN_CONF_MODULE}", config_name="train")
def app(cfg: DictConfig) -> float | None:
    return train_task(cfg)


def main(argv: list[str] | None = None) -> None:
    """Run the app on `argv` (default: this process's arguments); exits with its outcome."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]  # Hydra reads its arguments from sys.argv
    config.register()
    run_hydra_app(app)
