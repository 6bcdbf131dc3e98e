"""`labrun dashboard SWEEP_DIR|RUN_ROOT`: a sweep's results in a browser, without W&B.

    Optuna sweep   (its jobs.json names the study) optuna-dashboard on a copy of the study's
                   journal, SWEEP/.dashboard/optuna.journal, refreshed while the study runs:
                   optuna-dashboard can write to a study (notes, a trial told by hand, a study
                   deleted), and what it writes must never reach the study the sweeper runs.
                   A database storage (sqlite:///, postgresql://) is copied once, at start.
    anything else  TensorBoard on HParams summaries that track/hparams.py writes from the run
                   folders into SWEEP/.dashboard/tensorboard/ (whatever logger they used).

Both tools are other programs: labrun prepares what they read, starts them bound to 127.0.0.1
(--bind to change), waits until they answer, prints the URL and the `ssh -L` line that reaches
it from a laptop, and on Ctrl-C stops them. Their own output goes to SWEEP/.dashboard/NAME.log.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from labrun.core import probes
from labrun.core.errors import LabrunError, one_line
from labrun.runs.rundir import RunDir
from labrun.runs.sweepdir import SweepDir, open_storage
from labrun.track import hparams
from labrun.views import compare

FOLDER = ".dashboard"
JOURNAL_COPY = "optuna.journal"
DEFAULT_PORT = {"optuna-dashboard": 8080, "tensorboard": 6006}  # each tool's own default
EXTRA = "pip install -e '.[dashboard]'"  # labrun[dashboard]: optuna-dashboard, tensorboard
READY_TIMEOUT_S = 120.0
REFRESH_S = 2.0  # how often the study's copy catches up with its journal


@dataclass
class Plan:
    """What `labrun dashboard` starts: the tool, its command line, and what it shows."""

    tool: str
    argv: list[str]
    folder: Path  # SWEEP/.dashboard
    url_path: str
    what: str  # one line for the terminal: what the tool shows, from where
    copy: JournalCopy | None = None
    bind: str = "127.0.0.1"
    port: int = 0

    @property
    def log(self) -> Path:
        return self.folder / f"{self.tool}.log"


def prepare(path: Path, *, port: int | None = None, bind: str = "127.0.0.1",
            metric: str | None = None) -> Plan:
    """Everything before the tool starts: which tool, and the files it reads. Fails here, in
    one line, before anything is started (a missing tool, a port in use, no runs)."""
    if not path.is_dir():
        raise LabrunError(f"{path}: no such folder")
    path = path.resolve()
    if RunDir(path).is_run() and not SweepDir(path).jobs_path.is_file():
        raise LabrunError(f"{path} is one run's folder; give the sweep folder or a folder of "
                          f"runs above it (the dashboard writes its files beside the runs)")
    record = SweepDir(path).study_record()
    tool = "optuna-dashboard" if record else "tensorboard"
    module = "optuna_dashboard" if record else "tensorboard"
    if importlib.util.find_spec(module) is None:
        raise LabrunError(f"labrun dashboard needs {tool} for this folder; install it with "
                          f"{EXTRA}")
    port = DEFAULT_PORT[tool] if port is None else port
    probes.check_port(bind, port, "choose another port with --port")
    folder = path / FOLDER
    folder.mkdir(exist_ok=True)
    if record:
        copy = JournalCopy.of_study(record["name"], record["storage"], folder / JOURNAL_COPY)
        kept = f"refreshed every {REFRESH_S:g} s" if copy.source else "taken now"
        return Plan(tool, [_script("optuna-dashboard"), "--host", bind, "--port", str(port),
                           str(copy.copy)], folder, "/dashboard/",
                    f"study {record['name']}: a copy of {record['storage']}, {kept}", copy,
                    bind, port)
    run_paths = compare.find_runs([path])
    written = hparams.up_to_date(path, run_paths, metric)
    if written is None:
        ranked = compare.rank(run_paths, metric)
        written = hparams.write(path, ranked.runs, ranked.keys, ranked.metric)
    return Plan(tool, [sys.executable, "-m", "tensorboard.main", "--logdir",
                       str(written.folder), "--host", bind, "--port", str(port)], folder, "/",
                f"{len(run_paths)} runs by {', '.join(written.keys) or 'their folders'} and "
                f"best/final {written.metric} ({written.written} written, {written.skipped} "
                f"unchanged) in {written.folder}", None, bind, port)


def serve(plan: Plan) -> int:
    """Start the tool, print where to reach it, and wait; Ctrl-C (or SIGTERM) stops it."""
    with open(plan.log, "ab") as log_file:
        # Its own session: Ctrl-C reaches labrun, which stops it (and only it) in order.
        child = subprocess.Popen(plan.argv, stdout=log_file, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        _wait_until_ready(plan, child)
        if plan.copy is not None and plan.copy.source is not None:
            threading.Thread(target=plan.copy.follow, args=(stop, REFRESH_S), daemon=True,
                             name="journal-copy").start()
        url = f"http://{_host(plan.bind)}:{plan.port}{plan.url_path}"
        print(f"{plan.tool}: {plan.what}", flush=True)
        print(f"open {url}", flush=True)
        print(f"from a laptop: ssh -L {plan.port}:127.0.0.1:{plan.port} {socket.gethostname()}"
              f" then http://localhost:{plan.port}{plan.url_path}", flush=True)
        print(f"Ctrl-C stops it (its log: {plan.log})", flush=True)
        code = child.wait()
        raise LabrunError(f"{plan.tool} stopped by itself (exit {code}): {_last_line(plan.log)}")
    except KeyboardInterrupt:
        return 0
    finally:
        stop.set()
        _stop(child)


class JournalCopy:
    """The study's journal, copied into the dashboard's folder and brought up to date.

    A journal only grows, one JSON line an operation, so bringing the copy up to date appends
    the whole lines added since the last time, under the lock optuna takes on the copy (a note
    written from the dashboard goes in as a line of its own)."""

    def __init__(self, source: Path | None, copy: Path):
        self.source, self.copy = source, copy
        self.offset = 0

    @classmethod
    def of_study(cls, name: str, storage: str, copy: Path) -> JournalCopy:
        for stale in (copy, Path(f"{copy}.lock")):
            stale.unlink(missing_ok=True)  # a copy from an earlier start may hold notes
        if "://" not in storage:
            if not Path(storage).is_file():
                raise LabrunError(f"study {name}: its journal {storage} is missing")
            journal = cls(Path(storage), copy)
            journal.refresh()
            return journal
        import optuna

        # A database cannot be followed line by line: one copy of the study, taken now.
        optuna.copy_study(from_study_name=name, from_storage=storage,
                          to_storage=open_storage(str(copy)))
        return cls(None, copy)

    def refresh(self) -> int:
        """Append what the source gained; returns the bytes appended."""
        from optuna.storages.journal import JournalFileSymlinkLock

        with open(self.source, "rb") as f:
            f.seek(self.offset)
            added = f.read()
        added = added[:added.rfind(b"\n") + 1]  # a line the sweeper is still writing waits
        if not added:
            self.copy.touch()
            return 0
        lock = JournalFileSymlinkLock(str(self.copy))
        lock.acquire()
        try:
            with open(self.copy, "ab") as f:
                f.write(added)
        finally:
            lock.release()
        self.offset += len(added)
        return len(added)

    def follow(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            try:
                self.refresh()
            except OSError as error:  # a shared disk's hiccup: try again next time
                print(f"warning: could not refresh the study's copy: {one_line(error)}",
                      file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a job's end, `kill`) stops the tool as Ctrl-C does


def _script(name: str) -> str:
    """A console script of the environment labrun runs in."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name) or name


def _wait_until_ready(plan: Plan, child: subprocess.Popen) -> None:
    import httpx

    url = f"http://{'127.0.0.1' if plan.bind in ('0.0.0.0', '') else plan.bind}:{plan.port}/"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise LabrunError(f"{plan.tool} did not start (exit {child.returncode}): "
                              f"{_last_line(plan.log)}")
        try:
            httpx.get(url, timeout=2.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise LabrunError(f"{plan.tool} did not answer on {url} within {READY_TIMEOUT_S:.0f} s "
                      f"(its log: {plan.log})")


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is not None:
        return
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _host(bind: str) -> str:
    return socket.gethostname() if bind in ("0.0.0.0", "", "::") else bind


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"

