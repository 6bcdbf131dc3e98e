"""hparams_search=optuna: labrun's own Hydra sweeper on current Optuna (4.2 to 5.x).

    python train.py -m hparams_search=optuna [cluster=lab] [hydra.sweeper.n_trials=40 ...]

Keys (conf/hparams_search/optuna.yaml; the schema is in hydra_plugins/labrun_launcher):
    storage      null: a journal file SWEEP_DIR/optuna.journal (Optuna's JournalStorage, made
                 for many processes on a shared file system); a path: a journal file there;
                 a URL (sqlite:///..., postgresql://...): that database
    study_name, sampler (a `_target_`, TPE by default)
    direction    maximize | minimize; null: the one checkpoint.mode means (max: maximize,
                 min: minimize)
    n_trials     trials in all, counting those an earlier run of the study finished
    n_jobs       trials in flight at once: when one ends, the next starts (cluster=lab: each
                 trial is one SLURM job, submitted as it is asked)
    pruner       a `_target_` (optuna.pruners.MedianPruner by default); null: no pruning
    max_failure_rate  the share of the ended trials that may fail; above it the study asks
                 for no more trials, lets those in flight finish, and the command fails
    params       the search space, in hydra-optuna-sweeper's syntax (launch/search_space.py)

Each trial is one job of the launcher that `cluster=` picked, in the sweep folder's N/ for
trial N. The trial gets its parameters and, while a pruner is set, the pruning callback
(train/pruning.py) as overrides: it reports checkpoint.monitor after every epoch to the trial
in the study's storage and stops the run as "pruned" when the pruner says so. The sweeper
tells the study each trial's outcome: its objective (the best checkpoint.monitor, which
train.py returns), pruned, or failed.

Running the same command again into the same sweep folder continues the study: finished
trials (complete or pruned) count towards n_trials, a trial that was cut off (still running
in the study) is marked failed and its parameters are tried again, and new trials, numbered
after the existing ones, get new folders. One sweeper per study at a time.
"""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from labrun.config import validation
from labrun.config.objective import OPTUNA_DIRECTIONS, optuna_direction
from labrun.core.errors import ConfigError, LabrunError, one_line
from labrun.launch import search_space, sweep
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import (
    TRIAL_CALLBACK,
    Job,
    SweepDir,
    open_storage,
    print_table,
    read_result,
)
from labrun.train.pruning import PRUNER_ATTR

log = logging.getLogger(__name__)

# optuna is imported inside the methods: Hydra imports this module on every start-up, and
# importing optuna costs about a second.

JOURNAL = "optuna.journal"
RESULTS = "optimization_results.yaml"
CALLBACK = f"+{TRIAL_CALLBACK}"  # the pruning callback's overrides (train/pruning.py)


