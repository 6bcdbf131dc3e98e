"""W&B holes after kill -9: a run logging to W&B (offline, the real client) is killed at a
seeded random moment after several logged points, resumed, and its W&B run, read back with
`wandb leet inspect` over all its offline segments, must hold every step of metrics.jsonl
exactly once with the same values (test_wandb_history.history_problems).

As in test_kills.py, a kill counts only if it provably landed mid-training: the process is
frozen (SIGSTOP), the test sees logged points and a checkpoint, and only then kills it and checks
that it died by signal 9; otherwise the moment is drawn again. Each note also says how many of
the logged points the killed W&B segment itself held: what W&B alone would have kept."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_tracking import OFFLINE
from test_wandb_history import WANDB_RUN, history_problems, wandb_rows

from conftest import read_metrics, run_train, start_train
from faults.conftest import freeze, read_lines

TRIALS = 1  # each trial trains twice with W&B (about 2 min here): one is enough to show the hole closed
ATTEMPTS = 3  # a kill that landed before a checkpoint or after the end is drawn again
TARGETS = [10, 15, 20]  # checkpoints after which to kill: points at steps 5, 10... are logged
# A run reaches step 20 in well under a minute even on a loaded 2-core machine; 300 s: a hang.
TIMEOUT = 300


def logged_steps(run_dir: Path) -> list[int]:
    rows, _ = read_lines(run_dir / "metrics.jsonl")
    return sorted({row["step"] for row in rows})


def kill_at(run_dir: Path, target: int, fraction: float) -> tuple[bool, list[int], float]:
    """Start a run; once step-`target`.pt exists, wait `fraction` of the time the run took to
    get there from its previous checkpoint, freeze it, and kill -9 it. Returns (landed
    mid-training: a point logged and a checkpoint saved, the logged steps, the delay)."""
    proc = start_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE, output=subprocess.DEVNULL)
    folder = run_dir / "checkpoints"
    deadline = time.monotonic() + TIMEOUT
    try:
        previous = time.monotonic()
        seen: set[str] = set()
        while not (folder / f"step-{target:08d}.pt").exists():
            if proc.poll() is not None:
                return False, logged_steps(run_dir), 0.0
            assert time.monotonic() < deadline, "the run never reached its checkpoint"
            now = {p.name for p in folder.glob("step-*.pt")} if folder.is_dir() else set()
            if now - seen:
                seen, previous = now, time.monotonic()
            time.sleep(0.02)
        delay = fraction * (time.monotonic() - previous)
        try:
            proc.wait(timeout=delay)
            return False, logged_steps(run_dir), delay  # it ended on its own
        except subprocess.TimeoutExpired:
            pass
        freeze(proc)
        steps = logged_steps(run_dir)
        proc.kill()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}, not signal 9"
        return bool(steps) and any(folder.glob("step-*.pt")), steps, delay
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_wandb_history_is_whole_after_kill_9(tmp_path, fault):
    record = fault("W&B holes after kill -9")
    rng = random.Random(20261130)
    failed = []
    for trial in range(TRIALS):
        for attempt in range(ATTEMPTS):
            run_dir = tmp_path / f"trial-{trial}-attempt-{attempt}"
            target, fraction = rng.choice(TARGETS), rng.random()
            landed, steps, delay = kill_at(run_dir, target, fraction)
            if landed:
                break
        else:
            pytest.fail(f"trial {trial + 1}: no kill landed mid-training in {ATTEMPTS} runs")
        kept_by_wandb = {row.get("step") for row in wandb_rows(run_dir)[0]}
        result = run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE, check=False)
        resumed = re.search(r"resuming from \S+ \(step (\d+)\)", result.stdout)
        problems = history_problems(run_dir)
        completed = result.returncode == 0
        # Lost: a step of metrics.jsonl missing from W&B or with another value there.
        lost = [p for p in problems if "missing" in p or "differ" in p]
        survived = completed and bool(resumed) and not problems
        note = (f"kill -9 {delay:.1f}s after step-{target:08d}.pt with steps {steps} logged; "
                f"the killed W&B segment held {len(kept_by_wandb & set(steps))} of them; "
                f"resumed from step {resumed.group(1) if resumed else 'nothing'}, "
                f"{len(read_metrics(run_dir))} metrics.jsonl lines; W&B: "
                f"{'; '.join(problems) or 'every step once, same values'}")
        record.trial(survived, lost=bool(lost), note=note)
        if not survived:
            failed.append(f"trial {trial + 1}: {note}")
    assert not failed, "\n".join(failed)
