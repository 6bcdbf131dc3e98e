"""CheckpointManager: atomic saves, keep-last-N history, best-by-metric, resume.

Layout of a run's checkpoints/ folder (after timm's CheckpointSaver):
    step-00000420.pt   the history, the newest `keep_last` kept
    last.pt            the newest checkpoint (a hard link to the newest step file)
    best.pt            the checkpoint with the best monitored value so far

What a run keeps once it has completed or been pruned is checkpoint.on_finish (`keep_on_finish`):
everything (`all`), best.pt and last.pt (`best_last`, the sweep jobs' default) or best.pt alone
(`best`); `labrun gc` applies the same to a sweep already on disk (train/checkpoint_gc.py).

Every file is written to a temporary name, flushed to disk and renamed, so a file that exists
under its final name is never half-written, even if the process is killed mid-save. Checkpoints
are plain dicts of tensors and numbers (CheckpointState lists every key), loaded with
`weights_only=True`: nothing here unpickles arbitrary objects.
"""

from __future__ import annotations

import errno
import math
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

import labrun
from labrun.config.objective import DEFAULT_MODE, DEFAULT_MONITOR, better
from labrun.core.errors import LabrunError, torch_load_reason
from labrun.core.files import atomic_path
from labrun.runs.lock import ensure_owner
from labrun.runs.rundir import RunDir

STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")


class CheckpointError(LabrunError):
    """A checkpoint could not be written or read; the message names the file and the fix."""


class DataPosition(TypedDict):
    epoch: int  # the epoch in progress
    position: int  # samples of its order this rank has trained on
    micro_batch_size: int  # what fitted in memory (trainer.micro_batch_size=auto)


class LogWindow(TypedDict):
    loss: torch.Tensor  # summed train loss of the steps since the last logged point
    steps: int


class Ema(TypedDict):
    model: dict[str, torch.Tensor]  # the average's state dict, with the model's own keys
    updates: int  # optimizer steps averaged so far (the warm-up goes on from it)


class _AddedLater(TypedDict, total=False):
    """Keys absent from checkpoints written before labrun kept them."""

    log_window: LogWindow
    callbacks: dict[str, dict[str, Any]]  # each callback's state_dict(), by name
    deploy: str | None  # the task's deploy module (labrun.deploy.hooks), None without one
    # trainer.ema only (train/ema.py): the average of the weights, and which weights evaluation
    # and deployment use ("ema"; absent: "model"), read through inference_weights() alone.
    ema: Ema
    inference_weights: str


class CheckpointState(_AddedLater):
    """Everything in a checkpoint file: what a run needs to continue exactly, and what export
    and `labrun compare` read without the config files. Built by Trainer.state_dict() only."""

    model: dict[str, torch.Tensor]  # the plain module's state dict (no DDP/compile prefix)
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]  # fp16's GradScaler (disabled, and empty, otherwise)
    epoch: int  # epochs done
    step: int  # optimizer steps done
    rng: dict[str, Any]  # rng_state()
    data: DataPosition
    best: float | None  # best value of checkpoint.monitor so far
    wandb_run_id: str | None  # the W&B run a resumed run continues
    config: dict[str, Any]  # the resolved config of the run
    class_names: list[str]
    labrun_version: str


def load(path: str | Path) -> CheckpointState:
    """Load a checkpoint safely; a file that is not a labrun checkpoint raises CheckpointError."""
    state = read_torch_file(path)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path}: not a labrun checkpoint (no 'model' entry)")
    return state  # type: ignore[return-value]  # a labrun checkpoint: the keys above


def inference_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint is evaluated and deployed with: its EMA's when the run kept one
    (trainer.ema: "inference_weights" is "ema"), else the trained weights ("model", which a
    resumed run trains on). Every reader of a checkpoint for inference goes through here: the
    test split's evaluation, `labrun eval`, `labrun export` (and so serve and predict),
    model.init_from."""
    which = state.get("inference_weights", "model")
    if which == "model":
        return state["model"]
    if which == "ema" and isinstance(state.get("ema"), dict) and "model" in state["ema"]:
        return state["ema"]["model"]
    raise CheckpointError(f"the checkpoint's inference_weights names {which!r}, which it does "
                          f"not hold")


def for_inference(state: CheckpointState) -> CheckpointState:
    """The checkpoint with "model" holding its inference weights: what a task's deploy module
    is handed (its export_plan reads state["model"])."""
    return {**state, "model": inference_weights(state)}  # type: ignore[typeddict-item]


def read_torch_file(path: str | Path) -> Any:
    """What a file of torch.save holds, unpickled with weights_only=True (tensors and plain
    containers, nothing that could run code); anything else raises CheckpointError."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except Exception as error:
        raise CheckpointError(f"{path}: not a readable checkpoint "
                              f"({torch_load_reason(error)})") from error


