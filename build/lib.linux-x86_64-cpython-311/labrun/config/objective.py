"""What a run is judged by: checkpoint.monitor, better when higher (checkpoint.mode=max) or lower
(min). The one place that reads a mode's direction: best.pt, early stopping, `labrun gc`'s top
K, `labrun compare`, `aggregate` and `status`, and the Optuna study's direction all ask here.

Each task's config (conf/task/NAME.yaml) declares the monitor a run of it is judged by, and
its mode. DEFAULT_MONITOR and DEFAULT_MODE are what holds where nothing says: a task config
that names no monitor (the schema's default), and a summary.json written before it recorded
"monitor" and "mode".
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

from labrun.core.errors import ConfigError

DEFAULT_MONITOR = "val/acc"
MODES = ("max", "min")  # checkpoint.mode's values
DEFAULT_MODE = "max"
# Optuna's name for each mode's direction (hydra.sweeper.direction, unless set).
OPTUNA_DIRECTIONS = dict(zip(MODES, ("maximize", "minimize"), strict=True))


def maximizes(mode: str) -> bool:
    """Whether higher is better under `mode`. Any mode but "max" counts as "min"."""
    return mode == "max"


def better(mode: str) -> Callable[[float, float], bool]:
    """The comparator of `mode`: better(mode)(a, b) is whether a is better than b (timm's
    CheckpointSaver.cmp)."""
    return operator.gt if maximizes(mode) else operator.lt


def best_first(mode: str) -> Callable[[float], float]:
    """A sort key under which ascending order puts the best value first."""
    return operator.neg if maximizes(mode) else _same


def best_of(values: Iterable[float], mode: str) -> float:
    """The best of `values`."""
    return max(values) if maximizes(mode) else min(values)


def to_beat(best: float, margin: float, mode: str) -> float:
    """`best` moved by `margin` in the better direction: what a value must be better than to
    improve on `best` by more than `margin` (early stopping's min_delta)."""
    return best + margin if maximizes(mode) else best - margin


def optuna_direction(mode: str) -> str:
    """The Optuna study's direction that checkpoint.mode `mode` means."""
    if mode not in OPTUNA_DIRECTIONS:
        raise ConfigError(f"checkpoint.mode={mode} is not one of: {', '.join(OPTUNA_DIRECTIONS)}")
    return OPTUNA_DIRECTIONS[mode]


def _same(value: float) -> float:
    return value
