"""How a sweep's jobs are composed: JobComposer gives each job the config Hydra's own
load_sweep_config would compose for it, composing once what the jobs share; python_gc_kept_off
keeps Python's cyclic garbage collector off a grid's configs while launch/sweep.plan makes them."""

from __future__ import annotations

import contextlib
import gc
import pickle
from typing import Any

from hydra.types import HydraContext
from omegaconf import DictConfig, OmegaConf


class JobComposer:
    """Each job's config, equal to what Hydra's load_sweep_config composes for it, at a
    fraction of the cost: Hydra composes every job from scratch (the defaults list, every
    config file, the schemas), about 0.1 s a job, and no public API of it composes once what
    the jobs share. Here a job's overrides are split as Hydra splits them
    (hydra/_internal/defaults_list.py, Overrides): those that choose a config group's option
    decide the defaults list, so each distinct choice is composed once by load_sweep_config;
    a job's value overrides are then applied to a copy of it by Hydra's own
    _apply_overrides_to_config, in their order, after the composition, as Hydra applies them,
    and hydra.overrides.task and hydra.job.override_dirname are written as Hydra writes them.
    (tests/test_sweep_compose.py compares both ways.)"""

    def __init__(self, hydra_context: HydraContext, master: DictConfig):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.loader, self.master = hydra_context.config_loader, master
        self.parser = OverridesParser.create()
        # (group choices, leading value overrides) -> their config, pickled
        self.composed: dict[tuple[tuple[str, ...], tuple[str, ...]], bytes] = {}
        self.parsed: dict[str, Any] = {}  # override line -> Hydra's Override
        self.chooses: dict[str, bool] = {}  # override line -> whether it chooses an option

    def __call__(self, overrides: list[str], shared: int = 0) -> DictConfig:
        """The job's config. `shared`: how many of its leading value overrides every job of
        the batch has (shared_values), applied once to the composition the jobs share:
        applying them first, then the rest, is Hydra's own order."""
        from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname

        parsed = [self._parse(line) for line in overrides]
        if any(o.is_hydra_override() or o.is_sweep_override() for o in parsed):
            return self.loader.load_sweep_config(self.master, list(overrides))  # as Hydra
        values = [o for o in parsed if not self._chooses_option(o)]
        choices = tuple(o.input_line for o in parsed if self._chooses_option(o))
        key = (choices, tuple(o.input_line for o in values[:shared]))
        if key not in self.composed:
            cfg = self.loader.load_sweep_config(self.master, list(choices))
            ConfigLoaderImpl._apply_overrides_to_config(values[:shared], cfg)
            # Kept pickled: unpickling copies an OmegaConf config three times faster than
            # deepcopy does.
            self.composed[key] = pickle.dumps(cfg)
        cfg = pickle.loads(self.composed[key])
        OmegaConf.copy_cache(from_config=self.master, to_config=cfg)  # as load_sweep_config
        ConfigLoaderImpl._apply_overrides_to_config(values[shared:], cfg)
        naming = cfg.hydra.job.config.override_dirname
        cfg.hydra.overrides.task = [o.input_line for o in parsed]
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=parsed, kv_sep=naming.kv_sep, item_sep=naming.item_sep,
            exclude_keys=naming.exclude_keys)
        return cfg

    def shared_values(self, job_overrides: list[list[str]]) -> int:
        """How many leading value overrides all these jobs have in common (a grid's fixed
        overrides come before its swept ones): 0 for a single job (a search's trial), whose
        composition no other job would share."""
        if len(job_overrides) < 2:
            return 0
        values = [[line for line in overrides if not self._chooses_option(self._parse(line))]
                  for overrides in job_overrides]
        shared = 0
        for column in zip(*values, strict=False):  # jobs may have more or fewer
            if any(line != column[0] for line in column):
                break
            shared += 1
        return shared

    def chooses_option(self, line: str) -> bool:
        """Whether the override `line` chooses a config group's option (model=resnet18)."""
        return self._chooses_option(self._parse(line))

    def _parse(self, line: str):
        """Hydra's parse of one override, once per distinct line (a grid's jobs share most)."""
        if line not in self.parsed:
            self.parsed[line] = self.parser.parse_overrides([line])[0]
        return self.parsed[line]

    def _chooses_option(self, override) -> bool:
        line = override.input_line
        if line not in self.chooses:
            self.chooses[line] = (self.loader.repository.group_exists(override.key_or_group)
                                  and not isinstance(override.value(), dict))
        return self.chooses[line]


@contextlib.contextmanager
def python_gc_kept_off():
    """Python's cyclic garbage collector kept off a grid sweep's job configs: each is
    thousands of small objects, alive until the sweep ends, and each collection would walk
    all of those made so far (at 1,500 jobs, a third of the submission's time). Paused while
    they are planned, then frozen (gc.freeze: left out of every later collection). Planning
    leaves almost no cyclic garbage (gc.collect() finds 33 objects after 1,500 jobs), so
    freezing loses nothing; what submitting leaves is collected as usual. Not for a search:
    its trials are planned one at a time, and their configs end with them.

    A launcher that drops each job's config once planned (SlurmLauncher.prepare) frees it with
    free_dropped_config: a config is cyclic garbage (its nodes point to their parents), which
    only the collector frees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def free_dropped_config() -> None:
    """Free the config of the job just planned, which its launcher has dropped, while
    python_gc_kept_off holds the collector off: with it off, nothing is collected, so every
    object made since the last call (that job's config, thousands of them) is in the youngest
    generation, and collecting that generation alone walks each once. Left to the collector,
    a 5,000-job grid spent a third more time a job (each config walked again as it aged)."""
    gc.collect(0)
