"""W&B history without holes: a resumed run's W&B history holds every metrics.jsonl point once.

What W&B does on its own (wandb 0.31, measured): an offline run's `.wandb` file is written by
the wandb-core process in buffered blocks, so a kill -9 of the training process can leave the
killed segment with no record at all (a 7-byte header after 16 steps and 3 checkpoints), and
`wandb sync` of it uploads nothing. The resumed run (same id, resume="allow") then starts a new
offline segment from the resumed step: everything before it is a hole.

What labrun does (`prepare`, when the tracker starts):
- History is keyed on labrun's own `step` (define_metric("*", step_metric="step")), not on
  W&B's `_step`: W&B refuses a `_step` below the run's last one, but takes any value of a step
  metric, so points below the last step W&B holds can be logged again.
- Earlier offline segments in the run folder that were never uploaded (no `.wandb.synced`
  marker) are moved to wandb/superseded/: whatever they hold, the new segment logs again from
  metrics.jsonl, which RunDir has already cut back to the resumed step. Uploading them too
  would double their points, or bring back the points of a killed attempt past its checkpoint.
- What W&B already holds is never logged again: the steps of uploaded segments of this run
  (read back with `wandb leet inspect`), or, for an online run, every step up to the last one
  the server has (its summary's `step`: points reach the server in order).
- A segment whose upload was interrupted (`wandb sync` stopped: wandb-core has written its
  run-ID.wandb.syncstate, but no .wandb.synced) holds steps of which W&B has an unknown first
  part. Online, the server's last step says how far it got, and the rest is logged again.
  Offline nobody can say, so none of its steps is logged again (W&B may then lack the ones
  the upload did not reach; metrics.jsonl has them all). Either way it is moved aside: a
  second `wandb sync` of it sends it again from its first row (measured with wandb 0.31: it
  resumes the W&B run after the rows already there), which would put its uploaded part in
  W&B twice.
- When an uploaded or partly uploaded segment cannot be read, which steps W&B holds is
  unknown: `prepare` raises Unreadable, and the tracker then logs no history to W&B for this
  attempt rather than risk a step twice.
- Then every metrics.jsonl point W&B does not hold is logged, in order, before training goes
  on; training's own points at a step W&B holds are skipped.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from labrun.core.errors import first_line, one_line
from labrun.runs.rundir import RunDir

log = logging.getLogger(__name__)

STEP = "step"  # labrun's optimizer step: the x-axis of every metric in W&B
SUPERSEDED = "superseded"  # wandb/superseded/: segments the current one logged again
# What metrics.jsonl holds beyond what the trainer hands the tracker: not logged to W&B, so
# that a point logged again looks the same as one logged live.
NOT_LOGGED = ("epoch", "time")
# Reading a small local .wandb file takes a second or two; a reader that hangs is given up.
INSPECT_TIMEOUT = 120


def declare_step(run: Any) -> None:
    """Every metric is plotted against labrun's `step` (define_metric), not W&B's `_step`."""
    run.define_metric(STEP)
    run.define_metric("*", step_metric=STEP)


class StepRows:
    """One W&B row per labrun step: metrics.jsonl has several lines at one step (the last
    training point of an epoch and its validation), which W&B keyed on `_step` used to merge.
    A row is logged when a point of a later step arrives, or at `flush` (the end)."""

    def __init__(self, run: Any):
        self.run = run
        self.pending: dict[str, Any] | None = None

    def add(self, metrics: dict[str, Any], step: int) -> None:
        if self.pending is not None and self.pending[STEP] != step:
            self.flush()
        self.pending = {**(self.pending or {}), **point(metrics, step)}

    def flush(self) -> None:
        if self.pending is not None:
            row, self.pending = self.pending, None
            self.run.log(row)


def prepare(run: Any, run_dir: Path, resumed: bool, rows: StepRows) -> set[int]:
    """Make the W&B run whole before training continues (see the module's note), through
    `rows`. Returns the steps W&B already holds, which training must not log again. Raises
    Unreadable, before logging anything, when an earlier segment that W&B holds all or part
    of cannot be read."""
    segment = Path(run.dir).parent  # wandb/offline-run-DATE-ID/ (or run-DATE-ID/ online)
    held: set[int] = set()
    # The server's last step, online: it holds every step up to it, from whichever segment.
    last = run.summary.get(STEP) if resumed and not run.offline else None
    online_last = int(last) if isinstance(last, int | float) else None
    partly: dict[Path, set[int]] = {}
    if resumed:
        held = synced_steps(segment, run.id)
        if online_last is not None:
            held |= set(range(online_last + 1))
        if run.offline:
            partly = {s: steps_of(s) for s in earlier(segment, run.id) if is_partly_uploaded(s)}
            for steps in partly.values():
                held |= steps
    supersede(segment, run.id)
    for part, steps in partly.items():
        if steps:
            log.warning(f"W&B: the upload of {part.name} was interrupted (`wandb sync` did not "
                        f"finish) and this run is offline, so which of its steps W&B holds is "
                        f"unknown: its steps {min(steps)}-{max(steps)} are not logged again, "
                        f"so that none is in W&B twice (W&B may lack the ones the upload did "
                        f"not reach; metrics.jsonl has them all)")
    points = [row for row in RunDir(run_dir).read_metrics() if row.get(STEP) not in held]
    for row in points:
        rows.add(row, row[STEP])
    if points:
        log.info(f"W&B: logged {len(points)} points of metrics.jsonl again (steps "
                 f"{points[0][STEP]}-{points[-1][STEP]}) so that the W&B run has no holes")
    return held


def point(metrics: dict[str, Any], step: int) -> dict[str, Any]:
    """The W&B row of one logged point: labrun's step and the metrics (no null values)."""
    row = {k: v for k, v in metrics.items() if k not in NOT_LOGGED and v is not None}
    row[STEP] = step
    return row


def segments(wandb_dir: Path) -> list[Path]:
    """The offline segments in a run folder's wandb/ folder, oldest first (named by start)."""
    return sorted(p for p in wandb_dir.glob("offline-run-*") if p.is_dir())


def is_synced(segment: Path) -> bool:
    # `wandb sync` leaves run-ID.wandb.synced next to the file it uploaded.
    return any(segment.glob("*.wandb.synced"))


def is_partly_uploaded(segment: Path) -> bool:
    """A `wandb sync` of it started but did not finish: wandb-core writes run-ID.wandb.syncstate
    when it starts uploading a .wandb file (an offline run has none), .wandb.synced at the end."""
    return any(segment.glob("*.wandb.syncstate")) and not is_synced(segment)


def earlier(current: Path, run_id: str) -> list[Path]:
    """This W&B run's offline segments in the run folder besides the current one, those moved
    to wandb/superseded/ included: a partly uploaded one moved there by an earlier resume still
    holds steps W&B may have."""
    wandb_dir = current.parent
    return [s for s in segments(wandb_dir) + segments(wandb_dir / SUPERSEDED)
            if s != current and s.name.endswith(f"-{run_id}")]


def supersede(current: Path, run_id: str) -> None:
    """Move the earlier offline segments that were never (wholly) uploaded to
    wandb/superseded/."""
    wandb_dir = current.parent
    stale = [s for s in segments(wandb_dir) if s != current and not is_synced(s)]
    if not stale:
        return
    target = wandb_dir / SUPERSEDED
    target.mkdir(exist_ok=True)
    for segment in stale:
        shutil.move(str(segment), str(target / segment.name))
    partly = sum(is_partly_uploaded(target / s.name) for s in stale)
    log.info(f"W&B: {len(stale)} earlier offline segment(s) of this run folder were not "
             f"uploaded ({partly} of them partly); this segment logs again, from metrics.jsonl, "
             f"what W&B may lack of them, so they were moved to {target} (do not upload them)")


def synced_steps(current: Path, run_id: str) -> set[int]:
    """Labrun's steps in this run's offline segments that were already uploaded."""
    held: set[int] = set()
    for segment in earlier(current, run_id):
        if is_synced(segment):
            held |= steps_of(segment)
    return held


def steps_of(segment: Path) -> set[int]:
    return {row[STEP] for row in read_history(segment) if STEP in row}


class Unreadable(Exception):
    """An earlier segment W&B holds (part of) could not be read: which steps W&B holds is
    unknown."""


def read_history(segment: Path) -> list[dict[str, Any]]:
    """The history rows of an offline segment, read with W&B's own reader (`wandb leet
    inspect`; wandb has no Python reader of .wandb files). Unreadable if that fails."""
    wandb = shutil.which("wandb") or str(Path(sys.executable).with_name("wandb"))
    try:
        out = subprocess.run([wandb, "leet", "inspect", "--json", str(segment)],
                             capture_output=True, text=True, check=True,
                             timeout=INSPECT_TIMEOUT).stdout
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [history_row(r["history"]) for r in records if r.get("type") == "history"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as error:
        detail = first_line(getattr(error, "stderr", None) or "")  # what the reader said
        raise Unreadable(f"could not read {segment} with `wandb leet inspect` "
                         f"({one_line(error)}{'; ' + detail if detail else ''})") from error


def history_row(history: dict[str, Any]) -> dict[str, Any]:
    """One `history` record of `wandb leet inspect --json` as {name: value}."""
    return dict(history.get("item") or {})
