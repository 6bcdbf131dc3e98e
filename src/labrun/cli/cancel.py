"""`labrun cancel SWEEP_DIR`: cancel a sweep's waiting and running jobs from any terminal
(labrun.runs.cancel)."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR",
                        help="the sweep folder (multirun/DATE/TIME-XXXX)")


def run(args) -> int:
    from labrun.runs import cancel

    cancelled = cancel.cancel(args.path)
    print(f"cancelled {len(cancelled)} jobs of {args.path}" +
          (f": {', '.join(str(job.num) for job in cancelled)}" if cancelled else
           " (none was waiting or running)"))
    return 0
