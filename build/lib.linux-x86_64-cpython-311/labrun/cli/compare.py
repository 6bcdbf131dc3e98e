"""`labrun compare SWEEP_DIR|RUN_DIR...`: the arguments; the work is labrun.views.compare's
(`--exact A B`: labrun.views.exact's)."""

from __future__ import annotations

import argparse
from pathlib import Path

# What ranks or writes the table, meaningless for --exact's verdict on two runs.
TABLE_OPTIONS = ("metric", "mode", "csv", "markdown", "over", "plot")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, metavar="SWEEP_DIR|RUN_DIR",
                        help="run folders, or folders with run folders below them (a sweep)")
    parser.add_argument("--exact", action="store_true",
                        help="two run folders A B: their logged rows, summary.json and every "
                             "checkpoint compared bit for bit (what measures time left out, "
                             "and named); exit 0 when identical, 1 when different")
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
    if args.exact:
        return run_exact(args)
    from labrun.views import aggregate, compare

    if args.over:
        aggregate.compare_over(args.paths, args.over, metric=args.metric, mode=args.mode,
                               csv_file=args.csv, markdown=args.markdown, plot_file=args.plot)
    else:
        compare.compare(args.paths, metric=args.metric, mode=args.mode, csv_file=args.csv,
                        markdown=args.markdown, plot_file=args.plot)
    return 0


def run_exact(args: argparse.Namespace) -> int:
    from labrun.core.errors import LabrunError

    given = [f"--{name}" for name in TABLE_OPTIONS if getattr(args, name) is not None]
    if given:
        raise LabrunError(f"--exact compares two runs bit for bit and makes no table: drop "
                          f"{', '.join(given)}, or compare without --exact")
    if len(args.paths) != 2:
        raise LabrunError(f"--exact compares exactly two run folders, got {len(args.paths)}: "
                          f"labrun compare --exact RUN_A RUN_B")
    from labrun.views import exact

    comparison = exact.compare_runs(*args.paths)
    print("\n".join(comparison.lines()))
    return 0 if comparison.identical else 1
