"""`labrun <command>`: one sub-command per module.

Each command module exposes `configure(parser)` to declare its arguments and `run(args) -> int`.
Modules are imported only when their command runs, so `labrun --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

from labrun.core.errors import LabrunError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("labrun.data.convert", "convert an image folder to one HDF5 file"),
    "resume": ("labrun.runs.rerun", "resume an interrupted run in its own folder"),
    "rerun": ("labrun.runs.rerun", "reproduce a run from scratch in a new folder"),
    "status": ("labrun.runs.status", "show the state of a sweep's jobs"),
    "queue": ("labrun.launch.queue", "the SLURM cluster: GPUs in use, fair share, pending jobs"),
    "compare": ("labrun.runs.compare", "compare runs: table, csv, markdown, plot"),
    "configs": ("labrun.config.review", "check or diff configs for review"),
    "export": ("labrun.deploy.export", "export a run's model to TorchScript or ONNX"),
    "serve": ("labrun.deploy.serve", "serve an exported model over HTTP"),
    "predict": ("labrun.deploy.predict", "predict images offline with an exported model"),
    "doctor": ("labrun.doctor", "check this machine's GPU/CUDA/NCCL/SLURM set-up"),
    "bench": ("labrun.bench", "run the benchmarks"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labrun", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints usage or the error, exits 2
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"labrun {name}", description=COMMANDS[name][1])
    # resume and rerun share one module, which needs to know which of the two it is.
    if len(inspect.signature(module.configure).parameters) == 2:
        module.configure(parser, name)
    else:
        module.configure(parser)
    args = parser.parse_args(rest)
    args.command = name
    try:
        return int(module.run(args) or 0)
    except LabrunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


