"""`labrun <command>`: one sub-command per module.

Each command module exposes `configure(parser)` to declare its arguments and `run(args) -> int`.
Modules are imported only when their command runs, so `labrun --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys

from labrun.core.errors import LabrunError

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("labrun.cli.train", "train a run, or a sweep with -m: `labrun train --help` lists "
              "the config groups (the same app as `python train.py`)"),
    "new": ("labrun.cli.new", "a new project of the lab: its own repository, configs and code, "
            "on labrun by version"),
    "convert": ("labrun.cli.convert", "convert data: images (or images and masks: convert seg; "
                "images and boxes: convert det) to one HDF5 file, text to token files"),
    "resume": ("labrun.cli.rerun", "resume an interrupted run in its own folder"),
    "rerun": ("labrun.cli.rerun", "reproduce a run from scratch in a new folder"),
    "status": ("labrun.cli.status", "a sweep's or a run's jobs: state, metric, images/s or tokens/s, data wait, verdict"),
    "cancel": ("labrun.cli.cancel", "cancel a sweep's waiting and running jobs, from any terminal"),
    "gc": ("labrun.cli.gc", "remove the checkpoints a finished sweep's jobs need not keep"),
    "queue": ("labrun.cli.queue", "the SLURM cluster: GPUs in use, fair share, pending jobs"),
    "compare": ("labrun.cli.compare", "compare runs: table, csv, markdown, plot"),
    "dashboard": ("labrun.cli.dashboard", "a sweep's results in a browser, no W&B account: "
                  "optuna-dashboard or TensorBoard HParams"),
    "configs": ("labrun.cli.configs", "check or diff configs for review"),
    "eval": ("labrun.cli.eval", "evaluate a run's checkpoint on any split, of its dataset or "
             "another: RUN/eval/*.json"),
    "export": ("labrun.cli.export", "export a run's model to TorchScript or ONNX"),
    "serve": ("labrun.cli.serve", "serve an exported model over HTTP"),
    "predict": ("labrun.cli.predict", "predict offline with an exported model or a run: "
                "its task's inputs (images, or a lab task's own)"),
    "weights": ("labrun.cli.weights", "pretrained weights for offline nodes: fetch into the "
                "lab's cache, list it"),
    "doctor": ("labrun.cli.doctor", "check this machine's GPU/CUDA/NCCL/SLURM set-up"),
    "bench": ("labrun.cli.bench", "run the benchmarks"),
    "monitor": ("labrun.cli.monitor", "Prometheus for the runs training now and the SLURM queue: "
                "targets, queue, up"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labrun", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def setup_logging() -> None:
    """What a command reports goes to stderr, so that its output (tables, JSON, CSV) can be
    piped: through rich on a terminal, as plain lines otherwise (logs, CI, pipes). A no-op when
    logging is already set up (a test runner, a program calling main())."""
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # httpx logs every request at INFO: the commands' own polling (monitor up, bench serve)
    # would drown what they report.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # Hydra's app: its own arguments, its own logging, its exit code
        from labrun.cli.train import main as train

        train(argv[1:])
        return 0
    setup_logging()
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints usage or the error, exits 2
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    prog, description = f"labrun {name}", COMMANDS[name][1]
    # A command with sub-commands names their modules (`labrun convert text ...`); without one
    # of their names, its own module takes the arguments (`labrun convert SRC_DIR OUT.h5`).
    subcommands = getattr(module, "SUBCOMMANDS", {})
    if rest and rest[0] in subcommands:
        prog = f"{prog} {rest[0]}"
        module = importlib.import_module(subcommands[rest[0]])
        description = (module.__doc__ or description).splitlines()[0]
        rest = rest[1:]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    # resume and rerun share one module, which needs to know which of the two it is.
    if len(inspect.signature(module.configure).parameters) == 2:
        module.configure(parser, name)
    else:
        module.configure(parser)
    # A command whose overrides may come after its options (`labrun eval RUN --split test
    # dataset=x`) says so: argparse takes positionals after an option only when intermixed.
    intermixed = getattr(module, "INTERMIXED", False)
    args = parser.parse_intermixed_args(rest) if intermixed else parser.parse_args(rest)
    args.command = name
    try:
        return int(module.run(args) or 0)
    except LabrunError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


