"""`key()`: a schema field with its facts as metadata (what the facts mean: config/facts.py),
and NewKeys, which a schema's `new_keys` says of the keys it takes beyond its fields
(config/keys.py).

Its own module so that schema.py (which declares fields with it) and facts.py and keys.py
(which read the schemas) do not import each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import MISSING as NO_DEFAULT
from enum import Enum
from typing import Any

from omegaconf import MISSING


@dataclasses.dataclass(frozen=True)
class Facts:
    path: bool = False
    must_exist: bool = False
    resume_safe: bool = False
    # None: not stated, the sections' fact holds (config/facts.py facts_of); True under a section
    # that changes no result: this key does (the container image of `cluster`).
    affects_result: bool | None = None
    # The values the key may take (config/validation.py refuses any other); (): any its type
    # allows. A null is left to the type (`str | None` takes one).
    choices: tuple[str, ...] = ()


PLAIN = Facts()


class NewKeys(Enum):
    """Which keys a section takes beyond its schema's fields: its schema's `new_keys`.

    A `ClassVar`, so it is no config key; subclasses inherit it; CLOSED unless a schema says so.
    """

    CLOSED = "closed"  # none: `+trainer.max_epoch=3` is a typo that nothing would read
    OPEN = "open"  # any: the root, where runs are tagged with `+tag=x`
    TARGET = "target"  # those its `_target_` accepts: `+optimizer.amsgrad=true` (any: **kwargs)


def key(default: Any = MISSING, *, factory: Any = NO_DEFAULT, path: bool = False,
        must_exist: bool = False, resume_safe: bool = False, affects_result: bool | None = None,
        choices: Sequence[str] = ()) -> Any:
    """A dataclass field with its facts as metadata (`factory`: a default_factory)."""
    facts = Facts(path=path or must_exist, must_exist=must_exist, resume_safe=resume_safe,
                  affects_result=affects_result, choices=tuple(choices))
    if factory is not NO_DEFAULT:
        return dataclasses.field(default_factory=factory, metadata={"facts": facts})
    return dataclasses.field(default=default, metadata={"facts": facts})


def collect(schemas: dict[str, type]) -> dict[str, Facts]:
    """Dotted key -> Facts for every field of `schemas` ({"train": TrainConfig,
    "dataset/digits": DigitsConfig, ...}). Group sections (dataset, model, ...) take the union
    of their options' schemas: a key of any dataset option is described under `dataset.`."""
    found: dict[str, Facts] = {}
    for path, schema in schemas.items():
        _walk(schema, "" if path == "train" else path.split("/")[0] + ".", found)
    return found


def _walk(schema: type, prefix: str, found: dict[str, Facts]) -> None:
    for field in dataclasses.fields(schema):
        dotted = prefix + field.name
        found.setdefault(dotted, field.metadata.get("facts", PLAIN))
        # Sub-sections are fields with a dataclass default (field types are strings here).
        if field.default_factory is not NO_DEFAULT:
            default = field.default_factory()
            if dataclasses.is_dataclass(default):
                _walk(type(default), dotted + ".", found)
