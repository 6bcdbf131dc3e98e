"""`labrun status SWEEP_DIR|RUN_DIR [--json]`: the arguments; the table is labrun.runs.status's."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="a sweep folder (multirun/DATE/TIME-XXXX) or one run folder")
    parser.add_argument("--json", action="store_true",
                        help="print each job's state, metric, figures and verdict as JSON")


def run(args) -> int:
    from labrun.runs import status

    status.show(args.path, as_json=args.json)
    return 0
