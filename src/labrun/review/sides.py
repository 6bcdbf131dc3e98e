"""The two sides of a config review: a git revision's conf/, src/ and pyproject.toml (read
with `git archive` into a temporary folder, never touching the work tree) or the work tree
itself, each composed by labrun.review.compose_side in a subprocess with that side's src/ first
on PYTHONPATH.

A side whose conf/ holds the primary config (labrun's own repository) is composed from it. A
project's conf/ is a layer over labrun's groups: its side is composed from the installed
labrun's groups, run in the side's folder, where its pyproject.toml makes it the project whose
conf/ the search path plugin puts first (hydra_plugins/labrun_launcher/labrun_project.py), as
`labrun train` composes it. Both of a project's sides use the one installed labrun: reviewing a
labrun upgrade itself is out of scope."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labrun.core.errors import LabrunError, first_line
from labrun.core.project import LABRUN_CONF

ENTRY = "labrun.review.compose_side"
ENTRY_FILE = Path(__file__).with_name("compose_side.py")
# Today's copy of the entry for a revision older than it: a top-level module in that side's
# temporary src/, so that its own labrun package stays the one imported.
FALLBACK = "_labrun_compose_side"
# Where a revision keeps its config tree: a project's conf/, or, in labrun's own repository
# since its configs are package data, src/labrun/conf/.
CONF_PLACES = ("conf", "src/labrun/conf")


@dataclass
class Side:
    """Where one side's config tree and code are; `rev` None is the work tree."""

    label: str
    root: Path
    rev: str | None = None
    commit: str | None = None

    @property
    def conf(self) -> Path:
        return next((self.root / place for place in CONF_PLACES if (self.root / place).is_dir()),
                    self.root / CONF_PLACES[0])

    @property
    def src(self) -> Path:
        return self.root / "src"

    def primary_dir(self, config_name: str) -> Path:
        """The folder composition starts from: this side's conf/ where it holds the primary
        config, else the installed labrun's groups (a project's side)."""
        return self.conf if (self.conf / f"{config_name}.yaml").is_file() else LABRUN_CONF


@dataclass
class Composed:
    """What compose_side printed for one side."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    facts: dict[str, list[bool]] | None = None


def git(repo: Path, *args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LabrunError(f"git {' '.join(args)} failed: {error}") from None
    if out.returncode != 0:
        raise LabrunError(f"git {' '.join(args)}: {first_line(out.stderr) or 'failed'}")
    return out.stdout


def repo_root(start: Path) -> Path:
    try:
        return Path(git(start, "rev-parse", "--show-toplevel").strip())
    except LabrunError:
        raise LabrunError(f"{start} is not in a git repository; run the review from the "
                          f"project's checkout or give --repo DIR") from None


def commit_of(repo: Path, rev: str) -> str:
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").strip()
    except LabrunError:
        raise LabrunError(f"{rev}: no such git revision in {repo}; give a branch, tag or "
                          f"commit (git log --oneline lists them)") from None


def is_revision(repo: Path, rev: str) -> bool:
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                         cwd=repo, capture_output=True, text=True, timeout=60)
    return out.returncode == 0


def default_base(repo: Path) -> str:
    """The merge base with origin/HEAD, else with main: what a pull request is compared to."""
    for upstream in ("origin/HEAD", "main"):
        if is_revision(repo, upstream):
            with contextlib.suppress(LabrunError):
                return git(repo, "merge-base", "HEAD", upstream).strip()
    raise LabrunError("no BASE given, and neither origin/HEAD nor main to take the merge base "
                      "with; give the revision to compare with: labrun configs review BASE")


@contextlib.contextmanager
def checkout(repo: Path, rev: str | None) -> Iterator[Side]:
    """The side at `rev` (None: the work tree). A revision's conf/ and src/ are extracted from
    `git archive` into a temporary folder, removed afterwards."""
    if rev is None:
        yield Side("work tree", repo)
        return
    commit = commit_of(repo, rev)
    present = git(repo, "ls-tree", "--name-only", commit).split()
    if "conf" not in present and not git(repo, "ls-tree", commit, CONF_PLACES[1]).strip():
        raise LabrunError(f"{rev} has no conf/ folder; give a revision of this project")
    with tempfile.TemporaryDirectory(prefix="labrun-review-") as folder:
        paths = [p for p in ("conf", "src", "pyproject.toml") if p in present]
        archive = subprocess.run(["git", "archive", "--format=tar", commit, "--", *paths],
                                 cwd=repo, capture_output=True, timeout=300)
        if archive.returncode != 0:
            raise LabrunError(f"git archive {rev}: {first_line(archive.stderr.decode())}")
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(folder, filter="data")
        yield Side(rev, Path(folder), rev, commit)


def start(side: Side, targets: list[dict[str, Any]], config_name: str) -> subprocess.Popen:
    """compose_side on `side` in a subprocess; finish() collects it (sides run in parallel)."""
    module = ENTRY
    if not (side.src / (ENTRY.replace(".", "/") + ".py")).is_file():
        side.src.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ENTRY_FILE, side.src / f"{FALLBACK}.py")
        module = FALLBACK
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(side.src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("LABRUN_RUN_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", module, str(side.primary_dir(config_name).resolve()), config_name,
         json.dumps(targets)],
        cwd=side.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc


def finish(side: Side, proc: subprocess.Popen, timeout: float = 600) -> Composed:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise LabrunError(f"composing the configs of {side.label} took over {timeout:.0f} s"
                          ) from None
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        raise LabrunError(f"composing the configs of {side.label} failed: {last}")
    data = json.loads(out)
    return Composed(results=data["results"], facts=data["facts"])


def compose_sides(pairs: list[tuple[Side, list[dict[str, Any]]]], config_name: str
                  ) -> list[Composed]:
    procs = [start(side, targets, config_name) for side, targets in pairs]
    return [finish(side, proc) for (side, _), proc in zip(pairs, procs, strict=True)]
