"""`labrun resume RUN_DIR` and `labrun rerun RUN_DIR [--exec]`: the arguments; the work is
labrun.views.rerun's."""

from __future__ import annotations

from pathlib import Path


def configure(parser, name: str) -> None:
    parser.add_argument("run_dir", type=Path, help="the run folder (outputs/DATE/TIME-XXXX)")
    if name == "rerun":
        parser.add_argument("--exec", action="store_true", help="run the command, too")
    parser.add_argument("extra", nargs="*", help="more overrides, e.g. trainer.max_epochs=20")


def run(args) -> int:
    from labrun.views import rerun

    if args.command == "resume":
        return rerun.resume(args.run_dir, args.extra)
    return rerun.rerun(args.run_dir, args.extra, execute=args.exec)
