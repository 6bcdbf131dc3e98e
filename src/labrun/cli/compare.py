"""`labrun compare SWEEP_DIR|RUN_DIR...`: the arguments; the work is labrun.views.compare's."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="run folders, or folders with run folders below them (a sweep)")
    parser.add_argument("--metric", help="the metric to rank by (default: the runs' "
                                         "checkpoint.monitor, e.g. val/acc)")
    parser.add_argument("--mode", choices=("max", "min"),
                        help="max or min is best (default: the runs' checkpoint.mode for their "
                             "monitor; otherwise min for losses and errors, max for the rest)")
    parser.add_argument("--csv", type=Path, metavar="FILE", help="write the table as CSV")
    parser.add_argument("--markdown", type=Path, metavar="FILE",
                        help="write the table as Markdown (for a pull request)")
    parser.add_argument("--over", metavar="KEYS", type=lambda text: text.split(","),
                        help="fold these keys away (seed; several: seed,dataset.fold): one row "
                             "per configuration of the others, mean ± std, min, max and n")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="learning curves (and metric vs the swept parameter) as a PNG")


def run(args: argparse.Namespace) -> int:
    from labrun.views import aggregate, compare

    if args.over:
        aggregate.compare_over(args.paths, args.over, metric=args.metric, mode=args.mode,
                               csv_file=args.csv, markdown=args.markdown, plot_file=args.plot)
    else:
        compare.compare(args.paths, metric=args.metric, mode=args.mode, csv_file=args.csv,
                        markdown=args.markdown, plot_file=args.plot)
    return 0
