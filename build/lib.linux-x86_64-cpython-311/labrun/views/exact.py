"""`labrun compare --exact A B`: are two runs the same, bit for bit?

What "results unchanged" means, as a command anyone can re-run: every logged row of
metrics.jsonl (same steps, same keys, same values), summary.json, and every checkpoint file
present in both runs (every tensor of the model, optimizer, scheduler, scaler and RNG states,
and the plain values beside them: epoch, step, best, the config...). A checkpoint on one side
only is a difference.

Left out, and named in the output: what measures time or speed by nature, and what names the
run itself rather than what it computed. Two runs of the default job with the same seed, in two
folders, differ in exactly these (measured here, 6 steps and the full job): the rows' `time`,
summary.json's `started_at`/`ended_at`, the `perf/*` figures, and the checkpoints'
`config[paths][run_dir]` (compared relative to each run's folder instead). Left out too, though
equal there: summary.json's `requeued` (a requeued and resumed run must equal an uninterrupted
one) and the checkpoints' `wandb_run_id` (new for every logger=wandb run). `labrun_version` is
reported when it differs, never judged: the same code under another version string computes the
same.

Values are compared as bits: a float is equal only to the same float (NaN to NaN, 0.0 not to
-0.0), a tensor only to one of the same dtype and shape whose bytes are all the same.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from labrun.core.errors import LabrunError
from labrun.runs.rundir import RunDir
from labrun.train import checkpoint

SHOWN = 20  # differences printed one a line; the rest are counted

# Why each left-out key is left out (the reasons, as the output prints them).
CLOCK = "wall-clock times"
SPEED = "speed measured by the clock: throughput, data wait, GPU use"
REQUEUES = "the scheduler's restarts of the job, not a result"
OWN_FOLDER = "each run's own folder; compared relative to it"
WANDB_RUN = "each run's own W&B run"


def left_out_reason(key: str) -> str | None:
    """Why a key of a metrics.jsonl row or of summary.json is not compared (None: it is)."""
    if key in ("time", "started_at", "ended_at"):
        return CLOCK
    if key.startswith("perf/"):
        return SPEED
    if key == "requeued":  # a resumed run must equal an uninterrupted one
        return REQUEUES
    return None


@dataclass
class Comparison:
    a: Path
    b: Path
    differences: list[str] = field(default_factory=list)
    left_out: dict[str, list[str]] = field(default_factory=dict)  # reason -> keys
    notes: list[str] = field(default_factory=list)  # informational: never a difference
    rows: int = 0
    checkpoints: int = 0
    tensors: int = 0
    summary: bool = False

    def leave_out(self, key: str, reason: str) -> None:
        keys = self.left_out.setdefault(reason, [])
        if key not in keys:
            keys.append(key)

    @property
    def identical(self) -> bool:
        return not self.differences

    def lines(self) -> list[str]:
        """What the command prints: the two runs, what was left out and why, the differences
        (the first SHOWN), and the verdict last."""
        lines = [f"A: {self.a}", f"B: {self.b}"]
        lines += [f"left out: {', '.join(keys)} ({reason})"
                  for reason, keys in self.left_out.items()]
        lines += self.notes + self.differences[:SHOWN]
        if len(self.differences) > SHOWN:
            lines.append(f"... and {len(self.differences) - SHOWN} more differences")
        compared = (f"{self.rows} logged rows, {self.checkpoints} checkpoints "
                    f"({self.tensors} tensors), "
                    f"{'summary' if self.summary else 'no summary.json on either side'}")
        if self.identical:
            lines.append(f"identical: {compared}")
        else:
            lines.append(f"DIFFERENT: {len(self.differences)} differences in {compared}")
        return lines


def compare_runs(a: Path, b: Path) -> Comparison:
    """Compare the run folders `a` and `b`; a path that is not a run folder raises LabrunError."""
    folder_a, folder_b = run_folder(a), run_folder(b)
    result = Comparison(a, b)
    compare_metrics(folder_a, folder_b, result)
    compare_summaries(folder_a, folder_b, result)
    compare_checkpoints(folder_a, folder_b, result)
    return result


def run_folder(path: Path) -> RunDir:
    if not path.is_dir():
        raise LabrunError(f"{path}: no such folder; give two run folders "
                          f"(labrun compare --exact outputs/DATE/TIME-XXXX outputs/...)")
    folder = RunDir(path)
    if not folder.is_run():
        raise LabrunError(f"{path}: not a run folder (a run folder holds .hydra/ or "
                          f"summary.json); give the folder of one run, e.g. a sweep's job "
                          f"folder multirun/DATE/TIME-XXXX/0")
    return folder


# ---------------------------------------------------------------------------------------------
# metrics.jsonl and summary.json


def compare_metrics(a: RunDir, b: RunDir, result: Comparison) -> None:
    if a.metrics_path.is_file() != b.metrics_path.is_file():
        side = "A" if a.metrics_path.is_file() else "B"
        result.differences.append(f"metrics.jsonl: only in {side}")
    rows_a, rows_b = a.read_metrics(), b.read_metrics()
    if len(rows_a) != len(rows_b):
        result.differences.append(f"metrics.jsonl: {len(rows_a)} rows vs {len(rows_b)}")
    for number, (row_a, row_b) in enumerate(zip(rows_a, rows_b, strict=False), start=1):
        compare_records(row_a, row_b, f"metrics.jsonl row {number} (step {row_a.get('step')})",
                        result)
    result.rows = max(len(rows_a), len(rows_b))


def compare_summaries(a: RunDir, b: RunDir, result: Comparison) -> None:
    summary_a, summary_b = a.read_summary(), b.read_summary()
    compare_records(summary_a, summary_b, "summary.json", result)
    result.summary = bool(summary_a or summary_b)


def compare_records(a: dict[str, Any], b: dict[str, Any], where: str,
                    result: Comparison) -> None:
    """Two JSON objects (a logged row, a summary), key by key, except the left-out keys."""
    for key in dict.fromkeys([*a, *b]):
        reason = left_out_reason(key)
        if reason:
            result.leave_out(key, reason)
        elif key not in b or key not in a:
            result.differences.append(f"{where}: {key} only in {'A' if key in a else 'B'}")
        elif (difference := value_difference(a[key], b[key])) is not None:
            result.differences.append(f"{where}: {key} {difference}")


# ---------------------------------------------------------------------------------------------
# Checkpoints


def compare_checkpoints(a: RunDir, b: RunDir, result: Comparison) -> None:
    """Every checkpoints/*.pt of either run: one on one side only is a difference; each in both
    is compared entry by entry. last.pt and best.pt are often links to a step file: each name
    is compared all the same, since each is a file someone may load."""
    names_a = {path.name for path in a.checkpoints_dir.glob("*.pt")}
    names_b = {path.name for path in b.checkpoints_dir.glob("*.pt")}
    for name in sorted(names_a | names_b):
        if name not in names_a or name not in names_b:
            side = "A" if name in names_a else "B"
            result.differences.append(f"checkpoints/{name}: only in {side}")
            continue
        # CheckpointError (a LabrunError) for a file that does not load: one line, exit 2.
        state_a = checkpoint.load(a.checkpoints_dir / name)
        state_b = checkpoint.load(b.checkpoints_dir / name)
        compare_states(state_a, state_b, f"checkpoints/{name}", result)
        result.checkpoints += 1


def compare_states(a: dict[str, Any], b: dict[str, Any], where: str,
                   result: Comparison) -> None:
    version_a, version_b = a.get("labrun_version"), b.get("labrun_version")
    note = f"note: labrun_version {version_a} (A) vs {version_b} (B), not compared"
    if version_a != version_b and note not in result.notes:
        result.notes.append(note)
    leaves_a = dict(checkpoint_leaves(a, result))
    leaves_b = dict(checkpoint_leaves(b, result))
    # The config first: a difference there (optimizer.lr) explains the others.
    names = sorted(dict.fromkeys([*leaves_a, *leaves_b]), key=lambda n: not n.startswith("config["))
    for name in names:
        if name not in leaves_a or name not in leaves_b:
            result.differences.append(f"{where}: {name} only in {'A' if name in leaves_a else 'B'}")
            continue
        value_a, value_b = leaves_a[name], leaves_b[name]
        if isinstance(value_a, torch.Tensor) and isinstance(value_b, torch.Tensor):
            result.tensors += 1
            difference = tensor_difference(value_a, value_b)
        else:
            difference = value_difference(value_a, value_b)
        if difference is not None:
            result.differences.append(f"{where}: {name}: {difference}")


def checkpoint_leaves(state: dict[str, Any], result: Comparison):
    """(name, value) for every tensor and plain value in a checkpoint, named by where it lies:
    model[conv1.weight], optimizer[state][0][exp_avg], config[optimizer][lr]. The config's
    paths in the run's own folder become relative to it (each run has its own folder), and the
    W&B run id is left out (each run has its own)."""
    run_dir = ((state.get("config") or {}).get("paths") or {}).get("run_dir")
    for name, value in leaves(state):
        if name == "labrun_version":  # compare_states notes it
            continue
        if name == "wandb_run_id":
            result.leave_out(name, WANDB_RUN)
            continue
        if (name.startswith("config[") and isinstance(value, str) and run_dir
                and (value == run_dir or value.startswith(f"{run_dir}/"))):
            result.leave_out(name, OWN_FOLDER)
            value = "RUN_DIR" + value[len(run_dir):]
        yield name, value


def leaves(value: Any, name: str = ""):
    """The tensors and plain values inside nested dicts and lists; an empty dict or list is a
    value itself (so that {} against a missing entry, or against [], still shows)."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from leaves(item, f"{name}[{key}]" if name else str(key))
    elif isinstance(value, list | tuple) and value:
        for index, item in enumerate(value):
            yield from leaves(item, f"{name}[{index}]")
    else:
        yield name, value


# ---------------------------------------------------------------------------------------------
# One value against another, as bits


def value_difference(a: Any, b: Any) -> str | None:
    """None when two plain values are the same, else 'A vs B'. Floats compare as their bits:
    NaN equals NaN, 0.0 is not -0.0; 1 (an int) is not 1.0 (what was logged changed type)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{show(a)} vs {show(b)}"
    if isinstance(a, float) and isinstance(b, float):
        same = struct.pack("<d", a) == struct.pack("<d", b)
    else:
        same = type(a) is type(b) and a == b
    return None if same else f"{show(a)} vs {show(b)}"


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when two tensors have the same dtype, shape and bytes; else what differs. Bytes,
    not torch.equal: NaN != NaN and 0.0 == -0.0 there, and neither is what "the same" means."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    bytes_a, bytes_b = as_bytes(a), as_bytes(b)
    if torch.equal(bytes_a, bytes_b):
        return None
    differ = (bytes_a != bytes_b).any(dim=1)  # per element: any of its bytes
    first = int(differ.nonzero()[0])
    value_a, value_b = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
    return (f"{int(differ.sum())} of {a.numel()} values differ, first at "
            f"{position(first, a.shape)}: {value_a!r} vs {value_b!r}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, one row per element."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), flat.element_size())


def position(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    """Where the flat_index-th element of a tensor of `shape` lies: (0, 2, 1)."""
    return tuple(int(i) for i in np.unravel_index(flat_index, tuple(shape)))


def show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)} ({value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
