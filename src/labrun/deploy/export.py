"""`labrun export RUN_DIR|CHECKPOINT --format onnx|torchscript`: a deployable model + metadata.
(A deploy module may add formats of its own, EXTRA_FORMATS: labrun.deploy.hooks.)

    checkpoint (weights_only) -> the deploy module it names (labrun.deploy.hooks)
        -> its export_plan: the eager model with the checkpoint's weights, an example input,
           the input's dynamic axes, the parity check and the metadata serving needs
        -> trace/export with those axes dynamic
        -> parity check: the exported file, run by its own runtime (onnxruntime or the loaded
           TorchScript module), against eager PyTorch on the run's own validation data
        -> MODEL and MODEL.json (the plan's metadata, the deploy module, provenance)

What differs between tasks (an image classifier's normalised NCHW images and logits, a language
model's token ids, a segmenter's images of any size) is the plan's; how a file is written,
checked and described is here, the same for every task.

ONNX: the dynamo exporter (torch.export) is tried first, as it is the one PyTorch maintains
(the TorchScript-based exporter is deprecated); the legacy exporter is the fallback when the
dynamo one fails or misses the parity check. The metadata records which one made the file.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

import labrun
from labrun import models
from labrun.core.errors import LabrunError, one_line
from labrun.core.files import atomic_path, write_json_atomic
from labrun.deploy import hooks
from labrun.deploy import runtime as inference
from labrun.runs.rundir import RunDir
from labrun.train.checkpoint import for_inference
from labrun.train.checkpoint import load as load_checkpoint

log = logging.getLogger(__name__)

FORMATS = {"onnx": ".onnx", "torchscript": ".torchscript.pt"}
DEFAULT_OPSET = 18  # the dynamo exporter's minimum; run by onnxruntime >= 1.14 and TensorRT 8.6+
# Allowed max |exported - eager| output difference, relative to the largest eager output (at
# least 1): fp32 kernels differ in summation order only; fp16 rounds every activation.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}
# The one dynamic axis of a model that takes a batch of fixed-size items: the first.
BATCH_AXIS = {0: ("batch", None)}
FP16_NEEDS_GPU = ("--fp16 exports on a CUDA GPU and none is visible here; export fp32 (drop "
                  "--fp16) or run this on a GPU node")


@dataclass
class Exported:
    path: Path
    metadata: dict[str, Any]


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
    if "config" not in state:
        raise LabrunError(f"{checkpoint}: the checkpoint has no 'config' entry; export needs "
                          f"a checkpoint written by labrun's trainer")
    deploy = hooks.of_checkpoint(state, checkpoint)  # before anything is built or written
    extra = getattr(deploy, "EXTRA_FORMATS", {})
    if fmt not in FORMATS and fmt not in extra:
        raise LabrunError(f"--format {fmt}: a task={deploy.TASK} run exports to "
                          f"{', '.join([*FORMATS, *extra])}")
    cfg = state["config"]
    out = out or default_output(checkpoint, run_dir, fmt, fp16)
    if out.resolve() == checkpoint.resolve():
        raise LabrunError(f"--out {out} is the checkpoint being exported; choose another path")
    if fmt in extra:  # the deploy module's own format, written its own way, in fp32
        if fp16:
            raise LabrunError(f"--fp16 exports onnx and torchscript; --format {fmt} writes the "
                              f"fp32 weights: drop --fp16")
        result = extra[fmt](for_inference(state), checkpoint, out)
        if verbose:
            log.info(f"exported {checkpoint} -> {result.path} ({fmt})")
        return result
    dtype = torch.float16 if fp16 else torch.float32
    target = Target(fmt, dtype, device or ("cuda" if fp16 else "cpu"), check_data)
    # "model" is the weights to deploy: the EMA's when the run kept one (trainer.ema).
    plan = deploy.export_plan(for_inference(state), checkpoint, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    used, check = write_checked(plan, out, target, exporter, opset, verbose)

    metadata = {
        "format": fmt,
        "model_file": out.name,
        "dtype": target.dtype_name,
        "task": deploy.TASK,
        "deploy": deploy.__name__,  # what serving imports (labrun.deploy.hooks)
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
            "weights": state.get("inference_weights", "model"),  # "ema": trainer.ema's average
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


@dataclass(frozen=True)
class Target:
    """What an export is asked for: the format, the exported dtype, where the model runs while
    it is traced and checked, and the parity check's data ("val", "random", None: none)."""

    fmt: str
    dtype: torch.dtype
    device: str
    check_data: str | None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def tolerance(self) -> float:
        """The allowed output difference, relative to the largest eager output (at least 1)."""
        return TOLERANCE[self.dtype_name]

    def runtime(self, path: Path) -> Callable:
        """The written file in the runtime that will serve it."""
        return inference.open_runtime(path, self.fmt)


