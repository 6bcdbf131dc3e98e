"""What the SLURM cluster will accept of a sweep, asked before anything is submitted: the
cluster's limits (core/scheduler, one query each), a resource request no node can ever
satisfy, the QOS's submit limits and the controller's MaxJobCount (each a one-line
ConfigError naming the limit and the fix), and the arrays that fit MaxArraySize.
launch/slurm.py's SlurmLauncher.begin calls them for a sweep's jobs, and its
check_controller for a detached study's controller job (cluster.controller)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from labrun.core import probes
from labrun.core.errors import ConfigError, LabrunError
from labrun.core.scheduler import ClusterLimits, SlurmScheduler
from labrun.runs.sweepdir import Job


def cluster_limits() -> ClusterLimits:
    """The cluster's limits (core/scheduler: one sinfo, scontrol and sacctmgr each), or one
    line on why SLURM cannot be asked."""
    try:
        return SlurmScheduler().limits()
    except probes.SlurmError as error:
        if error.kind in ("missing", "unconfigured"):
            raise LabrunError(f"{error}; use cluster=local, or submit from a login node"
                              ) from None
        raise LabrunError(f"{error}; is the SLURM controller up?") from None


def split(jobs: list[Job], max_array_size: int | None) -> list[list[Job]]:
    """`jobs` in arrays that fit the cluster: MaxArraySize N allows indices 0 to N - 1."""
    size = max_array_size or len(jobs)
    return [jobs[i:i + size] for i in range(0, len(jobs), size)]


def throttle_shares(sizes: list[int], parallelism: int) -> list[int]:
    """cluster.array_parallelism shared out among a sweep's resource requests (of `sizes`
    jobs each), in proportion to their jobs and at least one each (largest remainders get
    the rest), so that together they run at most `parallelism` jobs at once; only more
    requests than `parallelism` can make them run more, one each."""
    total = sum(sizes)
    shares = [max(1, parallelism * size // total) for size in sizes]
    by_remainder = sorted(range(len(sizes)), key=lambda i: -(parallelism * sizes[i] % total))
    for i in by_remainder[:max(0, parallelism - sum(shares))]:
        shares[i] += 1
    return [min(share, size) for share, size in zip(shares, sizes, strict=True)]


def check_resources(cluster: DictConfig, limits: ClusterLimits) -> None:
    """Fail now, in one line, on a request that would pend forever."""
    cpus = cluster.cpus_per_task * cluster.tasks_per_node
    _check_node_fits(limits, cluster.partition, "cluster.partition",
                     (cpus, f"cluster.cpus_per_task x tasks_per_node = {cpus} CPUs per node"),
                     (cluster.mem_gb, f"cluster.mem_gb={cluster.mem_gb}"),
                     (cluster.gpus_per_node, f"cluster.gpus_per_node={cluster.gpus_per_node}"))


def check_controller(cluster: DictConfig, limits: ClusterLimits) -> None:
    """A detached study's controller (cluster.controller: one task in a CPU slot, no GPU),
    before it is submitted: its partition and QOS exist, a node of the partition can hold
    it, and its QOS takes one more job. One line naming the cluster.controller key."""
    controller = cluster.controller
    _check_node_fits(
        limits, controller.partition, "cluster.controller.partition",
        (controller.cpus_per_task, f"cluster.controller.cpus_per_task="
                                   f"{controller.cpus_per_task} CPUs"),
        (controller.mem_gb, f"cluster.controller.mem_gb={controller.mem_gb}"), (None, ""))
    # Accounting lists every QOS; a cluster without it enforces none (limits.qos is empty).
    if controller.qos is not None and limits.qos and controller.qos not in limits.qos:
        raise ConfigError(f"cluster.controller.qos={controller.qos} does not exist; QOS: "
                          f"{', '.join(sorted(limits.qos))}, or null for the default one")
    check_submission([OmegaConf.create({"qos": controller.qos,
                                        "account": controller.account or cluster.account})],
                     limits)


def _check_node_fits(limits: ClusterLimits, partition: str | None, partition_key: str,
                     cpus: tuple[int, str], mem_gb: tuple[int | None, str],
                     gpus: tuple[int | None, str]) -> None:
    """The partition (None: the cluster's default) exists and its largest node holds the
    request: each of cpus, mem_gb and gpus is (what is asked, the keys that ask it)."""
    wanted = partition or limits.default_partition
    if wanted not in limits.partitions:
        raise ConfigError(f"{partition_key}={wanted} does not exist; partitions: "
                          f"{', '.join(sorted(limits.partitions)) or 'none'}")
    node = limits.partitions[wanted]
    offer = (f"partition {wanted} offers at most {node.cpus} CPUs, "
             f"{node.mem_mb // 1024} GB and {node.gpus} GPUs per node")
    for (asked, named), most in ((cpus, node.cpus), (mem_gb, node.mem_mb / 1024),
                                 (gpus, node.gpus)):
        if asked and asked > most:
            raise ConfigError(f"{named}: {offer}")


def check_submission(clusters: list[DictConfig], limits: ClusterLimits) -> None:
    """Fail before anything is submitted, in one line naming the limit and the fix, when SLURM
    would refuse some of these jobs (each job's cluster config): a QOS's limit on submitted
    jobs per user or per account, counting the jobs already queued, or the controller's
    MaxJobCount. A job without cluster.qos gets its association's default QOS, which is
    SLURM's "normal" unless an admin set another; its limits are the ones checked."""
    import getpass
    from collections import Counter

    scheduler = SlurmScheduler()
    fix = ("submit fewer jobs (fewer sweep values, hydra.sweeper.n_trials), wait for some to "
           "end, or ask the cluster's admins to raise it")
    per_qos = Counter(cluster.qos or "normal" for cluster in clusters)
    per_account = Counter((cluster.qos or "normal", cluster.account) for cluster in clusters
                          if cluster.account)
    checks = []  # (limit, its name, who sets it, whose jobs it counts, the query, the count)
    for qos, count in per_qos.items():
        found = limits.qos.get(qos)
        if found is not None and found.max_submit_per_user is not None:
            checks.append((found.max_submit_per_user, "MaxSubmitJobsPerUser", f"QOS {qos} allows",
                           "per user", {"user": getpass.getuser(), "qos": qos}, count))
    for (qos, account), count in per_account.items():
        found = limits.qos.get(qos)
        if found is not None and found.max_submit_per_account is not None:
            checks.append((found.max_submit_per_account, "MaxSubmitJobsPerAccount",
                           f"QOS {qos} allows", f"for account {account}",
                           {"account": account, "qos": qos}, count))
    if limits.max_job_count:
        checks.append((limits.max_job_count, "MaxJobCount", "the controller holds at most",
                       "of all users at once", {}, len(clusters)))
    for limit, name, who, scope, query, count in checks:
        queued = scheduler.queued(**query)
        if queued + count > limit:
            raise ConfigError(f"{who} {limit} queued jobs {scope} ({name}); {queued} are "
                              f"queued and this sweep would add {count}: {fix}")