class OptunaSweeper(Sweeper):
    def __init__(self, *, storage: str | None, study_name: str | None, direction: str | None,
                 n_trials: int, n_jobs: int, max_failure_rate: float, sampler: Any,
                 pruner: Any, params: dict[str, Any] | None) -> None:
        # sampler and pruner arrive built: Hydra instantiates a plugin's config recursively.
        if direction is not None and direction not in OPTUNA_DIRECTIONS.values():
            raise ConfigError(f"hydra.sweeper.direction={direction}: maximize or minimize")
        if n_trials < 1 or n_jobs < 1 or not 0.0 <= max_failure_rate <= 1.0:
            raise ConfigError(f"hydra.sweeper: n_trials={n_trials} and n_jobs={n_jobs} must be "
                              f">= 1, max_failure_rate={max_failure_rate} within [0, 1]")
        self.storage, self.study_name, self.direction = storage, study_name, direction
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.sampler, self.pruner, self.params = sampler, pruner, params or {}
        self.config: DictConfig | None = None
        self.launcher: sweep.SweepLauncher | None = None
        self._stopped_by: str | None = None  # why the study stopped asking for trials
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        if self.direction is None:  # the direction checkpoint.mode means
            self.direction = optuna_direction(config.checkpoint.mode)
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function)
        if not isinstance(self.launcher, sweep.SweepLauncher):
            raise ConfigError(f"hparams_search=optuna starts trials one at a time through "
                              f"labrun's launchers, not {type(self.launcher).__name__}; use "
                              f"cluster=local, lab or slurm_dev")

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        distributions, fixed = search_space.parse(
            OmegaConf.to_container(OmegaConf.create(dict(self.params)), resolve=True),
            list(arguments))
        # Before the study asks for a trial: the launcher's plan refuses a monitor no trial
        # reports too, but only once the journal holds a trial left running.
        first_trial = self.hydra_context.config_loader.load_sweep_config(self.config,
                                                                         list(fixed))
        validation.check_checkpoint_monitor(first_trial)
        detach = OmegaConf.select(self.config, "cluster.detach", default=False)
        if detach:
            # The controller job is checked as a sweep's jobs are, before the study's folder,
            # its code snapshot or anything in SLURM exists.
            self.launcher.check_controller()
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage_spec = self._storage_spec(sweep_dir)
        study_name = self.study_name or str(self.config.hydra.job.name)
        storage = optuna.storages.get_storage(open_storage(storage_spec))
        if detach:
            self._check_direction(optuna.load_study(study_name=study_name, storage=storage)
                                  if _has_study(storage, study_name) else None, storage_spec)
            self._detach(sweep_dir, storage_spec, study_name)
            return
        self.launcher.record([], study={"name": study_name, "storage": storage_spec,
                                        "direction": self.direction, "n_trials": self.n_trials})
        finished, in_flight = self._continue(storage, study_name, sweep_dir)
        to_go = self.n_trials - finished - len(in_flight)
        if to_go <= 0 and not in_flight:
            return
        study = optuna.create_study(study_name=study_name, storage=storage,
                                    sampler=self.sampler, direction=self.direction,
                                    load_if_exists=True)
        self._check_direction(study, storage_spec)
        if study.metric_names is None:  # optuna-dashboard's plots say val/acc, not Objective 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names([str(first_trial.checkpoint.monitor)])
        pruner_cfg = OmegaConf.to_container(self.config.hydra.sweeper.pruner, resolve=True) \
            if self.pruner is not None else None
        study.set_user_attr(PRUNER_ATTR, pruner_cfg)  # what the trials judge with
        log.info("study %s in %s: %d trials to run, %d at a time; sampler %s, pruner %s",
                 study_name, storage_spec, max(0, to_go), self.n_jobs,
                 type(self.sampler).__name__,
                 type(self.pruner).__name__ if self.pruner is not None else "none")
        jobs = self._run_trials(study, distributions, fixed, storage_spec, to_go, in_flight)
        print_table(jobs, f"study {study_name} in {sweep_dir}")
        self._report(study, sweep_dir)
        if self._stopped_by is not None:
            raise LabrunError(self._stopped_by)

    def _check_direction(self, study: Any, storage_spec: str) -> None:
        if study is not None and study.direction.name.lower() != self.direction:
            raise ConfigError(f"study {study.study_name} in {storage_spec} was made to "
                              f"{study.direction.name.lower()}, not to {self.direction}; use "
                              f"another hydra.sweep.dir or hydra.sweeper.study_name")

    def _detach(self, sweep_dir: Path, storage_spec: str, study_name: str) -> None:
        """cluster.detach=true: submit the study's controller (the launcher's; a SLURM job
        running this same command, attached) and return."""
        replaced = ("cluster.detach", "cluster.snapshot", "hydra.sweep.dir", "hydra.mode")
        argv = [arg for arg in [*self.config.hydra.overrides.hydra,
                                *self.config.hydra.overrides.task]
                if arg.split("=")[0].lstrip("+~") not in replaced]
        controller = self.launcher.submit_controller(argv)
        self.launcher.record([], controller={**controller, "state": "submitted"},
                             study={"name": study_name, "storage": storage_spec,
                                    "direction": self.direction, "n_trials": self.n_trials})
        print(f"study {study_name}: {self.n_trials} trials, run by SLURM job "
              f"{controller['job_id']} (log {controller['log']})\n"
              f"  follow it:  labrun status {sweep_dir}\n"
              f"  stop it:    labrun cancel {sweep_dir}")

    def _run_trials(self, study: Any, distributions: dict[str, Any], fixed: list[str],
                    storage_spec: str, to_go: int, in_flight: dict[int, tuple[Any, Job]]
                    ) -> list[Job]:
        """Keep up to n_jobs trials in flight (`in_flight`: job num -> (trial, its job), those
        of an earlier run still running): whenever one ends (completed, pruned or failed),
        tell the study and start the next at once. Returns this run's jobs."""
        in_flight = dict(in_flight)
        jobs, ended, failures = [job for _, job in in_flight.values()], 0, []
        expected = None  # the next trial's number: another sweeper on the study would skip it
        try:
            while in_flight or (to_go > 0 and self._stopped_by is None):
                while to_go > 0 and self._stopped_by is None and len(in_flight) < self.n_jobs:
                    trial = study.ask(distributions)
                    if expected is not None and trial.number != expected:
                        raise LabrunError(f"study {study.study_name} gave trial {trial.number} "
                                          f"after {expected - 1}: another process asks it for "
                                          f"trials; run one sweeper per study")
                    expected = trial.number + 1
                    job = self.launcher.start(
                        self._overrides(trial, fixed, storage_spec, study.study_name),
                        trial.number)
                    in_flight[job.num] = (trial, job)
                    jobs.append(job)
                    to_go -= 1
                for job in self.launcher.wait_any([job for _, job in in_flight.values()]):
                    trial, _ = in_flight.pop(job.num)
                    ended += 1
                    failure = self._tell(study, trial.number, sweep.job_return(job))
                    if failure is not None:
                        failures.append(failure)
                    # Over the trials that have ended (not per batch): a failing study stops
                    # asking, and the trials in flight finish and are told.
                    if (failures and self._stopped_by is None
                            and len(failures) / ended > self.max_failure_rate):
                        self._stopped_by = (
                            f"{len(failures)} of {ended} trials failed (hydra.sweeper."
                            f"max_failure_rate={self.max_failure_rate}); first: {failures[0]}")
                        log.warning("stopping the study: %s; waiting for the %d trials in "
                                    "flight", self._stopped_by, len(in_flight))
        except KeyboardInterrupt:
            self.launcher.stop([job for _, job in in_flight.values()])
            self.launcher.record(jobs)
            raise
        return jobs

    # -- the study -----------------------------------------------------------------------------

    def _storage_spec(self, sweep_dir: Path) -> str:
        if not self.storage:
            return str(sweep_dir / JOURNAL)
        if "://" in self.storage:
            return str(self.storage)
        return str(Path(self.storage).expanduser().resolve())  # the jobs may run elsewhere

    def _continue(self, storage: Any, study_name: str, sweep_dir: Path
                  ) -> tuple[int, dict[int, tuple[Any, Job]]]:
        """An earlier run's study: its trials still running are attached to (a requeued
        controller, a sweeper whose terminal went); those that ended meanwhile are told as
        their run folders say; those cut off are marked failed and their parameters tried
        again. Returns the count of finished trials and the trials in flight."""
        import optuna

        if not _has_study(storage, study_name):
            return 0, {}
        study = optuna.load_study(study_name=study_name, storage=storage)
        state = optuna.trial.TrialState
        earlier = SweepDir(sweep_dir).earlier_jobs()
        in_flight: dict[int, tuple[Any, Job]] = {}
        for trial in study.get_trials(deepcopy=False, states=(state.RUNNING,)):
            row = earlier.get(trial.number)
            job = self.launcher.reattach(row.overrides, trial.number) if row else None
            if job is not None:
                in_flight[trial.number] = (trial, job)
                continue
            if row is not None and row.job_id:
                read_result(row)  # it ended while no sweeper waited for it
                if row.state in ("completed", "pruned"):
                    self._tell(study, trial.number, sweep.job_return(row))
                    self.launcher.record([row])
                    continue
            study.enqueue_trial(trial.params)  # cut off: its parameters are tried again
            study.tell(trial.number, state=state.FAIL)
        finished = len(study.get_trials(deepcopy=False, states=(state.COMPLETE, state.PRUNED)))
        log.info("continuing study %s: %d trials finished, %d running, %d to go", study_name,
                 finished, len(in_flight), max(0, self.n_trials - finished - len(in_flight)))
        return finished, in_flight

    def _overrides(self, trial: Any, fixed: list[str], storage: str, study: str) -> list[str]:
        params = [f"{name}={value}" for name, value in trial.params.items()]
        if self.pruner is None:
            return [*fixed, *params]
        return [*fixed, *params, f"{CALLBACK}._target_=labrun.train.pruning.OptunaPruning",
                f"{CALLBACK}.storage={quoted(storage)}", f"{CALLBACK}.study_name={quoted(study)}",
                f"{CALLBACK}.trial={trial.number}"]

    @staticmethod
    def _tell(study: Any, number: int, ret: JobReturn) -> str | None:
        """Tell the study how the trial ended; return why it failed, or None."""
        import optuna

        state = optuna.trial.TrialState
        status = RunDir(ret.working_dir).read_summary().get("status") if ret.working_dir else None
        if status == "pruned":  # from the trial's own record: the pruner stopped it
            study.tell(number, state=state.PRUNED)
            return None
        if ret.status == JobStatus.COMPLETED:
            value = ret.return_value
            if isinstance(value, int | float) and not math.isnan(value):
                study.tell(number, float(value))
                return None
            error = (f"trial {number} returned {value!r}, not a number: does its "
                     f"checkpoint.monitor appear in the validation metrics?")
        else:
            error = one_line(ret._return_value)  # the launcher's JobFailed: job, error, log
        study.tell(number, state=state.FAIL)
        log.warning("trial %d failed: %s", number, error)
        return error

    def _report(self, study: Any, sweep_dir: Path) -> None:
        """Log the best trial and write it to SWEEP_DIR/optimization_results.yaml."""
        try:
            best = study.best_trial
        except ValueError:  # no trial completed
            log.warning("study %s: no trial completed", study.study_name)
            return
        OmegaConf.save(OmegaConf.create({"name": "optuna", "best_trial": best.number,
                                         "best_params": best.params, "best_value": best.value}),
                       sweep_dir / RESULTS)
        log.info("best trial %d: %s %.4g with %s (%s)", best.number,
                 OmegaConf.select(self.config, "checkpoint.monitor", default="objective"),
                 best.value, " ".join(f"{k}={v}" for k, v in best.params.items()),
                 sweep_dir / RESULTS)


def _has_study(storage: Any, study_name: str) -> bool:
    import optuna

    return any(summary.study_name == study_name
               for summary in optuna.get_all_study_summaries(storage, include_best_trial=False))


def quoted(value: str) -> str:
    """A value as Hydra's override parser reads it back verbatim (a path may hold `=` or `,`)."""
    quote = "'" if "'" not in value else '"'
    return f"{quote}{value}{quote}"
