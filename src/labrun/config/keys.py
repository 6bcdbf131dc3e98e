"""Which keys a config section may hold (used by config.validation.validate, and for each job
of a sweep by launch/sweep.plan): one that nothing reads is refused in one line naming the
closest known key, before anything runs.

Hydra's `+KEY=VALUE` adds a key even into a typed section, where nothing would read it. Each
schema in config/schema.py says which new keys it takes with its class attribute `new_keys`
(config/fields.NewKeys). A section that a `_target_` builds (dataset, model, task, logger, each
callback) may have no schema at all: a lab's own, or labrun's callbacks. Its keys are those
labrun reads itself there (LABRUN_READS) and those its target's signature names; a typo would
otherwise be dropped unread (dataset and logger pass a target only the keys it names:
labrun.data.call_target) or fail late in the target's call (model, task, callbacks).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re

from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from labrun.config.dataset_schema import (
    AugmentConfig,
    DetectionAugmentConfig,
    DetectionDatasetConfig,
    SegmentationDatasetConfig,
)
from labrun.config.fields import NewKeys
from labrun.config.model_schema import PretrainedModelConfig
from labrun.config.schema import LoggerConfig, TaskConfig
from labrun.core import trust
from labrun.core.errors import ConfigError

# What Hydra's instantiate reads itself in a `_target_` section, whatever the target takes.
INSTANTIATE_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


def _fields(schema: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(schema))


# The keys labrun reads itself in each section that a `_target_` builds, whatever the target
# takes: what such a section without a schema may hold beside its target's arguments. The
# fields of the group's base schema among them: a plain copy of a composed config (a run's
# saved config.yaml) holds them all.
LABRUN_READS: dict[str, tuple[str, ...]] = {
    # The image formats' size, decoding, splits, normalisation and augmentation (data/image,
    # data/segmentation, data/detection), a language model's window (LanguageModelling.check_config), and
    # the decoder a served model decodes uploads with (tasks/classification.py,
    # tasks/segmentation.py).
    "dataset": (*_fields(SegmentationDatasetConfig), *_fields(DetectionDatasetConfig),
                "block_size", "decoder"),
    # The starting weights and frozen layers (models.LABRUN_KEYS).
    "model": _fields(PretrainedModelConfig),
    # The backend's name, as logger=NAME chose it, and the keys a lab's backend may share
    # with labrun's (W&B's project, group, tags...).
    "logger": _fields(LoggerConfig),
    "task": _fields(TaskConfig),
    "callbacks": (),  # of each callbacks.NAME
}
TARGET_SECTIONS = tuple(LABRUN_READS)
# Sections below those that labrun reads, unless the target takes them itself.
LABRUN_SUBSECTIONS = {"dataset.augment": (*_fields(AugmentConfig),
                                           *_fields(DetectionAugmentConfig))}
# Sections whose target Hydra's instantiate calls with every key, and a nested `_target_`
# node's too (unless `_recursive_: false`); dataset and logger pass nested values as they are.
INSTANTIATED = ("model", "task", "callbacks")
# Whose signatures may be read, by importing them: labrun's own targets and the libraries it
# is built on; a lab's own where it trusts them (core/trust.py: the project's packages,
# LABRUN_TRUSTED_MODULES). Any other target's section is not checked: importing runs its code.
INSPECTED = ("labrun.", "torch.", "torchvision.", "timm.")


def check_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for the first key that its section cannot take: one added with `+`
    (which Hydra adds even to a typed section) that its schema does not take (NewKeys), or a
    key of a section without a schema that neither labrun nor its `_target_` reads."""
    _check_section(cfg, "")


def check_target_sections(cfg: DictConfig) -> None:
    """check_keys of the sections that a `_target_` builds, alone: launch/sweep.plan checks
    each job's before any job is submitted (the job checks its whole config again)."""
    for name in TARGET_SECTIONS:
        node = cfg.get(name) if not OmegaConf.is_interpolation(cfg, name) else None
        if isinstance(node, DictConfig):
            _check_section(node, f"{name}.")


