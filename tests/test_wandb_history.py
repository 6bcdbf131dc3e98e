"""W&B history without holes (track/wandb_history.py): after a stop and a resume, the W&B run,
read back with W&B's own reader over all its offline segments, holds every step of
metrics.jsonl exactly once with the same values, keyed on labrun's `step`; and whatever state
the stopped segment was left in (uploaded, partly uploaded by an interrupted `wandb sync`,
unreadable), no step reaches W&B twice.

W&B's cloud cannot be reached from here, so the uploads go to FakeWandb: a small HTTP server on
127.0.0.1 that answers the GraphQL calls and file_stream uploads the real client makes (wandb
0.31's wandb-core) and keeps what a W&B server keeps of a run: its history rows by line offset,
its summary and its config. It is the only fake: train.py, the wandb client and wandb-core,
online and offline, `wandb sync` and `wandb leet inspect` all run for real.

All tests resume a copy of one run stopped by SIGTERM after its step-10 checkpoint (made once,
in the module's fixture). The kill -9 trials are in faults/test_wandb_holes.py, the SLURM
requeue in test_cluster_slurm.py (its preempted job); `history_problems` is their shared check."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from test_tracking import OFFLINE, WANDB, inspect_records

from conftest import read_metrics, run_train, start_train, wait_for
from labrun.track import wandb_history

WANDB_RUN = ["logger=wandb", "trainer.max_epochs=2", "trainer.log_every_n_steps=5",
             "checkpoint.every_n_steps=5"]
STOP_TIMEOUT = 60  # a stopped run saves a checkpoint and closes the offline run: seconds
# A sync of a small run to a server on loopback takes a few seconds; 120 s: it hung.
SYNC_TIMEOUT = 120


def segments(run_dir: Path) -> list[Path]:
    """The offline segments a `wandb sync RUN/wandb/offline-run-*` would upload."""
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def wandb_rows(run_dir: Path) -> tuple[list[dict], set[str]]:
    """Every history row of every offline segment (oldest first) and the run ids seen."""
    rows, ids = [], set()
    for segment in segments(run_dir):
        for record in inspect_records(segment):
            if record["type"] == "history":
                rows.append(record["history"]["item"])
            elif record["type"] == "run":
                ids.add(record["run"]["run_id"])
    return rows, ids


def segment_steps(segment: Path) -> list[int]:
    return [r["history"]["item"]["step"] for r in inspect_records(segment)
            if r["type"] == "history"]


def problems(points: list[dict], rows: list[dict], ids: set[str]) -> list[str]:
    """What differs between W&B's `rows` and metrics.jsonl's `points`: a step missing, logged
    twice or not in metrics.jsonl, a value that differs. Empty: the W&B history is whole."""
    expected: dict[int, dict] = {}
    for line in points:  # several lines at one step are one W&B row
        expected.setdefault(line["step"], {}).update(
            {k: v for k, v in line.items() if "/" in k and v is not None})
    found = [] if len(ids) <= 1 else [f"{len(ids)} W&B runs in one run folder: {ids}"]
    steps = [row.get("step") for row in rows]
    if missing := sorted(set(expected) - set(steps)):
        found.append(f"steps missing from W&B: {missing}")
    if doubled := sorted({s for s in steps if steps.count(s) > 1}):
        found.append(f"steps in W&B more than once: {doubled}")
    if extra := sorted(set(steps) - set(expected), key=str):
        found.append(f"steps in W&B that metrics.jsonl does not have: {extra}")
    for row in rows:
        want = expected.get(row.get("step"), {})
        differing = sorted(k for k, v in want.items() if row.get(k) != pytest.approx(v))
        if differing:
            found.append(f"step {row['step']}: {differing} differ from metrics.jsonl")
    return found


def history_problems(run_dir: Path) -> list[str]:
    """problems() of the W&B run the run folder's offline segments make."""
    return problems(read_metrics(run_dir), *wandb_rows(run_dir))


def sigterm_run(run_dir: Path, checkpoint: str) -> None:
    proc = start_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    wait_for(run_dir / "checkpoints" / checkpoint, proc)
    proc.send_signal(signal.SIGTERM)  # interrupted: checkpoint, then wandb.finish()
    proc.wait(timeout=STOP_TIMEOUT)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped by SIGTERM after its step-10 checkpoint, made once: tests resume copies."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    sigterm_run(run_dir, "step-00000010.pt")
    [segment] = segments(run_dir)
    assert len(segment_steps(segment)) >= 2, "the stopped run logged too little to split"
    return run_dir


