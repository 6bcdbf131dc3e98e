"""`labrun configs check` and `labrun configs diff A B`: config review for pull requests.

check: composes the primary config with its defaults, then every option of every config group
       (experiment presets included) on top of the defaults, the way `python train.py group=option`
       would, and validates each against the schemas and `labrun.config.validate`. One line per
       problem, `FILE: KEY: what is wrong`, then a count; exit 1 when anything fails.
diff:  the resolved keys that differ between two configs, each a run folder or an override list.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from labrun import config
from labrun.entry import user_error_message
from labrun.errors import ConfigError, LabrunError

PROJECT_CONF = Path(__file__).resolve().parents[2] / "conf"
PRIMARY = "train"
# Hydra's own settings and the untracked per-user overrides are not options people review.
SKIPPED_GROUPS = ("hydra", "local")

DIFF_HELP = """\
A and B are each one of:
  a run folder        outputs/2024-05-01/12-00-00-ab12 (its .hydra/config.yaml, as the run saw it)
  an override list    "model=resnet18,optimizer.lr=0.1": the overrides of `python train.py`,
                      separated by commas (commas inside [...] or {...} stay with their value)
  ""                  the defaults: conf/train.yaml with no overrides

An argument that names an existing folder is a run folder; anything else is an override list.
paths.* (where this machine keeps data and outputs) is left out unless --paths is given. Keys
whose value needs Hydra's runtime (paths.run_dir: ${hydra:runtime.output_dir}) are compared as
written, unresolved; the output lists them.

examples:
  labrun configs diff "" experiment=resnet18_cifar10
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 multirun/2024-05-02/09-00-00-cd34/3
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 "optimizer.lr=0.1,trainer.max_epochs=30"
"""


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check", help="compose and validate every option of every config group",
        description="Compose the defaults, then every option of every config group and every "
                    "experiment preset, and validate each against the schemas. Prints one line "
                    "per problem (FILE: KEY: what is wrong) and exits 1 when anything fails.")
    check.add_argument("--config-dir", type=Path, default=PROJECT_CONF,
                       help=f"the config tree to check (default: {PROJECT_CONF})")
    check.add_argument("--config-name", default=PRIMARY,
                       help="the primary config in it (default: train)")
    diff = actions.add_parser(
        "diff", help="the resolved keys that differ between two configs",
        description="Print the resolved keys that differ between A and B: `key: old -> new`, "
                    "and the keys only one side has.",
        epilog=DIFF_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("a", metavar="A", help="run folder or override list (see below)")
    diff.add_argument("b", metavar="B", help="run folder or override list (see below)")
    diff.add_argument("--config-dir", type=Path, default=PROJECT_CONF,
                      help="the config tree that override lists compose from (default: conf/)")
    diff.add_argument("--paths", action="store_true", help="compare paths.* too")


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        return check(args.config_dir, args.config_name)
    return diff(args.a, args.b, args.config_dir, include_paths=args.paths)


# ---------------------------------------------------------------------------------------------
# Composition, shared by check and diff


@contextmanager_type := None  # placeholder removed below