def in_target_section(override: str) -> bool:
    """Whether a command-line override sets, adds or removes a key of such a section."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.split(".", 1)[0] in TARGET_SECTIONS


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
    schema has the field or takes such new keys, or, without a schema, labrun or the section's
    target reads it, or nothing can tell (cluster.env, a target taking **kwargs)."""
    schema = OmegaConf.get_type(node)
    section = path.rpartition(".")[0] or "the top level"
    if not dataclasses.is_dataclass(schema):
        known = _keys_read(node, section)
        if known is None or key in known:
            return None
        target = _target_of(node)
        takes = f" and {target} takes no argument {key}" if target else ""
        return _refusal(path, section, key, list(known), takes)
    known = [f.name for f in dataclasses.fields(schema)]
    new_keys = getattr(schema, "new_keys", NewKeys.CLOSED)
    if key in known or new_keys is NewKeys.OPEN:
        return None
    takes = ""
    if new_keys is NewKeys.TARGET:
        target = _target_of(node)
        arguments = inspected_arguments(target) if target else None
        if arguments is None or key in arguments or key in INSTANTIATE_KEYS:
            return None
        known += [name for name in arguments if name not in known]
        takes = f" and {target} takes no argument {key}"
    return _refusal(path, section, key, known, takes)


def _refusal(path: str, section: str, key: str, known: list[str], takes: str) -> str:
    hint = difflib.get_close_matches(key, known, n=1)
    prefix = f"{section}." if "." in path else ""
    names = sorted({k for k in known if not k.startswith("_")})
    fix = (f"did you mean {prefix}{hint[0]}?" if hint else
           f"it takes: {', '.join(names)}" if names else "it takes no key but _target_")
    return f"{path}: no such key in {section}{takes}; {fix}"


def _keys_read(node: DictConfig, section: str) -> tuple[str, ...] | None:
    """The keys `node`, a section without a schema at `section`, may hold; None: any (no
    section a target builds, or a target whose arguments cannot be read: **kwargs, not
    importable, not trusted)."""
    if section in LABRUN_SUBSECTIONS:
        parent = node._get_parent()
        owner = _target_of(parent) if isinstance(parent, DictConfig) else None
        arguments = inspected_arguments(owner) if owner else None
        if arguments is None or section.rpartition(".")[2] in arguments:
            return None  # the target's own, to read as it likes
        return LABRUN_SUBSECTIONS[section]
    kind = _target_section(node, section)
    target = _target_of(node) if kind is not None else None
    arguments = inspected_arguments(target) if target else None
    if arguments is None:
        return None
    return (*INSTANTIATE_KEYS, *LABRUN_READS.get(kind, ()), *arguments)


def _target_section(node: DictConfig, section: str) -> str | None:
    """Which kind of `_target_` section `section` is (a key of LABRUN_READS, or "nested": a
    `_target_` node that instantiate builds inside one); None: none."""
    if re.fullmatch(r"callbacks\.[^.]+", section):
        return "callbacks"
    if section in LABRUN_READS and section != "callbacks":  # that one names the callbacks
        return section
    if section.split(".")[0] not in INSTANTIATED or "_target_" not in node:
        return None
    ancestor = node._get_parent()
    while isinstance(ancestor, DictConfig):
        if ancestor.get("_recursive_") is False:
            return None  # handed to the target as it is
        ancestor = ancestor._get_parent()
    return "nested"


def _target_of(node: DictConfig) -> str | None:
    try:
        target = node.get("_target_")
    except OmegaConfBaseException:  # an interpolation that does not resolve here
        return None
    return target if isinstance(target, str) and target != MISSING else None


def inspected_arguments(target: str) -> tuple[str, ...] | None:
    """target_arguments of a target whose module may be imported (INSPECTED, or trusted:
    core/trust.py); None for any other, whose keys go unchecked."""
    return target_arguments(target) if trust.trusted(target, INSPECTED) else None


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
