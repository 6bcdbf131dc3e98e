"""The grid sweeper behind `python train.py -m a=1,2 b=x,y` (hydra/sweeper=labrun_basic, the
default of conf/train.yaml; hparams_search=optuna picks launch/optuna_sweeper.py instead):
Hydra's BasicSweeper, which expands the overrides into jobs, without its batch check where a
labrun launcher runs the jobs.

BasicSweeper composes every job of a batch once before the launcher composes it again, so that
a job that cannot compose fails before any starts: about 0.9 s a job on a loaded 2-core machine
(its own comment calls it slow for large sweeps), 190 of a 200-job sweep's 215 s here. labrun's
launchers compose every job before they start any (launch/sweep.plan, with launch/compose.JobComposer),
and a job that does not compose fails there, the same way, with nothing submitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class GridSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        from labrun.launch.sweep import SweepLauncher

        if not isinstance(self.launcher, SweepLauncher):  # another launcher: Hydra's check
            super().validate_batch_is_legal(batch)
