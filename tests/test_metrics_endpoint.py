"""Every training run serves Prometheus metrics over HTTP (monitoring/metrics_endpoint.py): real runs
scraped while they train, a fixed port that is taken, monitor.enabled=false, two runs side by
side, `cluster=lab` on a machine without a SLURM controller; config mistakes in-process.

One module fixture starts three long runs at once (two cores: started together they are ready
together) and stops them after the last test."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_train, wait_for
from labrun.cli.hydra_app import user_error_message
from labrun.config import validation
from labrun.core.scheduler.slurm import SlurmScheduler, controller_address
from labrun.monitoring import metrics_endpoint
from labrun.monitoring.metrics_endpoint import (
    FAMILIES,
    GPU_FAMILIES,
    Endpoint,
    RunCollector,
    TrainingStats,
)
from labrun.runs.rundir import RunDir

# Long enough to outlive the module's tests (they stop it): 4 steps and 1 validation batch an
# epoch, so that every family has a value after the first epoch.
LONG = ["trainer.max_epochs=500", "trainer.limit_train_batches=4", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=2"]
USER = "monitor-tester"
# getpass.getuser() reads LOGNAME first, then USER; SLURM's variables empty: not a SLURM job.
# One thread each: three runs share two cores.
PLAIN_ENV = {"LOGNAME": USER, "USER": USER, "SLURM_JOB_ID": "", "SLURM_ARRAY_JOB_ID": "",
             "SLURM_ARRAY_TASK_ID": "", "OMP_NUM_THREADS": "1"}


class Run:
    def __init__(self, tmp: Path, name: str, *overrides: str, env: dict[str, str]):
        self.dir = tmp / name
        self.log = open(tmp / f"{name}.out", "w")  # a pipe nobody reads would fill and block
        self.proc = start_train(*LONG, *overrides, run_dir=self.dir, env=env, output=self.log)

    @property
    def endpoint_file(self) -> Path:
        return RunDir(self.dir).monitor_endpoint_path(0)

    def endpoint(self) -> dict:
        return json.loads(self.endpoint_file.read_text())

    def stop(self) -> None:
        """Killed: its folder is thrown away (the endpoint's own stop is tested in-process)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def held_port():
    """A port another program listens on: a run asked for it must take another."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, held_port):
    tmp = tmp_path_factory.mktemp("monitor")
    started = {
        # The defaults, with an experiment preset (its name is a label).
        "plain": Run(tmp, "plain", "experiment=digits_fast", env=PLAIN_ENV),
        # cluster=lab on a machine without SLURM: monitor.bind=node falls back to 127.0.0.1;
        # its fixed port is taken. As a SLURM array task would see it.
        "lab": Run(tmp, "lab", "cluster=lab", f"monitor.port={held_port}",
                   env={**PLAIN_ENV, "SLURM_CONF": str(tmp / "no-slurm.conf"),
                        "SLURM_JOB_ID": "780", "SLURM_ARRAY_JOB_ID": "777",
                        "SLURM_ARRAY_TASK_ID": "3", "SUBMITIT_EXECUTOR": "slurm"}),
        "off": Run(tmp, "off", "monitor.enabled=false", env=PLAIN_ENV),
    }
    try:
        for run in started.values():
            # metrics.jsonl's first point comes after the endpoint would have started.
            wait_for(run.dir / "metrics.jsonl", run.proc)
        yield started
    finally:
        for run in started.values():
            run.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def samples(text: str) -> dict[str, list]:
    """Sample name -> its samples, as Prometheus parses the text."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def value(text: str, name: str) -> float:
    [sample] = samples(text)[name]
    return sample.value


def scrape_until(run: Run, condition, what: str, deadline_s: float = 120) -> str:
    """Scrape until `condition(text)` holds; fails if the run ends first or never gets there."""
    deadline = time.time() + deadline_s
    while True:
        assert run.proc.poll() is None, f"the run ended before {what}"
        text = scrape(run.endpoint()["url"])
        if condition(text):
            return text
        assert time.time() < deadline, f"never {what}: {text}"
        time.sleep(0.2)


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on: its socket inodes (/proc/PID/fd) in LISTEN state in
    its network namespace's tables (what psutil reads; psutil is no dependency of labrun)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed while we look
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def warnings_in(run: Run, start: str) -> list[str]:
    return [line for line in (run.dir / "train.log").read_text().splitlines()
            if "WARNING" in line and start in line]


# ---------------------------------------------------------------------------------------------
# Real runs


def test_a_running_run_serves_its_metrics(runs):
    run = runs["plain"]
    endpoint = run.endpoint()
    assert endpoint["address"] == "127.0.0.1" and endpoint["requested_port"] == 0
    assert endpoint["url"] == f"http://127.0.0.1:{endpoint['port']}/metrics"
    assert endpoint["pid"] == run.proc.pid and endpoint["node_rank"] == 0
    assert endpoint["exports"] == ["run", "gpus"] and endpoint["host"] == socket.gethostname()
    assert endpoint["labels"] == {"run": "plain", "sweep": "", "experiment": "digits_fast",
                                  "user": USER, "host": socket.gethostname(),
                                  "slurm_job_id": ""}

    # After the first validation every family but the GPUs' has a value.
    expected = set(FAMILIES) - set(GPU_FAMILIES)
    first = scrape_until(run, lambda text: expected <= samples(text).keys(),
                         "a value in every family")
    second = scrape_until(run, lambda text: value(text, "labrun_train_samples_total")
                          > value(first, "labrun_train_samples_total"), "more samples")
    assert value(second, "labrun_train_steps_total") > value(first, "labrun_train_steps_total")
    # Every step's images, over all ranks (one here), from the same scrape: exactly.
    batch = RunDir(run.dir).saved_config()["trainer"]["batch_size"]
    assert value(second, "labrun_train_samples_total") == (
        value(second, "labrun_train_steps_total") * batch)
    assert "_created" not in second
    assert samples(second).keys() == expected  # the contract's families, no GPU ones on a CPU
    [info] = samples(second)["labrun_run_info"]
    assert info.labels == endpoint["labels"] and info.value == 1
    [val] = samples(second)["labrun_val_metric"]
    assert val.labels == {"metric": "val/acc"} and 0 <= val.value <= 1
    assert 0 < value(second, "labrun_run_dir_free_bytes") <= value(second,
                                                                   "labrun_run_dir_size_bytes")
    assert value(second, "labrun_last_step_timestamp_seconds") > endpoint["started_at"]
    assert value(second, "labrun_nonfinite_loss_steps_total") == 0
    # No NVML GPUs here: no perf/gpu_util either.
    logged = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert any("perf/images_per_s" in point for point in logged)
    assert not any("perf/gpu_util" in point for point in logged)


def test_a_taken_port_falls_back_to_a_free_one(runs, held_port):
    run = runs["lab"]
    endpoint = run.endpoint()
    assert endpoint["requested_port"] == held_port and endpoint["port"] != held_port
    assert endpoint["labels"]["slurm_job_id"] == "777_3"  # an array task: ARRAYJOB_TASK
    text = scrape(endpoint["url"])
    [info] = samples(text)["labrun_run_info"]
    assert info.labels["run"] == "lab"
    assert len(warnings_in(run, f"monitor.port={held_port} is taken")) == 1


def test_cluster_lab_without_a_controller_listens_on_this_machine_only(runs):
    run = runs["lab"]
    saved = RunDir(run.dir).saved_config()
    assert saved["monitor"]["bind"] == "node"  # what conf/cluster/lab.yaml sets
    assert run.endpoint()["address"] == "127.0.0.1"
    [warning] = warnings_in(run, "monitor.bind=node")
    assert "no SLURM configuration" in warning and "127.0.0.1" in warning


def test_two_concurrent_runs_get_distinct_endpoints(runs):
    plain, lab = runs["plain"], runs["lab"]
    assert plain.proc.poll() is None and lab.proc.poll() is None  # both are training now
    assert plain.endpoint()["port"] != lab.endpoint()["port"]
    for run in (plain, lab):
        [info] = samples(scrape(run.endpoint()["url"]))["labrun_run_info"]
        assert info.labels["run"] == run.dir.name
        assert listening_ports(run.proc.pid) == {run.endpoint()["port"]}


def test_monitor_disabled_writes_no_file_and_opens_no_port(runs):
    run = runs["off"]
    assert run.proc.poll() is None
    assert not RunDir(run.dir).monitor_dir.exists()
    assert listening_ports(run.proc.pid) == set()


# ---------------------------------------------------------------------------------------------
# In-process


def test_an_endpoint_serves_what_the_stats_say_and_stops(tmp_path):
    folder = RunDir(tmp_path / "run")
    stats = TrainingStats()
    endpoint = Endpoint.start(folder, node_rank=0, exports=("run", "gpus"),
                              labels=metrics_endpoint.run_labels(folder.path), stats=stats)
    try:
        assert json.loads(folder.monitor_endpoint_path(0).read_text()) == endpoint.record
        before = samples(scrape(endpoint.url))
        # Absent, not zero, before there is a value.
        assert not {"labrun_train_loss", "labrun_learning_rate", "labrun_val_metric",
                    "labrun_last_step_timestamp_seconds"} & before.keys()
        stats.steps, stats.samples = 3, 192
        stats.record({"train/loss": 1.5, "train/lr": 0.1, "val/loss": 0.7}, 2, "val/loss")
        after = scrape(endpoint.url)
        assert value(after, "labrun_train_steps_total") == 3
        assert value(after, "labrun_train_loss") == 1.5 and value(after, "labrun_epoch") == 2
        [val] = samples(after)["labrun_val_metric"]
        assert val.labels == {"metric": "val/loss"} and val.value == 0.7
    finally:
        endpoint.stop()
    with pytest.raises(OSError):
        scrape(endpoint.url)


def test_a_scrape_sees_each_step_with_its_images(tmp_path):
    """A scrape runs in the endpoint's HTTP thread, and the Trainer may count a step between
    the scrape's reading of the step counter and of the image counter: both come from one
    moment all the same."""
    stats = TrainingStats()
    stats.count_step(64, time.time())
    families = RunCollector(("run",), {}, tmp_path, stats, None).collect()
    steps = next(families)  # the scrape has read the step counter...
    stats.count_step(64, time.time())  # ...when the trainer counts another step
    samples = next(families)
    assert (steps.name, samples.name) == ("labrun_train_steps", "labrun_train_samples")
    assert samples.samples[0].value == steps.samples[0].value * 64


def test_a_gpus_only_endpoint_without_gpus_serves_just_its_labels(tmp_path):
    folder = RunDir(tmp_path / "run")
    endpoint = Endpoint.start(folder, node_rank=1, exports=("gpus",),
                              labels=metrics_endpoint.run_labels(folder.path))
    try:
        assert samples(scrape(endpoint.url)).keys() == {"labrun_run_info"}
        assert folder.monitor_endpoints()[0]["node_rank"] == 1
    finally:
        endpoint.stop()


def test_node_address_is_this_machines_address_towards_the_controller(tmp_path):
    conf = tmp_path / "slurm.conf"
    # The controller at 127.0.0.53: the interface that routes there holds 127.0.0.1.
    conf.write_text("# comment\nClusterName=lab\nslurmctldhost=ctl(127.0.0.53)\n"
                    "SlurmctldHost=backup(10.0.0.9)\n")
    assert SlurmScheduler(slurm_conf=conf).node_address() == ("127.0.0.1", "")
    address, why = SlurmScheduler(slurm_conf=tmp_path / "none.conf").node_address()
    assert address is None and "no SLURM configuration" in why


@pytest.mark.parametrize("text, controller", [
    ("SlurmctldHost=ctl(10.1.2.3)\n", "10.1.2.3"),
    ("SlurmctldHost=ctl\nSlurmctldAddr=10.9.9.9\n", "10.9.9.9"),
    ("ControlMachine=old # before 18.08\n", "old"),
    ("NodeName=node1 NodeAddr=10.77.0.11\n", None),
])
def test_controller_address_from_slurm_conf(text, controller):
    assert controller_address(text) == controller


def test_bind_node_without_slurm_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "none.conf"))
    with caplog.at_level(logging.WARNING):
        assert metrics_endpoint.listen_address("node") == "127.0.0.1"
    assert len(caplog.records) == 1 and "monitor.bind=node" in caplog.records[0].getMessage()


