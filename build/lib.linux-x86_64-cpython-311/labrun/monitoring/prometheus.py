"""A local Prometheus server: Debian's /usr/bin/prometheus in a subprocess on 127.0.0.1.

    with running(config, storage, log_file) as prom:
        httpx.get(f"{prom.url}/api/v1/query", params={"query": "up"})

Used by `labrun monitor up` and by the tests. Prometheus is a Go binary, not a library, so it
runs as its own process: started with the given configuration, its port read from its own log
(with port 0 the kernel picks it and Prometheus only says which in its "Listening on" line),
ready when /-/ready answers, and stopped by PID. When it exits on its own (a configuration it
rejects, a storage folder another Prometheus holds) the error is its own last log line, in one
line, instead of a wait that never ends.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from labrun.core.errors import LabrunError
from labrun.core.files import write_text_atomic
from labrun.core.project import SHIPPED_MONITORING

INSTALL_HINT = ("install it: sudo apt-get install prometheus (scripts/setup.sh, which `make "
                "test` runs, installs it when run as root)")
# Prometheus writes logfmt: key=value or key="quoted value" (Go's strconv.Quote, whose
# escapes are JSON's for what it logs). Hand-parsed: two fields of one line do not need a
# logfmt library.
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')
MONITORING_DIR = SHIPPED_MONITORING  # the shipped prometheus.yml, rules, dashboard
LABRUN_JOB = "labrun"  # the scrape job of training runs, fed by `labrun monitor targets`
QUEUE_JOB = "labrun-queue"  # the scrape job of `labrun monitor queue`, the cluster's queue
SERVE_JOB = "labrun-serve"
START_TIMEOUT_S = 60.0  # /-/ready took 0.1 s here; a TSDB replaying a large WAL takes longer


class PrometheusError(LabrunError):
    """Prometheus is missing, or exited, or did not get ready; the message says why."""


@dataclass
class Prometheus:
    url: str  # http://127.0.0.1:PORT
    port: int
    process: subprocess.Popen
    log: Path

    def check_alive(self) -> None:
        """Raise PrometheusError, with Prometheus's own last error, if it has exited."""
        if self.process.poll() is not None:
            why = last_error(self.log)
            if "address already in use" in why:
                why += " (another program listens there: choose another port; 0: any free one)"
            raise PrometheusError(f"prometheus exited ({self.process.returncode}): {why}")

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM (Prometheus closes its storage and exits, under 3 s here), then kill."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def local_config(targets_file: str | Path, *, shipped: str | Path | None = None,
                 scrape_interval: str | None = None, queue_target: str | None = None
                 ) -> dict[str, Any]:
    """The shipped monitoring/prometheus.yml for a Prometheus run from anywhere: the labrun job
    reads `targets_file`, the rule files are absolute paths, and optionally another scrape
    (and rule evaluation) interval. The labrun-queue job scrapes `queue_target` (HOST:PORT of
    `labrun monitor queue`), and is left out without one: no SLURM cluster here. The example
    jobs (node-exporter, DCGM) stay: on a machine without those exporters their targets are
    merely down."""
    shipped = Path(shipped or MONITORING_DIR / "prometheus.yml")
    config = yaml.safe_load(shipped.read_text())
    config["rule_files"] = [str((shipped.parent / rule).resolve())
                            for rule in config.get("rule_files", [])]
    if scrape_interval:
        config.setdefault("global", {})["scrape_interval"] = scrape_interval
        config["global"]["evaluation_interval"] = scrape_interval
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs[LABRUN_JOB]["file_sd_configs"] = [{"files": [str(Path(targets_file).resolve())],
                                            "refresh_interval": "1m"}]
    if queue_target is None:
        config["scrape_configs"] = [job for job in config["scrape_configs"]
                                    if job["job_name"] != QUEUE_JOB]
    else:
        jobs[QUEUE_JOB]["static_configs"] = [{"targets": [queue_target]}]
    return config


def write_config(path: str | Path, config: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(config, sort_keys=False))
    return path


def binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusError(f"the prometheus server is not installed; {INSTALL_HINT}")
    return found


def fields(line: str) -> dict[str, str]:
    """The key=value fields of one logfmt line, quotes removed."""
    out = {}
    for key, value in _FIELD.findall(line):
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError:
                value = value[1:-1]
        out[key] = value
    return out


def last_error(log: Path) -> str:
    """Prometheus's last error (or last line) in its log, as one line: `msg: err`."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no log at {log}"
    if not lines:
        return "it wrote no log"
    errors = [line for line in lines if "level=error" in line]
    line = (errors or lines)[-1]
    parsed = fields(line)
    if "msg" not in parsed:
        return line.strip()
    text = parsed["msg"]
    if parsed.get("err"):
        text += f": {parsed['err']}"
    return " ".join(text.split())


def _listening_port(log: Path) -> int | None:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if 'msg="Listening on"' in line:
            address = fields(line).get("address", "")
            port = address.rsplit(":", 1)[-1]
            if port.isdigit():
                return int(port)
    return None


def start(config: str | Path, storage: str | Path, log: str | Path, *, port: int = 0,
          args: Sequence[str] = (), timeout_s: float = START_TIMEOUT_S) -> Prometheus:
    """Start Prometheus on 127.0.0.1:`port` (0: a free one) with `config`, storing in
    `storage`, writing its log to `log`; return once it is ready. Raises PrometheusError with
    its own error line when it exits first."""
    import httpx

    exe = binary()
    log, storage = Path(log), Path(storage)
    storage.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={storage}",
             f"--web.listen-address=127.0.0.1:{port}", *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom = Prometheus("", port, process, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            prom.check_alive()
            if time.monotonic() > deadline:
                raise PrometheusError(f"prometheus was not ready within {timeout_s:.0f} s; its "
                                      f"last log line: {last_error(log)}")
            if not prom.url:
                # Trusted only from its own log, even for a fixed port: another server may
                # answer there until this one fails to bind it and exits.
                found = _listening_port(log)
                if found:
                    prom.port, prom.url = found, f"http://127.0.0.1:{found}"
            if prom.url:
                try:
                    if httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                        return prom
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
    except BaseException:
        prom.stop()
        raise


@contextlib.contextmanager
def running(config: str | Path, storage: str | Path, log: str | Path, **kwargs
            ) -> Iterator[Prometheus]:
    """start(...) for a `with` block; stopped at its end."""
    prom = start(config, storage, log, **kwargs)
    try:
        yield prom
    finally:
        prom.stop()
