"""`labrun configs check` and `labrun configs diff A B`: config review for pull requests.

check: composes the primary config with its defaults, then every option of every config group
       (experiment presets included) on top of the defaults, as `python train.py group=option`
       would, and validates each against the schemas and `labrun.config.schema.validate`. Prints one
       line per problem, `FILE: KEY: what is wrong`, then a count; exits 1 when anything fails.
diff:  the resolved keys that differ between two configs, each a run folder or an override list.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import os
import pydoc
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationToMissingValueError, OmegaConfBaseException

from labrun.cli.hydra_app import user_error_message
from labrun.config import schema as config
from labrun.core.errors import ConfigError, LabrunError
from labrun.core.project import CONF_DIR

PROJECT_CONF = CONF_DIR
PRIMARY = "train"
# Hydra's own settings and the untracked per-user overrides are not options people review.
SKIPPED_GROUPS = ("hydra", "local")

DIFF_HELP = """\
A and B are each one of:
  a run folder      outputs/2024-05-01/12-00-00-ab12 (its .hydra/config.yaml, as the run saw it)
  an override list  "model=resnet18,optimizer.lr=0.1": overrides as `python train.py` takes
                    them, separated by commas (commas inside [...] or {...} stay with the value)
  ""                the defaults: the primary config with no overrides

An argument naming an existing folder is a run folder; anything else is an override list.
paths.* (where this machine keeps data and outputs) is left out unless --paths is given. Keys
whose value needs Hydra's runtime (paths.run_dir: ${hydra:runtime.output_dir}) cannot be
resolved outside a job: they are compared as written, and the output lists them.

examples:
  labrun configs diff "" experiment=resnet18_cifar10
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 multirun/2024-05-02/09-00-00-cd34/3
  labrun configs diff outputs/2024-05-01/12-00-00-ab12 "optimizer.lr=0.1,trainer.max_epochs=30"
