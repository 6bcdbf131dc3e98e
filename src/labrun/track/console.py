"""The console side of a run's log: rich on a terminal, plain lines otherwise.

conf/hydra/job_logging/labrun.yaml installs it for `python train.py` next to Hydra's per-run
log file (train.log). Plain lines keep what scripts and tests read: INFO and below are the bare
message on stdout, warnings and errors go to stderr as "warning: ..." / "error: ...".
"""

from __future__ import annotations

import logging
import sys


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
