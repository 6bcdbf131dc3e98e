"""The fault-injection suite: each test injects a fault into real processes and real files,
records what it injected and what it saw, and the session ends with the table
(fault, trials, survived, data lost, cannot tell), printed by tests/conftest.py.

Every cell is computed from checks of the trial itself: `trial()` takes `survived` and `lost`
as the results of those checks and has no defaults, so a row cannot be typed as a constant.
`lost=None` means the trial's check cannot tell whether data was lost; the table counts those
separately instead of calling them "not lost".

The data-loss checks shared by the fault tests live here, written once:
    metrics_lost(run_dir, reference_dir, upto_step)   metrics.jsonl lines up to a step
    checkpoints_lost(run_dir, keep_last, saved)       the checkpoints keep_last should keep
    hash_inputs(paths) / inputs_changed(before, paths) input files the run must not touch
Each returns a list of problems (empty: nothing lost), so a note can say what was lost.
Cutting metrics.jsonl back to the resumed step and keep_last rotating old checkpoints are the
contract of a resume, not losses; these checks do not count them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FAULT_ROW


@dataclass
class FaultRecord:
    fault: str
    trials: int = 0
    survived: int = 0
    data_lost: int = 0
    cannot_tell: int = 0
    notes: list[str] = field(default_factory=list)

    def trial(self, survived: bool, *, lost: bool | None, note: str) -> None:
        """One trial: `survived` and `lost` are what this trial's own checks found;
        lost=None when the check cannot tell."""
        self.trials += 1
        self.survived += bool(survived)
        if lost is None:
            self.cannot_tell += 1
        else:
            self.data_lost += bool(lost)
        self.notes.append(note)
        print(f"[{self.fault}] survived={bool(survived)} lost="
              f"{'cannot tell' if lost is None else bool(lost)}: {note}")

    def row(self) -> dict:
        """What the end-of-session table adds up: plain values, which xdist can send."""
        return {"fault": self.fault, "trials": self.trials, "survived": self.survived,
                "data_lost": self.data_lost, "cannot_tell": self.cannot_tell}


@pytest.fixture
def fault(request):
    """fault("name") -> a FaultRecord that lands in the end-of-session table.

    Under `make test`'s xdist workers the test runs in a worker, and only the controlling
    process prints a summary: each record goes back with the test's teardown report, as a user
    property, and tests/conftest.py adds the rows up there. Teardown, so that a trial recorded
    before a failed assert still counts."""
    records: dict[str, FaultRecord] = {}

    def make(name: str) -> FaultRecord:
        return records.setdefault(name, FaultRecord(name))

    yield make
    for record in records.values():
        request.node.user_properties.append((FAULT_ROW, record.row()))


# ---------------------------------------------------------------------------------------------
# metrics.jsonl

# The fields of a metrics.jsonl line that a deterministic run reproduces exactly: step, epoch,
# train/loss, train/lr, val/*, test/*, best/*. Left out: "time" (the wall clock when the line
# was written) and "perf/*" (images/s and the data-wait fraction: measured speeds that change
# with the machine's load). Everything else is a number the run computed and must not change.
def deterministic_fields(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "time" and not k.startswith("perf/")}


def read_lines(path: Path) -> tuple[list[dict], list[str]]:
    """The rows of a JSON-lines file, and a problem for each line that does not parse."""
    rows, problems = [], []
    text = path.read_text() if path.exists() else ""
    for number, line in enumerate(text.splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            problems.append(f"{path.name} line {number} is not JSON: {line[:60]!r}")
    return rows, problems


def metrics_lost(run_dir: Path, reference_dir: Path, upto_step: int) -> list[str]:
    """Every metrics.jsonl line of `reference_dir` up to `upto_step` (the step the run resumed
    from) must be in `run_dir`'s metrics.jsonl, in the same order, with the same deterministic
    fields, and no other line up to that step. Lines after it were logged again by the resumed
    run; cutting them back is the resume's contract. (No line up to that step in either file:
    there was nothing to lose.)"""
    rows, problems = read_lines(run_dir / "metrics.jsonl")
    reference, _ = read_lines(reference_dir / "metrics.jsonl")
    mine = [deterministic_fields(r) for r in rows if r.get("step", 0) <= upto_step]
    theirs = [deterministic_fields(r) for r in reference if r.get("step", 0) <= upto_step]
    differing = [(index, a, b) for index, (a, b) in enumerate(zip(mine, theirs, strict=False))
                 if a != b]
    if differing:  # the first one, and how many (a missing line shifts all that follow)
        index, a, b = differing[0]
        fields = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        problems.append(f"line {index + 1} (step {b.get('step')}) differs in {fields}"
                        + (f", and {len(differing) - 1} more lines" if len(differing) > 1 else ""))
    if len(mine) != len(theirs):
        problems.append(f"{len(mine)} lines up to step {upto_step}, the reference has "
                        f"{len(theirs)}")
    return problems


def metrics_shape_differs(run_dir: Path, reference_dir: Path) -> list[str]:
    """The whole metrics.jsonl against a reference run of the same config: the same lines
    (step and names logged), none missing or doubled by a resume. Values after a resume are
    not compared here (the final weights are, by the tests)."""
    rows, problems = read_lines(run_dir / "metrics.jsonl")
    reference, _ = read_lines(reference_dir / "metrics.jsonl")
    mine = [(r.get("step"), sorted(r)) for r in rows]
    theirs = [(r.get("step"), sorted(r)) for r in reference]
    if mine != theirs:
        problems.append(f"metrics.jsonl has lines at steps {[s for s, _ in mine]}, the "
                        f"reference at {[s for s, _ in theirs]}")
    return problems


# ---------------------------------------------------------------------------------------------
# checkpoints


def saved_steps(every_n: int, steps_per_epoch: int, last_step: int) -> list[int]:
    """The steps at which a run saves a checkpoint up to `last_step`: every `every_n` steps
    and at every epoch's end (src/labrun/train/trainer.py)."""
    return [s for s in range(1, last_step + 1)
            if (every_n and s % every_n == 0) or s % steps_per_epoch == 0]


