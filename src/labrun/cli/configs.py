"""`labrun configs check`, `labrun configs diff A B` and `labrun configs review [BASE]`: config
review for pull requests; `labrun configs show KEY...`: where each key's value comes from.

The arguments only; the work is labrun.review.check, labrun.review.diff,
labrun.review.review and labrun.config.layers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from labrun.config.resolve import PRIMARY
from labrun.core.project import LABRUN_CONF

DIFF_HELP = """\
A and B are each one of:
  a run folder      outputs/2024-05-01/12-00-00-ab12 (its .hydra/config.yaml, as the run saw it)
  an override list  "model=resnet18,optimizer.lr=0.1": overrides as `python train.py` takes
                    them, separated by commas (commas inside [...] or {...} stay with the value)
  ""                the defaults: the primary config with no overrides
  REV:SPEC          an override list (or "") composed at git revision REV, with that
                    revision's own conf/ and schemas: main:experiment=resnet18_cifar10

An argument naming an existing folder is a run folder; REV:... where REV is a git revision of
the current repository is read from that revision (the work tree is not touched); anything else
is an override list composed from the work tree.
paths.* (where this machine keeps data and outputs) is left out unless --paths is given. Keys
whose value needs Hydra's runtime (paths.run_dir: ${hydra:runtime.output_dir}) cannot be
resolved outside a job: they are compared as written, and the output lists them.

examples:
  labrun configs diff "" experiment=resnet18_cifar10
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 multirun/2024-05-02/09-00-00-cd34/3
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 "optimizer.lr=0.1,trainer.max_epochs=30"
  labrun configs diff main:experiment=resnet18_cifar10 experiment=resnet18_cifar10
"""

REVIEW_HELP = """\
Composes, at BASE and at HEAD (the work tree unless --head REV), the primary config's defaults,
every experiment preset (conf/experiment/) and the override lists named in conf/review.yaml,
each side with its own conf/ and its own schemas (src/), and prints for each: the keys that
changed, which of them change results (the schema's affects_result) and which would make a
running job refuse to resume (resume_safe), and whether it still composes and validates.
BASE is read with `git archive` into a temporary folder; the work tree is never touched.
Exits 1 when a config that composed at BASE no longer composes or validates at HEAD.

examples:
  labrun configs review                        # against the merge base with origin/HEAD
  labrun configs review HEAD~1 --markdown review.md
  labrun configs review main --head my-branch --json review.json
"""


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check", help="compose and validate every option of every config group",
        description="Compose the defaults, then every option of every config group and every "
                    "experiment preset, and validate each against the schemas. Prints one line "
                    "per problem (FILE: KEY: what is wrong) and exits 1 when anything fails.")
    check.add_argument("--config-dir", type=Path, default=LABRUN_CONF,
                       help="the primary config tree (default: labrun's groups, with this "
                            "project's conf/ and the lab's over them)")
    check.add_argument("--config-name", default=PRIMARY,
                       help="the primary config in it (default: train)")
    diff = actions.add_parser(
        "diff", help="the resolved keys that differ between two configs",
        description="Print the resolved keys that differ between A and B as `key: old -> new`, "
                    "keys only one side has included.",
        epilog=DIFF_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("a", metavar="A", help="a run folder or an override list (see below)")
    diff.add_argument("b", metavar="B", help="a run folder or an override list (see below)")
    diff.add_argument("--config-dir", type=Path, default=LABRUN_CONF,
                      help="the primary config tree override lists compose from (default: "
                           "labrun's groups, with this project's conf/ and the lab's over them)")
    diff.add_argument("--config-name", default=PRIMARY,
                      help="the primary config in it (default: train)")
    diff.add_argument("--paths", action="store_true", help="compare paths.* too")
    review = actions.add_parser(
        "review", help="what a change does to every experiment, against a git revision",
        description="Compare every experiment's resolved config at BASE and at HEAD.",
        epilog=REVIEW_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    review.add_argument("base", metavar="BASE", nargs="?",
                        help="git revision to compare with (default: the merge base with "
                             "origin/HEAD, else with main)")
    review.add_argument("--head", metavar="REV",
                        help="the revision to review (default: the work tree)")
    review.add_argument("--markdown", metavar="FILE", type=Path,
                        help="also write the review as markdown for a pull-request comment")
    review.add_argument("--json", metavar="FILE", type=Path,
                        help="also write the review as JSON")
    review.add_argument("--repo", metavar="DIR", type=Path, default=Path.cwd(),
                        help="the project's git checkout (default: the current folder's)")
    review.add_argument("--config-name", default=PRIMARY,
                        help="the primary config (default: train)")
    show = actions.add_parser(
        "show", help="each key's value, and the layer and file that set it",
        description="Compose the config as `labrun train OVERRIDE...` would, here, and print "
                    "each KEY's value with the layer that set it last (labrun, lab: "
                    "LABRUN_SITE, project: its conf/, local: its conf/local/, command line) "
                    "and the file.",
        epilog="example: labrun configs show cluster.partition paths.weights_cache cluster=lab")
    show.add_argument("words", nargs="+", metavar="KEY|OVERRIDE",
                      help="keys to show (cluster.partition) and overrides to compose with "
                           "(cluster=lab, trainer.max_epochs=3): a word with '=' is an override")
    show.add_argument("--config-dir", type=Path, default=LABRUN_CONF, help=argparse.SUPPRESS)
    show.add_argument("--config-name", default=PRIMARY, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        from labrun.review.check import check

        return check(args.config_dir, args.config_name)
    if args.action == "show":
        from labrun.config import layers

        keys = [word for word in args.words if "=" not in word]
        if not keys:
            from labrun.core.errors import LabrunError

            raise LabrunError("name a key to show, such as cluster.partition (words with '=' "
                              "are overrides)")
        overrides = [word for word in args.words if "=" in word]
        layers.print_origins(layers.show(keys, overrides, args.config_dir, args.config_name))
        return 0
    if args.action == "review":
        from labrun.review.review_cli import run_review

        return run_review(args.repo, args.base, args.head, args.config_name,
                          markdown=args.markdown, json_file=args.json)
    from labrun.review.diff import diff

    return diff(args.a, args.b, args.config_dir, args.config_name, include_paths=args.paths)
