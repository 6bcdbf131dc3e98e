"""`labrun monitor queue`: the SLURM queue as the lab sees it, as Prometheus metrics.

    labrun monitor queue [--port 9101] [--bind 127.0.0.1]  -> GET /metrics

The lab guide's third number, "jobs queued longer than 2 hours mean the cluster needs more
capacity", needs the queue in Prometheus: how many jobs wait, for what GPUs, and for how long.
QueueCollector is a prometheus_client collector over the Scheduler (core/scheduler/slurm.py:
SLURM's own commands); labrun.launch.queue adds up the same answers for `labrun queue`.

Labels are bounded by the cluster's configuration, never by its traffic: partition, account,
user and QOS, never a job id. The series (QUEUE_FAMILIES):
  labrun_queue_up                          1 when SLURM answered the last query, else 0 (a
                                           controller that does not answer is a sample, not a
                                           failed scrape: an alert can fire on it)
  labrun_queue_pending_jobs, _pending_gpus jobs waiting (held ones too) and the GPUs they ask for
  labrun_queue_oldest_pending_seconds      per partition: how long its oldest pending job has
                                           waited since it was submitted
  labrun_queue_running_jobs, _running_gpus jobs running and the GPUs they hold
  labrun_queue_fairshare                   each user's fair-share factor in each account (sshare)
  labrun_queue_nodes_unavailable           nodes down, drained or failing, by state
  labrun_queue_query_timestamp_seconds     when SLURM was last asked

A scrape is answered from a snapshot at most `cache_s` old (10 s at least): one squeue, one
sshare and one sinfo a period however many Prometheus servers scrape, so that two of them
scraping every 15 s do not load slurmctld. Concurrent scrapes share one refresh.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from labrun.core import probes
from labrun.core.scheduler.slurm import SlurmScheduler, gpus_in_tres

log = logging.getLogger(__name__)

MIN_CACHE_S = 10.0
JOB_LABELS = ("partition", "account", "user", "qos")
QUEUE_FAMILIES = (
    "labrun_queue_up",
    "labrun_queue_pending_jobs",
    "labrun_queue_pending_gpus",
    "labrun_queue_oldest_pending_seconds",
    "labrun_queue_running_jobs",
    "labrun_queue_running_gpus",
    "labrun_queue_fairshare",
    "labrun_queue_nodes_unavailable",
    "labrun_queue_query_timestamp_seconds",
)


@dataclass
class Snapshot:
    """One round of SLURM's answers, added up by the labels."""

    up: bool
    at: float  # time.time() of the query
    pending: Counter = field(default_factory=Counter)  # JOB_LABELS values -> jobs
    pending_gpus: Counter = field(default_factory=Counter)
    running: Counter = field(default_factory=Counter)
    running_gpus: Counter = field(default_factory=Counter)
    oldest_submit: dict[str, float] = field(default_factory=dict)  # partition -> epoch seconds
    fairshare: dict[tuple[str, str], float] = field(default_factory=dict)  # (account, user)
    nodes_unavailable: Counter = field(default_factory=Counter)  # state -> nodes


