"""`labrun configs check`: compose the primary config with its defaults, then every option of
every config group (experiment presets included) on top of the defaults, as `python train.py
group=option` would, and validate each against the schemas and `labrun.config.validation.validate`.
In a project, the options are its conf/'s and the lab's (LABRUN_SITE/conf) as well as labrun's,
an option of the same name counted once, from the layer that replaces the others (the search
path's order). Prints one line per problem, `FILE: KEY: what is wrong`, then a count; exits 1
when anything fails."""

from __future__ import annotations

import difflib
import functools
import os
import pydoc
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from hydra import compose
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from labrun.config import dataset_schema, validation
from labrun.config import schema as config
from labrun.config.messages import user_error_message
from labrun.config.resolve import PRIMARY, Leaves, flatten, hydra_context
from labrun.core.errors import ConfigError, first_line
from labrun.core.project import layer_conf_dirs

# Hydra's own settings and the untracked per-user overrides are not options people review; the
# lab's and the project's layer files (site/, project/) are in every config checked.
SKIPPED_GROUPS = ("hydra", "local", "site", "project")


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
    # The search path, first match wins: the project's conf/, the lab's, then `config_dir`.
    folders = [*(d for d in layer_conf_dirs() if d != config_dir), config_dir]
    problems: dict[Problem, None] = {}  # ordered and deduplicated: one line per problem
    failed = 0
    with hydra_context(config_dir, config_name), tempfile.TemporaryDirectory() as placeholder:
        targets = list(check_targets(folders, config_name))
        baseline: set[tuple[str, str]] = set()
        for index, target in enumerate(targets):
            found = check_one(target, folders, config_name, placeholder)
            if index == 0:
                baseline = {(p.key, p.what) for p in found}
            elif found:
                # A problem of the defaults shows again with every option: report it once.
                found = [p for p in found if (p.key, p.what) not in baseline]
            failed += bool(found)
            problems.update(dict.fromkeys(found))
    for problem in problems:
        print(problem)
    where = " over ".join(_shown(folder) for folder in folders)
    if problems:
        print(f"configs check: {len(problems)} problem(s) in {failed} of {len(targets)} "
              f"configs composed from {where}")
        return 1
    print(f"configs check: all {len(targets)} configs in {where} compose and validate")
    return 0


def check_targets(folders: list[Path], config_name: str):
    """The defaults first, then every option of every group, as `group=option`; `folders`
    in search path order, the primary config's last."""
    primary = folders[-1] / f"{config_name}.yaml"
    listed = _defaults_list(primary)
    # conf/local/ holds one person's untracked settings: check the tree as everyone gets it.
    local = listed.get("local")
    base = ("~local",) if local and _find(folders, "local", local) else ()
    yield Target(base, primary)
    in_defaults = set(listed) | _chosen_groups(config_name, base)
    options: dict[tuple[str, str], Path] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            parts = path.relative_to(folder).parts
            if len(parts) >= 2 and parts[0] not in SKIPPED_GROUPS:
                options.setdefault(("/".join(parts[:-1]), path.stem), path)
    for (group, option), path in sorted(options.items()):
        # A group the defaults list does not name is added with `+`, as on the command line.
        plus = "" if group in in_defaults else "+"
        yield Target((*base, f"{plus}{group}={option}"), path)


def _find(folders: list[Path], group: str, option: str) -> Path | None:
    """The file Hydra composes for `group=option`: the first folder's on the search path."""
    return next((path for folder in folders
                 if (path := folder / group / f"{option}.yaml").is_file()), None)


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


def check_one(target: Target, folders: list[Path], config_name: str, placeholder: str
              ) -> list[Problem]:
    file = _shown(target.file)
    try:
        cfg = compose(config_name, overrides=list(target.overrides), return_hydra_config=True)
    except yaml.YAMLError as error:
        return [yaml_problem(error, file)]
    except Exception as error:  # whatever stops composition is this config's problem
        return [composition_problem(error, folders, file)]
    choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    sources = Sources(folders, config_name, choices, target.file)
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
    """labrun.config.validation.validate's first complaint (it stops at the first)."""
    try:
        validation.validate(cfg, read_data=False)  # its paths may be stand-ins (_fill)
    except ConfigError as error:
        return Problem(file, _key_of(str(error)), str(error))
    except OmegaConfBaseException as error:  # it read a key that cannot resolve
        return Problem(file, getattr(error, "full_key", "") or "-",
                       user_error_message(error) or first_line(str(error)))
    return None


def composition_problem(error: Exception, folders: list[Path], file: str) -> Problem:
    """FILE, KEY and what is wrong, from Hydra's composition error."""
    text = str(error)
    # Hydra names the file that failed ("In 'optimizer/sgd': ..."): more precise than the
    # option being checked when, say, an experiment preset pulls in a broken option.
    source = re.match(r"In '([^']+)'", text)
    named = source.group(1).rpartition("/") if source and "/" in source.group(1) else None
    if named and (found := _find(folders, named[0], named[2])):
        file = _shown(found)
    if isinstance(error, MissingConfigException):
        group = re.search(r"Could not find '/?([^']+)/[^'/]+'", text)
        key = f"defaults ({group.group(1)})" if group else "defaults"
        return Problem(file, key, user_error_message(error) or first_line(text))
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
        return Problem(file, "-", first_line(str(error)))
    return Problem(_shown(Path(mark.name)), f"line {mark.line + 1}",
                   getattr(error, "problem", None) or first_line(str(error)))


def _composition_message(text: str) -> str:
    """The line of Hydra's message that says what is wrong."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = re.sub(r"^In '[^']+':\s*", "", lines[0]) if lines else text
    if first.endswith("raised while composing config:") and len(lines) > 1:
        return lines[1]
    rest = [line for line in lines[1:] if not line.startswith(("full_key:", "object_type="))]
    return " ".join([first, *rest[:1]])


def _did_you_mean(key: str, schema: str) -> str:
    owner = getattr(config, schema, None) or getattr(dataset_schema, schema, None)
    fields = getattr(owner, "__dataclass_fields__", {})
    hint = difflib.get_close_matches(key, list(fields), n=1)
    return f"; did you mean {hint[0]}?" if hint else ""


def _key_of(message: str) -> str:
    # labrun.config.schema's messages start with the key: "optimizer.lr=-0.1 must be ..."
    match = re.match(r"[\w./]+", message)
    return match.group(0) if match else "-"


class Sources:
    """The YAML files one composed config came from, to name the file behind a key."""

    def __init__(self, folders: list[Path], config_name: str, choices: dict, checked: Path):
        self.checked = checked
        self.primary = folders[-1] / f"{config_name}.yaml"
        self.files = [(self.primary, "")]  # (file, the package its keys land in)
        for group, option in choices.items():
            path = _find(folders, group, option) if option else None
            if path is not None and not group.startswith("hydra"):
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
        return f"importing it fails: {first_line(str(error.value))}"
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
