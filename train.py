"""The one training entry: `python train.py [group=option ...] [key=value ...]`.

    python train.py                                  the default job (digits, small CNN, CPU)
    python train.py model=resnet18 optimizer.lr=0.1  any key from conf/ can be overridden
    python train.py -m optimizer.lr=0.1,0.01         a sweep
    python train.py --help | --cfg job               config groups / the composed config
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from labrun.cli.hydra_app import exit_on_user_error, run_hydra_app
from labrun.config import schema as config
from labrun.config import validation

config.register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    with exit_on_user_error():
        # A mistake in the config is one line before torch loads (seconds of imports); the
        # job is imported only then, which also keeps `--help` and `--cfg` fast.
        validation.validate(cfg)
        if HydraConfig.get().mode == RunMode.RUN:
            validation.check_single_run(cfg)
        from labrun.train.job import train

        return train(cfg)


if __name__ == "__main__":
    run_hydra_app(main)
