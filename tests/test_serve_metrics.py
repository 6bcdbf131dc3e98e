"""GET /metrics of `labrun serve`, scraped from real server processes on 127.0.0.1: the figures
equal the requests the test sent (by route template and status, 4xx included), scrapes are not
counted, and with --workers 2 the figures of both worker processes add up.

Every check compares two scrapes, before and after the test's requests: serving() itself asks
/health until the server answers, and those requests are counted too."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import PROJECT, digit_jpeg
from labrun.deploy.served import serving
from labrun.monitoring.serve_metrics import FAMILIES

REQUESTS = "labrun_serve_requests_total"
COUNT = "labrun_serve_request_duration_seconds_count"
IN_PROGRESS = "labrun_serve_requests_in_progress"
MAX_UPLOAD_MB = 0.05  # so that a 100 KB body is refused with 413 by the upload limit


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return digit_jpeg()


@pytest.fixture(scope="module")
def server_tmpdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("metrics_server_tmp")


@pytest.fixture(scope="module")
def server(onnx_model, server_tmpdir, tmp_path_factory):
    """One `labrun serve` process (no --workers), with server_tmpdir as its TMPDIR."""
    log = tmp_path_factory.mktemp("metrics_server") / "server.log"
    try:
        with serving(onnx_model, log, args=("--max-upload-mb", str(MAX_UPLOAD_MB)), cwd=PROJECT,
                     env={**os.environ, "TMPDIR": str(server_tmpdir)}) as served:
            yield served
    finally:
        print(log.read_text(errors="replace")[-3000:])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[str, Samples]:
    """The exposition text and its samples, parsed by prometheus_client's own parser."""
    answer = httpx.get(url, timeout=30)  # 30 s: a scrape on a loaded machine, with slack
    assert answer.status_code == 200, answer.text
    samples: Samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return answer.text, samples


def delta(after: Samples, before: Samples, name: str) -> dict[tuple, float]:
    """What each series of `name` gained between two scrapes (a series new since then counts
    from 0), keyed by its labels; series that did not change are left out."""
    gained = {labels: value - before.get((n, labels), 0.0)
              for (n, labels), value in after.items() if n == name}
    return {labels: value for labels, value in gained.items() if value}