def load_checkpoint(path: Path) -> tuple[dict | None, str]:
    """(the checkpoint, "") or (None, why it cannot be used)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure to load is the finding
        return None, f"{path.name} does not load ({type(error).__name__})"
    if not isinstance(state, dict) or "model" not in state:
        return None, f"{path.name} is not a labrun checkpoint"
    return state, ""


def checkpoints_lost(run_dir: Path, keep_last: int, saved: list[int]) -> list[str]:
    """Of the steps the run saved (`saved`), the newest `keep_last` step files must be there,
    load, hold that step and finite weights; last.pt must load and be the newest. Older step
    files being gone is keep_last's rotation, not a loss, and so is what checkpoint.on_finish
    removed once the run finished: the step files (best_last, best), and last.pt where best.pt
    is kept alone (best)."""
    import torch

    from labrun.runs.rundir import RunDir

    problems = []
    folder = run_dir / "checkpoints"
    folder_of = RunDir(run_dir)
    finished = folder_of.summary_path.is_file() and \
        folder_of.read_summary().get("status") in ("completed", "pruned")
    saved_config = folder_of.saved_config_node() if finished else None
    kept = saved_config.checkpoint.get("on_finish", "all") if saved_config is not None else "all"
    if kept in ("best_last", "best"):
        keep_last = 0
    if kept == "best" and (folder / "best.pt").exists():
        saved = []  # last.pt went too
    newest = saved[-keep_last:] if keep_last else []
    for step in newest:
        path = folder / f"step-{step:08d}.pt"
        if not path.exists():
            problems.append(f"{path.name} is missing")
            continue
        state, why = load_checkpoint(path)
        if state is None:
            problems.append(why)
        elif state["step"] != step:
            problems.append(f"{path.name} holds step {state['step']}")
        elif not all(torch.isfinite(t).all() for t in state["model"].values()
                     if t.is_floating_point()):
            problems.append(f"{path.name} holds non-finite weights")
    if saved:
        state, why = load_checkpoint(folder / "last.pt")
        if state is None:
            problems.append(why if (folder / "last.pt").exists() else "last.pt is missing")
        elif state["step"] != saved[-1]:
            problems.append(f"last.pt is step {state['step']}, the newest saved is {saved[-1]}")
    if (folder / "best.pt").exists():
        state, why = load_checkpoint(folder / "best.pt")
        if state is None:
            problems.append(why)
    return problems


# ---------------------------------------------------------------------------------------------
# inputs


def hash_inputs(paths: list[Path]) -> dict[str, str]:
    """sha256 of every file at or under `paths` (a file or a folder), by path."""
    hashes = {}
    for path in paths:
        files = sorted(p for p in Path(path).rglob("*") if p.is_file()) \
            if Path(path).is_dir() else [Path(path)]
        for file in files:
            hashes[str(file)] = (hashlib.sha256(file.read_bytes()).hexdigest()
                                 if file.exists() else "missing")
    return hashes


def inputs_changed(before: dict[str, str], paths: list[Path]) -> list[str]:
    """The input files that changed, appeared or went missing since `before` was hashed."""
    after = hash_inputs(paths)
    changed = []
    for path in sorted(before.keys() | after.keys()):
        if path not in before:
            changed.append(f"{path} appeared")
        elif after.get(path, "missing") == "missing" and before[path] != "missing":
            changed.append(f"{path} went missing")
        elif before[path] != after[path]:
            changed.append(f"{path} changed")
    return changed


def freeze(proc) -> None:
    """SIGSTOP, and wait until the kernel shows the process stopped: kill() returns before the
    signal has landed, and what the test reads next must not change under it."""
    import os
    import signal
    import time

    os.kill(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10  # a stop lands within milliseconds; 10 s: a loaded machine
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z"):
                    return  # stopped (or already dead, which the caller sees from its exit)
        except FileNotFoundError:
            return
        time.sleep(0.001)
    raise AssertionError(f"process {proc.pid} did not stop within 10 s of SIGSTOP")

