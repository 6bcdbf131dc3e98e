"""What lies around labrun on this machine: W&B login, SLURM, free disk, the project's config."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

from labrun.core import probes
from labrun.core.errors import one_line
from labrun.core.project import LABRUN_CONF
from labrun.core.scheduler import SlurmScheduler
from labrun.doctor.report import FAILED, OK, WARNING, Check

LOW_DISK_GIB, MIN_DISK_GIB = 10, 1


def check_wandb() -> Check:
    """Logged in or offline, read from the environment and ~/.netrc; the key is never shown."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        return Check("wandb", WARNING, "wandb not installed", "pip install -e .")
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled"):
        return Check("wandb", OK, f"WANDB_MODE={mode}: runs stay local (wandb sync later)")
    login = probes.wandb_login()
    if login.source == "WANDB_API_KEY":
        # Only the server can tell whether the key is valid, and doctor contacts no server:
        # a set key is reported as exactly that, never as "logged in".
        return Check("wandb", WARNING, "key set (WANDB_API_KEY), not verified",
                     "wandb login --verify checks the key against the server")
    if login.logged_in:
        return Check("wandb", OK, f"logged in to {login.host} ({login.netrc})")
    if login.error:
        return Check("wandb", WARNING, f"{login.netrc} unreadable: {login.error}",
                     "fix the file's syntax/permissions, or run: wandb login")
    return Check("wandb", WARNING, f"not logged in to {login.host}: logger=wandb runs offline",
                 "wandb login (or export WANDB_MODE=offline to make offline explicit)")


# What to do when SLURM cannot be asked, by probes.SlurmError.kind: (fix, partition fix).
SLURM_FIXES = {
    "missing": ("install slurm-client, or use cluster=local", "install slurm-client"),
    "unconfigured": ("put the cluster's slurm.conf in /etc/slurm/ (or set SLURM_CONF), or use "
                     "cluster=local", "set up the SLURM client first"),
    "timeout": ("is slurmctld up? (scripts/slurm_up.sh for the dev cluster); "
                "check /etc/slurm/slurm.conf and munge", "bring the SLURM controller up first"),
}
SLURM_FIXES["failed"] = SLURM_FIXES["timeout"]


def check_slurm(partition: str | None, partition_from: str) -> list[Check]:
    # With a configured partition the user means to submit: problems are failures then.
    severity = FAILED if partition else WARNING
    skipped = Check("slurm partition", WARNING, f"no partition to check ({partition_from})",
                    "pass --partition NAME, or set it in conf/cluster/lab.yaml")
    try:
        nodes = SlurmScheduler(timeout=20).nodes()
    except probes.SlurmError as error:
        fix, partition_fix = SLURM_FIXES[error.kind]
        detail = ("sinfo not found: SLURM client not installed" if error.kind == "missing"
                  else one_line(error))
        return [Check("slurm", severity, detail, fix),
                skipped if partition is None else
                Check("slurm partition", FAILED, f"{partition}: cannot ask SLURM", partition_fix)]
    # Per partition: how many nodes are in which state, in sinfo's order.
    states: dict[str, Counter[tuple[str, str]]] = {}
    for node in nodes:
        states.setdefault(node.partition, Counter())[(node.state, node.available)] += 1
    partitions = {name: [f"{n} node(s) {state}, {available}"
                         for (state, available), n in counts.items()]
                  for name, counts in states.items()}
    result = [Check("slurm", OK, f"sinfo ok; partitions: {', '.join(sorted(partitions)) or 'none'}")]
    if partition is None:
        return result + [skipped]
    if partition not in partitions:
        return result + [Check("slurm partition", FAILED,
                               f"{partition} ({partition_from}) does not exist",
                               f"use one of: {', '.join(sorted(partitions))}")]
    return result + [Check("slurm partition", OK,
                           f"{partition} ({partition_from}): {'; '.join(partitions[partition])}")]


def check_disk(folders: dict[str, Path]) -> list[Check]:
    checks = []
    for label, folder in folders.items():
        existing = folder.resolve()
        while not existing.exists():  # a folder made on first use: measure its parent's disk
            existing = existing.parent
        free = shutil.disk_usage(existing).free / 2**30
        detail = f"{folder}: {free:.1f} GiB free"
        if free < MIN_DISK_GIB:
            checks.append(Check(f"disk {label}", FAILED, detail,
                                "free space, or point paths at a bigger disk (LABRUN_*_DIR)"))
        elif free < LOW_DISK_GIB:
            checks.append(Check(f"disk {label}", WARNING, f"{detail} (under {LOW_DISK_GIB} GiB)",
                                "free space before long runs: checkpoints add up"))
        else:
            checks.append(Check(f"disk {label}", OK, detail))
    return checks


def load_project_context(partition: str | None) -> dict:
    """Output and data folders and the SLURM partition, from conf/ when it can be composed."""
    conf = next((d for d in (Path.cwd() / "conf", LABRUN_CONF) if d.is_dir()), None)
    folders = {"outputs": Path(os.environ.get("LABRUN_OUTPUT_ROOT", "outputs")),
               "data": Path(os.environ.get("LABRUN_DATA_DIR", "data"))}
    context = {"folders": folders, "partition": partition,
               "partition_from": "--partition" if partition else "no lab cluster config"}
    if conf is None:
        return context
    try:
        cfg = compose_config(conf, lab=(conf / "cluster" / "lab.yaml").is_file())
    except Exception as error:  # noqa: BLE001 - a broken config must not stop the doctor
        context["partition_from"] = f"conf/ does not compose: {one_line(error)}"
        return context
    from omegaconf import OmegaConf

    folders["outputs"] = Path(cfg.paths.output_root)
    folders["data"] = Path(cfg.paths.data_dir)
    if partition is None:
        for key in ("cluster.partition", "hydra.launcher.partition"):
            value = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
            if value:
                context["partition"], context["partition_from"] = str(value), f"lab config {key}"
                break
    return context


def compose_config(conf: Path, lab: bool):
    from hydra import compose, initialize_config_dir

    from labrun.config import schema as config

    config.register()
    with initialize_config_dir(str(conf.resolve()), version_base="1.3"):
        return compose("train", overrides=["cluster=lab"] if lab else [],
                       return_hydra_config=True)