def test_cluster_lab_sets_bind_node(composed):
    assert composed("cluster=lab").monitor.bind == "node"
    assert composed().monitor.bind == "127.0.0.1"  # everywhere else: this machine only


MISTAKES = {
    "port too high": ("monitor.port=70000", "monitor.port=70000"),
    "negative port": ("monitor.port=-1", "monitor.port=-1"),
    "host name": ("monitor.bind=node1", "monitor.bind=node1 is not an IP address"),
    "localhost": ("monitor.bind=localhost", "use 127.0.0.1"),
    "zero poll": ("monitor.gpu_poll_s=0", "monitor.gpu_poll_s=0"),
    "wait fraction above 1": ("monitor.data_bound_wait_frac=1.5",
                              "monitor.data_bound_wait_frac=1.5 must be a fraction in (0, 1)"),
    "zero idle threshold": ("monitor.gpu_idle_util=0", "monitor.gpu_idle_util=0"),
    "idle band above the good one": ("monitor.gpu_idle_util=0.8",
                                     "monitor.gpu_idle_util=0.8 must be below "
                                     "monitor.gpu_good_util=0.7"),
}


@pytest.mark.parametrize("mistake", MISTAKES, ids=list(MISTAKES))
def test_monitor_mistakes_give_one_clear_line(mistake, composed):
    override, expected = MISTAKES[mistake]
    with pytest.raises(Exception) as caught:
        validation.validate(composed(override))
    message = user_error_message(caught.value)
    assert message is not None and "\n" not in message
    assert expected in message, message


