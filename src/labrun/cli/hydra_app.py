"""The error path of `python train.py`: one clear line and exit code 2 for a mistake a person
can fix (a config key, a path, a file); a full traceback for everything else.

Hydra composes and runs the app as its docs show; only its error printing is replaced. Setting
HYDRA_FULL_ERROR=1 shows Hydra's full traceback, as usual.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from collections.abc import Callable

from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from labrun.config.keys import new_key_problem
from labrun.core.errors import LabrunError, one_line

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def exit_on_user_error():
    """Inside the task function: a user error or an interruption ends the job with one line.

    Raising SystemExit here (instead of the exception) keeps Hydra from printing its own
    "Error executing job" preamble and traceback.
    """
    try:
        yield
    except BaseException as error:
        code = _print_if_expected(error)
        if code is None:
            raise
        sys.exit(code)


def _print_if_expected(error: BaseException) -> int | None:
    """Print the one line for an interruption or a user error; return the exit code."""
    from labrun.train.trainer import RunInterrupted

    if isinstance(error, RunInterrupted | KeyboardInterrupt):
        print(f"interrupted: {error}" if str(error) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    message = user_error_message(error)
    if message is None or os.environ.get("LABRUN_FULL_ERROR") == "1":
        return None
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def run_hydra_app(main: Callable[[], object]) -> None:
    # Remember whether the person asked for tracebacks (child processes inherit the answer),
    # then let composition errors reach this function instead of Hydra's printer.
    os.environ.setdefault("LABRUN_FULL_ERROR",
                          "1" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "0")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except SystemExit:
        raise
    except BaseException as error:
        code = _print_if_expected(error)
        if code is None:
            raise
        sys.exit(code)


def user_error_message(error: BaseException) -> str | None:
    """One line for a mistake in the config or the input; None for a bug (show the traceback)."""
    if isinstance(error, LabrunError):
        return one_line(error)
    if isinstance(error, MissingConfigException):
        return _missing_option(error)
    if isinstance(error, ConfigCompositionException):
        # Hydra chains OmegaConf's error as the cause when an override fails, but only as the
        # context when a config file does not fit its schema ("In 'local/default': ...").
        cause = error.__cause__ or error.__context__
        if isinstance(cause, OmegaConfBaseException):
            source = re.match(r"In '([^']+)'", str(error))
            if source:
                return f"{source.group(1)}.yaml: {_omegaconf_message(cause, '', in_file=True)}"
            return _omegaconf_message(cause, str(error))
        return _first_line(str(error))
    if isinstance(error, OmegaConfBaseException):
        return _omegaconf_message(error, "")
    cause = error.__cause__ or error.__context__
    if isinstance(cause, LabrunError):  # wrapped by Hydra's instantiate, for example
        return str(cause)
    return None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _missing_option(error: MissingConfigException) -> str:
    match = re.search(r"Could not find '([^']+)'", str(error))
    options = list(error.options or [])
    if match and "/" in match.group(1):
        group, _, name = match.group(1).rpartition("/")
        group = group.strip("/")
        hint = difflib.get_close_matches(name, options, n=1)
        did_you_mean = f"did you mean {group}={hint[0]}? " if hint else ""
        return (f"{group}={name} is not an option of config group '{group}'; {did_you_mean}"
                f"choose one of: {', '.join(sorted(options))}")
    return _first_line(str(error))


def _omegaconf_message(error: OmegaConfBaseException, context: str, in_file: bool = False
                       ) -> str:
    """One line for OmegaConf's error; `in_file`: it comes from a config file, not an override."""
    key = getattr(error, "full_key", None) or ""
    message = _first_line(getattr(error, "msg", None) or str(error))
    value = re.search(r"override (\S+)", context)
    if "not in" in message or "is not in struct" in message:
        parent, _, leaf = key.rpartition(".")
        known = _known_keys(error)
        hint = difflib.get_close_matches(leaf, known, n=1)
        did_you_mean = f"; did you mean {parent + '.' if parent else ''}{hint[0]}?" if hint else ""
        # `+KEY=...` adds a key, but only where the section takes it (labrun.config.keys.NewKeys).
        node = getattr(error, "parent_node", None)
        takes_it = isinstance(node, DictConfig) and new_key_problem(node, leaf, key) is None
        add = f" (add a new key with +{key}=...)" if takes_it and not in_file else ""
        return f"{key}: no such config key{did_you_mean}{add}"
    if "could not be converted" in message or "Invalid type" in message or "Value '" in message:
        shown = value.group(1) if value else key
        return f"{shown}: {message}; give a value of the right type for {key}"
    if "Missing mandatory value" in message:
        return f"{key} is required; add {key}=... on the command line"
    return f"{key}: {message}" if key else message


def _known_keys(error: OmegaConfBaseException) -> list[str]:
    object_type = getattr(error, "object_type", None)
    fields = getattr(object_type, "__dataclass_fields__", None)
    return list(fields) if fields else []
