"""`labrun new NAME [--task KIND] [--dir DIR]`: the arguments; the project is labrun.scaffold's."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def configure(parser) -> None:
    from labrun.scaffold import TASKS

    parser.add_argument("name", metavar="NAME",
                        help="the project's name, which is its Python package's (plant-disease "
                             "-> plant_disease)")
    parser.add_argument("--task", choices=sorted(TASKS),
                        help="give the project a task of its own, a subclass of this built-in "
                             "task (default: labrun's image classification, unchanged)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to make it (default: ./NAME; must be new or empty)")


def run(args) -> int:
    from labrun.scaffold import new

    folder = new(args.name, args.dir, args.task)
    log.info("made the project %s (first commit done); next:\n  cd %s\n  make train\n  "
             "make test", args.name, folder)
    return 0
