"""The shipped Prometheus set-up (monitoring/) and its discovery: promtool on the shipped files,
the dashboard's and the alerts' metric names against what labrun declares, `labrun monitor
targets` on real run folders (locks held by live processes, killed ones, ended ones), and the
Prometheus harness on a configuration Prometheus rejects. The full path, from a training run
to a Prometheus query, is tests/test_prometheus_e2e.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from conftest import LABRUN, PROJECT, PYTHON, run_labrun
from labrun.core.project import SHIPPED_MONITORING

MONITORING = SHIPPED_MONITORING
DASHBOARD = MONITORING / "grafana" / "labrun.json"
INSTALL = "run scripts/setup.sh as root (it installs Debian's prometheus package)"

# Metrics of other exporters that the dashboard and the rules use as examples.
EXTERNAL = {
    "up",  # Prometheus's own, per target
    "node_cpu_seconds_total",  # node-exporter
    "DCGM_FI_DEV_GPU_UTIL",  # NVIDIA's dcgm-exporter
}
# Label names that look like metric names to the scan below.
LABELS = {"node_rank"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def tool(name: str) -> str:
    """A Prometheus binary; missing is a failure, never a skip: setup installs it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists()
                                   else None)
    if found is None:
        pytest.fail(f"{name} is not installed: {INSTALL}")
    return found


def promtool(*args: str, cwd: Path = MONITORING) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


# -- the shipped files ---------------------------------------------------------------------------


def test_shipped_config_and_rules_pass_promtool():
    checked = promtool("check", "config", "prometheus.yml")  # checks rules.yml too
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout
    rules = promtool("check", "rules", "rules.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    alerts = {rule["alert"] for group in yaml.safe_load((MONITORING / "rules.yml").read_text())
              ["groups"] for rule in group["rules"]}
    assert alerts == {"LabrunGPUIdle", "LabrunDataBound", "LabrunStalled", "LabrunTargetDown",
                      "LabrunNonFiniteLoss", "LabrunOutputDiskFull", "LabrunGPUMemoryGrowth",
                      "LabrunQueueWaitLong", "LabrunQueueDown"}


def test_every_alert_fires_on_its_case_and_stays_silent_on_healthy_runs():
    tested = promtool("test", "rules", "rules_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Each alert has its test: a firing one with its exact labels and text, and healthy series
    # beside it that must not fire (promtool compares the whole list of alerts).
    cases = yaml.safe_load((MONITORING / "rules_test.yml").read_text())["tests"]
    firing = {test["alertname"] for case in cases for test in case["alert_rule_test"]
              if test["exp_alerts"]}
    assert firing == {"LabrunGPUIdle", "LabrunDataBound", "LabrunStalled", "LabrunTargetDown",
                      "LabrunNonFiniteLoss", "LabrunOutputDiskFull", "LabrunGPUMemoryGrowth",
                      "LabrunQueueWaitLong", "LabrunQueueDown"}


def declared_metrics() -> set[str]:
    """Every series name labrun's own endpoints can expose."""
    from labrun.monitoring import metrics_endpoint, queue_exporter, serve_metrics

    names = (set(metrics_endpoint.FAMILIES) | set(serve_metrics.FAMILIES)
             | set(queue_exporter.QUEUE_FAMILIES))
    return names | {name + suffix for name in names for suffix in HISTOGRAM_SUFFIXES}


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"]
               for target in panel.get("targets", [])]
    queries += [variable["query"]["query"] for variable in dashboard["templating"]["list"]
                if variable["type"] == "query"]
    return queries


def metric_names(query: str) -> set[str]:
    query = re.sub(r'"(?:[^"\\]|\\.)*"', '""', query)  # label values are no names
    return {name for name in re.findall(r"\b(?:labrun|node|DCGM)_\w+|\bup\b", query)
            if name not in LABELS}


def test_dashboard_and_alerts_use_only_metrics_that_exist():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "labrun" and dashboard["panels"]
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for wanted in ("per user", "images/s", "data wait", "loss", "pending jobs per partition",
                   "oldest pending job", "gpus in use per account", "fair share"):
        assert wanted in titles, f"the dashboard has no panel for {wanted}"
    rules = [rule["expr"] for group in yaml.safe_load((MONITORING / "rules.yml").read_text())
             ["groups"] for rule in group["rules"]]
    known = declared_metrics() | EXTERNAL
    used = set()
    for query in dashboard_queries() + rules:
        names = metric_names(query)
        assert names, f"no metric in {query!r}"
        unknown = names - known
        assert not unknown, f"{query!r} uses {sorted(unknown)}, which no exporter declares"
        used |= names
    # The main figures are on the dashboard.
    assert {"labrun_train_samples_total", "labrun_data_wait_seconds_total", "labrun_train_loss",
            "labrun_gpu_utilization_ratio"} <= used


