"""`labrun queue [--json]`: the lab's view of its SLURM cluster in one command.

- GPUs in use per user and per account (running jobs' allocated `gres/gpu`);
- each user's fair-share factor and usage (sshare), the reason the next job of a light user
  starts before a heavy user's;
- pending jobs: priority, reason and expected start (`squeue --start`);
- the user's own labrun sweeps (labrun marks its jobs at submission with the comment
  `labrun:SWEEP_DIR`), with the state of their jobs;
- nodes that are down, drained or failing, with the reason.

Everything is read from SLURM's own commands (squeue, sshare, sinfo), so it works against any
SLURM cluster. No library wraps these commands (pyslurm needs a matching libslurm build), so
their `|`-separated output is parsed here.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from labrun.core import probes
from labrun.core.errors import LabrunError
from labrun.launch import SLURM_COMMENT_PREFIX

DOWN_STATES = "down,drain,draining,fail,no_respond"




def slurm(*args: str) -> list[list[str]]:
    """The rows of a SLURM command's `|`-separated, header-less output (core.probes asks)."""
    try:
        return probes.slurm_rows(*args)
    except probes.SlurmError as error:
        if error.kind in ("missing", "unconfigured"):
            raise LabrunError(f"{error}; run labrun queue on a login node") from None
        raise LabrunError(f"{error}; is the SLURM controller up? (labrun doctor)") from None


def gpus_of(tres: str) -> int:
    """GPUs in a TRES string such as `cpu=16,mem=64G,node=1,billing=16,gres/gpu=2`."""
    total = 0
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == "gres/gpu" and value.isdigit():  # gres/gpu:a100=2 is the same GPUs again
            total += int(value)
    return total


JOB_FIELDS = ["JobID", "UserName", "Account", "QOS", "State", "tres-alloc", "Reason",
              "PriorityLong", "Comment", "Name", "Partition"]


def jobs() -> list[dict[str, str]]:
    rows = slurm("squeue", "-h", "-O", ",".join(f"{f}:|" for f in JOB_FIELDS))
    return [dict(zip(JOB_FIELDS, row, strict=False)) for row in rows]


def pending_starts() -> dict[str, str]:
    """Expected start of each pending job (`squeue --start`; N/A when SLURM cannot tell)."""
    rows = slurm("squeue", "-h", "--start", "-t", "PD", "-o", "%i|%S")
    return {row[0]: row[1] for row in rows if len(row) == 2}


def fair_share() -> list[dict[str, Any]]:
    """One row per user and account: the share, the usage and the fair-share factor
    (1 = has used nothing of its share, towards 0 = has used far more than its share)."""
    rows = slurm("sshare", "-a", "-n", "-P", "-o",
                 "Account,User,RawShares,NormShares,RawUsage,EffectvUsage,FairShare")
    result = []
    for account, user, _, norm, raw, effective, factor in (r[:7] for r in rows if len(r) >= 7):
        if not user:  # the account's own line; its users follow
            continue
        result.append({"account": account, "user": user, "share": float(norm or 0),
                       "usage": int(raw or 0), "effective_usage": float(effective or 0),
                       "fairshare": float(factor) if factor else None})
    return result


def troubled_nodes() -> list[dict[str, str]]:
    rows = slurm("sinfo", "-h", "-N", "-t", DOWN_STATES, "-o", "%N|%T|%E")
    seen, result = set(), []
    for node, state, reason in (r[:3] for r in rows if len(r) >= 3):
        if node not in seen:  # a node in two partitions is listed twice
            seen.add(node)
            result.append({"node": node, "state": state, "reason": reason})
    return result


def collect(user: str) -> dict[str, Any]:
    all_jobs = jobs()
    starts = pending_starts()
    by_user: Counter[str] = Counter()
    by_account: Counter[str] = Counter()
    for job in all_jobs:
        if job["State"] == "RUNNING":
            gpus = gpus_of(job["tres-alloc"])
            by_user[job["UserName"]] += gpus
            by_account[job["Account"]] += gpus
    pending = [{"job_id": j["JobID"], "user": j["UserName"], "account": j["Account"],
                "qos": j["QOS"], "priority": int(j["PriorityLong"] or 0),
                "reason": j["Reason"], "expected_start": starts.get(j["JobID"], "N/A"),
                "name": j["Name"]}
               for j in all_jobs if j["State"] == "PENDING"]
    pending.sort(key=lambda p: -p["priority"])
    sweeps: dict[str, Counter[str]] = defaultdict(Counter)
    for job in all_jobs:
        if job["UserName"] == user and job["Comment"].startswith(SLURM_COMMENT_PREFIX):
            sweeps[job["Comment"][len(SLURM_COMMENT_PREFIX):]][job["State"].lower()] += 1
    return {
        "gpus_in_use": {"by_user": dict(by_user), "by_account": dict(by_account)},
        "fair_share": fair_share(),
        "pending": pending,
        "sweeps": [{"sweep_dir": folder, "jobs": dict(states)}
                   for folder, states in sorted(sweeps.items())],
        "nodes_down": troubled_nodes(),
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
    for column in ("job", "user", "account", "qos", "priority", "reason", "expected start"):
        pending.add_column(column)
    for row in view["pending"]:
        pending.add_row(row["job_id"], row["user"], row["account"], row["qos"],
                        str(row["priority"]), row["reason"], row["expected_start"])
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