def submitted_at(text: str) -> float | None:
    """SLURM's SubmitTime (2026-12-01T19:30:00, the controller's local time) as epoch
    seconds; None for anything else (Unknown, N/A)."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def node_state(state: str) -> str:
    """sinfo's state without its flags: down* (not responding) and drained~ (powered off)
    count as down and drained."""
    return state.rstrip("*~#!%$@^-+")


def query(scheduler: SlurmScheduler) -> Snapshot:
    """Ask SLURM once (squeue, sshare, sinfo) and add the answers up."""
    now = time.time()
    try:
        jobs = scheduler.queue_jobs()
        shares = scheduler.fair_share()
        down = scheduler.troubled_nodes()
    except probes.SlurmError as error:
        log.warning("SLURM did not answer: %s", error)
        return Snapshot(up=False, at=now)
    snapshot = Snapshot(up=True, at=now)
    for job in jobs:
        labels = (job["Partition"], job["Account"], job["UserName"], job["QOS"])
        gpus = gpus_in_tres(job["tres-alloc"])  # a pending job's: what it asks for
        if job["State"] == "PENDING":  # a job array's row: each of its waiting tasks
            snapshot.pending[labels] += job["Count"]
            snapshot.pending_gpus[labels] += gpus * job["Count"]
            submit = submitted_at(job.get("SubmitTime", ""))
            if submit is not None:
                partition = job["Partition"]
                snapshot.oldest_submit[partition] = min(
                    submit, snapshot.oldest_submit.get(partition, submit))
        elif job["State"] == "RUNNING":
            snapshot.running[labels] += 1
            snapshot.running_gpus[labels] += gpus
    for share in shares:
        if share.fairshare is not None:
            snapshot.fairshare[(share.account, share.user)] = share.fairshare
    for node in down:
        snapshot.nodes_unavailable[node_state(node["state"])] += 1
    return snapshot


class QueueCollector(Collector):
    """The queue's families, from a snapshot at most `cache_s` old."""

    def __init__(self, scheduler: SlurmScheduler | None = None, cache_s: float = MIN_CACHE_S):
        self.scheduler = scheduler or SlurmScheduler()
        self.cache_s = max(cache_s, MIN_CACHE_S)
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None

    def describe(self):
        return []  # nothing to ask SLURM when the registry is made

    def snapshot(self) -> Snapshot:
        with self._lock:  # a second scrape waits for the first's answer, and shares it
            if self._snapshot is None or time.time() - self._snapshot.at >= self.cache_s:
                self._snapshot = query(self.scheduler)
            return self._snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.snapshot()
        yield GaugeMetricFamily("labrun_queue_up", "1 when SLURM answered the last query",
                                value=int(snap.up))
        yield GaugeMetricFamily("labrun_queue_query_timestamp_seconds",
                                "Unix time SLURM was last asked", value=snap.at)
        if not snap.up:
            return  # no figures rather than zeros: an empty queue is not what is known
        for name, help_text, counts in (
                ("labrun_queue_pending_jobs", "Jobs waiting to start (held ones too)",
                 snap.pending),
                ("labrun_queue_pending_gpus", "GPUs the waiting jobs ask for", snap.pending_gpus),
                ("labrun_queue_running_jobs", "Jobs running", snap.running),
                ("labrun_queue_running_gpus", "GPUs the running jobs hold", snap.running_gpus)):
            family = GaugeMetricFamily(name, help_text, labels=JOB_LABELS)
            for labels, value in sorted(counts.items()):
                family.add_metric(list(labels), value)
            yield family
        oldest = GaugeMetricFamily("labrun_queue_oldest_pending_seconds",
                                   "How long the partition's oldest pending job has waited",
                                   labels=["partition"])
        for partition, submit in sorted(snap.oldest_submit.items()):
            oldest.add_metric([partition], max(0.0, time.time() - submit))
        yield oldest
        shares = GaugeMetricFamily("labrun_queue_fairshare",
                                   "The user's fair-share factor in the account (sshare)",
                                   labels=["account", "user"])
        for (account, user), factor in sorted(snap.fairshare.items()):
            shares.add_metric([account, user], factor)
        yield shares
        nodes = GaugeMetricFamily("labrun_queue_nodes_unavailable",
                                  "Nodes down, drained or failing", labels=["state"])
        for state, count in sorted(snap.nodes_unavailable.items()):
            nodes.add_metric([state], count)
        yield nodes


def serve(port: int, bind: str, cache_s: float = MIN_CACHE_S):
    """Start the exporter's HTTP server in a thread; returns (server, its port)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(QueueCollector(cache_s=cache_s))
    server, _ = start_http_server(port, addr=bind, registry=registry)
    return server, server.server_port
