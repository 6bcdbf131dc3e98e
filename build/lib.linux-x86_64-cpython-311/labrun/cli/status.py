"""`labrun status SWEEP_DIR|RUN_DIR [--json] [--wait]`: the arguments; the table is
labrun.views.status's."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="a sweep folder (multirun/DATE/TIME-XXXX) or one run folder")
    parser.add_argument("--json", action="store_true",
                        help="print each job's state, metric, figures and verdict as JSON")
    parser.add_argument("--all", action="store_true", dest="every_row",
                        help="every job's row, however many (by default a sweep larger than "
                             "the screen shows its counts by state and the rows that need a "
                             "look: failed, running, the best)")
    parser.add_argument("--wait", action="store_true",
                        help="wait until every job has ended, then print the table; exit 0 "
                             "when all completed, 1 when some did not (Ctrl-C cancels nothing)")


def run(args) -> int:
    from labrun.views import status

    if args.wait:
        return status.wait(args.path)
    status.show(args.path, as_json=args.json, every_row=args.every_row)
    return 0
