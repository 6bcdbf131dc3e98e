"""`labrun new NAME [--task classification|lm|segmentation]`: a new project of the lab, a
repository of its own that depends on labrun by version.

The files are template/'s, with {{name}}, {{package}} and the rest filled in (a file or folder
named PACKAGE takes the package's name, dot-NAME becomes .NAME, and every file's .tmpl suffix,
which keeps tools that read labrun's sources away from them, is dropped): the guide's layout (data/raw,
data/processed, src/PACKAGE with a model, a dataset loader and preprocess.py), conf/ with the
project's own groups and an experiment preset, a train.py of a few lines, a smoke test, a
Makefile and README with `make train` and `make test`, .gitignore, the pre-commit hooks and the
pull request's config review. Then a first git commit, under the person's git identity or, where
git has none, a stand-in one, so that it works on a fresh machine.

With --task, the project also gets a task of its own: a subclass of that built-in task in
src/PACKAGE/task.py and conf/task/PACKAGE.yaml, chosen by the project's defaults. A language
model or a segmentation task starts on labrun's own data and model for it (dataset=python_docs,
model=gpt; dataset=shapes, model=unet), said in its conf/project/default.yaml.
"""

from __future__ import annotations

import getpass
import keyword
import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import labrun
from labrun.core.errors import LabrunError

TEMPLATE = Path(__file__).with_name("template")
NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class TaskKind:
    base: str  # the built-in task class the project's task subclasses
    dataset: str  # the project's default dataset and model options
    model: str


TASKS = {"classification": TaskKind("Classification", "PACKAGE", "PACKAGE"),
         "lm": TaskKind("LanguageModelling", "python_docs", "gpt"),
         "segmentation": TaskKind("Segmentation", "shapes", "unet")}

TASK_MODULE = '''"""The project's task: labrun's {base}, to change where the project needs (the loss, the
metrics, how a batch reaches the device: labrun.train.task's protocol, docs/plugins.md). Its
deploy hooks stay {base}'s (its `deploy` attribute) until the project names its own."""

from labrun.train.task import {base}


class Task({base}):
    pass
'''
TASK_CONFIG = '''# @package _global_
# The project's task (src/{package}/task.py), judged as labrun's task={kind} is.
defaults:
  - /task/{kind}@_here_
  - _self_

task:
  _target_: {package}.task.Task
'''


def new(name: str, folder: Path | None = None, task: str | None = None) -> Path:
    """The project NAME made in `folder` (default: ./NAME), committed; its folder."""
    package = name.replace("-", "_")
    if not NAME.fullmatch(package) or keyword.iskeyword(package):
        raise LabrunError(f"{name}: a project's name is its Python package's: lowercase letters, "
                          f"digits, '_' or '-', starting with a letter (e.g. plant-disease)")
    if task is not None and task not in TASKS:
        raise LabrunError(f"--task {task}: choose one of {', '.join(TASKS)}")
    folder = folder or Path(name)
    if folder.exists() and any(folder.iterdir()):
        raise LabrunError(f"{folder} exists and is not empty; give a new folder (--dir)")
    kind = TASKS[task or "classification"]
    values = {"name": name, "package": package, "labrun_version": labrun.__version__,
              "labrun_range": version_range(labrun.__version__),
              "dataset": kind.dataset.replace("PACKAGE", package),
              "model": kind.model.replace("PACKAGE", package),
              "task_default": f"\n  - override /task: {package}" if task else "",
              "task_line": ", task.py" if task else ""}
    for source in sorted(TEMPLATE.rglob("*")):
        if source.is_file() and "__pycache__" not in source.parts:
            target = folder / place(source.relative_to(TEMPLATE), package)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(fill(source.read_text(), values))
    if task is not None:
        (folder / "src" / package / "task.py").write_text(TASK_MODULE.format(base=kind.base))
        task_config = folder / "conf" / "task" / f"{package}.yaml"
        task_config.parent.mkdir(parents=True, exist_ok=True)
        task_config.write_text(TASK_CONFIG.format(package=package, kind=task))
    for data in ("raw", "processed"):
        (folder / "data" / data).mkdir(parents=True, exist_ok=True)
    first_commit(folder)
    return folder


def place(relative: Path, package: str) -> Path:
    """A template file's path in the project: PACKAGE named, dot-NAME a dotfile, no .tmpl."""
    parts = [part.replace("PACKAGE", package) for part in relative.with_suffix("").parts]
    return Path(*[f".{part[4:]}" if part.startswith("dot-") else part for part in parts])


def fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():  # only these names: GitHub's ${{ ... }} stays
        text = text.replace(f"{{{{{key}}}}}", value)
    return text


def version_range(version: str) -> str:
    """Compatible releases of the labrun that made the project: from its own version (its
    public part: 0.1.dev57 from 0.1.dev57+g456f9af, which a >=0.1 would exclude) up to the next
    major release (below 1.0, the next minor one: a minor release may break)."""
    numbers = [int(n) for n in re.findall(r"\d+", version)[:2]] + [0, 0]
    major, minor = numbers[:2]
    upper = f"{major + 1}" if major else f"0.{minor + 1}"
    return f">={version.split('+')[0]},<{upper}"


def first_commit(folder: Path) -> None:
    """`git init` and a first commit, with a stand-in identity where git has none."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True,
                              timeout=60)

    if git("init", "-q").returncode != 0:
        raise LabrunError(f"{folder}: git init failed; is git installed?")
    identity = []
    if not git("config", "user.email").stdout.strip():
        user = getpass.getuser()
        identity = ["-c", f"user.name={user}", "-c", f"user.email={user}@{socket.gethostname()}"]
    git("add", "-A")
    done = git(*identity, "commit", "-q", "-m", "New labrun project (labrun new)")
    if done.returncode != 0:
        raise LabrunError(f"{folder}: the first commit failed: {done.stderr.strip()[:200]}")
