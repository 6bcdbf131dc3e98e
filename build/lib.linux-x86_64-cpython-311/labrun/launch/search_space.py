"""The Optuna sweeper's search space, written as hydra-optuna-sweeper's was: Hydra overrides.

    hydra.sweeper.params:                           (and the same on the command line)
      optimizer.lr: tag(log, interval(1e-4, 1e-1))  FloatDistribution(1e-4, 1e-1, log=True)
      optimizer.weight_decay: interval(0.0, 0.1)     FloatDistribution(0.0, 0.1)
      trainer.batch_size: int(interval(32, 256))     IntDistribution (Hydra's int() cast)
      model: choice(resnet18, resnet50)              CategoricalDistribution
      trainer.max_epochs: range(2, 10, 2)            IntDistribution(2, 8, step=2)
      precision: bf16                                not a sweep: the same in every trial

Each is parsed by Hydra's own override parser. One difference from hydra-optuna-sweeper:
range(start, stop, step) takes the values Hydra's basic sweeper takes (stop excluded), where
hydra-optuna-sweeper also tried `stop`.
"""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override, Transformer
from hydra.errors import HydraException

from labrun.core.errors import ConfigError


def parse(params: dict[str, Any], arguments: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(name -> Optuna distribution, overrides every trial gets) from hydra.sweeper.params and
    the command line's overrides (which win over params of the same key)."""
    lines = {str(key): f"{key}={value}" for key, value in params.items()}
    parser = OverridesParser.create()
    for line in arguments:
        try:
            key = parser.parse_override(line).get_key_element()
        except HydraException:
            key = line
        lines[key.lstrip("+~")] = line
    distributions, fixed = {}, []
    for line in lines.values():
        try:
            override = parser.parse_override(line)
        except HydraException as error:
            raise ConfigError(f"hydra.sweeper.params: cannot parse {line!r} ({error}); write "
                              f"e.g. interval(0, 1), tag(log, interval(1e-4, 1e-1)) or "
                              f"choice(a, b)") from None
        if override.is_sweep_override():
            distributions[override.get_key_element()] = distribution(override)
        else:
            fixed.append(override.input_line)
    return distributions, fixed


def distribution(override: Override) -> Any:
    """The Optuna distribution a sweep override describes."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    key, value = override.get_key_element(), override.value()
    unknown = (f"{key}: {override.input_line} is no search space the Optuna sweeper knows; use "
               f"interval(...), tag(log, interval(...)), range(...) or choice(...)")
    if isinstance(value, Glob):  # Hydra counts it as a choice (of config group options)
        raise ConfigError(unknown)
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        if not all(isinstance(c, str | int | float | bool) or c is None for c in choices):
            raise ConfigError(f"{key}: a choice takes numbers and strings, not lists or dicts; "
                              f"got {override.input_line}")
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        values = list(override.sweep_iterator())
        if not values:
            raise ConfigError(f"{key}: {override.input_line} is empty; give start < stop")
        if all(isinstance(v, int) for v in (value.start, value.stop, value.step)):
            return IntDistribution(values[0], values[-1], step=value.step)
        return FloatDistribution(values[0], values[-1], step=value.step)
    if override.is_interval_sweep():
        tags = set(value.tags) - {"log"}
        if tags:
            raise ConfigError(f"{key}: unknown tag {', '.join(sorted(tags))} in "
                              f"{override.input_line}; the one tag understood is log")
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise ConfigError(unknown)
