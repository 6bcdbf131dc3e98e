"""`labrun dashboard SWEEP_DIR|RUN_ROOT`: the arguments; the work is labrun.views.dashboard's."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, metavar="SWEEP_DIR|RUN_ROOT",
                        help="an Optuna sweep's folder (optuna-dashboard), or a grid sweep or "
                             "any folder with run folders below it (TensorBoard HParams)")
    parser.add_argument("--port", type=int,
                        help="the port (default: the tool's own, 8080 or 6006)")
    parser.add_argument("--bind", default="127.0.0.1",
                        help="the address to listen on (default: 127.0.0.1, this machine only; "
                             "reach it from a laptop with the ssh -L line it prints)")
    parser.add_argument("--metric", help="TensorBoard: the metric whose best and final value "
                                         "each run shows (default: the runs' checkpoint.monitor)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write what the tool reads (HParams summaries, the study's copy) "
                             "and stop, without starting it")


def run(args: argparse.Namespace) -> int:
    from labrun.views import dashboard

    plan = dashboard.prepare(args.path, port=args.port, bind=args.bind, metric=args.metric)
    if args.prepare_only:
        print(f"{plan.tool}: {plan.what}")
        print(" ".join(plan.argv))
        return 0
    return dashboard.serve(plan)
