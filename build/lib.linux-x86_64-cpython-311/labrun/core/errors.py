"""The one exception type for mistakes a user can fix: a config key, a file, an argument.

The message is one line that names the problem and the fix; entries print it and exit 2.
"""


class LabrunError(Exception):
    """A user-fixable problem; str(error) is the one line to print."""


class ConfigError(LabrunError):
    """A config value that cannot work; the message names the key and the fix."""


class DataError(LabrunError):
    """A data file or folder that cannot be read; the message names the file and the fix."""


class RunInterrupted(LabrunError):
    """A stop signal arrived; a checkpoint was saved at the step boundary that followed.
    Here, not in train/trainer.py, so that the entries' error path needs no torch."""


def first_line(text: str) -> str:
    """The first line of a (possibly multi-line) message."""
    return text.strip().splitlines()[0] if text.strip() else text


def one_line(error: BaseException) -> str:
    """The first line of an error's message.

    An exception raised in a DataLoader worker is re-raised in the main process with the
    worker's traceback as its message; its own message is that traceback's last line.
    """
    text = str(error).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return first_line(text) if text else type(error).__name__
