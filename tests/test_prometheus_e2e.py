"""End to end: a real Prometheus finds a real training run through `labrun monitor targets`,
scrapes it and a real `labrun serve`, and what it stores agrees with what the run logged and with
the requests sent.

Prometheus (Debian's, on 127.0.0.1, a free port) scrapes every second with the shipped
monitoring/prometheus.yml and rules; the training run's target file is written by `labrun
monitor targets --watch`, the server's by this test (it has no run folder). Missing prometheus
is a failure naming the fix, not a skip.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import LABRUN, read_metrics, start_train, wait_for
from labrun.deploy import prometheus
from labrun.deploy.served import serving

# A run that trains one long epoch until the test stops it: synthetic images (no data to
# read), a point logged every 5 steps, a checkpoint after the 5th step for the server.
TRAIN = ["dataset=synthetic", "dataset.num_train=200000", "dataset.num_val=64",
         "trainer.max_epochs=1", "trainer.limit_train_batches=3000",
         "trainer.log_every_n_steps=5", "checkpoint.every_n_steps=5", "checkpoint.keep_last=1"]
# The comparison window: at least this many logged points over at least this many seconds,
# all of them after Prometheus's first scrape of the run. 6 points are 25 steps: where a loaded
# machine takes seconds per step, the counter moves in steps of one batch, and one step more or
# less at the window's ends is then at most 4% each way.
MIN_POINTS, MIN_SPAN_S = 6, 10.0
TOLERANCE = 0.25
# Everything below is waited for; a deadline turns a hang into a failure. Under the load of
# the whole suite a step took up to 2.5 s here (a point every 12 s).
DEADLINE_S = 300
GOOD, BAD = 7, 3  # requests the test sends the server: answered 200, refused 400


def query(prom: prometheus.Prometheus, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    answer = httpx.get(f"{prom.url}/api/v1/query", params=params, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def until(condition, what: str, *procs: subprocess.Popen):
    """condition()'s first truthy value; fails when a process ends first or time runs out."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        for proc in procs:
            assert proc.poll() is None, f"{proc.args[:3]} ended while waiting for {what}"
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.25)


def png() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 120, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def steady_window(run_dir: Path, first_scrape: float) -> list[dict] | None:
    """The logged training points after Prometheus's first scrape of the run, once there are
    enough of them (MIN_POINTS over MIN_SPAN_S); None before."""
    points = [row for row in read_metrics(run_dir) if "perf/images_per_s" in row]
    points = [row for row in points if row["time"] >= first_scrape]
    if len(points) < MIN_POINTS or points[-1]["time"] - points[0]["time"] < MIN_SPAN_S:
        return None
    return points


