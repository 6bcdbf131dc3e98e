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


def torch_load_reason(error: BaseException) -> str:
    """Why torch.load could not read a file, in one line. A refusal of weights_only=True is
    named as such: torch's own message advises loading the file without it, which would run
    whatever code the file holds."""
    text = str(error)
    if "weights_only" in text or "Unsupported global" in text:
        return "it holds pickled objects that could run code, refused (weights_only)"
    reason = first_line(text)[:200]
    return "not a PyTorch checkpoint file" if reason.isdigit() else reason  # no pickle at all
