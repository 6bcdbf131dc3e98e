"""`labrun export RUN_DIR|CHECKPOINT --format onnx|torchscript`: a deployable model + metadata.

    checkpoint (weights_only) + its config -> models.build -> trace/export with a dynamic batch
        -> parity check: the exported file, run by its own runtime (onnxruntime or the loaded
           TorchScript module), against eager PyTorch on real validation images
        -> MODEL and MODEL.json (classes, input size, mean/std, resize ratio, provenance)

The exported model takes normalised float NCHW input, like the eager model; labrun.deploy.runtime
does the preprocessing from the metadata, for `labrun serve` and `labrun predict`.

A language model's checkpoint (its `task` is "lm": labrun.train.task.LanguageModelling) goes
the same way with labrun.deploy.lm's parts (lm_plan): token ids in, next-token logits out, the
batch and the sequence (up to block_size) dynamic, the parity check on windows of the run's
val tokens at two batch sizes and two lengths, and the tokenizer in the metadata. A segmentation
model's (task "segmentation") goes with labrun.deploy.segmentation's parts (seg_plan).

ONNX: the dynamo exporter (torch.export) is tried first, as it is the one PyTorch maintains
(the TorchScript-based exporter is deprecated); the legacy exporter is the fallback when the
dynamo one fails or misses the parity check. The metadata records which one made the file.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

import labrun
from labrun import models
from labrun.config.dataset_schema import ImageDatasetConfig
from labrun.core.errors import LabrunError, one_line
from labrun.core.files import atomic_path, write_json_atomic
from labrun.data.image.transforms import ValTransform, normalize_on_device
from labrun.deploy import lm, segmentation
from labrun.deploy import runtime as inference
from labrun.runs.rundir import RunDir
from labrun.train.checkpoint import load as load_checkpoint

log = logging.getLogger(__name__)

FORMATS = {"onnx": ".onnx", "torchscript": ".torchscript.pt"}
DEFAULT_OPSET = 18  # the dynamo exporter's minimum; run by onnxruntime >= 1.14 and TensorRT 8.6+
PARITY_IMAGES = 32
# Allowed max |exported - eager| logit difference, relative to the largest eager logit (at
# least 1): fp32 kernels differ in summation order only; fp16 rounds every activation.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
# Model configs name the class to build with `_target_`; a checkpoint could name anything, so
# only these are built unless LABRUN_TRUSTED_MODULES (comma-separated prefixes) adds more.
TRUSTED_TARGETS = ("labrun.models.", "torchvision.models.", "torch.nn.", "timm.")
# An image classifier's one dynamic axis: its input's (and logits') first, of any size.
BATCH_AXIS = {0: ("batch", None)}
FP16_NEEDS_GPU = ("--fp16 exports on a CUDA GPU and none is visible here; export fp32 (drop "
                  "--fp16) or run this on a GPU node")


@dataclass
class Exported:
    path: Path
    metadata: dict[str, Any]


@dataclass
class Preprocessing:
    """What a deployed model needs to see its input as validation showed it to the model."""

    image_size: int
    val_resize_ratio: float
    mean: list[float]
    std: list[float]
    decoder: str  # how the run's loader decodes files; in-memory datasets: the default one

    @classmethod
    def from_dataset(cls, dataset: dict[str, Any]) -> Preprocessing:
        default = ImageDatasetConfig()  # the schema's defaults, for keys an old config lacks
        augment = dataset.get("augment", {})
        return cls(int(dataset.get("image_size", default.image_size)),
                   float(augment.get("val_resize_ratio", default.augment.val_resize_ratio)),
                   list(dataset.get("mean", default.mean)), list(dataset.get("std", default.std)),
                   str(dataset.get("decoder", "turbojpeg")))


# ---------------------------------------------------------------------------------------------
# The whole export, also used by `labrun serve RUN_DIR` and the serving benchmark


def export(source: Path, *, out: Path | None = None, fmt: str = "onnx", which: str = "best",
           fp16: bool = False, opset: int = DEFAULT_OPSET, exporter: str = "auto",
           check_data: str | None = "val", device: str | None = None,
           verbose: bool = False) -> Exported:
    """Export a checkpoint; `check_data` is "val", "random" or None (no parity check).

    `device` defaults to the CPU for fp32 and CUDA for fp16 (tests pass "cpu" to exercise the
    fp16 path where no GPU exists).
    """
    checkpoint, run_dir = find_checkpoint(source, which)
    state = load_checkpoint(checkpoint)
    for key in ("config", "class_names"):
        if key not in state:
            raise LabrunError(f"{checkpoint}: the checkpoint has no '{key}' entry; "
                              f"export needs a checkpoint written by labrun's trainer")
    cfg = state["config"]
    out = out or default_output(checkpoint, run_dir, fmt, fp16)
    if out.resolve() == checkpoint.resolve():
        raise LabrunError(f"--out {out} is the checkpoint being exported; choose another path")
    dtype = torch.float16 if fp16 else torch.float32
    device = device or ("cuda" if fp16 else "cpu")
    # The checkpoint's task picks what differs between kinds of model (labrun.train.task). A
    # language model's checkpoint written before it said so has a tokenizer: lm_plan names
    # what it lacks.
    language = state.get("task") == lm.TASK or "tokenizer" in state
    make_plan = lm_plan if language else image_plan
    if state.get("task") == segmentation.TASK:
        make_plan = seg_plan
    plan = make_plan(state, checkpoint, check_data, fmt, dtype, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    used, check = write_checked(plan, out, fmt, exporter, opset, dtype, device, verbose)

    metadata = {
        "format": fmt,
        "model_file": out.name,
        "dtype": str(dtype).removeprefix("torch."),
        **plan.metadata,
        "exporter": used,
        "opset": opset if fmt == "onnx" else None,
        "parity": check,
        "source": {
            "run_dir": str(run_dir.path.resolve()) if run_dir else None,
            "checkpoint": str(checkpoint.resolve()),
            "checkpoint_sha256": sha256(checkpoint),
            "model": cfg["model"].get("_target_"),
            "epoch": state.get("epoch"),
            "step": state.get("step"),
            "monitor": cfg.get("checkpoint", {}).get("monitor"),
            "best": state.get("best"),
        },
        "versions": {"labrun": labrun.__version__, "torch": torch.__version__,
                     "python": platform.python_version(), **runtime_versions(fmt)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(inference.metadata_path(out), metadata)
    if verbose:
        source = metadata["source"]
        log.info(f"exported {checkpoint} (epoch {source['epoch']}, step {source['step']}, "
                 f"{source['monitor']} {_fmt(source['best'])}) -> {out} ({fmt}, "
                 f"{metadata['dtype']}, {used}, {out.stat().st_size / 2**20:.1f} MB)")
    return Exported(out, metadata)


@dataclass
class Plan:
    """What differs between kinds of model in an export (image_plan, lm_plan)."""

    model: torch.nn.Module  # eager, fp32, with the checkpoint's weights
    example: torch.Tensor  # an input to trace with, on the device, of the exported dtype
    axes: dict[int, tuple[str, int | None]]  # the input's dynamic axes: name, largest size
    # The parity check of a written file against the eager model (None: no check), and the
    # line that reports it.
    check: Callable[[Path, torch.nn.Module], dict[str, Any]] | None
    report: Callable[[dict[str, Any], str], None]
    metadata: dict[str, Any]  # what serving reads of this kind of model


def image_plan(state: dict[str, Any], checkpoint: Path, check_data: str | None, fmt: str,
               dtype: torch.dtype, device: str) -> Plan:
    """An image classifier: normalised float NCHW in, class logits out; checked on the run's
    validation images."""
    cfg, class_names = state["config"], list(state["class_names"])
    model = build_model(cfg, {"num_classes": len(class_names)}, state["model"], checkpoint)
    prep = Preprocessing.from_dataset(cfg.get("dataset", {}))
    check = None
    if check_data is not None:
        images = parity_images(cfg.get("dataset", {}), prep, check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, fmt, reference, images, prep, dtype, device)

    example = torch.randn(2, 3, prep.image_size, prep.image_size, device=device, dtype=dtype)
    metadata = {
        "task": inference.CLASSIFICATION,
        "input": {"name": "input", "shape": ["batch", 3, prep.image_size, prep.image_size],
                  "layout": "NCHW", "values": "(uint8 / 255 - mean) / std"},
        "output": {"name": "logits", "shape": ["batch", len(class_names)]},
        "class_names": class_names,
        "num_classes": len(class_names),
        **asdict(prep),
    }
    return Plan(model, example, BATCH_AXIS, check, report_parity, metadata)


def lm_plan(state: dict[str, Any], checkpoint: Path, check_data: str | None, fmt: str,
            dtype: torch.dtype, device: str) -> Plan:
    """A language model (labrun.deploy.lm): token ids in, next-token logits out, batch and
    sequence dynamic; checked on windows of the run's val tokens."""
    sizes = lm.sizes(state, checkpoint)
    model = build_model(state["config"], sizes, state["model"], checkpoint)
    check = None
    if check_data is not None:
        windows = lm.parity_windows(state["config"].get("dataset", {}), sizes, check_data)
        tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return lm.parity(path, fmt, reference, windows, tolerance, device)

    with torch.inference_mode():  # the model's own config may pad the vocabulary
        logits_size = model(lm.example_input(sizes, "cpu")[:1, :1]).shape[-1]
    return Plan(model, lm.example_input(sizes, device), lm.input_axes(sizes["block_size"]),
                check, lm.report_parity, lm.metadata(state, logits_size))


