"""`labrun configs diff A B`: the resolved keys that differ between two configs, each a run
folder, an override list, or an override list at a git revision (`REV:SPEC`, composed by the
config review's machinery: labrun.review.sides)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from labrun.config.messages import user_error_message
from labrun.config.resolve import PRIMARY, Leaves, flatten, hydra_context
from labrun.core.errors import LabrunError, first_line
from labrun.runs.rundir import RunDir


def diff(a: str, b: str, config_dir: Path, config_name: str = PRIMARY,
         include_paths: bool = False) -> int:
    lhs, left_name = side_leaves(a, config_dir, config_name)
    rhs, right_name = side_leaves(b, config_dir, config_name)
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


def side_leaves(spec: str, config_dir: Path, config_name: str) -> tuple[Leaves, str]:
    """One side, flattened: at a git revision (REV:SPEC), else a run folder or override list."""
    at_rev = _revision_spec(spec, config_dir)
    if at_rev is None:
        cfg, name = load_side(spec, config_dir, config_name)
        return flatten(cfg), name
    from labrun.review.sides import checkout, compose_sides

    repo, rev, overrides = at_rev
    with checkout(repo, rev) as side:
        [composed] = compose_sides([(side, [{"name": spec, "overrides": overrides}])],
                                   config_name)
    result = composed.results[spec]
    if result["error"] and result["stage"] == "compose":
        raise LabrunError(f"{spec}: {result['error']}")
    leaves = Leaves(values=dict(result["values"]), runtime=list(result["runtime"]))
    shown = ("defaults + " + " ".join(overrides)) if overrides else "defaults"
    return leaves, f"{shown} at {rev} ({side.commit[:10]})"


def _revision_spec(spec: str, config_dir: Path) -> tuple[Path, str, list[str]] | None:
    """(repository, REV, overrides) when `spec` is REV:SPEC and REV names a git revision of
    the repository holding `config_dir`; None for a run folder or a plain override list."""
    match = re.match(r"([^=:,\s]+):(.*)$", spec, re.DOTALL)
    if not match or Path(spec).is_dir():
        return None
    from labrun.review.sides import is_revision, repo_root

    try:
        repo = repo_root(config_dir.resolve())
    except LabrunError:
        return None
    if not is_revision(repo, match.group(1)):
        return None
    overrides = split_overrides(match.group(2))
    _parse(overrides, spec)
    return repo, match.group(1), overrides


def load_side(spec: str, config_dir: Path, config_name: str) -> tuple[DictConfig, str]:
    """A run folder's saved config, or the config an override list composes."""
    if spec and Path(spec).is_dir():
        saved = RunDir(spec).config_path
        if not saved.is_file():
            raise LabrunError(f"{spec} is not a run folder (no .hydra/config.yaml)")
        return OmegaConf.load(saved), f"run folder {spec}"
    overrides = split_overrides(spec)
    _parse(overrides, spec)
    with hydra_context(config_dir, config_name):
        try:
            cfg = compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise LabrunError(user_error_message(error) or first_line(str(error))) from error
    return cfg, ("defaults + " + " ".join(overrides)) if overrides else "defaults"


def _parse(overrides: list[str], spec: str) -> None:
    """Each override through Hydra's own grammar, as train.py reads it: one line if not."""
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as error:
            if "=" not in override and "/" in override:
                raise LabrunError(f"{spec}: no such run folder") from None
            if "=" not in override:
                raise LabrunError(f"{spec!r} is neither a run folder nor an override list; give "
                                  f"an existing folder or key=value pairs separated by commas"
                                  ) from None
            raise LabrunError(f"{override}: {first_line(str(error))}") from None


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