"""


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = actions.add_parser(
        "check", help="compose and validate every option of every config group",
        description="Compose the defaults, then every option of every config group and every "
                    "experiment preset, and validate each against the schemas. Prints one line "
                    "per problem (FILE: KEY: what is wrong) and exits 1 when anything fails.")
    check.add_argument("--config-dir", type=Path, default=PROJECT_CONF,
                       help="the config tree to check (default: this project's conf/)")
    check.add_argument("--config-name", default=PRIMARY,
                       help="the primary config in it (default: train)")
    diff = actions.add_parser(
        "diff", help="the resolved keys that differ between two configs",
        description="Print the resolved keys that differ between A and B as `key: old -> new`, "
                    "keys only one side has included.",
        epilog=DIFF_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("a", metavar="A", help="a run folder or an override list (see below)")
    diff.add_argument("b", metavar="B", help="a run folder or an override list (see below)")
    diff.add_argument("--config-dir", type=Path, default=PROJECT_CONF,
                      help="the config tree override lists compose from (default: conf/)")
    diff.add_argument("--config-name", default=PRIMARY,
                      help="the primary config in it (default: train)")
    diff.add_argument("--paths", action="store_true", help="compare paths.* too")


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        return check(args.config_dir, args.config_name)
    return diff(args.a, args.b, args.config_dir, args.config_name, include_paths=args.paths)


# ---------------------------------------------------------------------------------------------
# Composition and resolution, shared by check and diff


def hydra_context(config_dir: Path, config_name: str):
    """Hydra's compose API on `config_dir`, with labrun's schemas in the ConfigStore."""
    config_dir = config_dir.resolve()
    if not (config_dir / f"{config_name}.yaml").is_file():
        raise LabrunError(f"{config_dir} has no {config_name}.yaml; give the config tree with "
                          f"--config-dir (and its primary config with --config-name)")
    config.register()
    GlobalHydra.instance().clear()  # compose may have been initialised by an earlier caller
    return initialize_config_dir(config_dir=str(config_dir), version_base="1.3",
                                 job_name="labrun_configs")


class Unresolved(str):
    """A value kept as written because its interpolation could not be resolved here."""


@dataclass
class Leaves:
    """A config flattened to dotted keys. Lists and empty mappings are single values."""

    values: dict[str, Any] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # `???`: to be given on the command line
    runtime: list[str] = field(default_factory=list)  # need Hydra's runtime: kept as written
    broken: dict[str, str] = field(default_factory=dict)  # interpolations that cannot resolve


def flatten(cfg: DictConfig) -> Leaves:
    leaves = Leaves()
    _walk(cfg, "", leaves)
    return leaves


def _walk(node: DictConfig, prefix: str, leaves: Leaves) -> None:
    for key in node.keys():
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            leaves.missing.append(path)
            leaves.values[path] = "???"
            continue
        try:
            value = node[key]
            if isinstance(value, DictConfig) and len(value):
                _walk(value, f"{path}.", leaves)
                continue
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException as error:
            raw = OmegaConf.to_container(node, resolve=False)[key]
            leaves.values[path] = Unresolved(raw)
            if _needs_hydra_runtime(str(raw), error):
                leaves.runtime.append(path)
            elif not isinstance(error, InterpolationToMissingValueError):  # `???` not given yet
                leaves.broken[path] = _first_line(str(error))
            continue
        leaves.values[path] = value


def _needs_hydra_runtime(raw: str, error: Exception) -> bool:
    # `${hydra:...}` only resolves inside a running job (directly, or through another key).
    return "${hydra:" in raw or "HydraConfig was not set" in str(error)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


# ---------------------------------------------------------------------------------------------
# check


@dataclass(frozen=True)
class Problem:
    file: str
    key: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key}: {self.what}"


@dataclass(frozen=True)
class Target:
    """One config to compose: its overrides and the file it checks."""

    overrides: tuple[str, ...]
    file: Path


def check(config_dir: Path, config_name: str = PRIMARY) -> int:
    config_dir = config_dir.resolve()
    problems: dict[Problem, None] = {}  # ordered and deduplicated: one line per problem
    failed = 0
    with hydra_context(config_dir, config_name), tempfile.TemporaryDirectory() as placeholder:
        targets = list(check_targets(config_dir, config_name))
        baseline: set[tuple[str, str]] = set()
        for index, target in enumerate(targets):
            found = check_one(target, config_dir, config_name, placeholder)
            if index == 0:
                baseline = {(p.key, p.what) for p in found}
            elif found:
                # A problem of the defaults shows again with every option: report it once.
                found = [p for p in found if (p.key, p.what) not in baseline]
            failed += bool(found)
            problems.update(dict.fromkeys(found))
    for problem in problems:
        print(problem)
    where = _shown(config_dir)
    if problems:
        print(f"configs check: {len(problems)} problem(s) in {failed} of {len(targets)} "
              f"configs composed from {where}")
        return 1
    print(f"configs check: all {len(targets)} configs in {where} compose and validate")
    return 0


def check_targets(config_dir: Path, config_name: str):
    """The defaults first, then every option of every group, as `group=option`."""
    listed = _defaults_list(config_dir / f"{config_name}.yaml")
    # conf/local/ holds one person's untracked settings: check the tree as everyone gets it.
    local = listed.get("local")
    base = ("~local",) if local and (config_dir / "local" / f"{local}.yaml").is_file() else ()
    yield Target(base, config_dir / f"{config_name}.yaml")
    in_defaults = set(listed) | _chosen_groups(config_name, base)
    for path in sorted(config_dir.rglob("*.yaml")):
        parts = path.relative_to(config_dir).parts
        if len(parts) < 2 or parts[0] in SKIPPED_GROUPS:
            continue
        group, option = "/".join(parts[:-1]), path.stem
        # A group the defaults list does not name is added with `+`, as on the command line.
        plus = "" if group in in_defaults else "+"
        yield Target((*base, f"{plus}{group}={option}"), path)


def _defaults_list(primary: Path) -> dict[str, str | None]:
    """group -> option of the primary config's own defaults list (`optional local: default`)."""
    try:
        entries = (yaml.safe_load(primary.read_text()) or {}).get("defaults") or []
    except yaml.YAMLError:
        return {}  # check_one reports the broken file
    listed = {}
    for entry in entries:
        if isinstance(entry, dict):
            for key, option in entry.items():
                group = key.split()[-1].lstrip("/").split("@")[0]  # drop optional/override, @pkg
                listed[group] = option
    return listed


def _chosen_groups(config_name: str, base: tuple[str, ...]) -> set[str]:
    """Every group the defaults choose from, nested defaults lists included."""
    try:
        cfg = compose(config_name, overrides=list(base), return_hydra_config=True)
    except Exception:
        return set()  # the defaults fail: check_one reports why
    return set(cfg.hydra.runtime.choices.keys())