def seg_plan(state: dict[str, Any], checkpoint: Path, check_data: str | None, fmt: str,
             dtype: torch.dtype, device: str) -> Plan:
    """A segmentation model (labrun.deploy.segmentation): images in, per-pixel logits out,
    batch, height and width dynamic; checked on the run's val images and an odd size."""
    return Plan(**segmentation.plan(state, checkpoint, check_data, fmt, dtype, device,
                                    build=build_model,
                                    tolerance=TOLERANCE[str(dtype).removeprefix("torch.")]))


def write_checked(plan: Plan, out: Path, fmt: str, exporter: str, opset: int,
                  dtype: torch.dtype, device: str, verbose: bool
                  ) -> tuple[str, dict[str, Any] | None]:
    """Write `out` with the first exporter whose file passes the plan's parity check (when it
    has one); returns (exporter name, parity figures). The file appears only when it passed.
    """
    # The exported copy is fp16 with --fp16; the eager reference stays fp32, the model trained.
    reference = plan.model.to(device)
    to_export = copy.deepcopy(plan.model).to(device=device, dtype=dtype)
    candidates = exporters(fmt, exporter)
    failures = []
    for name in candidates:
        try:
            with atomic_path(out) as tmp:  # `out` appears only once it passed the parity check
                write_model(to_export, plan.example, tmp, fmt, name, opset, plan.axes)
                check = None
                if plan.check is not None:
                    check = plan.check(tmp, reference)
                    if verbose:
                        plan.report(check, name)
                    if not check["passed"]:
                        compared = "image(s)" if "images" in check else "token position(s)"
                        raise LabrunError(check.get("failure") or  # the plan's own words
                            f"parity check failed: max abs diff {check['max_abs_diff']:.2e} > "
                            f"{check['tolerance']:.2e} or top-1 differs on "
                            f"{check['top1_mismatches']} {compared}")
            return name, check
        except Exception as error:  # noqa: BLE001 - any exporter failure moves to the next one
            failures.append(f"{name}: {one_line(error)}")
            if verbose and len(failures) < len(candidates):
                log.warning("%s exporter failed (%s); trying the next one", name, failures[-1])
    raise LabrunError(f"could not export to {fmt}: {'; '.join(failures)}")


