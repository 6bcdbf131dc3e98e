"""Two processes training into one run folder (`labrun resume RUN` typed twice, a requeued SLURM
job while the old one still ends, a reused hydra.run.dir): one writer only (runs/lock.py).

Trials of the fault table's row "concurrent writers":
  - two `labrun resume` of one folder at once: exactly one trains, the other exits 2 naming
    the holder, and every file of the folder is what the winner alone writes (compared with a
    resume of the same folder made alone, fields that are clocks or speeds masked);
  - a kill -9'd holder: its lock is taken over with one line, and the run ends as an
    uninterrupted one;
  - a requeue (same SLURM_JOB_ID, higher SLURM_RESTART_COUNT, set as SLURM sets them) while the
    old attempt still runs: the new one takes over, the old one stops at its next write
    without writing, and the run ends as an uninterrupted one.
NFS, which lab output roots are, cannot be tested here (runs/lock.py says what it relies on)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (
    DETERMINISTIC,
    LABRUN,
    PROJECT,
    final_weights,
    read_summary,
    run_train,
    same_weights,
    start_train,
    wait_for,
)
from faults.conftest import freeze, metrics_lost, metrics_shape_differs
from labrun.runs.lock_holder import read_holder

FAULT = "concurrent writers"
# Short epochs (10 steps): the winner trains for many seconds, the loser is refused in its
# first two (before torch is imported), so the two always overlap.
SHORT = ["trainer.deterministic=true", "checkpoint.every_n_steps=5", "dataset.num_workers=0",
         "trainer.limit_train_batches=10", "trainer.limit_val_batches=2"]
TIMEOUT = 300  # a whole run at most (run_train's limit)


def masked(path: Path) -> bytes:
    """A file's bytes, with what differs between two identical runs masked: wall clocks
    (time, started_at, ended_at, log time stamps), the PID, measured speeds (perf/*) and the
    recorded diff of the working tree."""
    data = path.read_bytes()
    volatile = {"time", "started_at", "ended_at", "pid"}

    def clean(row: dict) -> dict:
        return {k: v for k, v in row.items() if k not in volatile and not k.startswith("perf/")}

    if path.name == "git.diff":
        # The working tree's uncommitted changes when each run started: they differ when the
        # code is edited between the two runs, which no run wrote.
        return b""
    if path.parent.name == "monitor":
        # Where the run's metrics endpoint listened (port, PID, start time): each run's own.
        return json.dumps(sorted(json.loads(data)), sort_keys=True).encode()
    if path.name == "summary.json" or path.parent.name == "ranks":
        return json.dumps(clean(json.loads(data)), sort_keys=True).encode()
    if path.name == "metrics.jsonl":
        return b"".join(json.dumps(clean(json.loads(line)), sort_keys=True).encode() + b"\n"
                        for line in data.splitlines())
    if path.name == "metrics.csv":
        rows = list(csv.DictReader(io.StringIO(data.decode())))
        return json.dumps([clean(r) for r in rows], sort_keys=True).encode()
    if path.suffix == ".log":
        text = re.sub(r"^\[[\d\- :,]+\]", "[T]", data.decode(), flags=re.M)
        text = re.sub(r"metrics: http://\S+", "metrics: URL", text)
        return re.sub(r"\d+ img/s", "N img/s", text).encode()
    return data


def folder_differences(mine: Path, reference: Path) -> list[str]:
    """The files that differ between two run folders (masked as above), or exist in one only."""
    files = {p.relative_to(mine) for p in mine.rglob("*") if p.is_file()}
    theirs = {p.relative_to(reference) for p in reference.rglob("*") if p.is_file()}
    problems = [f"{p} only in the contested folder" for p in sorted(files - theirs)]
    problems += [f"{p} missing from the contested folder" for p in sorted(theirs - files)]
    problems += [f"{p} differs" for p in sorted(files & theirs)
                 if masked(mine / p) != masked(reference / p)]
    return problems


def resume(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([LABRUN, "resume", str(run_dir), *extra], cwd=PROJECT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_resumes_at_once_one_trains_the_other_is_refused(tmp_path, fault):
    record = fault(FAULT)
    run_dir = tmp_path / "run"
    run_train(*SHORT, "trainer.max_epochs=1", run_dir=run_dir)
    start = tmp_path / "start"
    shutil.copytree(run_dir, start)

    both = [resume(run_dir, "trainer.max_epochs=3") for _ in range(2)]
    outs = [p.communicate(timeout=TIMEOUT) for p in both]
    codes = sorted(p.returncode for p in both)
    if codes != [0, 2]:
        record.trial(False, lost=None, note=f"two resumes at once ended with {codes}")
    assert codes == [0, 2], f"exit codes {codes}: {[o[1][-2000:] for o in outs]}"
    loser = next(i for i, p in enumerate(both) if p.returncode == 2)
    loser_err = [line for line in outs[loser][1].splitlines() if line.strip()]
    named = re.fullmatch(rf"error: {re.escape(str(run_dir))} is being trained by PID (\d+) on "
                         rf"\S+ since \d\d:\d\d; wait for it, or stop it first",
                         loser_err[-1] if loser_err else "")
    # The one named is the one that trained (its rank record), and the line is all it said.
    trained_pid = json.loads((run_dir / "ranks" / "rank-0.json").read_text())["pid"]
    refused_well = (len(loser_err) == 1 and named is not None
                    and int(named.group(1)) == trained_pid)

    contested = tmp_path / "contested"
    run_dir.rename(contested)
    shutil.copytree(start, run_dir)  # the same folder again, resumed alone
    alone = resume(run_dir, "trainer.max_epochs=3")
    _, err = alone.communicate(timeout=TIMEOUT)
    assert alone.returncode == 0, err[-2000:]
    problems = folder_differences(contested, run_dir)
    record.trial(refused_well and not problems, lost=bool(problems),
                 note="two resumes at once: one trained, one refused (exit 2); "
                      + ("; ".join(problems) if problems else "folder as the winner alone"))
    assert refused_well, loser_err
    assert problems == []


def test_a_kill_9d_holders_lock_is_taken_over(tmp_path, fault, reference_run):
    record = fault(FAULT)
    run_dir = tmp_path / "run"
    proc = start_train(*DETERMINISTIC, run_dir=run_dir, output=subprocess.DEVNULL)
    wait_for(run_dir / "checkpoints" / "step-00000005.pt", proc)
    freeze(proc)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert json.loads((run_dir / ".lock").read_text())["pid"] == proc.pid  # left behind

    result = run_train(*DETERMINISTIC, run_dir=run_dir)
    takeovers = [line for line in result.stderr.splitlines() + result.stdout.splitlines()
                 if "taking over" in line]
    assert len(takeovers) == 1 and takeovers[0].endswith(
        f"taking over from PID {proc.pid} on {os.uname().nodename}: PID {proc.pid} is gone"), \
        takeovers
    problems = metrics_shape_differs(run_dir, reference_run)
    problems += metrics_lost(run_dir, reference_run, read_summary(reference_run)["step"])
    same = same_weights(final_weights(run_dir), final_weights(reference_run))
    record.trial(read_summary(run_dir)["status"] == "completed" and same
                 and not (run_dir / ".lock").exists(), lost=bool(problems),
                 note=f"kill -9 of the holder: taken over in one line; "
                      f"{'; '.join(problems) or 'metrics as the reference'}, "
                      f"weights {'identical' if same else 'differ'}")
    assert problems == [] and same
    assert not (run_dir / ".lock").exists()


def test_a_requeue_takes_over_and_the_old_attempt_stops_writing(tmp_path, fault,
                                                                 reference_run):
    """The old attempt (restart 0) is frozen after a checkpoint, the requeued one (restart 1)
    takes the folder over, then the old one goes on: it must stop without writing, and the
    folder must end as an uninterrupted run's."""
    record = fault(FAULT)
    run_dir = tmp_path / "run"
    job = {"SLURM_JOB_ID": str(900000 + os.getpid() % 1000)}
    # Output to files: a pipe nobody reads while the other process is waited for could fill.
    old_log, new_log = tmp_path / "old.log", tmp_path / "new.log"
    with open(old_log, "w") as old_out, open(new_log, "w") as new_out:
        old = start_train(*DETERMINISTIC, "dataset.num_workers=0", run_dir=run_dir,
                          env={**job, "SLURM_RESTART_COUNT": "0"}, output=old_out)
        wait_for(run_dir / "checkpoints" / "step-00000005.pt", old)
        freeze(old)
        new = start_train(*DETERMINISTIC, "dataset.num_workers=0", run_dir=run_dir,
                          env={**job, "SLURM_RESTART_COUNT": "1"}, output=new_out)
        deadline = time.time() + TIMEOUT
        while getattr(read_holder(run_dir / ".lock"), "pid", None) != new.pid:
            assert new.poll() is None and time.time() < deadline, "the requeue never took over"
            time.sleep(0.05)
        os.kill(old.pid, signal.SIGCONT)
        old.wait(timeout=TIMEOUT)
        overlapped = new.poll() is None  # the old one stopped while the new one trained
        new.wait(timeout=TIMEOUT)
    old_said, new_said = old_log.read_text(), new_log.read_text()

    assert overlapped, "the requeued run ended before the old one stopped: no overlap"
    assert new.returncode == 0, new_said[-2000:]
    assert old.returncode == 2, old_said[-2000:]
    assert f"lost the run folder to PID {new.pid}" in old_said
    assert f"SLURM job {job['SLURM_JOB_ID']} was requeued (restart 1 > 0)" in new_said
    problems = metrics_shape_differs(run_dir, reference_run)
    problems += metrics_lost(run_dir, reference_run, read_summary(reference_run)["step"])
    same = same_weights(final_weights(run_dir), final_weights(reference_run))
    rank0 = json.loads((run_dir / "ranks" / "rank-0.json").read_text())
    if rank0["pid"] != new.pid:
        problems.append(f"ranks/rank-0.json was written by PID {rank0['pid']}")
    summary = read_summary(run_dir)
    record.trial(summary["status"] == "completed" and same and not problems,
                 lost=bool(problems),
                 note=f"requeue while the old attempt ran: old stopped without writing; "
                      f"{'; '.join(problems) or 'metrics as the reference'}, "
                      f"weights {'identical' if same else 'differ'}")
    assert problems == [] and same
    assert summary["requeued"] == 1


@pytest.fixture(autouse=True)
def _no_inherited_lock(monkeypatch):
    from labrun.runs import lock

    monkeypatch.delenv(lock.TOKEN_ENV, raising=False)