def test_prometheus_scrapes_a_training_run_and_a_server(tmp_path):
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: run scripts/setup.sh as root (it installs "
                    "Debian's prometheus package)")
    root = tmp_path / "outputs"
    run_dir = root / "run"
    run_targets = tmp_path / "targets" / "labrun.json"
    serve_targets = tmp_path / "targets" / "serve.json"
    root.mkdir()
    for file in (run_targets, serve_targets):
        file.parent.mkdir(exist_ok=True)
        file.write_text("[]\n")
    config = prometheus.local_config(run_targets, scrape_interval="1s")
    # The server's port is known only once it runs: its job reads a file too. The node and
    # DCGM examples are left out (nothing serves them here).
    config["scrape_configs"] = [job for job in config["scrape_configs"]
                                if job["job_name"] == prometheus.LABRUN_JOB] + [
        {"job_name": prometheus.SERVE_JOB,
         "file_sd_configs": [{"files": [str(serve_targets)]}]}]
    prometheus.write_config(tmp_path / "prometheus.yml", config)

    with prometheus.running(tmp_path / "prometheus.yml", tmp_path / "data",
                            tmp_path / "prometheus.log") as prom, \
            open(tmp_path / "train.log", "w") as train_log:
        watch = subprocess.Popen([LABRUN, "monitor", "targets", str(root), "--out",
                                  str(run_targets), "--watch", "0.5"],
                                 stderr=subprocess.DEVNULL)
        train = start_train(*TRAIN, run_dir=run_dir, output=train_log)
        try:
            wait_for(run_dir / "monitor" / "node-0.json", train, timeout=DEADLINE_S)
            endpoint = json.loads((run_dir / "monitor" / "node-0.json").read_text())
            wait_for(run_dir / "checkpoints" / "last.pt", train, timeout=DEADLINE_S)

            # The server, while the run trains: a known number of answered and refused requests.
            with serving(run_dir / "checkpoints" / "last.pt", tmp_path / "serve.log",
                         timeout_s=DEADLINE_S) as served:
                serve_targets.write_text(json.dumps([{"targets": [f"127.0.0.1:{served.port}"],
                                                      "labels": {}}]))
                image = png()
                for _ in range(GOOD):
                    answer = httpx.post(f"{served.url}/predict", timeout=30,
                                        files={"file": ("a.png", image)})
                    assert answer.status_code == 200, answer.text
                for _ in range(BAD):
                    answer = httpx.post(f"{served.url}/predict", timeout=30,
                                        files={"file": ("a.jpg", b"GIF89a no image")})
                    assert answer.status_code == 400, answer.text

                def counted():
                    found = {row["metric"]["status"]: float(row["value"][1]) for row in query(
                        prom, 'labrun_serve_requests_total{job="labrun-serve",route="/predict"}')}
                    return found if sum(found.values()) >= GOOD + BAD else None

                assert until(counted, "the server's requests in Prometheus",
                             served.process) == {"200": GOOD, "400": BAD}

            # The run: found through the target file, with its labels, scraped every second.
            def first_scrape():
                rows = query(prom, 'labrun_train_samples_total{job="labrun"}[10m]')
                return rows and float(rows[0]["values"][0][0])

            first = until(first_scrape, "Prometheus's first scrape of the run", train, watch)
            points = until(lambda: steady_window(run_dir, first),
                           f"{MIN_POINTS} logged points over {MIN_SPAN_S:.0f} s", train)
            train.send_signal(signal.SIGINT)  # a checkpoint, then "interrupted"
            assert train.wait(timeout=DEADLINE_S) == 130  # labrun's exit code for it
            # It ended: its lock is released, and the next refresh drops it from the file.
            until(lambda: json.loads(run_targets.read_text()) == [], "the ended run to leave "
                  "the target file", watch)
        finally:
            train.kill()
            train.wait()
            watch.send_signal(signal.SIGINT)
            watch.wait(timeout=30)

        start, end = points[0]["time"], points[-1]["time"]
        series = query(prom, 'labrun_train_samples_total{job="labrun"}', at=end)
        assert len(series) == 1
        labels = series[0]["metric"]
        assert labels["job"] == "labrun" and labels["run"] == "run"
        assert labels["node_rank"] == "0" and labels["instance"] == (
            f"127.0.0.1:{endpoint['port']}")
        grown_from = float(query(prom, 'labrun_train_samples_total{job="labrun"}',
                                 at=start)[0]["value"][1])
        grown_to = float(series[0]["value"][1])
        assert grown_to > grown_from > 0

        # Images/s over the same span, both ways. Each logged point's perf/images_per_s covers
        # the time since the point before it, so over (start, end] the run's own figure is
        # those rates weighted by the time each covers (images over seconds, as the counter's
        # rate is), not their plain mean. The span starts at a logged point after Prometheus's
        # first scrape and ends at a later logged point inside the same epoch: no validation
        # pause (which the logged rates leave out and the counter's rate would not) and no
        # part of the span before Prometheus saw the run (which rate() cannot extrapolate to).
        covered = [(row["perf/images_per_s"], row["time"] - before["time"])
                   for before, row in zip(points, points[1:], strict=False)]
        logged = sum(rate * seconds for rate, seconds in covered) / (end - start)
        span_ms = round((end - start) * 1000)
        scraped = float(query(prom, f'rate(labrun_train_samples_total{{job="labrun"}}'
                                    f'[{span_ms}ms])', at=end)[0]["value"][1])
        print(f"images/s over {end - start:.1f} s ({len(points)} logged points): Prometheus "
              f"{scraped:.2f}, the run's log {logged:.2f}")
        assert abs(scraped - logged) <= TOLERANCE * logged, (
            f"Prometheus: {scraped:.1f} images/s, the run logged {logged:.1f} images/s over the "
            f"same {end - start:.1f} s")