def find_checkpoint(source: Path, which: str) -> tuple[Path, RunDir | None]:
    """(checkpoint file, its run folder or None) for a run folder or a checkpoint path."""
    if source.is_dir():
        run_dir = RunDir(source)
        checkpoint = run_dir.checkpoint_path(which)
        if not checkpoint.is_file():
            raise LabrunError(f"{source}: no checkpoints/{which}.pt; is it a run folder "
                              f"of a run that finished at least one epoch?")
        return checkpoint, run_dir
    if not source.is_file():
        raise LabrunError(f"{source}: no such run folder or checkpoint file")
    return source, RunDir.of_checkpoint(source)


def default_output(checkpoint: Path, run_dir: RunDir | None, fmt: str, fp16: bool) -> Path:
    folder = run_dir.export_dir if run_dir else checkpoint.parent
    return folder / f"{checkpoint.stem}{'-fp16' if fp16 else ''}{FORMATS[fmt]}"


def build_model(cfg: dict[str, Any], sizes: dict[str, int], weights: dict[str, torch.Tensor],
                checkpoint: Path) -> torch.nn.Module:
    """The eager model of the checkpoint's config, built with `sizes` (num_classes; vocab_size
    and block_size), as its task built it for training, with the checkpoint's weights."""
    if "model" not in cfg:
        raise LabrunError(f"{checkpoint}: its config has no 'model' section; export needs a "
                          f"checkpoint written by labrun's trainer")
    check_targets(cfg["model"], "model")
    model = models.build(OmegaConf.create(cfg["model"]), **sizes)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise LabrunError(f"{checkpoint}: the weights do not fit the model its config builds "
                          f"({one_line(error)})") from None
    return model.eval()