def save_weights_only(path: str | Path, model: dict[str, torch.Tensor], *,
                      class_names: list[str], config: dict[str, Any]) -> Path:
    """A checkpoint of a model that labrun did not train (`labrun bench serve`'s untrained
    models): what export reads (model, class_names, config), without the optimizer and data
    position that a run would resume from, so it cannot be resumed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"model": model, "class_names": class_names, "config": config, "epoch": 0,
                    "step": 0, "best": None, "labrun_version": labrun.__version__}, tmp)
    return path


class CheckpointManager:
    def __init__(self, folder: str | Path, monitor: str = DEFAULT_MONITOR,
                 mode: str = DEFAULT_MODE, keep_last: int = 3):
        self.folder = Path(folder)
        self.monitor, self.mode, self.keep_last = monitor, mode, keep_last
        # The run folder's lock (runs/lock.py), checked before every write.
        self.lock_path = RunDir(self.folder.parent).lock_path

    @property
    def last_path(self) -> Path:
        return self.folder / "last.pt"

    @property
    def best_path(self) -> Path:
        return self.folder / "best.pt"

    # -- deciding what is best -----------------------------------------------------------------

    def is_better(self, value: float | None, best: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        if best is None:
            return True
        return better(self.mode)(value, best)

    # -- saving --------------------------------------------------------------------------------

    def save(self, state: CheckpointState, step: int, is_best: bool = False) -> Path:
        """Write step-NNNNNNNN.pt, point last.pt (and best.pt if `is_best`) at it, prune.
        Nothing is written, and LockLost raised, if another process took the run folder over."""
        ensure_owner(self.lock_path)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step-{step:08d}.pt"
        self._write_atomic(state, path)
        self._link(path, self.last_path)
        if is_best:
            self._link(path, self.best_path)
        self._prune()
        return path

    def _write_atomic(self, state: CheckpointState, path: Path) -> None:
        try:
            with atomic_path(path, durable=True) as tmp:
                torch.save(state, tmp)
                # Checked again after the save, which takes seconds for a large model: the
                # window in which a displaced holder could still rename its file in is then
                # only the fsync and the rename.
                ensure_owner(self.lock_path)
        except OSError as error:
            previous = self.latest_path()
            kept = f"; the previous checkpoint {previous.name} is intact" if previous else ""
            hint = "free some disk space" if error.errno == errno.ENOSPC else "check the folder"
            raise CheckpointError(f"could not write checkpoint {path}: "
                                  f"{error.strerror or error}{kept}; {hint}") from error

    def _link(self, target: Path, link: Path) -> None:
        """Atomically make `link` the same file as `target` (a hard link, or a copy)."""
        with atomic_path(link) as tmp:
            try:
                os.link(target, tmp)
            except OSError:  # file systems without hard links
                shutil.copyfile(target, tmp)

    def _prune(self) -> None:
        history = self.history()
        for path in history[:-self.keep_last] if self.keep_last else history:
            path.unlink(missing_ok=True)

    # -- once the run has finished -------------------------------------------------------------

    def keep_on_finish(self, policy: str, dry_run: bool = False) -> list[tuple[Path, int]]:
        """Remove what a finished run's `policy` (checkpoint.on_finish; "none": every
        checkpoint, for `labrun gc --keep-best`) does not keep; each removed file with the bytes
        its removal freed. Safe to interrupt and to repeat: each name goes atomically, and a
        second call finds nothing more to remove."""
        ensure_owner(self.lock_path)
        return remove_files(self.past_budget(policy), dry_run)

    def past_budget(self, policy: str) -> list[Path]:
        """The files `policy` removes: best_last the step files; best those and last.pt, unless
        there is no best.pt (a run whose monitor never had a finite value) to keep instead;
        none every checkpoint."""
        if policy in ("all", "auto") or not self.folder.is_dir():
            return []
        files = self.history()
        last, best = self.last_path, self.best_path
        if policy == "none" or (policy == "best" and best.exists()):
            files.append(last)
        if policy == "none":
            files.append(best)
        return [path for path in files if path.exists()]

    # -- finding and loading -------------------------------------------------------------------

    def history(self) -> list[Path]:
        """The step files, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if STEP_FILE.match(p.name))

    def latest_path(self) -> Path | None:
        history = self.history()
        return history[-1] if history else None

    def load_latest_valid(self) -> tuple[Path, CheckpointState] | None:
        """The newest checkpoint that loads; unreadable ones are named and skipped.

        Returns None when the folder holds no checkpoint at all; raises when it holds some but
        none of them loads.
        """
        candidates = list(reversed(self.history()))
        # last.pt after the newest step file: save() renames a step file into place before it
        # points last.pt at it, so a kill in between leaves last.pt one checkpoint behind.
        if self.last_path.exists():
            candidates.insert(1, self.last_path)
        if not candidates:
            return None
        for path in candidates:
            try:
                return path, load(path)
            except CheckpointError as error:
                warnings.warn(f"skipping unreadable checkpoint: {error}", stacklevel=2)
        raise CheckpointError(f"no checkpoint in {self.folder} can be read; start over with "
                              f"checkpoint.resume=never (in a new folder)")


def remove_files(paths: list[Path], dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove `paths` (or, dry_run, only count them); each with the bytes its removal frees. A
    step file, last.pt and best.pt may be one file under two or three names (hard links,
    CheckpointManager._link): its bytes are freed with its last name, and counted there."""
    links = {}  # inode -> names not yet removed, of the file's st_nlink in all
    removed = []
    for path in paths:
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed meanwhile (a second gc, say): nothing to free
            continue
        left = links.setdefault((stat.st_dev, stat.st_ino), stat.st_nlink) - 1
        links[(stat.st_dev, stat.st_ino)] = left
        if not dry_run:
            path.unlink(missing_ok=True)
        removed.append((path, stat.st_size if left == 0 else 0))
    return removed


# The "rng" entry of a checkpoint.


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain lists (loadable with weights_only=True)."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        # Only the GPUs visible now (a run may resume with fewer than it started with).
        for index, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