def check_one(target: Target, config_dir: Path, config_name: str, placeholder: str
              ) -> list[Problem]:
    file = _shown(target.file)
    try:
        cfg = compose(config_name, overrides=list(target.overrides), return_hydra_config=True)
    except yaml.YAMLError as error:
        return [yaml_problem(error, file)]
    except Exception as error:  # whatever stops composition is this config's problem
        return [composition_problem(error, config_dir, file)]
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    sources = Sources(config_dir, config_name, choices, target.file)
    leaves = flatten(cfg)
    problems = [Problem(sources.owner(key), key, f"cannot resolve: {message}")
                for key, message in leaves.broken.items()]
    for key in leaves.missing:
        if key in sources.required:
            _fill(cfg, key, placeholder)  # to be given on the command line, by design
        else:
            problems.append(Problem(sources.owner(key), key,
                                    "required by the schema but not set; give it a value "
                                    "(or `???` to require it on the command line)"))
    problems += _target_problems(cfg, sources)
    invalid = _validation_problem(cfg, file)
    if invalid and invalid.key not in {p.key for p in problems}:  # not the same key again
        problems.append(invalid)
    return problems


def _validation_problem(cfg: DictConfig, file: str) -> Problem | None:
    """labrun.config.schema.validate's first complaint (it stops at the first)."""
    try:
        config.validate(cfg)
    except ConfigError as error:
        return Problem(file, _key_of(str(error)), str(error))
    except OmegaConfBaseException as error:  # it read a key that cannot resolve
        return Problem(file, getattr(error, "full_key", "") or "-",
                       user_error_message(error) or _first_line(str(error)))
    return None


def composition_problem(error: Exception, config_dir: Path, file: str) -> Problem:
    """FILE, KEY and what is wrong, from Hydra's composition error."""
    text = str(error)
    # Hydra names the file that failed ("In 'optimizer/sgd': ..."): more precise than the
    # option being checked when, say, an experiment preset pulls in a broken option.
    source = re.match(r"In '([^']+)'", text)
    if source and "/" in source.group(1) and (config_dir / f"{source.group(1)}.yaml").is_file():
        file = _shown(config_dir / f"{source.group(1)}.yaml")
    if isinstance(error, MissingConfigException):
        group = re.search(r"Could not find '/?([^']+)/[^'/]+'", text)
        key = f"defaults ({group.group(1)})" if group else "defaults"
        return Problem(file, key, user_error_message(error) or _first_line(text))
    cause = error.__cause__ if isinstance(error.__cause__, OmegaConfBaseException) else error
    key_match = re.search(r"full_key: (\S+)", text)
    key = getattr(cause, "full_key", None) or (key_match.group(1) if key_match else "")
    what = _composition_message(text)
    unknown = re.match(r"Key '([^']+)' not in '([^']+)'", what)
    if unknown:
        key_name, schema = unknown.groups()
        what = f"no such key in {schema}{_did_you_mean(key_name, schema)}"
    return Problem(file, key or "defaults", what)


def yaml_problem(error: yaml.YAMLError, file: str) -> Problem:
    """A file that is not valid YAML (a bad indent, a duplicate key): name it and the line."""
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return Problem(file, "-", _first_line(str(error)))
    return Problem(_shown(Path(mark.name)), f"line {mark.line + 1}",
                   getattr(error, "problem", None) or _first_line(str(error)))


