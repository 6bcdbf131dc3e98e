"""The one training entry, as `labrun train` (labrun/cli/train.py): `python train.py [group=option
...] [key=value ...]`, `-m` for a sweep, `--help` and `--cfg job` as Hydra gives them."""

from labrun.cli.train import main

if __name__ == "__main__":
    main()
