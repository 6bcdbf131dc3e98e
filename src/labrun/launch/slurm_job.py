"""What runs inside a SLURM job that launch/slurm.py submits: a sweep's task (ArrayTask), with its
config's paths made absolute against where the sweep was submitted (make_paths_absolute), and
a detached study's controller (StudyController). submitit pickles them into the job, by their
path here; launch/slurm.py imports them under its own name too, so that a job queued before they
moved here still unpickles.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn
from omegaconf import DictConfig, OmegaConf, open_dict

import labrun
from labrun.config import facts
from labrun.core.errors import LabrunError
from labrun.core.project import TRAIN_COMMAND
from labrun.core.scheduler import SlurmScheduler
from labrun.launch import container
from labrun.runs.sweepdir import SweepDir


class ArrayTask:
    """What each task of a labrun job array runs: its job's config, pickled at submission by
    the C pickler, with the launcher and Hydra's singleton state read from the one file
    (SlurmLauncher.shared_file) that the submission wrote for all its tasks. submitit pickles
    each task's call on its own, with cloudpickle: with the launcher and the state in every
    one, a 1,500-job sweep spent most of its submission pickling the same objects again. The
    task makes its config's paths absolute (make_paths_absolute) against the folder the sweep
    was submitted from, as the job runs in the code snapshot's folder; in the task, not at
    submission, where it cost a 1,500-job sweep 5 s."""

    def __init__(self, sweep_dir: Path, submitted_from: str):
        self.sweep_dir, self.submitted_from = sweep_dir, submitted_from
        self.shared: Path | None = None  # the submission's launcher file, once written
        self.labrun_version = labrun.__version__  # the submitter's, which the job must run

    def __call__(self, config: bytes) -> JobReturn:
        # Before the launcher's pickle, which another labrun may not read.
        container.check_labrun_version(getattr(self, "labrun_version", None))
        with open(self.shared, "rb") as f:
            launcher, state = pickle.load(f)
        config = pickle.loads(config)
        Singleton.set_state(state)  # a path may interpolate ${hydra:runtime.cwd}
        container.relay_requeues()  # in cluster.container's image: requeue through the host
        make_paths_absolute(config, self.sweep_dir, self.submitted_from)
        return launcher(config, state)

    def checkpoint(self, *args: Any) -> Any:
        """submitit calls it on USR2 (see labrun.train.trainer): requeue the same task; the job
        resumes from the checkpoint it just saved."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


class StudyController:
    """What a detached study's controller job runs: the study's own command (`labrun train -m
    hparams_search=optuna ...`, attached; a project need not have a train.py), in a process of
    its own whose environment holds none of the controller job's SLURM variables, so that the
    trials it submits are jobs of their own and not steps of it. Requeued (a preemption, its node failing, USR2 before its
    time limit, within cluster.max_num_timeout), it runs the command again, which continues
    the study and attaches to the trials in flight (launch/optuna_sweeper.py)."""

    def __init__(self, argv: list[str], cwd: str, sweep_dir: Path):
        self.argv, self.cwd, self.sweep_dir = argv, cwd, sweep_dir

    def __call__(self) -> int:
        import subprocess

        code = subprocess.run([*TRAIN_COMMAND, "-m", *self.argv], cwd=self.cwd,
                              env=SlurmScheduler.outside_job(os.environ),
                              check=False).returncode
        if code < 0:
            # Stopped by a signal from outside (scancel: `labrun cancel` records "cancelled"
            # itself), not a failure of the study's: recording one would overwrite that.
            return code
        # Its end, in jobs.json too: what `labrun status` says once SLURM has forgotten it.
        SweepDir(self.sweep_dir).update_controller(
            state="completed" if code == 0 else "failed", ended_at=time.time())
        if code != 0:
            raise LabrunError(f"the study's sweeper exited with code {code}; its output is in "
                              f"this job's log")
        return code

    def checkpoint(self, *args: Any) -> Any:
        """submitit calls it on USR2 (the time limit near): requeue; the study continues."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


def make_paths_absolute(config: DictConfig, sweep_dir: Path, submitted_from: str) -> None:
    """The sweep folder and the path keys absolute, relative ones taken as relative to the
    folder the sweep was submitted from."""
    with open_dict(config):
        config.hydra.sweep.dir = str(sweep_dir)
        # Keys holding paths (the schema's `path` fact), which a job running elsewhere must
        # see as absolute paths.
        for key in facts.path_keys():
            value = OmegaConf.select(config, key, default=None, throw_on_missing=False)
            if key == "checkpoint.resume" and value in ("auto", "never"):
                continue
            if isinstance(value, str) and value and not os.path.isabs(value):
                OmegaConf.update(config, key, os.path.normpath(os.path.join(submitted_from,
                                                                            value)),
                                 merge=False)
