"""hparams_search=optuna: hydra-optuna-sweeper, with a study that survives interruption.

The study lives in the sweep folder (SQLite). Running the same command again into the same
sweep folder continues it: finished trials are kept and count towards n_trials, a trial that
was cut off is marked failed and its parameters are tried again, and new jobs are numbered
after the existing ones, so no job folder is reused by a different trial.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper

log = logging.getLogger(__name__)

# optuna is imported inside the methods: Hydra imports this module on every start-up, and
# importing optuna costs over a second.


class ResumableOptunaSweeper(OptunaSweeper):
    def sweep(self, arguments: list[str]) -> None:
        import optuna

        finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        impl = self.sweeper
        if impl.storage:
            Path(str(impl.sweep_dir)).mkdir(parents=True, exist_ok=True)
            study = self._existing_study(impl.storage, impl.study_name)
            if study is not None:
                finished = [t for t in study.trials if t.state in finished_states]
                impl.job_idx = len(study.trials)  # job N runs trial N
                for trial in study.trials:
                    if trial.state == optuna.trial.TrialState.RUNNING:  # cut off last time
                        study.enqueue_trial(trial.params)
                        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                impl.n_trials = max(0, impl.n_trials - len(finished))
                log.info("continuing study %s: %d trials finished, %d to go",
                         impl.study_name, len(finished), impl.n_trials)
                if impl.n_trials == 0:
                    return None
        return super().sweep(arguments)

    @staticmethod
    def _existing_study(storage: str, name: str):
        import optuna

        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:  # no study of that name yet
            return None