def check_targets(node: Any, key: str) -> None:
    """Refuse to build anything outside the trusted modules: hydra would import and call it."""
    trusted = TRUSTED_TARGETS + tuple(
        p.strip() for p in os.environ.get("LABRUN_TRUSTED_MODULES", "").split(",") if p.strip())
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None and not str(target).startswith(trusted):
            package = str(target).split(".")[0] + "."
            raise LabrunError(
                f"{key}._target_={target} is outside the trusted modules ({', '.join(trusted)}); "
                f"if you trust this checkpoint, set LABRUN_TRUSTED_MODULES={package}")
        for child_key, child in node.items():
            check_targets(child, f"{key}.{child_key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            check_targets(child, f"{key}[{i}]")


# ---------------------------------------------------------------------------------------------
# Writing the file


def exporters(fmt: str, choice: str) -> list[str]:
    if fmt == "torchscript":
        return ["torch.jit.trace"]
    return ["dynamo", "legacy"] if choice == "auto" else [choice]


def write_model(model: torch.nn.Module, example: torch.Tensor, path: Path, fmt: str,
                exporter: str, opset: int,
                axes: dict[int, tuple[str, int | None]] = BATCH_AXIS) -> None:
    """The model as `fmt`, its input's `axes` dynamic (the logits' leading axes follow them;
    tracing keeps shapes dynamic by itself)."""
    names = {axis: name for axis, (name, _) in axes.items()}
    with torch.no_grad(), warnings.catch_warnings():
        # Both torch.jit and the legacy ONNX exporter warn that they are deprecated; the
        # metadata records which exporter made the file, which is what a reader needs.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # Shape checks in a forward (the GPT's window length) become constants of a trace: the
        # parity check then runs the traced file at other shapes, which is what matters.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        if fmt == "torchscript":
            torch.jit.trace(model, example, check_trace=False).save(str(path))
        elif exporter == "dynamo":
            torch.onnx.export(model, (example,), str(path), dynamo=True, verbose=False,
                              input_names=["input"], output_names=["logits"],
                              dynamic_shapes=({axis: torch.export.Dim(name, max=largest)
                                               for axis, (name, largest) in axes.items()},),
                              opset_version=opset, external_data=False)
        else:
            torch.onnx.export(model, (example,), str(path), dynamo=False,
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": names, "logits": names},
                              opset_version=opset)


# ---------------------------------------------------------------------------------------------
# Parity check


def parity_images(dataset: dict[str, Any], prep: Preprocessing, data: str
                  ) -> tuple[torch.Tensor, str]:
    """A uint8 NCHW batch of validation images, or random images when those cannot be read,
    with a description of where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            return validation_images(dataset, prep)
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random input
            reason = f"validation images unavailable: {one_line(error)}"
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (PARITY_IMAGES, 3, prep.image_size, prep.image_size),
                           dtype=torch.uint8, generator=generator)
    return images, f"{PARITY_IMAGES} random images ({reason})"


def validation_images(dataset: dict[str, Any], prep: Preprocessing
                      ) -> tuple[torch.Tensor, str]:
    """The val loader's view of some validation images: same source, decoder and transform."""
    from labrun import data

    cfg = OmegaConf.create(dataset)
    if "download" in cfg:
        cfg.download = False  # never reach for the network in an export
    source = data.build(cfg).splits["val"]
    transform = ValTransform(prep.image_size, prep.val_resize_ratio)
    # Spread over the split rather than its first images, which may all share one class.
    indices = np.unique(np.linspace(0, len(source) - 1, PARITY_IMAGES).round().astype(int))
    images = torch.stack([transform(source.open(int(i))) for i in indices])  # as the val loader
    return images, f"{len(indices)} validation images of {source.name}"


def parity(path: Path, fmt: str, reference: torch.nn.Module,
           images: tuple[torch.Tensor, str], prep: Preprocessing, dtype: torch.dtype,
           device: str) -> dict[str, Any]:
    """The exported file in its own runtime vs the eager fp32 model, on the whole batch and on
    a batch of one (which proves the batch axis is really dynamic)."""
    batch, images_from = images
    runtime = (inference.onnx_runtime if fmt == "onnx" else inference.torchscript_runtime)(path)
    mean = torch.tensor(prep.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(prep.std, device=device).view(1, -1, 1, 1)
    x = normalize_on_device(batch.to(device), mean, std, torch.float32)
    with torch.inference_mode():
        eager = reference(x).float().cpu()
    x_exported = x.to(dtype).cpu().numpy()
    exported = torch.from_numpy(runtime(x_exported))
    single = torch.from_numpy(runtime(x_exported[:1]))
    diff = max((exported - eager).abs().max().item(), (single - eager[:1]).abs().max().item())
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")] * max(1.0, eager.abs().max().item())
    # A top-1 flip only counts where the eager top-2 margin exceeds what the tolerance allows.
    top2 = eager.topk(min(2, eager.shape[1]), dim=1).values
    margin = top2[:, 0] - top2[:, -1]
    differs = exported.argmax(1) != eager.argmax(1)
    mismatches = int((differs & (margin > 2 * tolerance)).sum())
    return {"images": len(batch), "images_from": images_from, "batch_sizes": [len(batch), 1],
            "max_abs_diff": diff, "tolerance": tolerance,
            "top1_agree": int((~differs).sum()), "top1_mismatches": mismatches,
            "passed": diff <= tolerance and mismatches == 0}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    log.info(f"parity ({exporter}): {check['images_from']}, batch sizes "
             f"{check['batch_sizes'][0]} and 1: max abs diff {check['max_abs_diff']:.2e} "
             f"(tolerance {check['tolerance']:.2e}), top-1 agrees on "
             f"{check['top1_agree']}/{check['images']} -> {verdict}")


# ---------------------------------------------------------------------------------------------
# Small helpers


def runtime_versions(fmt: str) -> dict[str, str]:
    if fmt != "onnx":
        return {}
    import onnx
    import onnxruntime
    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
