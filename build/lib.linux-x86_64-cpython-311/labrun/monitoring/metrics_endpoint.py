"""A training run's Prometheus endpoint: GET /metrics while it trains (prometheus_client).

    job.py: Endpoint.start(folder, stats=trainer.stats, ...) -> monitor/node-N.json
            -> Trainer.fit() -> Endpoint.stop()

Scraping costs the training loop nothing: the Trainer keeps plain Python numbers in a
TrainingStats (a few attribute updates per step; loss and learning rate copied as floats when
a point is logged), and RunCollector turns them into metric families in the HTTP server's own
thread, when Prometheus asks. A scrape never touches a tensor, so it never waits for the GPU.
GPU figures come from NVML (nvidia-ml-py) in GpuPoller's background thread every
monitor.gpu_poll_s: the scrape and the logged perf/gpu_util read its last values.

What node-N.json holds and the metric families are a contract (docs/ARCHITECTURE.md, the run
folder): `labrun monitor targets` and monitoring/ (Prometheus rules, dashboard) read them.
"""

from __future__ import annotations

import errno
import getpass
import ipaddress
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from labrun.core import environment, scheduler
from labrun.core.errors import ConfigError
from labrun.runs.rundir import RunDir

log = logging.getLogger(__name__)

# Every metric family an endpoint may serve (the names as scraped; a counter's family is the
# name without _total). GPU families appear only where NVML reports the run's GPUs.
FAMILIES = (
    "labrun_train_steps_total",
    "labrun_train_samples_total",
    "labrun_data_wait_seconds_total",
    "labrun_train_loss",
    "labrun_learning_rate",
    "labrun_epoch",
    "labrun_val_metric",
    "labrun_last_step_timestamp_seconds",
    "labrun_nonfinite_loss_steps_total",
    "labrun_run_dir_free_bytes",
    "labrun_run_dir_size_bytes",
    "labrun_gpu_utilization_ratio",
    "labrun_gpu_memory_used_bytes",
    "labrun_run_info",
)
GPU_FAMILIES = ("labrun_gpu_utilization_ratio", "labrun_gpu_memory_used_bytes")
# What an endpoint exports: "run" (the training figures: global rank 0) and "gpus" (the GPUs of
# its node: each node's local rank 0).
EXPORTS = ("run", "gpus")
LABELS = ("run", "sweep", "experiment", "user", "host", "slurm_job_id")


@dataclass
class TrainingStats:
    """What the Trainer tells the endpoint, as plain Python numbers. Counters count from this
    process's start (a resumed run starts again at 0, as Prometheus expects of a counter)."""

    steps: int = 0  # optimizer steps taken (also ranks/rank-N.json's optimizer_steps)
    samples: int = 0  # images trained on, over all ranks
    data_wait_s: float = 0.0  # this rank's time blocked on the loader
    last_step_at: float | None = None  # unix time of the last optimizer step
    nonfinite_steps: int = 0  # steps whose loss was NaN or infinite
    epoch: int = 0  # epochs completed (metrics.jsonl's "epoch" of the last logged point)
    loss: float | None = None  # train/loss of the last logged point
    lr: float | None = None
    monitor: str | None = None  # checkpoint.monitor, as the last logged point gave it (record)
    monitored: float | None = None  # its last value
    # steps and samples change together (count_step) and a scrape reads them together
    # (counts()), so that no scrape sees a step without its images: the scrape runs in the
    # HTTP server's thread, which may run between any two of the Trainer's statements.
    _counting: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                      compare=False)

    def count_step(self, samples: int, at: float) -> None:
        """One optimizer step, of `samples` images over all ranks, ended at unix time `at`."""
        with self._counting:
            self.steps += 1
            self.samples += samples
            self.last_step_at = at

    def counts(self) -> tuple[int, int]:
        """(steps, samples) at one moment."""
        with self._counting:
            return self.steps, self.samples

    def record(self, metrics: dict[str, Any], epoch: int, monitor: str) -> None:
        """A logged point: the values a scrape shows until the next one. Called at log time,
        where the values are floats already (a scrape never reads a tensor)."""
        self.epoch, self.monitor = epoch, monitor
        if metrics.get("train/loss") is not None:
            self.loss = float(metrics["train/loss"])
        if metrics.get("train/lr") is not None:
            self.lr = float(metrics["train/lr"])
        if metrics.get(monitor) is not None:
            self.monitored = float(metrics[monitor])