def series(samples: Samples, name: str) -> dict[tuple, float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def send(url: str, method: str, path: str, **request) -> int:
    """One request on a connection of its own (top-level httpx: no pooling), so that with
    several workers each request may be accepted by any of them."""
    # 60 s: one small prediction on a loaded machine, with slack.
    return httpx.request(method, f"{url}{path}", timeout=60, **request).status_code


def test_requests_are_counted_by_route_template_and_status(server, server_tmpdir, jpeg):
    text, before = scrape(server.metrics_url)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {name.removesuffix("_total") for name in FAMILIES} <= names, names
    sent = [  # (method, path, request, route label, expected status)
        ("POST", "/predict", dict(files={"file": ("a.jpg", jpeg)}), "/predict", 200),
        ("POST", "/predict", dict(files={"file": ("b.jpg", jpeg)}), "/predict", 200),
        ("POST", "/predict?k=3", dict(files={"file": ("c.jpg", jpeg)}), "/predict", 200),
        ("POST", "/predict", dict(files={"file": ("junk.jpg", b"not an image")}), "/predict",
         400),
        ("POST", "/predict", dict(files={"image": ("a.jpg", jpeg)}), "/predict", 422),
        ("POST", "/predict", dict(files={"file": ("big.jpg", b"x" * 100_000)}), "/predict",
         413),
        ("GET", "/predict", {}, "/predict", 405),
        ("POST", "/predict/batch", dict(files=[("files", ("a.jpg", jpeg)),
                                               ("files", ("b.jpg", jpeg))]),
         "/predict/batch", 200),
        ("GET", "/health", {}, "/health", 200),
        ("GET", "/metadata", {}, "/metadata", 200),
        # Raw paths no route matches share one series, whatever a client invents.
        ("GET", "/no/such/path-1", {}, "unmatched", 404),
        ("GET", "/no/such/path-2", {}, "unmatched", 404),
    ]
    expected: Counter = Counter()
    for i, (method, path, request, route, status) in enumerate(sent):
        assert send(server.url, method, path, **request) == status, path
        expected[(("route", route), ("status", str(status)))] += 1
        if i % 4 == 0:
            scrape(server.metrics_url)  # scrapes in between must not be counted
    text, after = scrape(server.metrics_url)

    assert delta(after, before, REQUESTS) == dict(expected)
    assert not any("/metrics" in str(labels) or "path-" in str(labels)
                   for _, labels in after), "a /metrics or raw-path series"
    # The histogram counts every request once, under its route.
    per_route: Counter = Counter()
    for (route, _), n in expected.items():
        per_route[(route,)] += n
    assert delta(after, before, COUNT) == dict(per_route)
    for (route,) in per_route:
        labels = (route,)
        assert after[("labrun_serve_request_duration_seconds_bucket",
                      tuple(sorted([route, ("le", "+Inf")])))] == after[(COUNT, labels)]
        assert after[("labrun_serve_request_duration_seconds_sum", labels)] > 0
    assert set(series(after, IN_PROGRESS).values()) == {0.0}  # nothing in flight now
    assert series(after, "labrun_serve_model_info") == {
        (("format", "onnx"), ("model", "digits.onnx")): 1.0}
    assert "_created" not in text
    # One process: its figures live in memory, no multiprocess folder in its TMPDIR.
    assert list(server_tmpdir.glob("labrun-serve-metrics-*")) == []


def test_a_request_in_flight_is_in_progress(server, jpeg):
    """A request whose head has arrived and whose body the app is waiting for (it asked for it:
    100 Continue) is in progress under its route until it is answered."""
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="d.jpg"\r\n'
            b"Content-Type: image/jpeg\r\n\r\n" + jpeg + b"\r\n--b--\r\n")
    head = (b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    predict = (("route", "/predict"),)
    # 30 s: answers that come in well under a second; slack for a loaded machine.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head)
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")
        _, during = scrape(server.metrics_url)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    _, after = scrape(server.metrics_url)
    assert during[(IN_PROGRESS, predict)] == 1.0
    assert after[(IN_PROGRESS, predict)] == 0.0


def child_pids(pid: int) -> set[int]:
    return {int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()}


def pids_with(folder: Path, pattern: str) -> set[int]:
    """The PIDs of the processes that wrote multiprocess files `pattern` (..._PID.db)."""
    return {int(f.stem.rsplit("_", 1)[1]) for f in folder.glob(pattern)}


def test_two_workers_add_up(onnx_model, jpeg, tmp_path):
    """--workers 2: requests on new connections until both worker processes have answered some
    (each has its counter file in the multiprocess folder), then every scrape, whichever worker
    answers it, reports the sum. A worker that dies keeps its counts and loses its live gauges;
    the folder is removed when the server stops."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    log = tmp_path / "server.log"
    try:
        with serving(onnx_model, log, args=("--workers", "2"), cwd=PROJECT,
                     env={**os.environ, "TMPDIR": str(tmpdir)}) as served:
            [folder] = tmpdir.glob("labrun-serve-metrics-*")
            _, before = scrape(served.metrics_url)
            statuses: Counter = Counter()
            # serving() returns once one worker answers; the other may still be importing
            # torch and loading the model (17+ s on a loaded 2-core machine): requests go on
            # until both have answered some, for up to 180 s, and at least 40 are sent.
            deadline = time.monotonic() + 180
            while ((len(pids_with(folder, "counter_*.db")) < 2 or sum(statuses.values()) < 40)
                   and time.monotonic() < deadline):
                files = {"file": ("d.jpg", jpeg if statuses[200] <= 3 * statuses[400]
                                  else b"junk")}
                statuses[send(served.url, "POST", "/predict", files=files)] += 1
            workers = pids_with(folder, "counter_*.db")
            assert len(workers) == 2 and workers <= child_pids(served.process.pid), workers
            assert set(statuses) == {200, 400}, statuses
            expected = {(("route", "/predict"), ("status", str(s))): float(n)
                        for s, n in statuses.items()}
            for _ in range(6):  # on new connections: both workers answer some of them
                text, after = scrape(served.metrics_url)
                assert delta(after, before, REQUESTS) == expected
                assert delta(after, before, COUNT) == {(("route", "/predict"),):
                                                       float(sum(statuses.values()))}
                assert series(after, "labrun_serve_model_info") == {
                    (("format", "onnx"), ("model", "digits.onnx")): 1.0}
                assert "_created" not in text

            # A worker killed (uvicorn starts another): its answers stay counted, its live
            # gauges go at the next scrape (it can no longer have requests in progress).
            dead = min(workers)
            assert dead in pids_with(folder, "gauge_livesum_*.db")
            os.kill(dead, signal.SIGKILL)
            deadline = time.monotonic() + 60  # a scrape, with slack for a loaded machine
            while dead in pids_with(folder, "gauge_live*_*.db") and time.monotonic() < deadline:
                _, after = scrape(served.metrics_url)
                time.sleep(0.2)
            assert dead not in pids_with(folder, "gauge_live*_*.db")
            # Its replacement joins: it has built its app (the model info gauge) and its
            # figures add up with the others'. Waited for also because a server stopped while
            # a worker starts can take longer to stop than serving() waits before killing it.
            deadline = time.monotonic() + 180  # a worker starts in 17+ s on a loaded machine
            while (len(pids_with(folder, "gauge_livemax_*.db")) < 2
                   and time.monotonic() < deadline):
                time.sleep(0.5)
            [replacement] = pids_with(folder, "gauge_livemax_*.db") - workers
            assert replacement in child_pids(served.process.pid)
            for _ in range(4):
                _, after = scrape(served.metrics_url)
                assert delta(after, before, REQUESTS) == expected
                assert series(after, "labrun_serve_model_info") == {
                    (("format", "onnx"), ("model", "digits.onnx")): 1.0}
    finally:
        print(log.read_text(errors="replace")[-3000:])
    assert not folder.exists()