def test_the_dashboards_gpu_bands_are_labrun_statuss():
    from labrun.config.schema import MonitorConfig

    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "GPU utilisation per job")
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    defaults = MonitorConfig()
    assert [step["value"] for step in steps] == [None, defaults.gpu_idle_util,
                                                 defaults.gpu_good_util]


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses each query as a recording rule (Grafana's variables filled in)."""
    rules = []
    for index, query in enumerate(q for q in dashboard_queries()
                                  if not q.startswith("label_values(")):
        expr = (query.replace("$__rate_interval", "1m").replace("$user", ".*")
                .replace("$run", ".*"))
        rules.append({"record": f"dashboard:query_{index}", "expr": expr})
    (tmp_path / "dashboard_rules.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", "dashboard_rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- discovery -----------------------------------------------------------------------------------

# A process that takes a run folder's lock the way training does (runs.lock), writes the
# folder's monitor/node-0.json, and holds both until its stdin closes (then exits normally,
# which releases the lock).
HOLDER = """
import os, sys, time
from labrun.runs import lock
from labrun.runs.rundir import RunDir
from labrun.core.project import SHIPPED_MONITORING
run = RunDir(sys.argv[1])
lock.acquire(run.lock_path)
if sys.argv[2] != "none":
    run.write_monitor_endpoint(0, {
        "url": f"http://127.0.0.1:{sys.argv[2]}/metrics", "address": "127.0.0.1",
        "port": int(sys.argv[2]), "requested_port": 0, "pid": os.getpid(), "host": "here",
        "node_rank": 0, "exports": ["run", "gpus"], "started_at": time.time(),
        "labels": {"run": run.path.name, "sweep": "", "experiment": "", "user": "ann",
                   "host": "here", "slurm_job_id": ""}})
print("ready", flush=True)
sys.stdin.read()
"""


def hold(run_dir: Path, port: str) -> subprocess.Popen:
    proc = subprocess.Popen([PYTHON, "-c", HOLDER, str(run_dir), port], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=PROJECT)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def listed(out: Path) -> dict[str, dict]:
    return {entry["labels"]["run"]: entry for entry in json.loads(out.read_text())}


def test_monitor_targets_lists_the_runs_alive_now(tmp_path):
    outputs = tmp_path / "outputs" / "2026-01-01"
    sweep = tmp_path / "multirun" / "2026-01-01" / "10-00-00-abcd"
    live, killed, ended = hold(outputs / "live", "41001"), hold(sweep / "0", "41002"), \
        hold(sweep / "1", "41003")
    no_endpoint = hold(outputs / "no-endpoint", "none")  # monitor.enabled=false
    out = tmp_path / "prom" / "targets" / "labrun.json"
    try:
        run_labrun("monitor", "targets", str(tmp_path / "outputs"), str(tmp_path / "multirun"),
                   "--out", str(out))
        assert set(listed(out)) == {"live", "0", "1"}
        assert listed(out)["live"] == {"targets": ["127.0.0.1:41001"], "labels": {
            "run": "live", "sweep": "", "experiment": "", "user": "ann", "host": "here",
            "slurm_job_id": "", "node_rank": "0"}}

        killed.kill()  # no clean exit: its lock file stays, naming a PID that is gone
        killed.wait()
        ended.stdin.close()  # a clean end releases the lock
        assert ended.wait(timeout=60) == 0
        assert (sweep / "0" / ".lock").exists() and not (sweep / "1" / ".lock").exists()
        assert (sweep / "1" / "monitor" / "node-0.json").exists()
        run_labrun("monitor", "targets", str(tmp_path / "outputs"), str(tmp_path / "multirun"),
                   "--out", str(out))
        assert set(listed(out)) == {"live"}
    finally:
        for proc in (live, killed, ended, no_endpoint):
            proc.kill()
            proc.wait()


def test_monitor_targets_watch_drops_a_run_when_it_ends(tmp_path):
    live = hold(tmp_path / "outputs" / "run", "41004")
    out = tmp_path / "labrun.json"
    watch = subprocess.Popen([LABRUN, "monitor", "targets", str(tmp_path / "outputs"), "--out",
                              str(out), "--watch", "0.2"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and listed(out)):
            assert watch.poll() is None, watch.stderr.read()
            assert time.monotonic() < deadline, "the live run was never listed"
            time.sleep(0.1)
        live.stdin.close()
        live.wait(timeout=60)
        while listed(out):
            assert watch.poll() is None, watch.stderr.read()
            assert time.monotonic() < deadline, "the ended run stayed listed"
            time.sleep(0.1)
    finally:
        live.kill()
        live.wait()
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0


def test_monitor_targets_names_a_missing_root(tmp_path):
    result = run_labrun("monitor", "targets", str(tmp_path / "nope"), "--out",
                        str(tmp_path / "t.json"), check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {tmp_path / 'nope'}: no such folder")


def test_monitor_queue_refuses_a_cache_that_would_load_the_controller():
    # Refused before anything is served or asked (the exporter itself: tests/test_queue_exporter.py).
    result = run_labrun("monitor", "queue", "--cache", "2", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --cache 2: give 10 seconds or more (two Prometheus servers scraping every 15 s "
        "would otherwise load the SLURM controller)"]


def fake_slurm_commands(folder: Path) -> Path:
    """squeue, sshare and sinfo that write their name to folder/calls and answer an empty
    queue: what the exporter asks SLURM, counted, without a cluster. Returns folder."""
    folder.mkdir()
    for name in ("squeue", "sshare", "sinfo"):
        (folder / name).write_text(f'#!/bin/sh\necho {name} >> "{folder}/calls"\n')
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize(("cache_s", "queries"), [(2, 6), (10, 6), (30, 2)],
                         ids=["below-the-minimum", "the-minimum", "longer"])
def test_the_queue_exporter_asks_slurm_once_a_cache_period_however_often_it_is_scraped(
        cache_s, queries, tmp_path, monkeypatch):
    """30 scrapes 2 s apart (Prometheus's interval in tests/test_queue_exporter.py) on a clock
    the test moves: SLURM is asked at the first and once each cache period after (10 s at
    least), judged by the commands' calls; 8 scrapes at one moment share one query."""
    from labrun.monitoring import queue_exporter

    fake = fake_slurm_commands(tmp_path / "slurm")
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LABRUN_SLURM_CONFIGLESS", "1")  # the fakes need no slurm.conf
    now = [1_800_000_000.0]
    monkeypatch.setattr(queue_exporter, "time", SimpleNamespace(
        time=lambda: now[0], mktime=time.mktime, strptime=time.strptime))

    def asked() -> Counter:
        calls = fake / "calls"
        return Counter(calls.read_text().split() if calls.exists() else [])

    server, port = queue_exporter.serve(0, "127.0.0.1", cache_s)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        def scrape() -> str:
            return client.get("/metrics").text

        for _ in range(30):
            assert re.search(r"(?m)^labrun_queue_up 1\.0$", scrape())
            now[0] += 2
        assert asked() == dict.fromkeys(("squeue", "sshare", "sinfo"), queries)
        now[0] += 60  # the snapshot is stale: the first of these scrapes asks, the rest share it
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: scrape(), range(8)))
        assert asked() == dict.fromkeys(("squeue", "sshare", "sinfo"), queries + 1)
    finally:
        client.close()
        server.shutdown()


# -- the Prometheus harness and `labrun monitor up` ---------------------------------------------


def test_a_config_prometheus_rejects_fails_with_its_own_error(tmp_path):
    from labrun.monitoring import prometheus

    tool("prometheus")
    config = tmp_path / "bad.yml"
    config.write_text("global:\n  scrape_interval: every now and then\n")
    with pytest.raises(prometheus.PrometheusError) as failed:
        prometheus.start(config, tmp_path / "data", tmp_path / "prometheus.log")
    message = str(failed.value)
    # Noticed as an exit (not a wait for /-/ready that runs out), with Prometheus's own words.
    assert message.startswith("prometheus exited (2): ") and "\n" not in message, message
    assert "Error loading config" in message and "not a valid duration string" in message, message


def test_monitor_up_without_prometheus_names_the_install(tmp_path):
    # Only the virtual environment on PATH: no prometheus there.
    env = {**os.environ, "PATH": str(Path(LABRUN).parent)}
    result = subprocess.run([LABRUN, "monitor", "up", "--output-root", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sudo apt-get install prometheus" in lines[0], result.stderr
    assert not (tmp_path / ".prometheus").exists()


def test_monitor_up_serves_the_shipped_rules_and_stops_on_ctrl_c(tmp_path):
    tool("prometheus")
    live = hold(tmp_path / "outputs" / "run", "41005")
    up = subprocess.Popen([LABRUN, "monitor", "up", "--port", "0", "--roots",
                           str(tmp_path / "outputs"), "--output-root", str(tmp_path / "outputs"),
                           "--refresh", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    try:
        line = up.stdout.readline()
        assert line.startswith("Prometheus: http://127.0.0.1:"), line + up.stderr.read()
        url = line.split()[1]
        rules = httpx.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert {rule["name"] for group in rules for rule in group["rules"]} >= {
            "LabrunStalled", "LabrunTargetDown"}
        config = httpx.get(f"{url}/api/v1/status/config", timeout=10).json()["data"]["yaml"]
        targets_file = tmp_path / "outputs" / ".prometheus" / "targets" / "labrun.json"
        assert str(targets_file) in config
        assert listed(targets_file)["run"]["targets"] == ["127.0.0.1:41005"]
        assert (tmp_path / "outputs" / ".prometheus" / "data").is_dir()
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=60)
        live.kill()
        live.wait()
    assert code == 0
    # Its Prometheus is gone with it: nothing listens on the URL any more.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/-/ready", timeout=5)
