"""`labrun cancel SWEEP_DIR|RUN_DIR`: cancel a sweep's waiting and running jobs, or a run,
from any terminal (labrun.views.cancel)."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="a sweep folder (multirun/DATE/TIME-XXXX) or a run folder "
                             "(outputs/DATE/TIME-XXXX)")


def run(args) -> int:
    from labrun.runs.sweepdir import num_ranges
    from labrun.views import cancel

    cancelled = cancel.cancel(args.path)
    print(f"cancelled {len(cancelled)} jobs of {args.path}" +
          (f": {num_ranges([job.num for job in cancelled])}" if cancelled else
           " (none was waiting or running)"))
    return 0
