"""`labrun monitor queue` on the real test cluster, scraped by a real Prometheus: held jobs
(`--hold`: nothing runs) pend with the GPUs they ask for, the oldest one's wait grows with the
clock, a cancelled job leaves the figures, and Prometheus's scrapes caused one query of SLURM
per cache period's worth of them, counted (the exact count, on a clock the test moves:
tests/test_monitoring.py); a stopped controller is `labrun_queue_up 0` in a scrape that still
answers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from test_cluster_slurm import slurm  # noqa: F401 - the fixture that fails without a cluster

from conftest import LABRUN, PROJECT
from labrun.monitoring import prometheus, queue_exporter

pytestmark = pytest.mark.slurm

STATE = Path(os.environ.get("LABRUN_SLURM_STATE", "/tmp/labrun-slurm"))
ACCOUNT = "nlp"  # the held jobs' account: the figures the test reads are theirs alone
DEADLINE_S = 120
SCRAPE_INTERVAL_S = 2
# Scrapes served from one answer of SLURM: a cache period's worth of Prometheus's.
SCRAPES_PER_QUERY = int(queue_exporter.MIN_CACHE_S // SCRAPE_INTERVAL_S)


def shims(folder: Path) -> Path:
    """squeue, sshare and sinfo on PATH that log each call's name, then run the real one."""
    folder.mkdir()
    for name in ("squeue", "sshare", "sinfo"):
        real = subprocess.run(["which", name], capture_output=True, text=True).stdout.strip()
        (folder / name).write_text(f'#!/bin/sh\necho "{name}" >> "{folder}/calls"\n'
                                   f'exec {real} "$@"\n')
        (folder / name).chmod(0o755)
    return folder


