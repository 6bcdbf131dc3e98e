"""`labrun configs check` and `labrun configs diff A B`: config review for pull requests.

The arguments only; the work is labrun.config.check and labrun.config.diff.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from labrun.config.resolve import PRIMARY, PROJECT_CONF

DIFF_HELP = """\
A and B are each one of:
  a run folder      outputs/2024-05-01/12-00-00-ab12 (its .hydra/config.yaml, as the run saw it)
  an override list  "model=resnet18,optimizer.lr=0.1": overrides as `python train.py` takes
                    them, separated by commas (commas inside [...] or {...} stay with the value)
  ""                the defaults: the primary config with no overrides

An argument naming an existing folder is a run folder; anything else is an override list.
paths.* (where this machine keeps data and outputs) is left out unless --paths is given. Keys
whose value needs Hydra's runtime (paths.run_dir: ${hydra:runtime.output_dir}) cannot be
resolved outside a job: they are compared as written, and the output lists them.

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
                       help="the config tree to check (default: this project's conf/)")
    check.add_argument("--config-name", default=PRIMARY,
                       help="the primary config in it (default: train)")
    diff = actions.add_parser(
        "diff", help="the resolved keys that differ between two configs",
        description="Print the resolved keys that differ between A and B as `key: old -> new`, "
                    "keys only one side has included.",
        epilog=DIFF_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("a", metavar="A", help="a run folder or an override list (see below)")
    diff.add_argument("b", metavar="B", help="a run folder or an override list (see below)")
    diff.add_argument("--config-dir", type=Path, default=PROJECT_CONF,
                      help="the config tree override lists compose from (default: conf/)")
    diff.add_argument("--config-name", default=PRIMARY,
                      help="the primary config in it (default: train)")
    diff.add_argument("--paths", action="store_true", help="compare paths.* too")


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        from labrun.config.check import check

        return check(args.config_dir, args.config_name)
    from labrun.config.diff import diff

    return diff(args.a, args.b, args.config_dir, args.config_name, include_paths=args.paths)