@dataclass
class LogitsParity:
    """Exported logits against the eager model's, summed over a parity check's calls, for a
    task whose output is class scores (per text, per token): the largest difference, the
    tolerance (`relative` x the largest eager logit, at least 1), and top-1 agreement, where a
    flip counts as a mismatch only if the eager top two are further apart than twice the
    tolerance (closer than that, rounding may honestly flip them)."""

    relative: float  # Target.tolerance
    max_abs_diff: float = 0.0
    tolerance: float = 0.0
    top1_agree: int = 0
    top1_mismatches: int = 0
    positions: int = 0  # the top-1 decisions compared

    def add(self, exported: torch.Tensor, eager: torch.Tensor) -> None:
        """One call's logits, [..., classes], on the CPU in float32."""
        self.tolerance = max(self.tolerance, self.relative * max(1.0, eager.abs().max().item()))
        self.max_abs_diff = max(self.max_abs_diff, (exported - eager).abs().max().item())
        top2 = eager.topk(min(2, eager.shape[-1]), dim=-1).values
        differs = exported.argmax(-1) != eager.argmax(-1)
        margin = top2[..., 0] - top2[..., -1]
        self.top1_mismatches += int((differs & (margin > 2 * self.tolerance)).sum())
        self.top1_agree += int((~differs).sum())
        self.positions += differs.numel()

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.top1_mismatches == 0

    def figures(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance,
                "top1_agree": self.top1_agree, "top1_mismatches": self.top1_mismatches,
                "positions": self.positions, "passed": self.passed}


@dataclass
class Plan:
    """What a task's deploy module gives an export (its export_plan)."""

    model: torch.nn.Module  # eager, fp32, with the checkpoint's weights
    # An input to trace with, on the device, of the exported dtype; a tuple for a model of
    # several inputs (its forward's arguments, in order, named by `inputs`).
    example: torch.Tensor | tuple[torch.Tensor, ...]
    axes: dict[int, tuple[str, int | None]]  # every input's dynamic axes: name, largest size
    # The parity check of a written file against the eager model (None: no check): its
    # figures, with "passed" and, when it failed, "failure" (one line saying why).
    check: Callable[[Path, torch.nn.Module], dict[str, Any]] | None
    report: Callable[[dict[str, Any], str], None]  # logs the check's figures (--verbose)
    metadata: dict[str, Any]  # what serving reads of this kind of model
    output: str = "logits"  # the output's name in the file
    # The output's dynamic axes, by name (None: the input's axes' names, at the same axes).
    output_axes: dict[int, str] | None = None
    # The ONNX exporters `--exporter auto` tries, in order (None: dynamo, then legacy): a
    # model whose graph only one of them can export names that one.
    exporters: tuple[str, ...] | None = None
    inputs: tuple[str, ...] = ("input",)  # the inputs' names in the file


def write_checked(plan: Plan, out: Path, target: Target, exporter: str, opset: int,
                  verbose: bool) -> tuple[str, dict[str, Any] | None]:
    """Write `out` with the first exporter whose file passes the plan's parity check (when it
    has one); returns (exporter name, parity figures). The file appears only when it passed.
    """
    # The exported copy is fp16 with --fp16; the eager reference stays fp32, the model trained.
    reference = plan.model.to(target.device)
    to_export = copy.deepcopy(plan.model).to(device=target.device, dtype=target.dtype)
    candidates = exporters(target.fmt, exporter, plan.exporters)
    failures = []
    for name in candidates:
        try:
            with atomic_path(out) as tmp:  # `out` appears only once it passed the parity check
                write_model(to_export, plan.example, tmp, target.fmt, name, opset, plan.axes,
                            plan.output, plan.output_axes, plan.inputs)
                check = None
                if plan.check is not None:
                    check = plan.check(tmp, reference)
                    if verbose:
                        plan.report(check, name)
                    if not check["passed"]:
                        raise LabrunError(check.get("failure") or "parity check failed")
            return name, check
        except Exception as error:  # noqa: BLE001 - any exporter failure moves to the next one
            failures.append(f"{name}: {one_line(error)}")
            if verbose and len(failures) < len(candidates):
                log.warning("%s exporter failed (%s); trying the next one", name, failures[-1])
    raise LabrunError(f"could not export to {target.fmt}: {'; '.join(failures)}")


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
    suffix = FORMATS.get(fmt, f"-{fmt}")  # a deploy module's own format: best-hf, say
    return folder / f"{checkpoint.stem}{'-fp16' if fp16 else ''}{suffix}"


