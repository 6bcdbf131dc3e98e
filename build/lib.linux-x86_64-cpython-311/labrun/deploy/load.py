"""What a MODEL argument of `labrun serve` and `labrun predict` may be, and loading it.

    predictor, tmp = load(MODEL)      MODEL: model.onnx | model.torchscript.pt (each with its
                                      metadata JSON beside it), or a run folder or checkpoint,
                                      exported to ONNX in the temp folder `tmp` first
    ...
    remove_folder(tmp)

What it loads is what the model's task serves with: the deploy module that the export's
metadata (or the checkpoint) names loads it (labrun.deploy.hooks); deploy_of(MODEL) names that
module without loading anything, for what must be checked first (`labrun predict`'s arguments).

This sits above both labrun.deploy.export and labrun.deploy.runtime, so that the runtime never
needs the exporter (export's parity check runs the exported file through the runtime).
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

from labrun.core.errors import LabrunError
from labrun.deploy import hooks, runtime


def is_torchscript_archive(path: Path) -> bool:
    """TorchScript archives hold code/ and constants.pkl; a checkpoint holds only data.pkl."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("constants.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def needs_export(model: Path) -> bool:
    """A run folder or a checkpoint (any file that is not an exported model): export first."""
    if model.is_dir():
        return True
    exported = (runtime.metadata_path(model).exists() or model.suffix == ".onnx"
                or is_torchscript_archive(model))
    return not exported


def export_for_inference(model: Path, folder: Path) -> Path:
    """Export a run folder or checkpoint to ONNX in `folder` (checked on random input, fast)."""
    # Imported here: the exporter pulls in the models, the data and the checkpoint code, which a
    # server given an exported file (and each of its worker processes) never needs.
    from labrun.deploy import export

    out = folder / "model.onnx"
    export.export(model, out=out, fmt="onnx", check_data="random")
    return out


def load(model: str | Path, threads: int | None = None, task: str | None = None
         ) -> tuple[Any, Path | None]:
    """The model of any MODEL argument, ready to answer, and the temp folder to delete
    afterwards (or None). `task`: the task it must be an export of (None: any)."""
    model = existing(model)
    if not needs_export(model):
        return open_exported(model, threads, task), None
    folder = Path(tempfile.mkdtemp(prefix="labrun-export-"))
    try:
        return open_exported(export_for_inference(model, folder), threads, task), folder
    except BaseException:
        remove_folder(folder)
        raise


def open_exported(path: Path, threads: int | None, task: str | None) -> Any:
    meta = runtime.read_metadata(path, task=task)
    return hooks.of_metadata(meta, path).load(path, threads)


def deploy_of(model: str | Path) -> ModuleType:
    """The deploy module of a MODEL argument, read from its metadata or checkpoint."""
    model = existing(model)
    if not needs_export(model):
        return hooks.of_metadata(runtime.read_metadata(model), model)
    from labrun.deploy import export
    from labrun.train.checkpoint import load as load_checkpoint

    checkpoint, _ = export.find_checkpoint(model, "best")
    return hooks.of_checkpoint(load_checkpoint(checkpoint), checkpoint)


def existing(model: str | Path) -> Path:
    model = Path(model)
    if not model.exists():
        raise LabrunError(f"{model}: no such file or folder; give an exported .onnx or .pt "
                          f"file, a run folder or a checkpoint")
    return model


def remove_folder(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
