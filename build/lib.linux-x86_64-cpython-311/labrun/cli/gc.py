"""`labrun gc SWEEP_DIR [--keep-best K] [--dry-run]`: remove the checkpoints a finished sweep's
jobs need not keep (labrun.train.checkpoint_gc)."""

from __future__ import annotations

from pathlib import Path


def configure(parser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR",
                        help="the sweep folder (multirun/DATE/TIME-XXXX)")
    parser.add_argument("--keep-best", type=int, metavar="K", default=None,
                        help="the jobs outside the best K by checkpoint.monitor lose best.pt "
                             "and last.pt too (their metrics, summary and config stay)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would be removed, and remove nothing")


def run(args) -> int:
    from rich.filesize import decimal

    from labrun.core.errors import LabrunError
    from labrun.train import checkpoint_gc

    if args.keep_best is not None and args.keep_best < 0:
        raise LabrunError(f"--keep-best {args.keep_best}: give 0 or more jobs to keep")
    result = checkpoint_gc.collect(args.path, keep_best=args.keep_best, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path, size in result.removed:
        # 0 B: another name of the same file (best.pt, last.pt) keeps its bytes.
        print(f"{verb} {path} ({decimal(size)})")
    for line in result.kept:
        print(line)
    print(f"{'would free' if args.dry_run else 'freed'} {decimal(result.freed)} in "
          f"{len(result.removed)} files of {args.path}")
    return 0
