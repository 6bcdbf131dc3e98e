"""`labrun resume RUN_DIR` and `labrun rerun RUN_DIR [--exec]`.

resume: continue an interrupted run in its own folder, with the overrides it was started with
        (checkpoint.resume=auto picks up its newest valid checkpoint).
rerun:  reproduce a run from scratch in a new folder; prints the command (or runs it with
        --exec) and warns when the code or the packages differ from the recorded ones.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from labrun.core.errors import LabrunError
from labrun.core.project import PROJECT_DIR
from labrun.runs import provenance


def configure(parser, name: str) -> None:
    parser.add_argument("run_dir", type=Path, help="the run folder (outputs/DATE/TIME-XXXX)")
    if name == "rerun":
        parser.add_argument("--exec", action="store_true", help="run the command, too")
    parser.add_argument("extra", nargs="*", help="more overrides, e.g. trainer.max_epochs=20")


def saved_overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        raise LabrunError(f"{run_dir} is not a labrun run folder (no .hydra/overrides.yaml)")
    overrides = yaml.safe_load(path.read_text()) or []
    # The folder is chosen again by the command; everything else is the run's own settings.
    return [o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep."))]


def train_command(run_dir: Path) -> tuple[list[str], Path]:
    """The interpreter and train.py that started the run, and the folder it started in, so
    relative paths in its config mean the same again (this project's, if not recorded)."""
    command_file = run_dir / "provenance" / "command.json"
    python, script, cwd = sys.executable, PROJECT_DIR / "train.py", PROJECT_DIR
    if command_file.is_file():
        recorded = json.loads(command_file.read_text())
        recorded_script = Path(recorded["cwd"]) / recorded["argv"][0]
        if recorded_script.is_file():
            script = recorded_script
        if Path(recorded["executable"]).is_file():
            python = recorded["executable"]
        if Path(recorded["cwd"]).is_dir():
            cwd = Path(recorded["cwd"])
    return [python, str(script)], cwd


def differences(run_dir: Path) -> list[str]:
    """What differs between the recorded environment and this one, in words."""
    notes = []
    git_file = run_dir / "provenance" / "git.json"
    if git_file.is_file():
        recorded = json.loads(git_file.read_text())
        now = provenance.git_state(PROJECT_DIR)
        if recorded.get("commit") and recorded["commit"] != now["commit"]:
            notes.append(f"git commit differs: run {recorded['commit'][:10]}, "
                         f"now {str(now['commit'])[:10]}")
        if recorded.get("dirty"):
            notes.append(f"the run had uncommitted changes: {run_dir}/provenance/git.diff")
    packages_file = run_dir / "provenance" / "packages.txt"
    if packages_file.is_file():
        recorded = set(packages_file.read_text().split())
        now = set(provenance.installed_packages())
        changed = sorted({p.split("==")[0] for p in recorded ^ now})
        if changed:
            notes.append(f"{len(changed)} packages differ: {', '.join(changed[:8])}"
                         f"{'...' if len(changed) > 8 else ''}")
    return notes


def run(args) -> int:
    run_dir = args.run_dir.resolve()
    overrides = saved_overrides(run_dir) + list(args.extra)
    train, cwd = train_command(run_dir)
    command = train + overrides
    if args.command == "resume":
        command.append(f"hydra.run.dir={run_dir}")
        print("resuming:", shlex.join(command), flush=True)
        return subprocess.call(command, cwd=cwd)
    for note in differences(run_dir):
        print(f"warning: {note}", file=sys.stderr)
    print(shlex.join(command))
    if args.exec:
        return subprocess.call(command, cwd=cwd)
    return 0
