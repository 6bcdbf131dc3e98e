"""Clients that load `labrun serve` for the serving benchmark (serve.py): a /predict request's
body built once (multipart_body), the call each client thread makes (post_call), and measure(),
which times a number of calls shared by concurrent threads: their rate, median and p99 latency,
and the failed calls. The same measure() times the runtime called directly, the baseline.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from typing import Any

BOUNDARY = "labrun-bench-boundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"


def multipart_body(filename: str, jpeg: bytes) -> bytes:
    """A /predict request's body: the multipart form of one file field, as a browser sends it.
    Written here rather than by an HTTP library so that it is built once, not per request."""
    head = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{filename}"\r\nContent-Type: image/jpeg\r\n\r\n')
    return head.encode() + jpeg + f"\r\n--{BOUNDARY}--\r\n".encode()


def new_client(port: int) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=60)


def post_call(bodies: list[bytes]):
    """POST /predict of bodies[i]: true for a 200 answer that holds a top-k list."""
    def call(client: http.client.HTTPConnection, i: int) -> bool:
        try:
            client.request("POST", "/predict", body=bodies[i % len(bodies)],
                           headers={"Content-Type": CONTENT_TYPE})
            response = client.getresponse()
            answer = response.read()
        except (OSError, http.client.HTTPException):
            client.close()  # the next request opens a fresh connection
            raise
        return response.status == 200 and bool(json.loads(answer)["top"])
    return call


def measure(make_client, call, requests: int, clients: int, warmup: int = 2) -> dict[str, Any]:
    """`requests` calls shared by `clients` threads after `warmup` calls each."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(requests))
    lock = threading.Lock()
    start_line = threading.Barrier(clients + 1)

    def client_loop(worker: int) -> None:
        nonlocal errors
        client = make_client()
        for j in range(warmup):
            try:
                call(client, worker + j)
            except Exception:  # noqa: BLE001 - the measured calls will count it
                pass
        start_line.wait()
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            t0 = time.perf_counter()
            try:
                ok = call(client, i)
            except Exception:  # noqa: BLE001 - a failed request is counted, not fatal
                ok = False
            elapsed = time.perf_counter() - t0
            with lock:
                latencies.append(elapsed)
                errors += not ok
        if client is not None:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(clients)]
    for thread in threads:
        thread.start()
    start_line.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    ms = sorted(x * 1000 for x in latencies)
    return {"per_s": len(ms) / wall, "p50_ms": statistics.median(ms),
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "errors": errors,
            "count": len(ms), "seconds": wall}
