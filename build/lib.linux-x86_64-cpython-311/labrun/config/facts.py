"""Facts about config keys, carried by the schema fields themselves, and what is derived from them.

A schema field declared with `key(...)` (config/fields.py) states:
  path            the value is a file or folder: a job running elsewhere gets it as an absolute
                  path (the SLURM launcher), and with `must_exist` validation checks it exists
  resume_safe     it may differ when a run is resumed (a moved data folder, more epochs)
  affects_result  changing it changes what a run computes (optimizer.lr does; trainer.progress,
                  checkpoint.keep_last do not); the config review of pull requests reads it
  choices         the values it may take (checkpoint.mode: max, min); validation refuses others
A plain field has the defaults: no path, not resume-safe, affects the result. A fact on a
section (the `logger` field, say) holds for every key below it, except that a key stating
`affects_result` itself overrides its sections (`cluster` changes no result; its
`container.image` does).

Every list of keys that used to be written out by hand (path keys, resume-safe keys, the allowed
values of a key) is derived here or in config/validation.py, so a new field states its facts
once, where it is declared.
"""

from __future__ import annotations

import functools
from typing import Any

from labrun.config.fields import PLAIN, Facts, collect
from labrun.config.schema import SCHEMAS


@functools.cache
def all_facts() -> dict[str, Facts]:
    """Dotted key -> Facts, for every field of every registered schema."""
    return collect(SCHEMAS)


def facts_of(dotted: str) -> Facts:
    """The facts of a key: its own field's, plus what its sections state for all below them."""
    table = all_facts()
    parts = dotted.split(".")
    own = table.get(dotted, PLAIN)
    sections = [table.get(".".join(parts[:end]), PLAIN) for end in range(1, len(parts))]
    # affects_result: what the key states, else the nearest section that states it, else yes.
    stated = [f.affects_result for f in (own, *reversed(sections)) if f.affects_result is not None]
    return Facts(path=own.path, must_exist=own.must_exist,
                 resume_safe=own.resume_safe or any(s.resume_safe for s in sections),
                 affects_result=stated[0] if stated else True, choices=own.choices)


def path_keys() -> tuple[str, ...]:
    """Keys whose values are files or folders (made absolute for jobs that run elsewhere)."""
    return tuple(sorted(k for k, f in all_facts().items() if f.path))


def must_exist_keys() -> tuple[str, ...]:
    return tuple(sorted(k for k, f in all_facts().items() if f.must_exist))


def changed_keys(old: dict[str, Any], new: dict[str, Any], *, ignore_resume_safe: bool = False,
                 prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (plain dicts)."""
    changed = []
    for name in sorted(set(old) | set(new)):
        dotted = f"{prefix}{name}"
        if ignore_resume_safe and facts_of(dotted).resume_safe:
            continue
        a, b = old.get(name), new.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_keys(a, b, ignore_resume_safe=ignore_resume_safe,
                                    prefix=dotted + ".")
        elif a != b:
            changed.append(dotted)
    return changed
