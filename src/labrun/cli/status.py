"""`labrun status SWEEP_DIR`: the arguments; the table is labrun.runs.status's."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("sweep_dir", type=Path, help="the sweep folder (multirun/DATE/TIME-XXXX)")


def run(args) -> int:
    from labrun.runs import status

    status.show(args.sweep_dir)
    return 0