@pytest.mark.parametrize("bind", ["node", "0.0.0.0", "::1", "10.77.0.11"])
def test_monitor_bind_takes_addresses_and_node(bind, composed):
    validation.validate(composed(f"monitor.bind={bind}"))


class FakeNvml:
    """NVML's calls that GpuPoller makes, on two made-up GPUs (there is no GPU here): the second
    reports no utilisation, as NVML does for a MIG slice."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.util = {"a": 40}
        self.shut = False

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802 - NVML's names
        if handle not in self.util:
            raise self.NVMLError("Not Supported")
        return type("Rates", (), {"gpu": self.util[handle]})

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        return type("Memory", (), {"used": {"a": 1000, "b": 2000}[handle]})

    def nvmlShutdown(self):  # noqa: N802
        self.shut = True


def test_gpu_figures_are_served_and_averaged_for_perf_gpu_util(tmp_path):
    nvml = FakeNvml()
    gpus = metrics_endpoint.GpuPoller(nvml, [("0", "a"), ("1", "b")], poll_s=3600)
    assert gpus.take_utilization() is None  # nothing read yet
    gpus._read()
    nvml.util["a"] = 80
    gpus._read()
    assert gpus.take_utilization() == pytest.approx(0.6)  # the mean of the reads since
    assert gpus.take_utilization() == pytest.approx(0.6)  # none since: the last mean
    folder = RunDir(tmp_path / "run")
    endpoint = Endpoint.start(folder, node_rank=0, exports=("gpus",),
                              labels=metrics_endpoint.run_labels(folder.path), gpus=gpus)
    try:
        found = samples(scrape(endpoint.url))
    finally:
        endpoint.stop()
        gpus.stop()
    assert {(s.labels["gpu"], s.value) for s in found["labrun_gpu_utilization_ratio"]} == {
        ("0", 0.8)}  # gpu 1 reports none: absent, not zero
    assert {(s.labels["gpu"], s.value) for s in found["labrun_gpu_memory_used_bytes"]} == {
        ("0", 1000), ("1", 2000)}
    assert nvml.shut
