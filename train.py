"""The one training entry: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                  the default job (digits, small CNN, CPU)
    python train.py model=resnet18 optimizer.lr=0.1  any key from conf/ can be overridden
    python train.py cluster=lab                      one run, submitted to SLURM and followed
    python train.py -m optimizer.lr=0.1,0.01         a sweep
    python train.py --help | --cfg job               config groups / the composed config
"""

import hydra
from omegaconf import DictConfig

from labrun.cli.hydra_app import run_hydra_app, train_task
from labrun.config import schema as config

config.register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    return train_task(cfg)


if __name__ == "__main__":
    run_hydra_app(main)
