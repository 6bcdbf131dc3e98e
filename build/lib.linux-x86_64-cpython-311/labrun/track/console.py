"""The console side of a run's log: rich on a terminal, plain lines otherwise.

conf/hydra/job_logging/labrun.yaml installs it for `python train.py` next to Hydra's per-run
log file (train.log). Plain lines keep what scripts and tests read: INFO and below are the bare
message on stdout, warnings and errors go to stderr as "warning: ..." / "error: ...".
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

# conf/hydra/job_logging/labrun.yaml's format for train.log
FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class PlainHandler(logging.Handler):
    """Bare messages on stdout; WARNING and above, prefixed with their level, on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.WARNING:
                stream, message = sys.stderr, f"{record.levelname.lower()}: {message}"
            else:
                stream = sys.stdout
            stream.write(message + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy: report, never raise
            self.handleError(record)


def console_handler() -> logging.Handler:
    """RichHandler when stdout is a terminal, PlainHandler otherwise."""
    if sys.stdout.isatty():
        from rich.highlighter import NullHighlighter
        from rich.logging import RichHandler

        # No highlighting: metric lines read as written, as they did before logging.
        return RichHandler(show_path=False, markup=False, highlighter=NullHighlighter())
    return PlainHandler()


def log_like_a_job(log_file: Path) -> None:
    """Logging for a process Hydra did not configure (each rank that `trainer.devices=N`
    starts): the same console handler and the run's train.log, appended to. Without it the
    ranks' reports (rank 0's progress, "resuming from") would go nowhere."""
    root = logging.getLogger()
    if root.handlers:
        return
    root.setLevel(logging.INFO)
    root.addHandler(console_handler())
    file = logging.FileHandler(log_file)
    file.setFormatter(logging.Formatter(FILE_FORMAT))
    root.addHandler(file)