class GpuPoller:
    """The run's GPUs on this node, read from NVML in a background thread every `poll_s`.

    A thread, not a read at log time: an NVML query takes a fraction of a millisecond per GPU
    but can block for much longer while the driver is busy, and the training loop must never
    wait for it; the loop only takes the mean of the utilisations read since its last logged
    point (take_utilization), and a scrape reads the last values (latest)."""

    def __init__(self, nvml: Any, handles: list[tuple[str, Any]], poll_s: float):
        self.nvml, self.handles, self.poll_s = nvml, handles, poll_s
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[float | None, int | None]] = {}
        self._sum, self._count, self._last_mean = 0.0, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="labrun-nvml", daemon=True)

    @classmethod
    def open(cls, uuids: list[str], poll_s: float) -> GpuPoller | None:
        """A poller of the GPUs with these UUIDs ("GPU-..." as CUDA and NVML name them; the
        n-th is labelled gpu="n", the run's cuda:n), or None where NVML does not initialise or
        knows none of them."""
        if not uuids:
            return None
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return None
        handles, unknown = [], []
        for index, uuid in enumerate(uuids):
            # CUDA gives a MIG slice's UUID without saying it is one; NVML names it MIG-...
            names = (uuid, "MIG-" + uuid[4:]) if uuid.startswith("GPU-") else (uuid,)
            for name in names:
                try:
                    handles.append((str(index), pynvml.nvmlDeviceGetHandleByUUID(name)))
                    break
                except pynvml.NVMLError:
                    continue
            else:
                unknown.append(f"cuda:{index} ({uuid})")
        if unknown:
            log.warning(f"NVML does not know {', '.join(unknown)}: not in perf/gpu_util and "
                        f"the GPU metrics")
        if not handles:
            pynvml.nvmlShutdown()
            return None
        poller = cls(pynvml, handles, poll_s)
        poller._read()
        poller._thread.start()
        return poller

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._read()

    def _read(self) -> None:
        nvml, latest = self.nvml, {}
        for label, handle in self.handles:
            util = used = None
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
            except nvml.NVMLError:
                pass  # e.g. a MIG slice: NVML reports no utilisation for it
            try:
                used = nvml.nvmlDeviceGetMemoryInfo(handle).used
            except nvml.NVMLError:
                pass
            latest[label] = (util, used)
        utils = [u for u, _ in latest.values() if u is not None]
        with self._lock:
            self._latest = latest
            if utils:
                self._sum += sum(utils) / len(utils)
                self._count += 1

    def latest(self) -> dict[str, tuple[float | None, int | None]]:
        """gpu label -> (utilisation 0..1, memory used in bytes), as last read (None: not
        reported)."""
        with self._lock:
            return dict(self._latest)

    def take_utilization(self) -> float | None:
        """The mean utilisation (0..1, over the GPUs) of the reads since the last call, or the
        last mean when there was none since; None when NVML reports no utilisation."""
        with self._lock:
            if self._count:
                self._last_mean = self._sum / self._count
                self._sum, self._count = 0.0, 0
            return self._last_mean

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (open() starts it)
            self._thread.join(timeout=5)
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


class RunCollector(Collector):
    """The families one endpoint serves, made at scrape time from what is kept elsewhere."""

    def __init__(self, exports: tuple[str, ...], labels: dict[str, str], run_dir: Path,
                 stats: TrainingStats | None, gpus: GpuPoller | None):
        self.exports, self.labels, self.run_dir = exports, labels, run_dir
        self.stats, self.gpus = stats, gpus

    def describe(self):
        return []  # nothing to collect when the registry is made

    def collect(self):
        if "run" in self.exports and self.stats is not None:
            yield from self._run_families(self.stats)
        if "gpus" in self.exports and self.gpus is not None:
            yield from self._gpu_families(self.gpus.latest())
        info = GaugeMetricFamily("labrun_run_info", "The run this endpoint belongs to (value 1)",
                                 labels=LABELS)
        info.add_metric([self.labels.get(name, "") for name in LABELS], 1)
        yield info

    def _run_families(self, stats: TrainingStats):
        steps, samples = stats.counts()  # read together: samples == steps x global batch
        yield CounterMetricFamily("labrun_train_steps_total",
                                  "Optimizer steps this process has taken", value=steps)
        yield CounterMetricFamily("labrun_train_samples_total",
                                  "Images trained on, over all ranks", value=samples)
        yield CounterMetricFamily("labrun_data_wait_seconds_total",
                                  "Rank 0's time blocked waiting for batches",
                                  value=stats.data_wait_s)
        yield CounterMetricFamily("labrun_nonfinite_loss_steps_total",
                                  "Steps whose loss was NaN or infinite",
                                  value=stats.nonfinite_steps)
        yield GaugeMetricFamily("labrun_epoch", "Epochs completed", value=stats.epoch)
        # Absent, not zero, until there is a value: a 0 would read as a real loss or rate.
        optional = (("labrun_train_loss", "train/loss of the last logged point", stats.loss),
                    ("labrun_learning_rate", "Learning rate of the last logged point", stats.lr),
                    ("labrun_last_step_timestamp_seconds",
                     "Unix time of the last optimizer step", stats.last_step_at))
        for name, help_text, value in optional:
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        if stats.monitored is not None:
            val = GaugeMetricFamily("labrun_val_metric",
                                    "The last value of checkpoint.monitor", labels=["metric"])
            val.add_metric([stats.monitor], stats.monitored)
            yield val
        try:
            disk = shutil.disk_usage(self.run_dir)
        except OSError:
            return  # the folder is gone or its file system does not answer: no figure
        yield GaugeMetricFamily("labrun_run_dir_free_bytes",
                                "Free bytes on the file system of the run folder",
                                value=disk.free)
        yield GaugeMetricFamily("labrun_run_dir_size_bytes",
                                "Size in bytes of the file system of the run folder",
                                value=disk.total)

    def _gpu_families(self, latest: dict[str, tuple[float | None, int | None]]):
        util = GaugeMetricFamily("labrun_gpu_utilization_ratio",
                                 "Fraction of time a kernel ran on the GPU (NVML)",
                                 labels=["gpu"])
        used = GaugeMetricFamily("labrun_gpu_memory_used_bytes", "GPU memory used (NVML)",
                                 labels=["gpu"])
        for gpu, (ratio, used_bytes) in latest.items():
            if ratio is not None:
                util.add_metric([gpu], ratio)
            if used_bytes is not None:
                used.add_metric([gpu], used_bytes)
        yield from (family for family in (util, used) if family.samples)  # absent, not empty


