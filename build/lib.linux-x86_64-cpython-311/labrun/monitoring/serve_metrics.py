"""Prometheus metrics of `labrun serve`: GET /metrics on the server's own address and port.

    labrun_serve_requests_total{route,status}          counter: answered requests
    labrun_serve_request_duration_seconds{route}       histogram: from the request's arrival in
                                                       the app to its answer's last byte
    labrun_serve_requests_in_progress{route}           gauge: requests being handled now
    labrun_serve_model_info{model,format} = 1          the served model file and its format

`route` is the route's template ("/predict", "/predict/batch", ...), never the raw path, so that
a client inventing paths cannot create series: anything no route matches is "unmatched".
Scrapes of /metrics are not counted. A request uvicorn itself refuses (503 past
MAX_CONCURRENCY, a malformed request head) never reaches the app and is not counted either.

With `--workers N` every worker records into prometheus_client's multiprocess files and a scrape,
whichever worker answers it, adds all of them up: the `labrun serve` process calls
`prepare(workers)` before uvicorn starts its workers (a fresh folder in PROMETHEUS_MULTIPROC_DIR,
which every worker inherits and must have before it imports prometheus_client) and `cleanup()`
when the server stops. With one process the metrics live in memory, in a registry of their own.

Hand-written rather than starlette-exporter or prometheus-fastapi-instrumentator: their metric
and label names (path/handler, status_code, method) are not the ones labrun's dashboards and
alerts use, and what remains to write is the route lookup and the timing below.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

ENV_DIR = "PROMETHEUS_MULTIPROC_DIR"
METRICS_PATH = "/metrics"
UNMATCHED = "unmatched"

REQUESTS = "labrun_serve_requests_total"
DURATION = "labrun_serve_request_duration_seconds"
IN_PROGRESS = "labrun_serve_requests_in_progress"
MODEL_INFO = "labrun_serve_model_info"
FAMILIES = (REQUESTS, DURATION, IN_PROGRESS, MODEL_INFO)


def metrics_url(host: str, port: int) -> str:
    """Where a server bound to HOST:PORT answers scrapes."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{METRICS_PATH}"


# ---------------------------------------------------------------------------------------------
# The `labrun serve` process


def prepare(workers: int) -> Path | None:
    """Before uvicorn starts: with several workers, a fresh, empty folder for the multiprocess
    files, named in PROMETHEUS_MULTIPROC_DIR for the workers to inherit; None with one.

    A folder the caller's environment already names is never used: files left in it by earlier
    runs or other programs would be added to this server's figures."""
    for name in (ENV_DIR, ENV_DIR.lower()):  # prometheus_client also reads the old lower-case
        os.environ.pop(name, None)
    if workers == 1:
        return None
    folder = Path(tempfile.mkdtemp(prefix="labrun-serve-metrics-"))
    os.environ[ENV_DIR] = str(folder)
    return folder


def cleanup(folder: Path | None) -> None:
    """When the server has stopped: remove the multiprocess folder."""
    if folder is not None:
        os.environ.pop(ENV_DIR, None)
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# In each server process


class ServeMetrics:
    """The outermost ASGI layer of the app: answers GET /metrics and measures every other
    request. `routes` are the FastAPI app's routes (to name a request's route template),
    `app` is what handles requests (the app inside its upload limit, so that a 413 the limit
    answers is counted under its route too)."""

    def __init__(self, app, routes, *, model: str, model_format: str):
        # prometheus_client is imported here, in the server process, not when this module is:
        # it chooses between in-memory and multiprocess values once, when it is first imported,
        # from PROMETHEUS_MULTIPROC_DIR, which prepare() sets or clears first.
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess

        self.app, self.routes = app, list(routes)
        self.folder = os.environ.get(ENV_DIR)
        prometheus_client.disable_created_metrics()  # no *_created series
        self.registry = CollectorRegistry()
        if self.folder:
            # The metrics write to the folder; a scrape reads every process's files there.
            multiprocess.MultiProcessCollector(self.registry, path=self.folder)
        own = None if self.folder else self.registry
        self.requests = Counter(REQUESTS, "requests answered, by route template and status",
                                ["route", "status"], registry=own)
        self.duration = Histogram(DURATION, "seconds from a request's arrival to its answer's "
                                  "last byte, by route template", ["route"], registry=own)
        # livesum/livemax: a worker that died stops counting (see forget_dead_workers).
        self.in_progress = Gauge(IN_PROGRESS, "requests being handled now, by route template",
                                 ["route"], registry=own, multiprocess_mode="livesum")
        info = Gauge(MODEL_INFO, "the served model (file name) and its format",
                     ["model", "format"], registry=own, multiprocess_mode="livemax")
        info.labels(model, model_format).set(1)
        self.expose = prometheus_client.make_asgi_app(self.registry)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == METRICS_PATH:
            if self.folder:
                forget_dead_workers(self.folder)
            await self.expose(scope, receive, send)
            return
        route = self.route_of(scope)
        in_progress = self.in_progress.labels(route)
        in_progress.inc()
        start = time.perf_counter()
        status: int | None = None
        finished = False

        def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                self.requests.labels(route, str(status or 500)).inc()
                self.duration.labels(route).observe(time.perf_counter() - start)
                in_progress.dec()

        async def measured_send(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # Counted before the last byte leaves: a client that scrapes right after its
                # answer arrived finds its request counted, whichever worker it asks.
                finish()
            await send(message)

        try:
            await self.app(scope, receive, measured_send)
        finally:
            finish()  # no complete answer: the app failed (uvicorn answers 500) or the client left

    def route_of(self, scope) -> str:
        """The template of the route the router will pick: the first full match, else the first
        partial one (the right path with another method: 405)."""
        from starlette.routing import Match

        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route.path
            if match == Match.PARTIAL and partial is None:
                partial = route.path
        return partial or UNMATCHED


def forget_dead_workers(folder: str) -> None:
    """Drop the live gauges of workers that are gone (uvicorn restarts a worker that died or
    hung), which prometheus_client would otherwise keep adding up. A gunicorn server does this
    in its child_exit hook; uvicorn has none, so it happens before each scrape. Their counters
    and histograms stay: what they answered was answered."""
    from prometheus_client import multiprocess

    for file in Path(folder).glob("gauge_live*_*.db"):
        pid = int(file.stem.rsplit("_", 1)[1])
        if not is_alive(pid):
            multiprocess.mark_process_dead(pid, folder)


def is_alive(pid: int) -> bool:
    """False for a process that is gone or a zombie: a dead worker stays a zombie until
    uvicorn's supervisor notices, which can take its whole health-check timeout (60 s) when it
    was waiting for that worker's answer to a ping."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the PID: alive, not ours to judge
        return True
    try:  # Linux: the state letter follows the parenthesised command name
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc here: the signal test has to do
        return True
    return state not in ("Z", "X")
