"""`labrun serve MODEL` in a subprocess on a free 127.0.0.1 port, for benchmarks and tests.

    with serving(model, log_file) as served:
        httpx.get(f"{served.url}/health")
        httpx.get(served.metrics_url)       # its Prometheus metrics

It starts the real command (python -m labrun.cli serve), so what is measured or tested is what
a user runs; it imports neither FastAPI nor the model.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from labrun.core.errors import LabrunError
from labrun.monitoring.serve_metrics import METRICS_PATH


@dataclass
class Served:
    url: str
    port: int
    process: subprocess.Popen

    @property
    def metrics_url(self) -> str:
        """Where Prometheus scrapes the server (labrun.monitoring.serve_metrics)."""
        return f"{self.url}{METRICS_PATH}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(model: str | Path, log: Path, *, args: Sequence[str] = (), cwd: Path | None = None,
            env: dict[str, str] | None = None, timeout_s: float = 120,
            python: str = sys.executable) -> Iterator[Served]:
    """`labrun serve MODEL` on a free 127.0.0.1 port, until /health answers; stopped by PID.
    `python`: the environment whose labrun serves (default: this one)."""
    import httpx

    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen([python, "-m", "labrun.cli", "serve", str(model),
                                    "--port", str(port), *args], cwd=cwd, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
    served = Served(f"http://127.0.0.1:{port}", port, process)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise LabrunError(f"labrun serve exited with {process.returncode}: "
                                  f"{log.read_text(errors='replace')[-500:]}")
            if time.monotonic() > deadline:
                raise LabrunError(f"labrun serve did not answer /health within {timeout_s:.0f} s")
            try:
                if httpx.get(f"{served.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield served
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