def copy_of(stopped: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(stopped, run_dir, symlinks=True)  # wandb/latest-run etc. are symlinks
    return run_dir


# ---------------------------------------------------------------------------------------------
# The fake W&B server (see the module's docstring)


class FakeWandb:
    """What the wandb client asks of a W&B server, answered on 127.0.0.1 (measured with wandb
    0.31: the GraphQL operations below, then POST /files/ENTITY/PROJECT/RUN/file_stream with
    {"files": {"wandb-history.jsonl": {"offset": line, "content": [json, ...]}, ...}}).

    `cut_after = N` stops an upload after the first N history rows have reached the server, as
    if the connection had died after the request that ended there: the fake keeps those rows,
    and the summary they make (the last value of each key: the summary wandb-core sends with a
    request is the one of the rows sent so far, measured), and never answers that request or
    any later file_stream request of the run, until `cut_after` is cleared."""

    def __init__(self):
        self.lock = threading.Lock()
        self.history: dict[str, dict[int, str]] = {}  # run -> line offset -> JSON row
        self.summary: dict[str, dict] = {}
        self.config: dict[str, str] = {}
        self.cut_after: int | None = None
        self.cut = threading.Event()  # an upload was cut
        self.release = threading.Event()  # the requests held since the cut may end
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the tests read the state instead
                pass

            def do_POST(self):
                size = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(size)
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = json.loads(body or b"{}")
                if self.path.startswith("/graphql"):
                    self.answer(fake.graphql(request))
                elif self.path.endswith("/file_stream"):
                    if fake.file_stream(self.path.split("/")[-2], request):
                        self.answer({"exitcode": None, "limits": {}})
                    else:
                        fake.release.wait(SYNC_TIMEOUT)  # no answer: the connection died
                        self.close_connection = True
                else:  # wandb-core's own telemetry (/sdk/otel/...)
                    self.answer({})

            def do_PUT(self):  # run files (config.yaml, ...), at the upload URLs given below
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.answer({})

            def answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self, mode: str) -> dict[str, str]:
        """A wandb client's environment towards this server (a made-up 40-character key)."""
        return {"WANDB_MODE": mode, "WANDB_BASE_URL": self.url, "WANDB_API_KEY": "f" * 40,
                "NETRC": "/nonexistent", "WANDB_ERROR_REPORTING": "false"}

    def rows(self, run: str) -> list[dict]:
        with self.lock:
            lines = self.history.get(run, {})
            return [json.loads(lines[i]) for i in sorted(lines)]

    def file_stream(self, run: str, request: dict) -> bool:
        """Keep what the request brings; False: cut (the request gets no answer)."""
        with self.lock:
            lines = self.history.setdefault(run, {})
            files = request.get("files", {})
            if self.cut.is_set() and self.cut_after is not None:
                return False
            if chunk := files.get("wandb-history.jsonl"):
                for i, line in enumerate(chunk["content"]):
                    if self.cut_after is not None and chunk["offset"] + i >= self.cut_after:
                        summary: dict = {}
                        for kept in sorted(lines):
                            summary.update(json.loads(lines[kept]))
                        self.summary[run] = summary
                        self.cut.set()
                        return False
                    lines[chunk["offset"] + i] = line
            if (summary := files.get("wandb-summary.json")) and summary["content"]:
                self.summary[run] = json.loads(summary["content"][-1])
            return True

    def graphql(self, request: dict) -> dict:
        name, variables = request.get("operationName"), request.get("variables") or {}
        run = variables.get("name") or variables.get("run")
        project = {"id": "project", "name": variables.get("project"),
                   "entity": {"id": "entity", "name": variables.get("entity") or "fake"}}
        with self.lock:
            if name == "RunResumeStatus":
                if run not in self.config:  # no such run yet
                    return {"data": {"model": {**project, "bucket": None}}}
                lines = [self.history.get(run, {})[i] for i in sorted(self.history.get(run, {}))]
                return {"data": {"model": {**project, "bucket": {
                    "id": f"bucket-{run}", "name": run, "displayName": run,
                    "summaryMetrics": json.dumps(self.summary.get(run, {})),
                    "historyLineCount": len(lines), "historyTail": json.dumps(lines[-10:]),
                    "logLineCount": 0, "eventsLineCount": 0, "eventsTail": "[]",
                    "config": self.config[run], "tags": [], "notes": None,
                    # wandb-core resumes only a run whose wandbConfig has "t" (it started).
                    "wandbConfig": json.dumps({"t": {}})}}}}
            if name == "UpsertBucket":
                self.config[run] = variables.get("config") or self.config.get(run) or "{}"
                return {"data": {"upsertBucket": {"inserted": True, "bucket": {
                    "id": f"bucket-{run}", "name": run, "displayName": run, "description": "",
                    "config": self.config[run], "sweepName": None,
                    "historyLineCount": len(self.history.get(run, {})), "project": project}}}}
        if name == "Viewer":
            return {"data": {"viewer": {"id": "user", "entity": "fake", "username": "fake",
                                        "email": "fake@127.0.0.1", "flags": "{}",
                                        "teams": {"edges": []}}}}
        if name == "ServerFeaturesQuery":
            return {"data": {"serverInfo": {"features": []}}}
        if name == "CreateRunFiles":
            return {"data": {"createRunFiles": {"runID": f"bucket-{run}", "uploadHeaders": [],
                                                "files": [{"name": f, "uploadUrl":
                                                           f"{self.url}/upload/{f}"}
                                                          for f in variables["files"]]}}}
        return {"data": {}}  # what the client only reports or may go without

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    server = FakeWandb()
    try:
        yield server
    finally:
        server.close()


