"""Composition and resolution shared by `labrun configs check` and `labrun configs diff`: Hydra's
compose API on a config tree, and a composed config flattened to dotted keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, OmegaConfBaseException

from labrun.config import schema as config
from labrun.core.errors import LabrunError, first_line

PRIMARY = "train"


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
                leaves.broken[path] = first_line(str(error))
            continue
        leaves.values[path] = value


def _needs_hydra_runtime(raw: str, error: Exception) -> bool:
    # `${hydra:...}` only resolves inside a running job (directly, or through another key).
    return "${hydra:" in raw or "HydraConfig was not set" in str(error)