def held_job() -> str:
    out = subprocess.run(["sbatch", "--hold", "--parsable", "-p", "gpu", "-A", ACCOUNT,
                          "--gres=gpu:2", "-J", "labrun-queue-test", "--wrap", "true"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return out.strip().split(";")[0]


def value(prom: prometheus.Prometheus, expr: str) -> float | None:
    rows = httpx.get(f"{prom.url}/api/v1/query", params={"query": expr},
                     timeout=10).json()["data"]["result"]
    return float(rows[0]["value"][1]) if rows else None


def oldest_waits(prom: prometheus.Prometheus) -> list[tuple[float, str]] | None:
    """The gpu partition's oldest wait in the last 20 s of scrapes, once there are three."""
    rows = httpx.get(f"{prom.url}/api/v1/query", params={
        "query": 'labrun_queue_oldest_pending_seconds{partition="gpu"}[20s]'},
        timeout=10).json()["data"]["result"]
    return rows[0]["values"] if rows and len(rows[0]["values"]) >= 3 else None


def slurm_submit_time(job: str) -> float:
    """The job's SubmitTime as squeue reports it (the controller's local time), in epoch
    seconds."""
    text = subprocess.run(["squeue", "-h", "-j", job, "-o", "%V"], capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
    return datetime.fromisoformat(text).timestamp()


def until(condition, what: str, exporter: subprocess.Popen):
    deadline = time.monotonic() + DEADLINE_S
    while not (result := condition()):
        assert exporter.poll() is None, f"the exporter ended while waiting for {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.5)
    return result


def test_held_jobs_through_a_real_prometheus_and_one_query_a_cache_period(tmp_path):
    shim = shims(tmp_path / "shims")
    jobs = [held_job() for _ in range(3)]
    exporter = subprocess.Popen([LABRUN, "monitor", "queue", "--port", "0"], cwd=PROJECT,
                                env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = exporter.stdout.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        if not port:
            exporter.kill()
            pytest.fail(f"labrun monitor queue did not start: {line}{exporter.stdout.read()}")
        config = prometheus.local_config(tmp_path / "targets.json",
                                         scrape_interval=f"{SCRAPE_INTERVAL_S}s",
                                         queue_target=f"127.0.0.1:{port[1]}")
        config["scrape_configs"] = [job for job in config["scrape_configs"]
                                    if job["job_name"] == prometheus.QUEUE_JOB]
        prometheus.write_config(tmp_path / "prometheus.yml", config)
        with prometheus.running(tmp_path / "prometheus.yml", tmp_path / "data",
                                tmp_path / "prometheus.log") as prom:
            mine = f'{{account="{ACCOUNT}",partition="gpu"}}'
            until(lambda: value(prom, f"sum(labrun_queue_pending_jobs{mine})") == 3,
                  "the three held jobs", exporter)
            assert value(prom, f"sum(labrun_queue_pending_gpus{mine})") == 6  # 2 each
            assert value(prom, "labrun_queue_up") == 1
            # The oldest job's wait, scrape after scrape: it grows, also between two scrapes
            # served from one answer of SLURM, and is the time of its scrape less the job's
            # SubmitTime as SLURM reports it: computed during the scrape, so after that scrape
            # began and before the next one did.
            samples = until(lambda: oldest_waits(prom), "three scrapes of the oldest wait",
                            exporter)
            submit = min(slurm_submit_time(job) for job in jobs)
            for (t0, v0), (t1, v1) in zip(samples, samples[1:], strict=False):
                assert float(v1) > float(v0), samples
                assert t0 <= submit + float(v0) < t1, (submit, samples)
            subprocess.run(["scancel", *jobs], check=True, timeout=60)
            until(lambda: value(prom, f"sum(labrun_queue_pending_jobs{mine}) or vector(0)") == 0,
                  "the cancelled jobs to leave the figures", exporter)
            # The queries first, then Prometheus's scrapes (`up`: one sample per scrape, even
            # one that timed out): a scrape after the count of queries only adds to the scrapes.
            asked = Counter((shim / "calls").read_text().split())
            scrapes = int(value(prom, f'count_over_time(up{{job="{prometheus.QUEUE_JOB}"}}[1h])'))
    finally:
        subprocess.run(["scancel", *jobs], timeout=60)
        exporter.send_signal(signal.SIGINT)
        exporter.wait(timeout=30)
    # SLURM was asked once per SCRAPES_PER_QUERY scrapes at most (the first scrape asks; one
    # more for a scrape whose query was counted before its sample was stored), and again after
    # the first (the cancelled jobs left the figures); an exporter asking SLURM at every scrape
    # would have made as many queries as there were scrapes.
    most = -(-scrapes // SCRAPES_PER_QUERY) + 1
    assert scrapes > most, (scrapes, asked)
    for name in ("squeue", "sshare", "sinfo"):
        assert 2 <= asked[name] <= most, (name, asked, scrapes)


def test_a_stopped_controller_is_queue_up_0_in_a_scrape_that_answers():
    pid = int((STATE / "pids" / "slurmctld.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(
                f"/proc/{pid}/status").read_text(errors="replace"):
            assert time.monotonic() < deadline, "slurmctld did not stop"
            time.sleep(0.2)
        server, port = queue_exporter.serve(0, "127.0.0.1")
        try:
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=120)
        finally:
            server.shutdown()
        assert scrape.status_code == 200
        assert re.search(r"(?m)^labrun_queue_up 0\.0$", scrape.text), scrape.text
        assert "labrun_queue_pending_jobs{" not in scrape.text  # no figures, rather than zeros
    finally:
        subprocess.run(["bash", str(PROJECT / "scripts" / "slurm_up.sh"), "--restart-controller"],
                       check=True, capture_output=True, timeout=120)


def test_monitor_up_serves_and_scrapes_the_queue_where_slurm_answers(tmp_path):
    up = subprocess.Popen([LABRUN, "monitor", "up", "--port", "0", "--output-root",
                           str(tmp_path / "outputs")], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline()
        queue = re.search(r"the SLURM queue from (127\.0\.0\.1:\d+)", line)
        assert line.startswith("Prometheus: http://127.0.0.1:") and queue, \
            line + (up.stderr.read() if up.poll() is not None else "")
        url = line.split()[1]
        config = httpx.get(f"{url}/api/v1/status/config", timeout=10).json()["data"]["yaml"]
        assert f"job_name: {prometheus.QUEUE_JOB}" in config and queue[1] in config
        scrape = httpx.get(f"http://{queue[1]}/metrics", timeout=60).text
        assert re.search(r"(?m)^labrun_queue_up 1\.0$", scrape), scrape
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
    assert code == 0


def test_every_family_is_in_a_scrape_and_each_waiting_array_task_counts(tmp_path):
    """One scrape holds every family the README and docs/monitoring.md list, each with the
    figures of what the test put on the cluster: a held array of six 2-GPU jobs counts six
    jobs and twelve GPUs (squeue shows it as one row), in the exporter and in `labrun queue`
    alike; a running 1-GPU job; a drained node; the query's time between its scrape's start
    and end."""
    from prometheus_client.parser import text_string_to_metric_families

    labels = {"partition": "dev", "account": "vision", "user": "root", "qos": "normal"}
    array = subprocess.run(["sbatch", "--hold", "--parsable", "-p", "dev", "-A", "vision",
                            "--array=0-5", "--gres=gpu:2", "-J", "labrun-queue-array",
                            "--wrap", "true"], capture_output=True, text=True, check=True,
                           timeout=60).stdout.strip().split(";")[0]
    running = subprocess.run(["sbatch", "--parsable", "-p", "dev", "-A", "vision",
                              "--gres=gpu:1", "-J", "labrun-queue-running", "-o", "/dev/null",
                              "--wrap", "sleep 300"], capture_output=True, text=True,
                             check=True, timeout=60).stdout.strip().split(";")[0]
    subprocess.run(["scontrol", "update", "nodename=node3", "state=drain",
                    "reason=labrun queue test"], check=True, timeout=30)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while subprocess.run(["squeue", "-h", "-j", running, "-o", "%T"], capture_output=True,
                             text=True, timeout=30).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the running job never started"
            time.sleep(0.5)
        server, port = queue_exporter.serve(0, "127.0.0.1")
        try:
            before = time.time()
            scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=120).text
            after = time.time()
        finally:
            server.shutdown()
        samples = {}
        for family in text_string_to_metric_families(scrape):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)

        def mine(name: str) -> float:
            [found] = [s.value for s in samples.get(name, [])
                       if all(s.labels.get(k) == v for k, v in labels.items())]
            return found

        assert set(queue_exporter.QUEUE_FAMILIES) <= set(samples), sorted(samples)
        assert (mine("labrun_queue_pending_jobs"), mine("labrun_queue_pending_gpus")) == (6, 12)
        assert (mine("labrun_queue_running_jobs"), mine("labrun_queue_running_gpus")) == (1, 1)
        assert [s.value for s in samples["labrun_queue_up"]] == [1]
        assert any(s.labels == {"account": "vision", "user": "root"} and 0 <= s.value <= 1
                   for s in samples["labrun_queue_fairshare"]), samples["labrun_queue_fairshare"]
        assert any(s.labels.get("state") in ("drain", "drained", "draining") and s.value >= 1
                   for s in samples["labrun_queue_nodes_unavailable"]), \
            samples["labrun_queue_nodes_unavailable"]
        [stamp] = samples["labrun_queue_query_timestamp_seconds"]
        assert before <= stamp.value <= after
        view = subprocess.run([LABRUN, "queue", "--json"], capture_output=True, text=True,
                              timeout=120, cwd=PROJECT)
        [row] = [p for p in json.loads(view.stdout)["pending"] if p["job_id"] == array]
        assert (row["jobs"], row["gpus"]) == (6, 12), row
    finally:
        subprocess.run(["scancel", array, running], timeout=60)
        subprocess.run(["scontrol", "update", "nodename=node3", "state=resume"], timeout=30)
