"""One line for a mistake in the config or the input, from Hydra's and OmegaConf's errors.

Shared by `python train.py` (labrun.cli.hydra_app) and `labrun configs` (check.py, diff.py).
"""

from __future__ import annotations

import difflib
import re

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from labrun.config.keys import new_key_problem
from labrun.core.errors import LabrunError, first_line, one_line


def user_error_message(error: BaseException) -> str | None:
    """One line for a mistake in the config or the input; None for a bug (show the traceback)."""
    if isinstance(error, LabrunError):
        return one_line(error)
    if isinstance(error, MissingConfigException):
        return _missing_option(error)
    if isinstance(error, OverrideParseException):
        return _unparsable_override(error)
    if isinstance(error, ConfigCompositionException):
        # Hydra chains OmegaConf's error as the cause when an override fails, but only as the
        # context when a config file does not fit its schema ("In 'local/default': ...").
        cause = error.__cause__ or error.__context__
        if isinstance(cause, OmegaConfBaseException):
            source = re.match(r"In '([^']+)'", str(error))
            if source:
                return f"{source.group(1)}.yaml: {_omegaconf_message(cause, '', in_file=True)}"
            return _omegaconf_message(cause, str(error))
        return first_line(str(error))
    if isinstance(error, OmegaConfBaseException):
        return _omegaconf_message(error, "")
    cause = error.__cause__ or error.__context__
    if isinstance(cause, LabrunError):  # wrapped by Hydra's instantiate, for example
        return str(cause)
    return None


def _unparsable_override(error: OverrideParseException) -> str:
    """The override Hydra's grammar could not read, where it stumbled, and the forms it takes."""
    lines = [line for line in str(error.message).splitlines() if line.strip()]
    # Hydra's message: "Error parsing override 'X'" (a sweep's) then ANTLR's words, or these
    # alone; the list of tokens ANTLR expected says nothing to a person.
    why = next((line for line in lines if not line.startswith(("Error parsing", "See "))), "")
    why = why.split(" expecting ")[0]
    return (f"cannot read the override {error.override!r}" + (f" ({why})" if why else "")
            + "; write key=value, key=a,b,c to sweep (with -m), and quote a value that "
              "holds spaces, commas or brackets: 'key=\"a b\"'")


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
    return first_line(str(error))


def _omegaconf_message(error: OmegaConfBaseException, context: str, in_file: bool = False
                       ) -> str:
    """One line for OmegaConf's error; `in_file`: it comes from a config file, not an override."""
    key = getattr(error, "full_key", None) or ""
    message = first_line(getattr(error, "msg", None) or str(error))
    value = re.search(r"override (\S+)", context)
    if "not in" in message or "is not in struct" in message:
        parent, _, leaf = key.rpartition(".")
        known = _known_keys(error)
        hint = difflib.get_close_matches(leaf, known, n=1)
        did_you_mean = f"; did you mean {parent + '.' if parent else ''}{hint[0]}?" if hint else ""
        # `+KEY=...` adds a key, but only where the section takes it (labrun.config.keys).
        node = getattr(error, "parent_node", None)
        problem = new_key_problem(node, leaf, key) if isinstance(node, DictConfig) else None
        if problem and not known:
            return problem  # a section without a schema: the closest of what reads it
        takes_it = isinstance(node, DictConfig) and problem is None
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
