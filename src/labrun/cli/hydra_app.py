"""The error path of `python train.py`: one clear line and exit code 2 for a mistake a person
can fix (a config key, a path, a file); a full traceback for everything else.

Hydra composes and runs the app as its docs show; only its error printing is replaced. Setting
HYDRA_FULL_ERROR=1 shows Hydra's full traceback, as usual.

train_task is what `python train.py` runs for each run: validation, then training. Two Hydra
callbacks (conf/train.yaml, hydra.callbacks) act on a single run before Hydra writes anything in
its folder: ClusterRunCallback sends a run on a SLURM cluster config to the cluster
(launch/cluster_run.py) and exits with its outcome; RunLockCallback takes the run folder's lock
(runs/lock.py) for a run that trains here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable

from hydra.experimental.callback import Callback

# user_error_message is re-exported: the one-line messages live with the config they explain.
from labrun.config.messages import user_error_message  # noqa: F401
from labrun.core.errors import RunInterrupted

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


@contextlib.contextmanager
def exit_on_user_error():
    """Inside the task function: a user error or an interruption ends the job with one line.

    Raising SystemExit here (instead of the exception) keeps Hydra from printing its own
    "Error executing job" preamble and traceback.
    """
    try:
        yield
    except BaseException as error:
        code = _print_if_expected(error)
        if code is None:
            raise
        sys.exit(code)


def _print_if_expected(error: BaseException) -> int | None:
    """Print the one line for an interruption or a user error; return the exit code."""
    if isinstance(error, RunInterrupted | KeyboardInterrupt):
        print(f"interrupted: {error}" if str(error) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    message = user_error_message(error)
    if message is None or os.environ.get("LABRUN_FULL_ERROR") == "1":
        return None
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USER_ERROR


def train_task(cfg) -> float | None:
    """One run from its composed config: validated, then trained; the best value of
    checkpoint.monitor (a sweeper's objective). Hydra's task function, in this process or in a
    cluster job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from labrun.config import validation
    from labrun.core import environment

    with exit_on_user_error():
        # A mistake in the config is one line before torch loads (seconds of imports); the
        # job is imported only then, which also keeps `--help` and `--cfg` fast.
        single = HydraConfig.get().mode == RunMode.RUN
        here = environment.read()
        if not (single and judged_before_the_lock(here)):  # else refuse_outside_fit did it
            validation.validate(cfg)
            if single:
                announce(validation.check_single_run(cfg, here))
        from labrun.train.job import train

        return train(cfg)


def run_hydra_app(main: Callable[[], object]) -> None:
    # Remember whether the person asked for tracebacks (child processes inherit the answer),
    # then let composition errors reach this function instead of Hydra's printer.
    os.environ.setdefault("LABRUN_FULL_ERROR",
                          "1" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "0")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except SystemExit:
        raise
    except BaseException as error:
        code = _print_if_expected(error)
        if code is None:
            raise
        sys.exit(code)


class RunLockCallback(Callback):
    """Takes the run folder's lock in on_run_start, which Hydra 1.3 calls before run_job saves
    .hydra/ and opens train.log (on_job_start comes after both). A refusal prints one line and
    exits 2. Sweeps: the launchers take each job's lock themselves, before run_job
    (launch/local.py, launch/slurm.py)."""

    def __init__(self) -> None:
        self.lock = None

    def on_run_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        from labrun.runs import lock
        from labrun.runs.rundir import RunDir

        refuse_outside_fit(config)
        # run_job makes the same path of hydra.run.dir (`now` is cached, the token is in the
        # environment: the value is the one run_job will get).
        run_dir = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        try:
            self.lock = lock.claim(RunDir(run_dir).lock_path)
        except lock.RunLocked as error:
            # Hydra turns a callback's exception into a warning and runs the job anyway: the
            # refusal must leave as SystemExit (one line, exit 2) before run_job writes.
            # (Not through _print_if_expected: with LABRUN_FULL_ERROR=1 that re-raises, which
            # Hydra would swallow here.)
            print(f"error: {error}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)

    def on_run_end(self, config, **kwargs) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def announce(where: str | None) -> None:
    if where:
        print(f"labrun: {where}", flush=True)


def judged_before_the_lock(here) -> bool:
    """Whether a run without -m is validated and checked against its allocation in
    RunLockCallback (refuse_outside_fit), not in train_task: inside a person's own allocation,
    with several ranks (srun python train.py)."""
    return here.scheduler is not None and not here.submitted_by_labrun and here.world_size > 1


def refuse_outside_fit(config) -> None:
    """Inside a person's own allocation with several ranks, each rank validates the run and
    refuses an allocation smaller than it (validation.check_single_run) before the lock, not
    in train_task: a rank other than 0 would otherwise wait for the lock of a rank 0 that had
    refused (lock.follow, up to its timeout). Elsewhere nothing: that is train_task's."""
    from omegaconf import OmegaConf

    from labrun.config import validation
    from labrun.core import environment

    here = environment.read()
    if not judged_before_the_lock(here):
        return
    try:  # every way out a SystemExit: Hydra would run the job after a callback's exception
        with exit_on_user_error():
            cfg = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
            validation.validate(cfg)
            announce(validation.check_single_run(cfg, here))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


class ClusterRunCallback(Callback):
    """A run without -m on a SLURM cluster config goes to the cluster: in on_run_start, before
    Hydra writes anything in the run folder, it is validated, submitted (or attached to, where
    its folder records a live job) and followed (launch/cluster_run.py); this process then
    exits with the run's outcome and Hydra's run_job never starts here. In the job, and for
    cluster=local, it does nothing."""

    def on_run_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        from labrun.config import validation
        from labrun.launch import cluster_run

        if not cluster_run.goes_to_cluster(config):
            return
        # Hydra turns a callback's exception into a warning and runs the job anyway, here:
        # every way out of this method is SystemExit, a bug's with its traceback.
        try:
            with exit_on_user_error():
                validation.validate(OmegaConf.masked_copy(config, [k for k in config
                                                                   if k != "hydra"]))
                code = cluster_run.run(config, task_function=train_task)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.exit(code)
