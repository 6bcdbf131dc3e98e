"""`labrun resume RUN_DIR` and `labrun rerun RUN_DIR [--exec]`.

resume: continue an interrupted run in its own folder, with the overrides it was started with
        (checkpoint.resume=auto picks up its newest valid checkpoint).
rerun:  reproduce a run from scratch in a new folder; prints the command (or runs it with
        --exec) and warns when the code or the packages differ from the recorded ones.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from pathlib import Path

from labrun.core.errors import LabrunError
from labrun.core.project import TRAIN_COMMAND, project_dir
from labrun.runs import provenance
from labrun.runs.lock import RunLocked
from labrun.runs.lock_holder import busy_message, live_holder, me
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import SweepDir

log = logging.getLogger(__name__)




def saved_overrides(run_dir: Path) -> list[str]:
    overrides = RunDir(run_dir).overrides()
    if overrides is None:
        raise LabrunError(f"{run_dir} is not a labrun run folder (no .hydra/overrides.yaml)")
    # The folder is chosen again by the command; everything else is the run's own settings.
    return [o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep."))]


def train_command(run_dir: Path) -> tuple[list[str], Path]:
    """The interpreter and train.py that started the run (`labrun train` when it was that, or
    is not recorded), and the folder it started in, so relative paths in its config mean the
    same again (this project's, if not recorded)."""
    command_file = RunDir(run_dir).provenance_dir / provenance.COMMAND
    command, cwd = list(TRAIN_COMMAND), project_dir() or Path.cwd()
    if command_file.is_file():
        recorded = json.loads(command_file.read_text())
        recorded_script = Path(recorded["cwd"]) / recorded["argv"][0]
        python = recorded["executable"] if Path(recorded["executable"]).is_file() else command[0]
        if recorded_script.name == "train.py" and recorded_script.is_file():
            command = [python, str(recorded_script)]
        else:
            command = [python, *TRAIN_COMMAND[1:]]
        if Path(recorded["cwd"]).is_dir():
            cwd = Path(recorded["cwd"])
    return command, cwd


def differences(run_dir: Path) -> list[str]:
    """What differs between the recorded environment and this one, in words."""
    notes = []
    recorded_dir = RunDir(run_dir).provenance_dir
    git_file = recorded_dir / provenance.GIT
    project = project_dir() or Path.cwd()
    if git_file.is_file():
        recorded = json.loads(git_file.read_text())
        now = provenance.git_state(project)
        if recorded.get("commit") and recorded["commit"] != now["commit"]:
            notes.append(f"git commit differs: run {recorded['commit'][:10]}, "
                         f"now {str(now['commit'])[:10]}")
        if recorded.get("dirty"):
            notes.append(f"the run had uncommitted changes: {recorded_dir / provenance.GIT_DIFF}")
    labrun_file = recorded_dir / provenance.LABRUN
    if labrun_file.is_file():  # a run from before labrun recorded itself has packages.txt
        recorded, now = json.loads(labrun_file.read_text()), provenance.labrun_state()
        if recorded.get("version") != now["version"]:
            notes.append(f"labrun version differs: run {recorded.get('version')}, now "
                         f"{now['version']} (pip install labrun=={recorded.get('version')} "
                         f"gives the run's)")
        elif (recorded.get("commit") and now["commit"] and recorded["commit"] != now["commit"]
              and now["checkout"] != str(project)):  # labrun's own repository: said above
            notes.append(f"labrun's commit differs: run {recorded['commit'][:10]}, now "
                         f"{now['commit'][:10]} ({now['checkout']})")
    packages_file = recorded_dir / provenance.PACKAGES
    if packages_file.is_file():
        recorded = set(packages_file.read_text().split())
        now = set(provenance.installed_packages())
        changed = sorted({p.split("==")[0] for p in recorded ^ now})
        if changed:
            notes.append(f"{len(changed)} packages differ: {', '.join(changed[:8])}"
                         f"{'...' if len(changed) > 8 else ''}")
    return notes




def resume(run_dir: Path, extra: list[str]) -> int:
    """Continue the run in its own folder; the exit code of the training process."""
    run_dir = run_dir.resolve()
    # Refused here, before starting Python again, when a live process trains in the folder;
    # train.py takes the lock itself (a stale one is taken over there, in one line). A run
    # sent to a cluster (its folder records the job: jobs.json) is train.py's to judge: it
    # attaches to the job still holding the folder, or submits it again.
    path = RunDir(run_dir).lock_path
    holder = None if SweepDir(run_dir).jobs_path.is_file() else live_holder(path, me())
    if holder is not None:
        raise RunLocked(busy_message(path, holder))
    train, cwd = train_command(run_dir)
    command = [*train, *saved_overrides(run_dir), *extra, f"hydra.run.dir={run_dir}"]
    # The command goes to stdout, like rerun's: it is what this command produces.
    print("resuming:", shlex.join(command), flush=True)
    return subprocess.call(command, cwd=cwd)


def rerun(run_dir: Path, extra: list[str], execute: bool = False) -> int:
    """Print the command that reproduces the run (stdout: it can be piped into a shell), and
    run it when `execute`."""
    run_dir = run_dir.resolve()
    train, cwd = train_command(run_dir)
    command = [*train, *saved_overrides(run_dir), *extra]
    for note in differences(run_dir):
        log.warning("warning: %s", note)
    print(shlex.join(command), flush=True)
    if execute:
        return subprocess.call(command, cwd=cwd)
    return 0
