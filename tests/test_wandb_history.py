"""W&B history without holes (track/wandb_history.py): after a stop and a resume, the W&B run,
read back with W&B's own reader over all its offline segments, holds every step of
metrics.jsonl exactly once with the same values, keyed on labrun's `step`.

The kill -9 trials are in faults/test_wandb_holes.py, the SLURM requeue in
test_wandb_requeue.py; `history_problems` is their shared check."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from test_tracking import OFFLINE, inspect_records

from conftest import read_metrics, run_train, start_train, wait_for

WANDB_RUN = ["logger=wandb", "trainer.max_epochs=2", "trainer.log_every_n_steps=5",
             "checkpoint.every_n_steps=5"]
STOP_TIMEOUT = 60  # a stopped run saves a checkpoint and closes the offline run: seconds


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


def history_problems(run_dir: Path) -> list[str]:
    """What differs between the W&B run and metrics.jsonl: a step missing, logged twice or not
    in metrics.jsonl, a value that differs. Empty: the W&B history is whole."""
    expected: dict[int, dict] = {}
    for line in read_metrics(run_dir):  # several lines at one step are one W&B row
        expected.setdefault(line["step"], {}).update(
            {k: v for k, v in line.items() if "/" in k and v is not None})
    rows, ids = wandb_rows(run_dir)
    problems = [] if len(ids) <= 1 else [f"{len(ids)} W&B runs in one run folder: {ids}"]
    steps = [row.get("step") for row in rows]
    if missing := sorted(set(expected) - set(steps)):
        problems.append(f"steps missing from W&B: {missing}")
    if doubled := sorted({s for s in steps if steps.count(s) > 1}):
        problems.append(f"steps in W&B more than once: {doubled}")
    if extra := sorted(set(steps) - set(expected), key=str):
        problems.append(f"steps in W&B that metrics.jsonl does not have: {extra}")
    for row in rows:
        want = expected.get(row.get("step"), {})
        differing = sorted(k for k, v in want.items() if row.get(k) != pytest.approx(v))
        if differing:
            problems.append(f"step {row['step']}: {differing} differ from metrics.jsonl")
    return problems


def sigterm_run(run_dir: Path, checkpoint: str) -> None:
    proc = start_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    wait_for(run_dir / "checkpoints" / checkpoint, proc)
    proc.send_signal(signal.SIGTERM)  # interrupted: checkpoint, then wandb.finish()
    proc.wait(timeout=STOP_TIMEOUT)


def test_a_sigtermed_run_resumes_into_a_whole_history(tmp_path):
    run_dir = tmp_path / "run"
    sigterm_run(run_dir, "step-00000010.pt")
    result = run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    assert "resuming from" in result.stdout
    assert history_problems(run_dir) == []
    # The stopped segment was logged again by the resumed one: kept aside, not uploaded.
    assert list((run_dir / "wandb" / "superseded").glob("offline-run-*"))
    assert len(segments(run_dir)) == 1


def test_an_uploaded_segment_is_not_logged_again(tmp_path):
    """A segment `wandb sync` already uploaded stays, and its steps are not logged twice."""
    run_dir = tmp_path / "run"
    sigterm_run(run_dir, "step-00000010.pt")
    [first] = segments(run_dir)
    uploaded = {row["step"] for row in wandb_rows(run_dir)[0]}
    assert uploaded, "the stopped run logged nothing: the test would prove nothing"
    for wandb_file in first.glob("run-*.wandb"):  # what `wandb sync` leaves when it is done
        wandb_file.with_suffix(".wandb.synced").touch()
    run_train(*WANDB_RUN, run_dir=run_dir, env=OFFLINE)
    assert segments(run_dir)[0] == first and len(segments(run_dir)) == 2
    assert history_problems(run_dir) == []