def _composition_message(text: str) -> str:
    """The line of Hydra's message that says what is wrong."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = re.sub(r"^In '[^']+':\s*", "", lines[0]) if lines else text
    if first.endswith("raised while composing config:") and len(lines) > 1:
        return lines[1]
    rest = [line for line in lines[1:] if not line.startswith(("full_key:", "object_type="))]
    return " ".join([first, *rest[:1]])


def _did_you_mean(key: str, schema: str) -> str:
    fields = getattr(getattr(config, schema, None), "__dataclass_fields__", {})
    hint = difflib.get_close_matches(key, list(fields), n=1)
    return f"; did you mean {hint[0]}?" if hint else ""


def _key_of(message: str) -> str:
    # labrun.config.schema's messages start with the key: "optimizer.lr=-0.1 must be ..."
    match = re.match(r"[\w./]+", message)
    return match.group(0) if match else "-"


class Sources:
    """The YAML files one composed config came from, to name the file behind a key."""

    def __init__(self, config_dir: Path, config_name: str, choices: dict, checked: Path):
        self.checked = checked
        self.primary = config_dir / f"{config_name}.yaml"
        self.files = [(self.primary, "")]  # (file, the package its keys land in)
        for group, option in choices.items():
            path = config_dir / group / f"{option}.yaml"
            if option and not group.startswith("hydra") and path.is_file():
                self.files.append((path, _package(path, group)))
        self.written: dict[str, list[Path]] = {}  # key -> the files that set it
        self.required: set[str] = set()  # keys a file sets to `???` on purpose (dataset.root)
        for path, package in self.files:
            leaves = _file_leaves(path)
            for key in leaves.values:
                self.written.setdefault(_join(package, key), []).append(path)
            self.required.update(_join(package, key) for key in leaves.missing)

    def owner(self, key: str) -> str:
        """The file to fix: the checked one if it sets `key`, else another that sets it, else
        the group file whose package holds it (a key its schema requires), else the checked."""
        writers = self.written.get(key, [])
        if self.checked in writers:
            return _shown(self.checked)
        others = [path for path in writers if path != self.primary] or writers
        if others:
            return _shown(others[0])
        holders = [(len(package), path) for path, package in self.files
                   if package and (key == package or key.startswith(f"{package}."))]
        return _shown(max(holders)[1] if holders else self.checked)


def _join(package: str, key: str) -> str:
    return f"{package}.{key}" if package else key


def _file_leaves(path: Path) -> Leaves:
    return _load_leaves(path, path.stat().st_mtime_ns)  # read again when the file changes


@functools.cache
def _load_leaves(path: Path, mtime_ns: int) -> Leaves:
    return flatten(OmegaConf.load(path))


def _package(path: Path, group: str) -> str:
    """Where a group file's keys land: its `# @package` header, or the group's own path."""
    default = group.replace("/", ".")
    for line in path.read_text().splitlines():
        header = re.match(r"#\s*@package\s+(\S+)", line)
        if header:
            package = header.group(1).replace("_group_", default)
            return "" if package == "_global_" else package
        if line.strip() and not line.startswith("#"):
            break
    return default


def _fill(cfg: DictConfig, key: str, placeholder: str) -> None:
    """Stand in an existing folder for a required path, so validate() checks the rest."""
    try:
        OmegaConf.update(cfg, key, placeholder, merge=False)
    except OmegaConfBaseException:
        pass  # not a string (a required number): validate() does not read those


def _target_problems(cfg: DictConfig, sources: Sources) -> list[Problem]:
    problems = []
    for key, target in _targets(cfg, ""):
        why = _why_not_importable(target)
        if why:
            problems.append(Problem(sources.owner(key), key, f"{target} cannot be imported: {why}"))
    return problems


@functools.cache  # each _target_ is imported once per process, however many files name it
def _why_not_importable(target: str) -> str | None:
    """None when `target` imports (what Hydra's instantiate will do), else the reason."""
    try:
        if pydoc.locate(target) is not None:
            return None
        module_name, _, name = target.rpartition(".")
        module = pydoc.locate(module_name) if module_name else None
    except pydoc.ErrorDuringImport as error:
        return f"importing it fails: {_first_line(str(error.value))}"
    hint = difflib.get_close_matches(name, dir(module), n=1) if module is not None else []
    return "no such module or name" + (f"; did you mean {module_name}.{hint[0]}?" if hint else "")


def _targets(node: DictConfig, prefix: str):
    for key in node.keys():
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        if key == "_target_":
            yield f"{prefix}{key}", str(value)
        elif isinstance(value, DictConfig):
            yield from _targets(value, f"{prefix}{key}.")


def _shown(path: Path) -> str:
    """A path relative to the working folder when it is below it (conf/optimizer/sgd.yaml)."""
    path = Path(path).resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


# ---------------------------------------------------------------------------------------------
# diff


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
    for override in overrides:
        if "=" not in override and "/" in override:
            raise LabrunError(f"{spec}: no such run folder")
        if "=" not in override and not override.startswith("~"):
            raise LabrunError(f"{spec!r} is neither a run folder nor an override list; give an "
                              f"existing folder or key=value pairs separated by commas")
    with hydra_context(config_dir, config_name):
        try:
            cfg = compose(config_name, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as error:
            raise LabrunError(user_error_message(error) or _first_line(str(error))) from error
    return cfg, ("defaults + " + " ".join(overrides)) if overrides else "defaults"


def split_overrides(spec: str) -> list[str]:
    """Split on the commas that separate overrides, not those inside [...], {...} or quotes."""
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
