"""Where each key's value comes from: `labrun configs show KEY... [OVERRIDE...]`.

A run's config is labrun's defaults, then the layers over them (conf/train.yaml's defaults
list), lowest first:

    labrun    the package's config groups (pkg://labrun.conf), with the LABRUN_* environment
              defaults they read
    lab       the folder LABRUN_SITE names: conf/site/default.yaml, conf/site/cluster/NAME.yaml,
              conf/site/logger/NAME.yaml, and any group option it adds or replaces
    project   the project's conf/: project/default.yaml (and its cluster/, logger/), its options
    local     the project's untracked conf/local/: one person's settings
    command line

The file that set a key last is read off Hydra's own defaults list (the order it merges the
files in), each file loaded from the search path entry that provides it, whose provider names
its layer (hydra_plugins/labrun_launcher/labrun_project.py adds the lab's and the project's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

from labrun.config.resolve import hydra_context
from labrun.core.errors import LabrunError, first_line

# Hydra's search path providers, by layer (structured configs are labrun's schemas).
LAYER_OF_PROVIDER = {"main": "labrun", "schema": "labrun", "labrun": "labrun",
                     "labrun-site": "lab", "labrun-project": "project"}


@dataclass
class Origin:
    key: str
    value: Any
    layer: str
    file: str  # the file that set it last, or the override that did


def show(keys: list[str], overrides: list[str], config_dir: Path, config_name: str
         ) -> list[Origin]:
    """Each key's value in the config `overrides` compose, with its layer and file."""
    try:
        with hydra_context(config_dir, config_name):
            cfg = compose(config_name, overrides=overrides)
            loader = GlobalHydra.instance().config_loader()
            defaults = loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults
            files = []  # (config path, package, provider, loaded config), in merge order
            for default in defaults:
                if default.config_path is None or default.package is None:
                    continue
                loaded = loader.repository.load_config(default.config_path)
                if loaded is not None:
                    files.append((default.config_path, default.package, loaded))
    except LabrunError:
        raise
    except Exception as error:  # Hydra's own error for an unknown option or key: one line
        raise LabrunError(first_line(str(error))) from None
    parsed = OverridesParser.create().parse_overrides(overrides)
    origins = []
    for key in keys:
        if OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=False) \
                is _MISSING:
            raise LabrunError(f"{key}: no such key in the composed config; `labrun train "
                              f"--cfg job` prints every key")
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) \
            else value
        layer, source = "labrun", "(a schema's default)"
        for config_path, package, loaded in files:
            if _sets(loaded.config, package, key):
                layer = _layer(config_path, loaded.provider)
                source = _where(loaded.path, config_path, loaded.provider)
        for override in parsed:
            if override.key_or_group == key:
                layer, source = "command line", override.input_line
        origins.append(Origin(key, value, layer, source))
    return origins


_MISSING = object()


def _sets(config: Any, package: str, key: str) -> bool:
    """Whether a file loaded at `package` holds `key` (one of its own keys, not its defaults)."""
    prefix = f"{package}." if package else ""
    if not key.startswith(prefix) and key != package:
        return False
    inner = key[len(prefix):] if key != package else ""
    if not inner:
        return False
    node = OmegaConf.select(config, inner, default=_MISSING, throw_on_resolution_failure=False)
    return node is not _MISSING


def _layer(config_path: str, provider: str) -> str:
    layer = LAYER_OF_PROVIDER.get(provider, provider)
    if layer == "project" and config_path.split("/")[0] == "local":
        return "local"  # the project's conf/local/: one person's, untracked
    return layer


def _where(path: str, config_path: str, provider: str) -> str:
    if path.startswith("file://"):
        return str(Path(path.removeprefix("file://")) / f"{config_path}.yaml")
    return f"{config_path} ({provider}: {path})"


def print_origins(origins: list[Origin]) -> None:
    width = max(len(o.key) for o in origins)
    for origin in origins:
        value = OmegaConf.to_yaml(origin.value).strip() if isinstance(
            origin.value, dict | list) else origin.value
        print(f"{origin.key:<{width}}  {value}    [{origin.layer}: {origin.file}]")
