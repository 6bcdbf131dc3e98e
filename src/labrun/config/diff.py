"""`labrun configs diff A B`: the resolved keys that differ between two configs, each a run
folder or an override list."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from labrun.config.messages import user_error_message
from labrun.config.resolve import PRIMARY, flatten, hydra_context
from labrun.core.errors import LabrunError, first_line


def diff(a: str, b: str, config_dir: Path, config_name: str = PRIMARY,
         include_paths: bool = False) -> int:
    left, left_name = load_side(a, config_dir, config_name)
    right, right_name = load_side(b, config_dir, config_name)
    lhs, rhs = flatten(left), flatten(right)
    skipped = ("paths",) if not include_paths else ()
    keys = [k for k in sorted(set(lhs.values) | set(rhs.values)) if not k.startswith(skipped)]
    lines = [_diff_line(key, lhs.values, rhs.values) for key in keys]
    lines = [line for line in lines if line]
    print(f"A: {left_name}")
    print(f"B: {right_name}")
    print("\n".join(lines) if lines else "no differences")
    notes = []
    if skipped:
        notes.append("paths.* skipped (machine-specific; --paths compares them)")
    runtime = sorted(k for k in set(lhs.runtime) | set(rhs.runtime) if not k.startswith(skipped))
    if runtime:
        notes.append(f"need Hydra's runtime, compared as written: {', '.join(runtime)}")
    broken = sorted(set(lhs.broken) | set(rhs.broken))
    if broken:
        notes.append(f"could not be resolved, compared as written: {', '.join(broken)}")
    print(f"{len(lines)} key(s) differ" + "".join(f"; {note}" for note in notes))
    return 0


def _diff_line(key: str, left: dict[str, Any], right: dict[str, Any]) -> str | None:
    if key not in left:
        return f"{key}: (not in A) -> {_show(right[key])}"
    if key not in right:
        return f"{key}: {_show(left[key])} -> (not in B)"
    if _same(left[key], right[key]):
        return None
    return f"{key}: {_show(left[key])} -> {_show(right[key])}"


def _same(a: Any, b: Any) -> bool:
    # 1 and 1.0 are the same number; true and 1, or "1" and 1, are not the same value.
    return a == b and isinstance(a, bool) == isinstance(b, bool) and \
        isinstance(a, str) == isinstance(b, str)


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def load_side(spec: str, config_dir: Path, config_name: str) -> tuple[DictConfig, str]:
    """A run folder's saved config, or the config an override list composes."""
    if spec and Path(spec).is_dir():
        saved = Path(spec) / ".hydra" / "config.yaml"
        if not saved.is_file():
            raise LabrunError(f"{spec} is not a run folder (no .hydra/config.yaml)")
        return OmegaConf.load(saved), f"run folder {spec}"
    overrides = split_overrides(spec)
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])  # Hydra's own grammar, as train.py reads it
        except OverrideParseException as error:
            if "=" not in override and "/" in override:
                raise LabrunError(f"{spec}: no such run folder") from None
            if "=" not in override:
                raise LabrunError(f"{spec!r} is neither a run folder nor an override list; give "
                                  f"an existing folder or key=value pairs separated by commas"
                                  ) from None
            raise LabrunError(f"{override}: {first_line(str(error))}") from None
    with hydra_context(config_dir, config_name):
        try:
            cfg = compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise LabrunError(user_error_message(error) or first_line(str(error))) from error
    return cfg, ("defaults + " + " ".join(overrides)) if overrides else "defaults"


def split_overrides(spec: str) -> list[str]:
    """Split on the commas that separate overrides, not those inside [...], {...} or quotes.

    Hydra reads `key=a,b` as a sweep over a and b; `labrun configs diff` takes one config per
    side, so its commas separate overrides instead: split here, then Hydra parses each part."""
    parts, current, depth, quote = [], "", 0, ""
    for char in spec:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]