def build_model(cfg: dict[str, Any], sizes: dict[str, int], weights: dict[str, torch.Tensor],
                checkpoint: Path) -> torch.nn.Module:
    """The eager model of the checkpoint's config, built with `sizes` (what its task gave the
    model from the data: num_classes; vocab_size and block_size), as its task built it for
    training, with the checkpoint's weights."""
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


def build_data(dataset: dict[str, Any]) -> Any:
    """The run's data, from its checkpoint's dataset section (for a parity check on its val
    split), never downloading anything."""
    from labrun import data

    check_targets(dataset, "dataset", hooks.TRUSTED_DATA)
    cfg = OmegaConf.create(dataset)
    if "download" in cfg:
        cfg.download = False
    return data.build(cfg)


def check_targets(node: Any, key: str, ours: tuple[str, ...] = hooks.TRUSTED_TARGETS) -> None:
    """Refuse to build anything outside the trusted modules: hydra would import and call it."""
    if isinstance(node, dict):
        target = node.get("_target_")
        if target is not None:
            refusal = hooks.untrusted(str(target), f"{key}._target_", ours)
            if refusal is not None:
                raise refusal
        for child_key, child in node.items():
            check_targets(child, f"{key}.{child_key}", ours)
    elif isinstance(node, list):
        for i, child in enumerate(node):
            check_targets(child, f"{key}[{i}]", ours)


# ---------------------------------------------------------------------------------------------
# Writing the file


def exporters(fmt: str, choice: str, preferred: tuple[str, ...] | None = None) -> list[str]:
    if fmt == "torchscript":
        return ["torch.jit.trace"]
    if choice != "auto":
        return [choice]
    return list(preferred or ("dynamo", "legacy"))


def write_model(model: torch.nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...],
                path: Path, fmt: str, exporter: str, opset: int,
                axes: dict[int, tuple[str, int | None]] = BATCH_AXIS, output: str = "logits",
                output_axes: dict[int, str] | None = None,
                inputs: tuple[str, ...] = ("input",)) -> None:
    """The model as `fmt`, its inputs' `axes` dynamic (the output's leading axes follow them
    unless `output_axes` names its own; tracing keeps shapes dynamic by itself)."""
    examples = example if isinstance(example, tuple) else (example,)
    names = {axis: name for axis, (name, _) in axes.items()}
    # One Dim per axis, shared by every input: torch.export then knows their sizes are equal.
    dims = {axis: torch.export.Dim(name, max=largest) for axis, (name, largest) in axes.items()}
    out_names = names if output_axes is None else output_axes
    with torch.no_grad(), warnings.catch_warnings():
        # Both torch.jit and the legacy ONNX exporter warn that they are deprecated; the
        # metadata records which exporter made the file, which is what a reader needs.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # Shape checks in a forward (the GPT's window length) become constants of a trace: the
        # parity check then runs the traced file at other shapes, which is what matters.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # Inputs that share their axes (a text's ids and mask) share their Dims, and the dynamo
        # exporter says it names each axis once: they are named all the same.
        warnings.filterwarnings("ignore", message=".*The axis name", category=UserWarning)
        if fmt == "torchscript":
            torch.jit.trace(model, examples, check_trace=False).save(str(path))
        elif exporter == "dynamo":
            torch.onnx.export(model, examples, str(path), dynamo=True, verbose=False,
                              input_names=list(inputs), output_names=[output],
                              dynamic_shapes=tuple(dims for _ in examples),
                              opset_version=opset, external_data=False)
        else:
            torch.onnx.export(model, examples, str(path), dynamo=False,
                              input_names=list(inputs), output_names=[output],
                              dynamic_axes={**{name: names for name in inputs},
                                            output: out_names},
                              opset_version=opset)


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
