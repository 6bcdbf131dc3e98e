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
from labrun.deploy.served import serving
from labrun.monitoring import prometheus
from labrun.runs.rundir import RunDir

# A run that trains one long epoch until the test stops it: synthetic images (no data to
# read), a point logged every step, a checkpoint after the 5th step for the server.
TRAIN = ["dataset=synthetic", "dataset.num_train=200000", "dataset.num_val=64",
         "trainer.max_epochs=1", "trainer.limit_train_batches=3000",
         "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=5", "checkpoint.keep_last=1"]
# What Prometheus stores is checked against the run's own log, not against a labrun counter:
# the steps of metrics.jsonl times the global batch. A point is logged every step, at a time
# when the run has taken exactly that point's steps, so a scrape read between two points
# logged one step apart saw one of those two step counts (`bracket`). Over a window from such
# a scrape to a later one, the counter's increase, and so rate() (Prometheus's slope between
# the two), is then known to within one step at each end: for a window of MIN_STEPS steps
# that is 1/25 = 4% each way, and the check allows that and no more. MIN_SPAN_S: at least
# ten 1-second scrapes apart, so that rate() is a rate.
MIN_STEPS, MIN_SPAN_S = 25, 10.0
# Both clocks are this machine's; metrics.jsonl rounds its times to the millisecond and
# Prometheus its timestamps: a bracket is widened by that much on each side.
CLOCK_S = 0.002
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


def series(prom: prometheus.Prometheus, name: str) -> dict[float, float]:
    """Every sample Prometheus holds of the run's `name` (scrape time -> value)."""
    rows = query(prom, f'{name}{{job="labrun"}}[1h]')
    return {float(t): float(v) for t, v in rows[0]["values"]} if rows else {}


def bracket(points: list[dict], at: float, took: float) -> tuple[int, int] | None:
    """The fewest and most steps the run can have taken when a scrape that started at `at`
    and took `took` seconds read its counters: the steps of the last point logged before it
    and of the first logged after it. None unless a point lies on each side."""
    before = [p["step"] for p in points if p["time"] <= at - CLOCK_S]
    after = [p["step"] for p in points if p["time"] > at + took + CLOCK_S]
    return (max(before), min(after)) if before and after else None


def window(prom: prometheus.Prometheus, run_dir: Path) -> list[tuple[float, int, int]] | None:
    """The scrapes whose step count is known to within one step, (time, fewest, most), once
    the first and the last of them are MIN_STEPS steps and MIN_SPAN_S seconds apart; None
    before."""
    took = series(prom, "scrape_duration_seconds")
    points = read_metrics(run_dir)
    known = []
    for at in sorted(series(prom, "labrun_train_samples_total")):
        steps = bracket(points, at, took.get(at, 0.0)) if at in took else None
        if steps is not None and steps[1] - steps[0] == 1:
            known.append((at, *steps))
    if len(known) < 2 or known[-1][1] - known[0][2] < MIN_STEPS or (
            known[-1][0] - known[0][0] < MIN_SPAN_S):
        return None
    return known


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
            until(lambda: series(prom, "labrun_train_samples_total"),
                  "Prometheus's first scrape of the run", train, watch)
            until(lambda: window(prom, run_dir), f"scrapes {MIN_STEPS} steps and "
                  f"{MIN_SPAN_S:.0f} s apart", train)
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

        known = window(prom, run_dir)
        start, end = known[0][0], known[-1][0]
        rows = query(prom, 'labrun_train_samples_total{job="labrun"}', at=end)
        assert len(rows) == 1
        labels = rows[0]["metric"]
        assert labels["job"] == "labrun" and labels["run"] == "run"
        assert labels["node_rank"] == "0" and labels["instance"] == (
            f"127.0.0.1:{endpoint['port']}")

        # Each scrape: the images counter is the step counter of the same scrape times the
        # global batch (one process: its batch), and that step count is the log's.
        batch = RunDir(run_dir).saved_config()["trainer"]["batch_size"]
        images, steps = (series(prom, name) for name in ("labrun_train_samples_total",
                                                        "labrun_train_steps_total"))
        for at, fewest, most in known:
            assert images[at] == steps[at] * batch, (at, images[at], steps[at])
            assert fewest <= steps[at] <= most, (at, steps[at], fewest, most)

        # Images/s over the window, as the dashboard reads it: rate() over exactly the span
        # from its first scrape to its last (1 ms more, so that the first is inside), which is
        # their slope; the log says it lies between the fewest and the most images the run
        # can have trained in that span.
        span = end - start
        scraped = float(query(prom, f'rate(labrun_train_samples_total{{job="labrun"}}'
                                    f'[{round(span * 1000) + 1}ms])', at=end)[0]["value"][1])
        low = (known[-1][1] - known[0][2]) * batch / span
        high = (known[-1][2] - known[0][1]) * batch / span
        print(f"images/s over {span:.1f} s ({known[-1][1] - known[0][2]}+ steps of {batch}): "
              f"Prometheus {scraped:.2f}, the run's log {low:.2f}-{high:.2f}")
        # 1e-6: the timestamps' float rounding in the span (Prometheus keeps integer ms).
        assert low * (1 - 1e-6) <= scraped <= high * (1 + 1e-6), (
            f"Prometheus: {scraped:.2f} images/s; from the run's log, {low:.2f}-{high:.2f} "
            f"over the same {span:.1f} s")
