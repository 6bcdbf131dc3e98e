"""Which keys a config section may hold beyond its schema's fields (used by config.validation.validate).

Hydra's `+KEY=VALUE` adds a key even into a typed section, where nothing would read it. Each
schema in config.py says which new keys it takes with its class attribute `new_keys`; the
functions here walk a composed config and refuse the rest, naming the closest known key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from enum import Enum

from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from labrun.core.errors import ConfigError


class NewKeys(Enum):
    """Which keys a section takes beyond its schema's fields: its schema's `new_keys`.

    A `ClassVar`, so it is no config key; subclasses inherit it; CLOSED unless a schema says so.
    """

    CLOSED = "closed"  # none: `+trainer.max_epoch=3` is a typo that nothing would read
    OPEN = "open"  # any: the root, where runs are tagged with `+tag=x`
    TARGET = "target"  # those its `_target_` accepts: `+optimizer.amsgrad=true` (any: **kwargs)


# What Hydra's instantiate reads itself in a `_target_` section, whatever the target takes.
INSTANTIATE_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def check_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for the first key that its section cannot take (see NewKeys): one
    added with `+`, which Hydra adds even to a typed section, where nothing would read it."""
    _check_section(cfg, "")


def _check_section(node: DictConfig, prefix: str) -> None:
    for key in node.keys():
        path = f"{prefix}{key}"
        problem = new_key_problem(node, str(key), path)
        if problem:
            raise ConfigError(problem)
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue
        value = node[key]
        if isinstance(value, DictConfig):
            _check_section(value, f"{path}.")


def new_key_problem(node: DictConfig, key: str, path: str) -> str | None:
    """Why the section `node` cannot hold `key` (at `path`), in one line; None when it can: its
    schema has the field, or takes such new keys, or `node` has no schema (cluster.env)."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return None
    known = [f.name for f in dataclasses.fields(schema)]
    new_keys = getattr(schema, "new_keys", NewKeys.CLOSED)
    if key in known or new_keys is NewKeys.OPEN:
        return None
    section = path.rpartition(".")[0] or "the top level"
    takes = ""
    if new_keys is NewKeys.TARGET:
        target = _target_of(node)
        arguments = target_arguments(target) if target else None
        if arguments is None or key in arguments or key in INSTANTIATE_KEYS:
            return None
        known += [name for name in arguments if name not in known]
        takes = f" and {target} takes no argument {key}"
    hint = difflib.get_close_matches(key, known, n=1)
    prefix = f"{section}." if "." in path else ""
    fix = (f"did you mean {prefix}{hint[0]}?" if hint else
           f"it takes: {', '.join(sorted(k for k in known if not k.startswith('_')))}")
    return f"{path}: no such key in {section}{takes}; {fix}"


def _target_of(node: DictConfig) -> str | None:
    try:
        target = node.get("_target_")
    except OmegaConfBaseException:  # an interpolation that does not resolve here
        return None
    return target if isinstance(target, str) and target != MISSING else None


@functools.cache  # each target is imported and inspected once per process
def target_arguments(target: str) -> tuple[str, ...] | None:
    """The keyword arguments `target` takes; None when it takes any (**kwargs), or when it
    cannot be imported or inspected: instantiate (and `labrun configs check`) reports that."""
    try:
        parameters = inspect.signature(get_object(target)).parameters.values()
    except Exception:  # importing runs foreign code: any error means "cannot tell"
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in parameters if p.kind in keyword)
