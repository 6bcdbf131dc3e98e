"""provenance/: what a run needs to be reproduced on another machine.

    git.json          the project: its name and folder, and the commit, branch and dirty flag
                      of its working tree
    git.diff          the project's uncommitted changes (tracked files), when its tree is dirty
    labrun.json       the labrun that ran: its version and folder, and where that folder is a
                      git checkout (installed editable, or a job's snapshot of labrun's own
                      repository) its commit, branch and dirty flag
    labrun.diff       that checkout's uncommitted changes, when it is dirty
    site.json         the lab's layer (LABRUN_SITE): its conf/ folder and the sha256 of each of
                      its files the run's config was composed from; absent without one
    packages.txt      installed distributions, `name==version`, read with importlib.metadata
    environment.json  python, torch, CUDA, cuDNN, NCCL, GPUs and driver, host, container,
                      the scheduler's ids (core.environment)
    command.json      the exact command line, working directory and Hydra overrides
    weights.json      where the starting weights came from (model.pretrained's library and
                      name, or model.init_from's file), the file loaded and its sha256
    split.json        how an image dataset's val split was drawn: dataset.split_seed, and
                      dataset.num_folds and dataset.fold for cross-validation

Secrets never land here: command-line values of keys that look like credentials are redacted,
and no environment variable is recorded except the scheduler's ids (SLURM's job, array and
task ids, node list and task count).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import labrun
from labrun.core import environment as where
from labrun.core import probes
from labrun.core.project import project_name
from labrun.core.secrets import redact

# The files of a run's provenance/ folder (RunDir.provenance_dir).
GIT, GIT_DIFF, PACKAGES = "git.json", "git.diff", "packages.txt"
LABRUN, LABRUN_DIFF, SITE = "labrun.json", "labrun.diff", "site.json"
SITE_PROVIDER = "labrun-site"  # the lab's folder on Hydra's search path (hydra_plugins/)
ENVIRONMENT, COMMAND = "environment.json", "command.json"
WEIGHTS = "weights.json"  # the starting weights' source, file and sha256 (fine-tuning)
SPLIT = "split.json"  # how the val split was drawn: split_seed, num_folds, fold
# Set inside a cluster.container job by its task script or batch script (launch/container.py).
CONTAINER_IMAGE_ENV, CONTAINER_DIGEST_ENV = "LABRUN_CONTAINER_IMAGE", "LABRUN_CONTAINER_DIGEST"


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(cwd: Path) -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    if commit is None:
        return {"commit": None, "branch": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd) or ""
    return {"commit": commit.strip(),
            "branch": (_git("rev-parse", "--abbrev-ref", "HEAD", cwd=cwd) or "").strip(),
            "dirty": bool(status.strip())}


def labrun_state() -> dict[str, Any]:
    """The labrun this process runs: its version and folder, and the git state of the
    checkout that folder is in (src/labrun of a repository), None for an installed package."""
    package = Path(labrun.__file__).resolve().parent
    checkout = package.parents[1]
    in_checkout = package.parent.name == "src" and (checkout / ".git").exists()
    state = git_state(checkout) if in_checkout else {"commit": None, "branch": None,
                                                     "dirty": None}
    return {"version": labrun.__version__, "path": str(package),
            "checkout": str(checkout) if in_checkout else None, **state}


def site_files(composed: dict[str, Any]) -> dict[str, Any] | None:
    """The lab's layer the run was composed with: its conf/ folder and the sha256 of each of
    its files among the run's choices (`composed`: Hydra's config sources and choices), None
    without one."""
    folders = [source["path"] for source in composed.get("sources", [])
               if source["provider"] == SITE_PROVIDER]
    if not folders:
        return None
    folder = Path(folders[0])
    files = {}
    for group, option in composed.get("choices", {}).items():
        path = folder / group.split("@")[0] / f"{option}.yaml"
        if option is not None and path.is_file():
            files[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"conf": str(folder), "files": dict(sorted(files.items()))}


def installed_packages() -> list[str]:
    """Name==version of every installed distribution, as pip freeze names them.

    Read from the header lines of each METADATA alone: `dist.metadata` parses the whole file
    as an e-mail message (long descriptions included), which took 0.35 s of every run's start
    for 145 packages; the headers take 0.01 s and give the same list."""
    names = {}
    for dist in importlib.metadata.distributions():
        name = version = None
        for line in (dist.read_text("METADATA") or dist.read_text("PKG-INFO") or "").splitlines():
            if not line.strip():
                break  # the headers end at the first blank line
            if line.startswith("Name: "):
                name = line[6:].strip()
            elif line.startswith("Version: "):
                version = line[9:].strip()
        if name:
            names[name.lower()] = f"{name}=={version}"
    return sorted(names.values(), key=str.lower)


def environment() -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    here = where.read()
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "labrun": str(Path(__file__).resolve().parent),  # which copy of the code ran
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "driver": probes.gpu_driver_version() if cuda else None,
        "container": here.container,
        # What cluster.container ran the job in, as its task script names it (launch/container.py).
        "container_image": os.environ.get(CONTAINER_IMAGE_ENV),
        "container_digest": os.environ.get(CONTAINER_DIGEST_ENV),
        # Under the scheduler's own names (SLURM_JOB_ID...); the key keeps the name it had
        # when SLURM was the only scheduler, for whoever reads these files.
        "slurm": dict(here.scheduler_variables),
    }
    return env


def write(folder: Path, overrides: list[str], project_dir: Path, argv: list[str], cwd: str,
          weights: dict[str, Any] | None = None, split: dict[str, Any] | None = None,
          composed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write provenance/ and return what W&B and the checkpoint also record; `argv` and
    `cwd`: the command that started the run, and where (`labrun rerun` runs it again);
    `weights`: where its starting weights came from (source, file, sha256), if not random;
    `split`: how its val split was drawn, where the dataset draws one; `composed`: the
    config sources and choices Hydra composed the run's config from."""
    folder.mkdir(parents=True, exist_ok=True)
    git = {"project": project_name(project_dir), "path": str(project_dir),
           **git_state(project_dir)}
    (folder / GIT).write_text(json.dumps(git, indent=2) + "\n")
    if git["dirty"]:
        (folder / GIT_DIFF).write_text(_git("diff", "HEAD", cwd=project_dir) or "")
    tool = labrun_state()
    (folder / LABRUN).write_text(json.dumps(tool, indent=2) + "\n")
    if tool["dirty"] and tool["checkout"] != str(project_dir):  # else git.diff has it
        (folder / LABRUN_DIFF).write_text(_git("diff", "HEAD", cwd=Path(tool["checkout"])) or "")
    site = site_files(composed or {})
    if site is not None:
        (folder / SITE).write_text(json.dumps(site, indent=2) + "\n")
    (folder / PACKAGES).write_text("\n".join(installed_packages()) + "\n")
    env = environment()
    (folder / ENVIRONMENT).write_text(json.dumps(env, indent=2) + "\n")
    command = {"argv": [redact(a) for a in argv], "executable": sys.executable,
               "cwd": cwd, "overrides": [redact(o) for o in overrides]}
    (folder / COMMAND).write_text(json.dumps(command, indent=2) + "\n")
    if weights is not None:
        (folder / WEIGHTS).write_text(json.dumps(weights, indent=2) + "\n")
    if split is not None:
        (folder / SPLIT).write_text(json.dumps(split, indent=2) + "\n")
    started = ({"weights": weights["source"], "weights_sha256": weights["sha256"]}
               if weights else {})
    return {**started, "project": git["project"], "git_commit": git["commit"],
            "git_dirty": git["dirty"], "labrun": tool["version"], "host": env["hostname"],
            "slurm_job_id": where.read().job_id, "torch": env["torch"],
            "cuda": env["cuda"]}


def read_weights(folder: Path) -> dict[str, Any] | None:
    """weights.json of a provenance folder: None for a run from random weights (or one whose
    record is unreadable)."""
    try:
        return json.loads((folder / WEIGHTS).read_text())
    except (OSError, ValueError):
        return None
