"""SLURM as labrun's modules ask about it: the one place that reads SLURM's variables in a job
and runs SLURM's commands (through core.probes, which finds slurm.conf and turns a command's
failure into a SlurmError).

No library wraps SLURM's commands (pyslurm needs a libslurm of the same build), so their
`|`-separated output is parsed here. Node lists (node[01-04],gpu7) are expanded with
python-hostlist rather than `scontrol show hostnames`, which most container images lack.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrun.core import probes
from labrun.core.scheduler.base import (
    ACTIVE_STATES,
    ClusterLimits,
    FairShare,
    NodeLimits,
    PendingJob,
    QosLimits,
    SchedulerJob,
)

# The SLURM variables a run records in provenance/environment.json: which job, which task.
RECORDED = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST",
            "SLURM_PROCID", "SLURM_NTASKS")
# Any port: connect() on a UDP socket only picks the route and the source address; it sends
# nothing.
PROBE_PORT = 6817
# The fields of every job `labrun queue` reads (squeue -O).
JOB_FIELDS = ["JobID", "UserName", "Account", "QOS", "State", "tres-alloc", "Reason", "SubmitTime",
              "PriorityLong", "Comment", "Name", "Partition", "ArrayTaskID"]
DOWN_STATES = "down,drain,draining,fail,no_respond"
# The longest job_alive waits for the controller: a run lock's holder is judged by it, and
# judging a lock waits no longer.
JOB_ALIVE_TIMEOUT_S = 15
# Every SLURM command labrun runs (here, and submitit's sbatch), for tools that count them
# (`labrun bench sweep`'s shims).
COMMANDS = ("squeue", "sacct", "scontrol", "sinfo", "sacctmgr", "sshare", "sbatch", "scancel",
            "srun")


def hostnames(nodelist: str) -> list[str]:
    """SLURM's compact node list (node[01-03],login1) as host names, in SLURM's order."""
    import hostlist  # python-hostlist; only a multi-node job without MASTER_ADDR needs it

    return hostlist.expand_hostlist(nodelist)


def host_in_allocation(env: Mapping[str, str], hostname: str | None = None) -> bool:
    """Whether this host is one of the nodes of the allocation `env` names: SLURMD_NODENAME
    (slurmd sets it in every step and batch script, whatever the host calls itself), or the
    short host name (`hostname`, default this machine's), within SLURM_JOB_NODELIST expanded.

    False is an allocation held from outside it: the shell salloc leaves on a login host
    (SLURM without LaunchParameters=use_interactive_step), where nothing runs on its nodes
    unless srun puts it there. An environment that names no nodes is taken at its word (SLURM
    names them in every job and allocation; only a hand-made environment lacks them)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return True
    import hostlist  # python-hostlist

    try:
        nodes = set(hostnames(nodelist))
    except hostlist.BadHostlist:
        return True  # not SLURM's syntax: nothing to judge by
    if env.get("SLURMD_NODENAME") in nodes:
        return True
    host = hostname if hostname is not None else socket.gethostname()
    return host in nodes or host.split(".")[0] in nodes


def _digits(value: str | None) -> int | None:
    return int(value) if value and value.isdigit() else None


@dataclass(frozen=True)
class SlurmNode:
    """One node of one partition (a node in two partitions appears twice)."""

    partition: str
    default: bool  # the partition jobs go to when they name none
    available: str  # the partition's state: up, down, drain, inact
    state: str  # the node's: idle, mixed, allocated, down...
    cpus: int
    mem_mb: int
    gpus: int


def gpus_in_gres(gres: str) -> int:
    """GPUs in sinfo's %G: gpu:4, gpu:a100:4 or gpu:a100:4(S:0-1): the count is the last field
    before "("."""
    counts = [g.split("(")[0].rsplit(":", 1)[-1] for g in gres.split(",") if g.startswith("gpu")]
    return sum(int(c) for c in counts if c.isdigit())


def gpus_in_tres(tres: str) -> int:
    """GPUs in a TRES string such as `cpu=16,mem=64G,node=1,billing=16,gres/gpu=2`."""
    total = 0
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == "gres/gpu" and value.isdigit():  # gres/gpu:a100=2 is the same GPUs again
            total += int(value)
    return total


def array_tasks(task_ids: str) -> int:
    """How many jobs a row of squeue stands for, from its ArrayTaskID: 0-5,9%2 is seven
    waiting array tasks (the %2 is the array's limit of running ones); one task's number, or
    N/A (no array), one."""
    tasks = re.sub(r"%\d+$", "", task_ids.strip())
    if not re.fullmatch(r"[\d,-]+", tasks):
        return 1
    return len(hostnames(f"t[{tasks}]"))


def _count(text: str) -> int:
    # sinfo writes e.g. "4+" for a range over nodes; a node-oriented query gives plain numbers.
    return _digits(text.rstrip("+")) or 0


class SlurmScheduler:
    name = "slurm"

    def __init__(self, slurm_conf: str | Path | None = None,
                 timeout: float = probes.SLURM_TIMEOUT_S):
        """`slurm_conf`: the file node_address reads the controller from (default: the one
        SLURM's commands read); `timeout`: the longest a command may take."""
        self.slurm_conf = slurm_conf
        self.timeout = timeout

    # -- in a job ----------------------------------------------------------------------------

    @staticmethod
    def read_job(env: Mapping[str, str]) -> SchedulerJob | None:
        job_id = env.get("SLURM_JOB_ID")
        if not job_id:  # unset or empty: not a SLURM job
            return None
        array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        tasks = _digits(env.get("SLURM_NTASKS")) or 1
        ranks = None
        if tasks > 1 and _digits(env.get("SLURM_PROCID")) is not None:
            # srun started one process per task: each is a rank.
            ranks = (int(env["SLURM_PROCID"]), _digits(env.get("SLURM_LOCALID")) or 0, tasks)
        nodelist = env.get("SLURM_JOB_NODELIST")
        return SchedulerJob(
            scheduler="slurm", job_id=job_id,
            queue_id=f"{array}_{task}" if array and task else job_id,
            restart_count=_digits(env.get("SLURM_RESTART_COUNT")) or 0,
            node_rank=_digits(env.get("SLURM_NODEID")),
            num_nodes=_digits(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or 1,
            ranks=ranks, first_node=hostnames(nodelist)[0] if nodelist else None,
            recorded={k: env[k] for k in RECORDED if k in env},
            tasks=_digits(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")),
            gpus_on_node=_digits(env.get("SLURM_GPUS_ON_NODE")) or 0,
            on_job_node=host_in_allocation(env), nodelist=nodelist or "")

    @staticmethod
    def outside_job(env: Mapping[str, str]) -> dict[str, str]:
        """`env` without the variables SLURM (and sbatch, and submitit) set in a job: for a
        process in a job that submits jobs of its own, which must not inherit them."""
        return {key: value for key, value in env.items()
                if not key.startswith(("SLURM_", "SBATCH_", "SUBMITIT_"))}

    @staticmethod
    def step_command(command: list[str], nodes: int, tasks_per_node: int,
                     env: Mapping[str, str] | None = None) -> list[str]:
        """`command` run as a step of the allocation this process holds (`env`'s, default this
        process's): srun with the run's own shape, `nodes` x `tasks_per_node` tasks, each a
        rank (read_job), and the allocation's CPUs per task, which srun 22.05 no longer takes
        from salloc by itself. Not --kill-on-bad-exit: a refusal in every task would then end
        as the SIGTERM of the tasks still refusing (exit 143), not as its own exit 2."""
        env = os.environ if env is None else env
        cpus = _digits(env.get("SLURM_CPUS_PER_TASK"))
        return ["srun", f"--nodes={nodes}", f"--ntasks={nodes * tasks_per_node}",
                f"--ntasks-per-node={tasks_per_node}",
                *([f"--cpus-per-task={cpus}"] if cpus else []), *command]

    def job_gpus(self, job_id: str) -> int:
        """The GPUs `job_id` was given on all its nodes together (the gres/gpu of its TRES; 0:
        none). What an salloc shell is not told: salloc --gres=gpu:N sets no variable there."""
        rows = self._rows("squeue", "-h", "-j", job_id, "-O", "tres-alloc:|")
        return gpus_in_tres(rows[0][0]) if rows else 0

    # A job's own id, in its batch script and in its tasks (each array element's own).
    JOB_ID_VARIABLE = "SLURM_JOB_ID"
    # What submitit runs in a job to requeue it (SlurmJobEnvironment._requeue): COMMAND VERB JOB.
    REQUEUE_COMMAND = ("scontrol", "requeue")

    @classmethod
    def requeue_line(cls, job: str) -> str:
        """The shell line that requeues `job` (a word of the shell: an id, "$VARIABLE")."""
        return " ".join([*cls.REQUEUE_COMMAND, job])

    # -- jobs --------------------------------------------------------------------------------

    @staticmethod
    def require_client() -> None:
        """SlurmError ("missing", "unconfigured") where this machine is no SLURM client at
        all; the controller is not asked (it may be down)."""
        probes.require_slurm_client("squeue")

    def _rows(self, *args: str, timeout: float | None = None) -> list[list[str]]:
        return probes.slurm_rows(*args, timeout=self.timeout if timeout is None else timeout)

    def job_alive(self, job_id: str) -> bool | None:
        try:
            state = self._queue_states([job_id], min(self.timeout, JOB_ALIVE_TIMEOUT_S)
                                       ).get(job_id)
        except probes.SlurmError:
            return None
        # Not listed: ended long enough ago that the controller forgot it.
        return state in ACTIVE_STATES

    def cancel(self, job_ids: Iterable[str]) -> None:
        """scancel: a running job gets SIGTERM (a checkpoint), then SIGKILL after KillWait."""
        ids = list(dict.fromkeys(str(i) for i in job_ids if i))
        if ids:
            self._rows("scancel", *ids)

    def job_states(self, job_ids: Iterable[str]) -> dict[str, str]:
        """The controller's view (squeue: fresh, and right about a job requeued a moment ago,
        which accounting still shows as failed), then accounting (sacct) for the jobs the
        controller has forgotten: two queries at most, whatever the number of jobs. Raises
        SlurmError when the controller cannot be asked; where accounting cannot (no
        slurmdbd), the jobs only it would know are left out."""
        ids = list(dict.fromkeys(str(i) for i in job_ids if i))
        if not ids:
            return {}
        states = self._queue_states(ids)
        forgotten = [i for i in ids if i not in states]
        if forgotten:
            try:
                states.update(self._accounting_states(forgotten))
            except probes.SlurmError:
                pass
        return {i: states[i] for i in ids if i in states}

    def job_whereabouts(self, job_id: str) -> tuple[str, str, str] | None:
        """(its state; why it waits, SLURM's pending reason: Priority, Resources, BeginTime...;
        the nodes it runs on) as squeue lists the job now; None when squeue does not list it."""
        try:
            rows = self._rows("squeue", "-h", "-j", job_id, "-o", "%T|%r|%N")
        except probes.SlurmError as error:
            if error.kind == "failed" and "invalid job id" in str(error).lower():
                return None  # ended, and the controller has forgotten it
            raise
        return (rows[0][0], rows[0][1], rows[0][2]) if rows and len(rows[0]) >= 3 else None

    def _queue_states(self, ids: list[str], timeout: float | None = None) -> dict[str, str]:
        """squeue's state of each job it lists, under both of its ids: ARRAYJOB_TASK (%i) and
        the element's own job id (%A, its SLURM_JOB_ID). -r: one row per array element, even
        for those still pending; -t all: jobs that ended a moment ago too."""
        try:
            rows = self._rows("squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids),
                              "-o", "%i|%A|%T", timeout=timeout)
        except probes.SlurmError as error:
            if error.kind == "failed" and "invalid job id" in str(error).lower():
                return {}  # none of them is known to the controller any more
            raise
        states = {}
        for queue_id, job_id, state in (r[:3] for r in rows if len(r) >= 3):
            states[queue_id] = states[job_id] = state
        return states

    def _accounting_states(self, ids: list[str]) -> dict[str, str]:
        rows = self._rows("sacct", "-n", "-X", "-P", "-o", "JobID,JobIDRaw,State",
                          "-j", ",".join(ids))
        states = {}
        for queue_id, job_id, state in (r[:3] for r in rows if len(r) >= 3):
            state = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0"
            # Array elements that never started are one row, 12_[3-5%2]: expanded (the %2
            # is the array's limit of running elements).
            for element in hostnames(re.sub(r"%\d+", "", queue_id)):
                states[element] = state
            states.setdefault(job_id, state)
        return states

    # -- this node -----------------------------------------------------------------------------

    def node_address(self) -> tuple[str | None, str]:
        """The kernel's route to the controller of slurm.conf names this node's interface that
        the controller (and a Prometheus beside it) reaches."""
        path = Path(self.slurm_conf) if self.slurm_conf else probes.slurm_conf()
        if path is None:
            return None, f"no SLURM configuration at {' or '.join(probes.slurm_conf_places())}"
        try:
            text = path.read_text()
        except OSError:
            return None, f"no SLURM configuration at {path}"
        controller = controller_address(text)
        if controller is None:
            return None, f"{path} names no SLURM controller (SlurmctldHost)"
        try:
            ip = ipaddress.ip_address(controller)
        except ValueError:
            # slurm.conf names the controller without its address: look the name up as slurmd
            # does (the controller's name only, never a compute node's).
            try:
                ip = ipaddress.ip_address(socket.getaddrinfo(controller, None)[0][4][0])
            except (OSError, IndexError) as error:
                return None, f"cannot resolve the SLURM controller {controller} ({error})"
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((str(ip), PROBE_PORT))
                return probe.getsockname()[0], ""
        except OSError as error:
            return None, f"no route to the SLURM controller {ip} ({error.strerror})"

    # -- the cluster ---------------------------------------------------------------------------

    def nodes(self) -> list[SlurmNode]:
        """Every node of every partition, from one sinfo query."""
        rows = self._rows("sinfo", "-h", "-N", "-o", "%P|%a|%T|%c|%m|%G")
        return [SlurmNode(partition.rstrip("*"), partition.endswith("*"), available, state,
                          _count(cpus), _count(mem), gpus_in_gres(gres))
                for partition, available, state, cpus, mem, gres in (r[:6] for r in rows
                                                                      if len(r) >= 6)]

    def partitions(self) -> tuple[dict[str, NodeLimits], str | None]:
        """Each partition's largest node (one sinfo query), and the default partition."""
        largest: dict[str, NodeLimits] = {}
        default = None
        for node in self.nodes():
            seen = largest.get(node.partition, NodeLimits(0, 0, 0))
            largest[node.partition] = NodeLimits(max(seen.cpus, node.cpus),
                                                 max(seen.mem_mb, node.mem_mb),
                                                 max(seen.gpus, node.gpus))
            if node.default:
                default = node.partition
        return largest, default

    def limits(self) -> ClusterLimits:
        partitions, default = self.partitions()
        config = self.controller_config()
        return ClusterLimits(partitions, default, _digits(config.get("MaxArraySize")),
                             self.qos_limits(), _digits(config.get("MaxJobCount")))

    def controller_config(self) -> dict[str, str]:
        """The controller's running configuration (`scontrol show config`: slurm.conf may not
        be on this machine, on configless clusters), key -> value."""
        config = {}
        for row in self._rows("scontrol", "show", "config"):
            key, _, value = row[0].partition("=")
            config[key.strip()] = value.strip()
        return config

    def queued(self, user: str | None = None, account: str | None = None,
               qos: str | None = None) -> int:
        # -r: each array element is one job to the limits; squeue's default states are those
        # that count (pending, running, suspended, completing).
        filters = [arg for flag, value in (("-u", user), ("-A", account), ("-q", qos))
                   if value for arg in (flag, value)]
        return len(self._rows("squeue", "-h", "-r", *filters, "-o", "%i"))

    def qos_limits(self) -> dict[str, QosLimits]:
        """Each QOS's submit and run limits per user and account, from accounting (sacctmgr);
        none where the cluster keeps no accounting (no QOS is enforced then)."""
        try:
            rows = self._rows("sacctmgr", "-n", "-P", "show", "qos",
                              "format=Name,MaxSubmitPU,MaxSubmitPA,MaxJobsPU")
        except probes.SlurmError as error:
            if error.kind == "failed":  # no slurmdbd to ask
                return {}
            raise
        return {name: QosLimits(_digits(per_user), _digits(per_account), _digits(jobs))
                for name, per_user, per_account, jobs in (r[:4] for r in rows if len(r) >= 4)}

    # -- the queue (`labrun queue`) ------------------------------------------------------------

    def queue_jobs(self) -> list[dict[str, Any]]:
        """Every job in the queue, with the JOB_FIELDS (squeue -O names) and "Count": the jobs
        the row stands for (squeue shows a job array's waiting tasks as one row, ArrayTaskID
        0-5%2: six jobs, each asking for the row's resources)."""
        rows = self._rows("squeue", "-h", "-O", ",".join(f"{f}:|" for f in JOB_FIELDS))
        jobs = [dict(zip(JOB_FIELDS, row, strict=False)) for row in rows]
        for job in jobs:
            job["Count"] = array_tasks(job.get("ArrayTaskID", ""))
        return jobs

    def pending(self, jobs: list[dict[str, str]] | None = None) -> list[PendingJob]:
        """`jobs`: queue_jobs() when the caller has it already (one squeue fewer)."""
        jobs = self.queue_jobs() if jobs is None else jobs
        # Expected start of each pending job (`squeue --start`; N/A when SLURM cannot tell).
        starts = {row[0]: row[1] for row in
                  self._rows("squeue", "-h", "--start", "-t", "PD", "-o", "%i|%S")
                  if len(row) == 2}
        waiting = [PendingJob(j["JobID"], j["UserName"], j["Account"], j["QOS"],
                              int(j["PriorityLong"] or 0), j["Reason"],
                              starts.get(j["JobID"], "N/A"), j["Name"], j["Count"],
                              gpus_in_tres(j["tres-alloc"]) * j["Count"])
                   for j in jobs if j["State"] == "PENDING"]
        return sorted(waiting, key=lambda p: -p.priority)

    def fair_share(self) -> list[FairShare]:
        rows = self._rows("sshare", "-a", "-n", "-P", "-o",
                          "Account,User,RawShares,NormShares,RawUsage,EffectvUsage,FairShare")
        result = []
        for account, user, _, norm, raw, effective, factor in (r[:7] for r in rows
                                                                 if len(r) >= 7):
            if not user:  # the account's own line; its users follow
                continue
            result.append(FairShare(account, user, float(norm or 0), int(raw or 0),
                                    float(effective or 0), float(factor) if factor else None))
        return result

    def troubled_nodes(self) -> list[dict[str, str]]:
        """Nodes down, drained or failing, each once, with SLURM's reason."""
        rows = self._rows("sinfo", "-h", "-N", "-t", DOWN_STATES, "-o", "%N|%T|%E")
        seen, result = set(), []
        for node, state, reason in (r[:3] for r in rows if len(r) >= 3):
            if node not in seen:  # a node in two partitions is listed twice
                seen.add(node)
                result.append({"node": node, "state": state, "reason": reason})
        return result


def controller_address(slurm_conf_text: str) -> str | None:
    """The primary controller's address as slurm.conf gives it (SlurmctldAddr, the address in
    SlurmctldHost=name(address), or the name), None when it names none. slurm.conf's keys are
    case-insensitive; ControlMachine/ControlAddr are their names before Slurm 18.08. A plain
    regular expression: no library parses slurm.conf, and these keys are one line each."""
    values: dict[str, str] = {}
    for line in slurm_conf_text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"(\w+)\s*=\s*(\S+)", line)
        if match and match[1].lower() not in values:  # the first SlurmctldHost: the primary
            values[match[1].lower()] = match[2]
    if "slurmctldaddr" in values:
        return values["slurmctldaddr"]
    if "controladdr" in values:
        return values["controladdr"]
    host = values.get("slurmctldhost") or values.get("controlmachine")
    if host is None:
        return None
    named = re.fullmatch(r"([^(]+)\(([^)]+)\)", host)
    return named[2] if named else host
