"""`labrun bench NAME [--check]` and `labrun bench all [--check]`: the arguments and the loop
over the benchmarks of labrun.bench.BENCHES."""

from __future__ import annotations

import argparse

from labrun.bench import BENCHES, bench, report

CHECK_HELP = ("exit 1 when a figure is past its floor (a required target), naming each (what "
              "`make bench` does); a goal not reached fails nothing")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (_, _, help_text) in BENCHES.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        bench(name)[0](bench_parser)
        bench_parser.add_argument("--check", action="store_true", help=CHECK_HELP)
    every = sub.add_parser("all", help="every benchmark above, with its defaults "
                                       "(`make bench` runs `all --check`)")
    every.add_argument("--check", action="store_true", help=CHECK_HELP)
    every.add_argument("--skip", action="append", default=[], choices=list(BENCHES),
                       metavar="NAME", help="leave benchmark NAME out (one that cannot run "
                                            "here, such as sweep without a SLURM cluster); "
                                            "the summary names it")


def run(args: argparse.Namespace) -> int:
    if args.bench != "all":
        return report(bench(args.bench)[1](args), args.check)
    verdicts = []
    for name in BENCHES:
        if name in args.skip:
            print(f"== labrun bench {name}: left out (--skip {name})", flush=True)
            continue
        configure_bench, run_bench = bench(name)
        defaults = argparse.ArgumentParser()
        configure_bench(defaults)
        print(f"== labrun bench {name}", flush=True)
        verdicts += run_bench(defaults.parse_args([]))
    print("== every benchmark's figures against its baseline, floor and goal", flush=True)
    return report(verdicts, args.check, skipped=args.skip)