@dataclass
class Endpoint:
    """A metrics endpoint that is serving; `record` is what monitor/node-N.json says."""

    server: Any
    thread: threading.Thread
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.record["url"]

    @classmethod
    def start(cls, folder: RunDir, *, node_rank: int, exports: tuple[str, ...],
              labels: dict[str, str], bind: str = "127.0.0.1", port: int = 0,
              stats: TrainingStats | None = None, gpus: GpuPoller | None = None
              ) -> Endpoint:
        """Serve /metrics on `bind` (an IP address, or "node") and `port` (0: a free one; a
        taken one falls back to a free one) and write monitor/node-<node_rank>.json."""
        disable_created_metrics()  # no *_created series (none of ours sets one anyway)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(RunCollector(exports, labels, folder.path, stats, gpus))
        address = listen_address(bind)
        server, thread = _serve(address, port, registry)
        endpoint = cls(server, thread)
        try:
            advertised = address
            if ipaddress.ip_address(address).is_unspecified:  # 0.0.0.0: any of this machine's
                advertised = node_address()[0] or "127.0.0.1"
            host = f"[{advertised}]" if ":" in advertised else advertised
            endpoint.record = {
                "url": f"http://{host}:{server.server_port}/metrics", "address": advertised,
                "port": server.server_port, "requested_port": port, "pid": os.getpid(),
                "host": socket.gethostname(), "node_rank": node_rank, "exports": list(exports),
                "labels": labels, "started_at": time.time()}
            folder.write_monitor_endpoint(node_rank, endpoint.record)
        except BaseException:
            endpoint.stop()
            raise
        log.info(f"metrics: {endpoint.url}")
        return endpoint

    def stop(self) -> None:
        self.server.shutdown()  # serve_forever returns within its 0.5 s poll
        self.server.server_close()
        self.thread.join(timeout=5)


def _serve(address: str, port: int, registry: CollectorRegistry):
    try:
        return start_http_server(port, addr=address, registry=registry)
    except OSError as error:
        if port and error.errno == errno.EADDRINUSE:
            log.warning(f"monitor.port={port} is taken on {address}: the metrics endpoint "
                        f"listens on a free port instead (monitor/node-N.json names it)")
            return start_http_server(0, addr=address, registry=registry)
        raise ConfigError(f"monitor.bind={address} monitor.port={port}: cannot listen there "
                          f"({error.strerror}); use monitor.bind=127.0.0.1, node or an address "
                          f"of this machine, and monitor.port=0 or a free port") from error


# ---------------------------------------------------------------------------------------------
# Where to listen: monitor.bind=node


def listen_address(bind: str) -> str:
    """The address to listen on: `bind` itself, or for "node" this node's address towards its
    scheduler's controller (127.0.0.1, with one warning, where there is none)."""
    if bind != "node":
        return bind
    address, why = node_address()
    if address is None:
        log.warning(f"monitor.bind=node: {why}; the metrics endpoint listens on 127.0.0.1 only "
                    f"(set monitor.bind to an address of this node for a remote Prometheus)")
        return "127.0.0.1"
    return address


def node_address() -> tuple[str | None, str]:
    """(the address of this node's interface that routes to the controller, "") or (None, why
    there is none), asked of this process's scheduler (core.scheduler.here). The lab's
    Prometheus reaches compute nodes the way the controller does."""
    return scheduler.here().node_address()


# ---------------------------------------------------------------------------------------------
# Labels


def run_labels(run_dir: str | Path, *, sweep_dir: str | None = None,
               experiment: str | None = None) -> dict[str, str]:
    """labrun_run_info's labels (also in node-N.json): which run, whose, where. Strings, ""
    when unknown; nothing secret (no config values, no environment beyond the job id)."""
    return {"run": Path(run_dir).resolve().name,
            "sweep": Path(sweep_dir).name if sweep_dir else "",
            "experiment": experiment or "", "user": _user(), "host": socket.gethostname(),
            "slurm_job_id": scheduler_job_id()}


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login variable and no passwd entry (some containers)
        return ""


def scheduler_job_id() -> str:
    """The scheduler's id of this job as its queue shows it (ARRAYJOB_TASK for an array task),
    "" outside a job; the label keeps its name from when SLURM was the only scheduler."""
    return environment.read().queue_id