def sync(fake: FakeWandb, segment: Path) -> None:
    """The real `wandb sync SEGMENT`, to the fake."""
    result = subprocess.run([WANDB, "sync", str(segment)], capture_output=True, text=True,
                            env={**os.environ, **fake.env("online")}, timeout=SYNC_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert wandb_history.is_synced(segment), result.stdout + result.stderr


def interrupted_sync(fake: FakeWandb, segment: Path, keep: int) -> None:
    """`wandb sync SEGMENT` to the fake, cut after `keep` history rows reached it, then killed
    (a hung upload ended by hand); later requests are answered again."""
    fake.cut_after = keep
    proc = subprocess.Popen([WANDB, "sync", str(segment)], env={**os.environ,
                                                                **fake.env("online")},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its wandb-core too, in one group
    try:
        assert fake.cut.wait(SYNC_TIMEOUT), "the upload never reached the fake server"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        fake.cut_after = None
        fake.release.set()
    assert not wandb_history.is_synced(segment)
    # What labrun reads as "partly uploaded": wandb-core began the upload and never ended it.
    assert wandb_history.is_partly_uploaded(segment), sorted(p.name for p in segment.iterdir())


def run_id(segment: Path) -> str:
    return segment.name.rsplit("-", 1)[1]  # offline-run-DATE_TIME-ID


# ---------------------------------------------------------------------------------------------


def test_a_sigtermed_run_resumes_into_a_whole_history(stopped, tmp_path):
    run_dir = copy_of(stopped, tmp_path)
    result = run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    assert "resuming from" in result.stdout
    assert history_problems(run_dir) == []
    # The stopped segment was logged again by the resumed one: kept aside, not uploaded.
    [first] = sorted((run_dir / "wandb" / "superseded").glob("offline-run-*"))
    [second] = segments(run_dir)
    # Both segments are one W&B run, which the second resumed.
    ids = {next(r["run"]["run_id"] for r in inspect_records(p) if r["type"] == "run")
           for p in (first, second)}
    assert len(ids) == 1, "the resumed run started a new W&B run"
    assert next(r["run"] for r in inspect_records(second) if r["type"] == "run")["resume"] is True


def test_an_uploaded_segment_is_not_logged_again(stopped, tmp_path, fake):
    """A segment `wandb sync` uploaded stays, and its steps are not logged twice."""
    run_dir = copy_of(stopped, tmp_path)
    [first] = segments(run_dir)
    sync(fake, first)
    assert [row["step"] for row in fake.rows(run_id(first))] == segment_steps(first)
    run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    assert segments(run_dir)[0] == first and len(segments(run_dir)) == 2
    assert history_problems(run_dir) == []


def test_an_unreadable_uploaded_segment_is_not_logged_again(stopped, tmp_path, fake):
    """When the uploaded segment cannot be read back, which steps W&B holds is unknown: the
    resumed attempt logs no history to W&B, and says so, rather than log them twice."""
    run_dir = copy_of(stopped, tmp_path)
    [first] = segments(run_dir)
    sync(fake, first)
    # labrun reads segments with the `wandb` command on PATH: here one that fails, as a broken
    # or mismatched install would (this test reads them with the real one, test_tracking.WANDB).
    broken = tmp_path / "bin"
    broken.mkdir()
    (broken / "wandb").write_text("#!/bin/sh\necho 'wandb: error: cannot read' >&2\nexit 1\n")
    (broken / "wandb").chmod(0o755)
    result = run_train(*WANDB_RUN, run_dir=run_dir,
                       env={**OFFLINE, "PATH": f"{broken}:{os.environ['PATH']}"})
    assert "resuming from" in result.stdout
    [kept, second] = segments(run_dir)
    assert kept == first
    assert segment_steps(second) == []  # nothing of this attempt, so nothing twice
    assert f"could not read {first}" in result.stderr and "cannot read" in result.stderr
    assert "this attempt logs no history to W&B" in result.stderr
    summary = json.loads(subprocess.run(
        [WANDB, "leet", "inspect", "--summary", "--json", str(second)], capture_output=True,
        text=True, check=True, timeout=120).stdout)["summary"]
    assert "step" not in summary and "val/acc" in summary  # no `step` W&B does not hold


def test_a_partly_uploaded_segment_resumed_online_gives_a_whole_history(stopped, tmp_path,
                                                                        fake):
    """An interrupted `wandb sync`, then a resume online: W&B's summary says the last step it
    holds, and the resumed run logs exactly what W&B lacks (its summary-step path)."""
    run_dir = copy_of(stopped, tmp_path)
    [first] = segments(run_dir)
    steps = segment_steps(first)
    keep = len(steps) // 2  # at least 1 and fewer than all (the fixture logged 2 or more)
    interrupted_sync(fake, first, keep)
    held = [row["step"] for row in fake.rows(run_id(first))]
    assert held == steps[:keep]
    result = run_train(*WANDB_RUN, "logger.mode=online", run_dir=run_dir,
                       env=fake.env("online"))
    assert "resuming from" in result.stdout
    # The server's history: the uploaded part, then the rest logged again, then the new steps.
    assert problems(read_metrics(run_dir), fake.rows(run_id(first)), set()) == []
    assert [row["step"] for row in fake.rows(run_id(first))][:keep] == held
    again = [p["step"] for p in read_metrics(run_dir) if steps[keep - 1] < p["step"] <= steps[-1]]
    log = (run_dir / "train.log").read_text()
    assert f"steps {again[0]}-" in log, log[-2000:]  # logged again from the first step W&B lacks
    # Never to be uploaded again: a second `wandb sync` of it would resend its uploaded part.
    assert not segments(run_dir)
    assert (run_dir / "wandb" / "superseded" / first.name).is_dir()


def test_a_partly_uploaded_segment_resumed_offline_logs_none_of_its_steps_again(stopped,
                                                                                tmp_path,
                                                                                fake):
    """An interrupted `wandb sync`, then a resume offline: which of the segment's steps W&B
    holds is unknown, so none of them is logged again (and the run says so); once the new
    segment is uploaded W&B holds every step at most once, missing only those the
    interrupted upload did not reach."""
    run_dir = copy_of(stopped, tmp_path)
    [first] = segments(run_dir)
    steps = segment_steps(first)
    keep = len(steps) // 2
    interrupted_sync(fake, first, keep)
    result = run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    assert "resuming from" in result.stdout
    [second] = segments(run_dir)
    assert not set(segment_steps(second)) & set(steps)
    sync(fake, second)
    assert problems(read_metrics(run_dir), fake.rows(run_id(first)), set()) == [
        f"steps missing from W&B: {steps[keep:]}"]
    assert f"the upload of {first.name} was interrupted" in result.stderr, result.stderr
    assert f"steps {steps[0]}-{steps[-1]} are not logged again" in result.stderr
