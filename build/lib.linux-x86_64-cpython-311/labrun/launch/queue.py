"""`labrun queue [--json]`: the lab's view of its SLURM cluster in one command.

- GPUs in use per user and per account (running jobs' allocated `gres/gpu`);
- each user's fair-share factor and usage (sshare), the reason the next job of a light user
  starts before a heavy user's;
- pending jobs: priority, reason and expected start (`squeue --start`);
- the user's own labrun sweeps (labrun marks its jobs at submission with the comment
  `labrun:SWEEP_DIR`), with the state of their jobs;
- nodes that are down, drained or failing, with the reason.

Everything is asked of SLURM's scheduler (core/scheduler/slurm.py: SLURM's own commands), so
it works against any SLURM cluster; this module adds the view up and shows it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict
from typing import Any

from labrun.core import probes
from labrun.core.errors import LabrunError
from labrun.core.scheduler.slurm import SlurmScheduler, gpus_in_tres
from labrun.launch import SLURM_COMMENT_PREFIX


def collect(user: str) -> dict[str, Any]:
    cluster = SlurmScheduler()
    try:
        all_jobs = cluster.queue_jobs()
        pending = cluster.pending(all_jobs)
        shares = cluster.fair_share()
        down = cluster.troubled_nodes()
    except probes.SlurmError as error:
        if error.kind in ("missing", "unconfigured"):
            raise LabrunError(f"{error}; run labrun queue on a login node") from None
        raise LabrunError(f"{error}; is the SLURM controller up? (labrun doctor)") from None
    by_user: Counter[str] = Counter()
    by_account: Counter[str] = Counter()
    for job in all_jobs:
        if job["State"] == "RUNNING":
            gpus = gpus_in_tres(job["tres-alloc"])
            by_user[job["UserName"]] += gpus
            by_account[job["Account"]] += gpus
    sweeps: dict[str, Counter[str]] = defaultdict(Counter)
    for job in all_jobs:
        if job["UserName"] == user and job["Comment"].startswith(SLURM_COMMENT_PREFIX):
            sweeps[job["Comment"][len(SLURM_COMMENT_PREFIX):]][job["State"].lower()] += \
                job["Count"]
    return {
        "gpus_in_use": {"by_user": dict(by_user), "by_account": dict(by_account)},
        "fair_share": [asdict(share) for share in shares],
        "pending": [asdict(job) for job in pending],
        "sweeps": [{"sweep_dir": folder, "jobs": dict(states)}
                   for folder, states in sorted(sweeps.items())],
        "nodes_down": down,
        "user": user,
    }


def show(view: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    gpus = Table(title="GPUs in use")
    gpus.add_column("user or account")
    gpus.add_column("GPUs", justify="right")
    for kind in ("by_user", "by_account"):
        for name, count in sorted(view["gpus_in_use"][kind].items()):
            gpus.add_row(f"{kind[3:]} {name}", str(count))
    console.print(gpus)

    shares = Table(title="Fair share (factor 1.0: nothing used yet; lower: used more)")
    for column in ("account", "user", "share", "usage", "factor"):
        shares.add_column(column)
    for row in sorted(view["fair_share"], key=lambda r: (r["account"], r["user"])):
        factor = "-" if row["fairshare"] is None else f"{row['fairshare']:.3f}"
        shares.add_row(row["account"], row["user"], f"{row['share']:.2f}", str(row["usage"]),
                       factor)
    console.print(shares)

    pending = Table(title="Pending jobs, highest priority first")
    for column in ("job", "jobs", "GPUs", "user", "account", "qos", "priority", "reason",
                   "expected start"):
        pending.add_column(column)
    for row in view["pending"]:
        pending.add_row(row["job_id"], str(row["jobs"]), str(row["gpus"]), row["user"],
                        row["account"], row["qos"], str(row["priority"]), row["reason"],
                        row["expected_start"])
    console.print(pending)

    sweeps = Table(title=f"labrun sweeps of {view['user']}")
    sweeps.add_column("sweep folder")
    sweeps.add_column("jobs")
    for sweep in view["sweeps"]:
        sweeps.add_row(sweep["sweep_dir"],
                       ", ".join(f"{n} {state}" for state, n in sorted(sweep["jobs"].items())))
    console.print(sweeps)

    if view["nodes_down"]:
        nodes = Table(title="Nodes down or drained")
        for column in ("node", "state", "reason"):
            nodes.add_column(column)
        for row in view["nodes_down"]:
            nodes.add_row(row["node"], row["state"], row["reason"])
        console.print(nodes)
    else:
        console.print("every node is up")
