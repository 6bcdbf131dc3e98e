"""kill -9 at seeded random moments of training and in the middle of a checkpoint write, SIGINT
and SIGTERM: every trial runs in its own folder, resumes, and ends bit-identical to an
uninterrupted run (the `reference_run` fixture); no checkpoint that exists under its final name
is ever half-written, and no metrics line or kept checkpoint is lost.

A kill counts only if it provably landed mid-training: the process is frozen (SIGSTOP), the test
sees at least one optimizer step in metrics.jsonl and one checkpoint on disk, and only then
kills it (SIGKILL) and checks that it died by signal 9. A kill that landed before the first logged
step and checkpoint (in start-up, say) or after the run had finished is not a trial of this
fault; it is retried, a bounded number of times. The moments are seeded: a random checkpoint,
then a random fraction of the time between checkpoints, so that the kill lands at any point of
training (a step, a log line, an evaluation, a save) however loaded the machine is. Every trial
also checks where the run resumed: from the newest checkpoint on disk when it was frozen (a
resume from an older one would still end bit-identical, and lose the steps in between)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from inotify_simple import INotify, flags

from conftest import (
    DETERMINISTIC,
    final_weights,
    read_metrics,
    read_summary,
    run_train,
    same_weights,
    start_train,
    wait_for,
)
from faults.conftest import (
    checkpoints_lost,
    freeze,
    load_checkpoint,
    metrics_lost,
    metrics_shape_differs,
    read_lines,
    saved_steps,
)

RANDOM_KILLS = 2  # kill -9 trials at random moments; with the one during a write, 3 in all
ATTEMPTS = 4  # runs per trial at most: a kill in start-up or after the end is drawn again
EVERY_N = 5  # checkpoint.every_n_steps in DETERMINISTIC
KEEP_LAST = 3  # checkpoint.keep_last, the default (conf/train.yaml)
# How long a stopped process may take to write its stop checkpoint and exit: one optimizer
# step, one save and the data workers' shutdown, which take seconds even on a loaded machine.
STOP_TIMEOUT = 180
# How long a trial waits for a run to reach the checkpoint it is waiting for: a whole
# DETERMINISTIC run's time (run_train's 300 s), so that a run that hangs or never saves fails
# the trial instead of blocking the suite.
RUN_TIMEOUT = 300

# These tests share no module fixture (reference_run is a session fixture, built once for both
# xdist workers): each is a group of its own and the two workers run them side by side
# (tests/conftest.py, pytest_itemcollected).
SPREAD_OVER_WORKERS = True


def start(run_dir: Path) -> subprocess.Popen:
    return start_train(*DETERMINISTIC, run_dir=run_dir, output=subprocess.DEVNULL)


def schedule(reference_run: Path) -> list[int]:
    """The steps at which a DETERMINISTIC run saves a checkpoint (read off the reference)."""
    rows = read_metrics(reference_run)
    per_epoch = next(row["step"] for row in rows if "val/loss" in row)
    return saved_steps(EVERY_N, per_epoch, read_summary(reference_run)["step"])


def newest_logged_step(run_dir: Path) -> int | None:
    """The newest optimizer step with a train/loss line in metrics.jsonl (None: none yet)."""
    rows, _ = read_lines(run_dir / "metrics.jsonl")
    steps = [row["step"] for row in rows if "train/loss" in row]
    return max(steps) if steps else None


def step_files(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.glob("step-*.pt")) if folder.is_dir() else []


def newest_step(files: list[str]) -> int | None:
    """The step of the newest of `files` (step-NNNNNNNN.pt names, as step_files gives them)."""
    return int(re.fullmatch(r"step-(\d{8})\.pt", files[-1]).group(1)) if files else None


def unreadable_checkpoints(run_dir: Path) -> list[str]:
    """Every checkpoint under a final name (step files, last.pt, best.pt) that does not load."""
    folder = run_dir / "checkpoints"
    problems = []
    for path in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
        state, why = load_checkpoint(path)
        if state is None:
            problems.append(why)
    return problems


def kill_at(run_dir: Path, target: int, fraction: float, launch=start,
            timeout: float = RUN_TIMEOUT) -> tuple[str, int | None, list[str], float]:
    """Start a run; once it has saved step-`target`.pt, wait `fraction` of the time that
    checkpoint took after the one before (the run's pace now: the machine's load changes it
    tenfold), freeze the run, look at what it has done, kill -9 it. The kill lands anywhere
    from that checkpoint to about the next one: in a step, a log write, an evaluation, a save.
    Returns where it landed ("mid-training"; "too early": no step logged or no checkpoint yet;
    "finished"), the newest logged step and the checkpoint files seen while it was frozen,
    and the seconds waited after step-`target`.pt. `launch` starts the run; a run that neither
    saves step-`target`.pt nor ends within `timeout` seconds fails the trial."""
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)  # to be watched from the start; labrun accepts an empty folder
    inotify = INotify()
    inotify.add_watch(folder, flags.MOVED_TO)  # a checkpoint's rename to its final name
    proc = launch(run_dir)
    arrivals = [time.monotonic()]  # the start, then every step file's arrival
    deadline = arrivals[0] + timeout
    delay = None
    try:
        while delay is None and proc.poll() is None:
            assert time.monotonic() < deadline, \
                f"the run neither saved step-{target:08d}.pt nor ended within {timeout} s"
            # Wake at least every second to notice a run that ended before step `target`.
            for event in inotify.read(timeout=1000):
                match = re.fullmatch(r"step-(\d{8})\.pt", event.name)
                if match:
                    arrivals.append(time.monotonic())
                    if int(match.group(1)) >= target:
                        delay = fraction * (arrivals[-1] - arrivals[-2])
        if delay is None:
            return "finished", newest_logged_step(run_dir), step_files(run_dir), 0.0
        try:
            proc.wait(timeout=delay)
            return "finished", newest_logged_step(run_dir), step_files(run_dir), delay
        except subprocess.TimeoutExpired:
            pass
        freeze(proc)  # frozen: what the test reads cannot change under it
        step, files = newest_logged_step(run_dir), step_files(run_dir)
        proc.kill()
        proc.wait()
        if proc.returncode == 0:  # it ended on its own just before the SIGSTOP
            return "finished", step, files, delay
        assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}, not signal 9"
        landed = "mid-training" if step is not None and files else "too early"
        return landed, step, files, delay
    finally:
        inotify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def resume_and_check(run_dir: Path, reference_run: Path, reference_weights: dict
                     ) -> tuple[bool, list[str], str, int | None]:
    """After a kill or a stop: resume to the end, then compare with the reference run.
    Returns (survived, what was lost, a note, the step resumed from or None)."""
    broken = unreadable_checkpoints(run_dir)  # right after the kill, before the resume
    logged = newest_logged_step(run_dir) or 0
    result = run_train(*DETERMINISTIC, run_dir=run_dir, check=False)
    resumed = re.search(r"resuming from \S+ \(step (\d+)\)", result.stdout)
    # Without a resume, the lines the killed run had logged are the ones to compare.
    upto = int(resumed.group(1)) if resumed else logged
    completed = result.returncode == 0 and read_summary(run_dir)["status"] == "completed"
    identical = completed and same_weights(final_weights(run_dir), reference_weights)
    shape = metrics_shape_differs(run_dir, reference_run)
    lost = (broken + metrics_lost(run_dir, reference_run, upto)
            + checkpoints_lost(run_dir, KEEP_LAST, schedule(reference_run)))
    survived = bool(resumed) and completed and identical and not shape and not broken
    note = (f"resumed from step {resumed.group(1) if resumed else 'nothing (started over)'}, "
            f"completed={completed}, torch.equal to the reference={identical}"
            f"{'; ' + '; '.join(shape) if shape else ''}; lost: {'; '.join(lost) or 'nothing'}")
    return survived, lost, note, int(resumed.group(1)) if resumed else None


# One test per trial, each with its own seed: the trials are independent, so the two xdist
# workers run them side by side, in any order (one test of four trials took 17 min, alone on
# one worker, on a loaded machine).
@pytest.mark.parametrize("trial", range(1, RANDOM_KILLS + 1), ids=lambda t: f"trial-{t}")
def test_kill_9_at_a_random_moment(tmp_path, reference_run, reference_weights, fault, trial):
    record = fault("kill -9 (random moment)")
    rng = random.Random(20261129 + trial)
    saved = schedule(reference_run)
    for attempt in range(ATTEMPTS):
        run_dir = tmp_path / f"attempt-{attempt}"
        # Any checkpoint but the last; from the first one on, nothing has been logged yet
        # (the first line is at step 10): such a kill is drawn again, as one in start-up.
        target, fraction = rng.choice(saved[:-1]), rng.random()
        landed, step, files, delay = kill_at(run_dir, target, fraction)
        if landed == "mid-training":
            break
        print(f"[kill -9] trial {trial}: the kill {delay:.1f}s after step-{target:08d}.pt "
              f"landed {landed} (logged step {step}, files {files}): not counted, drawn again")
    else:
        pytest.fail(f"trial {trial}: no kill landed mid-training in {ATTEMPTS} runs")
    survived, lost, note, resumed_from = resume_and_check(run_dir, reference_run,
                                                          reference_weights)
    resumed_there = resumed_from == newest_step(files)
    record.trial(survived and resumed_there, lost=bool(lost),
                 note=f"kill -9 {delay:.1f}s after step-{target:08d}.pt, frozen at logged "
                      f"step {step} with {files[-1]} the newest saved; {note}")
    assert resumed_there, f"resumed from step {resumed_from}, not from the newest checkpoint " \
                          f"when frozen ({files[-1]}): {note}"
    assert survived and not lost, note


def kill_during_write(run_dir: Path, target: int, launch=start,
                      timeout: float = RUN_TIMEOUT) -> dict | None:
    """Start a run and kill -9 it while it writes the checkpoint of step `target` or a later
    one: inotify reports the temporary file's creation, the run is frozen at once, and killed
    if the file is still there under its temporary name (the rename has not happened). A write
    that finished before the freeze landed is let go, and the next one is caught. None if the
    run ended without a caught write. `launch` starts the run; a run that neither is caught
    writing nor ends within `timeout` seconds fails the trial."""
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True)  # to be watched from the start; labrun accepts an empty folder
    inotify = INotify()
    inotify.add_watch(folder, flags.CREATE)
    proc = launch(run_dir)
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, \
                f"no checkpoint write from step {target} on was caught, and the run did not " \
                f"end, within {timeout} s"
            # Wake at least every second to notice a run that ended without the write.
            for event in inotify.read(timeout=1000):
                match = re.fullmatch(r"\.step-(\d{8})\.pt\.tmp", event.name)
                if not match or int(match.group(1)) < target:
                    continue
                freeze(proc)
                tmp, final = folder / event.name, folder / event.name[1:-len(".tmp")]
                if not tmp.exists() or final.exists():
                    proc.send_signal(signal.SIGCONT)  # renamed already: catch the next write
                    continue
                caught = {"step": int(match.group(1)), "size": tmp.stat().st_size,
                          "logged": newest_logged_step(run_dir), "files": step_files(run_dir)}
                proc.kill()
                proc.wait()
                # Still under the temporary name after the death: the kill beat the rename.
                caught.update(returncode=proc.returncode,
                              before_rename=tmp.exists() and not final.exists())
                return caught
        return None
    finally:
        inotify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kill_9_while_writing_a_checkpoint(tmp_path, reference_run, reference_weights, fault):
    record = fault("kill -9 while writing a checkpoint")
    saved = schedule(reference_run)
    # Any save from the third on: by then a step is logged and a checkpoint is on disk.
    target = random.Random(20261130).choice(saved[2:-1])
    for attempt in range(2):  # a run whose every write beat the freeze is started again
        run_dir = tmp_path / f"attempt-{attempt}"
        caught = kill_during_write(run_dir, target)
        if caught is not None:
            break
        print(f"[kill -9 while writing] no write caught in run {attempt + 1}; starting again")
    else:
        pytest.fail("no checkpoint write was caught in 2 runs")
    assert caught["returncode"] == -signal.SIGKILL, f"exit {caught['returncode']}"
    mid_training = caught["logged"] is not None and bool(caught["files"])
    survived, lost, note, resumed_from = resume_and_check(run_dir, reference_run,
                                                          reference_weights)
    # The newest checkpoint under its final name when frozen, not the one being written.
    resumed_there = resumed_from == newest_step(caught["files"])
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").glob(".*.tmp"))
    survived = (survived and resumed_there and caught["before_rename"] and mid_training
                and not leftovers)
    record.trial(survived, lost=bool(lost),
                 note=f"kill -9 while step-{caught['step']:08d}.pt was being written "
                      f"({caught['size']} bytes under its temporary name, still unrenamed after "
                      f"the kill={caught['before_rename']}; logged step {caught['logged']}, "
                      f"{caught['files'][-1] if caught['files'] else 'no file'} saved); {note}; "
                      f"temporary files left at the end: {leftovers or 'none'}")
    assert caught["before_rename"], "the checkpoint was renamed before the kill landed"
    assert mid_training, f"the write was not mid-training: {caught}"
    assert resumed_there, f"resumed from step {resumed_from}, not from the newest checkpoint " \
                          f"when frozen ({caught['files'][-1]}): {note}"
    assert survived and not lost, note


def test_the_waits_for_a_checkpoint_end_at_their_deadline(tmp_path):
    """A run that never saves a checkpoint (here a process that only sleeps) fails the trial at
    the deadline: without one, kill_at and kill_during_write wait as long as it lives."""
    def never_saves(run_dir: Path) -> subprocess.Popen:
        return subprocess.Popen(["sleep", "600"])

    with pytest.raises(AssertionError, match="neither saved step-00000005.pt nor ended"):
        kill_at(tmp_path / "kill", 5, 0.5, launch=never_saves, timeout=1)
    with pytest.raises(AssertionError, match="no checkpoint write from step 5 on was caught"):
        kill_during_write(tmp_path / "write", 5, launch=never_saves, timeout=1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_checkpoints_then_resumes_identically(tmp_path, reference_run,
                                                         reference_weights, fault, signum):
    name = signal.Signals(signum).name
    record = fault("SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM")
    run_dir = tmp_path / "run"
    proc = start_train(*DETERMINISTIC, run_dir=run_dir)
    wait_for(run_dir / "checkpoints" / "step-00000015.pt", proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=STOP_TIMEOUT)
    summary = read_summary(run_dir)
    stop_step = summary["step"]
    stop_file, why = load_checkpoint(run_dir / "checkpoints" / f"step-{stop_step:08d}.pt")
    last, _ = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    stopped = (proc.returncode == 130 and summary["status"] == "interrupted"
               and f"resume with: labrun resume {run_dir}" in stderr
               and stop_file is not None and last is not None and last["step"] == stop_step)
    survived, lost, note, resumed_from = resume_and_check(run_dir, reference_run,
                                                          reference_weights)
    resumed_there = resumed_from == stop_step
    lost += [] if stop_file is not None else [f"the stop checkpoint: {why}"]
    record.trial(stopped and survived and resumed_there, lost=bool(lost),
                 note=f"{name} after step-00000015.pt: exit {proc.returncode}, status "
                      f"{summary['status']}, stop checkpoint at step {stop_step} "
                      f"{'loads' if stop_file is not None else why}; {note}")
    assert stopped, stderr[-2000:]
    assert survived and resumed_there and not lost, note
