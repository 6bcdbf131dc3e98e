"""A run's starting weights: `model.pretrained` (a library's weights, found offline by
models/pretrained.py) or `model.init_from` (a labrun checkpoint, a plain state dict `.pt`/
`.pth`, or a `.safetensors` file).

The head swap: where the file's head has another shape than this run's (1000 ImageNet classes
against the lab's 5), the head is re-initialised and every other tensor must load; any other
missing, extra or differently shaped tensor is an error naming the first one. The head is the
library's own: timm's `pretrained_cfg["classifier"]`; for torchvision and labrun's models, the
tensors their constructor sizes by `num_classes` (asked by building the model a second time, on
the meta device, with another class count), so nothing is guessed from shapes.

torchvision's weights are the tensors of the model torchvision's own builder loads from the file
(models/pretrained.py, load_torchvision: DenseNet's renamed keys, GoogLeNet's dropped heads),
copied into the run's model, which labrun built with the builder's arguments for them; before
data loads, validation runs the same builder on the meta device and compares both models.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from labrun import models
from labrun.core.errors import ConfigError
from labrun.models import pretrained
from labrun.train.checkpoint import CheckpointError, inference_weights, read_torch_file

log = logging.getLogger(__name__)

# Wrappers' prefixes in a state dict saved from a wrapped model (DDP's, torch.compile's).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# torchvision's auxiliary classifiers, which its weights hold: a segmentation model's (kept
# with model.aux_loss=true), GoogLeNet's and Inception v3's (labrun's classifiers have none:
# models.AUX_LOGITS).
AUX_HEADS = ("aux_classifier", "aux1", "aux2", "AuxLogits")
# Module settings (their last name) that differ from the builder's model by labrun's choice:
# Inception v3's builder keeps its auxiliary classifier, whose switch aux_logits is; a detector
# sees the data's image size (its transform's), and keeps the answers its evaluation asks for.
OWN_SETTINGS = ("aux_logits", "min_size", "max_size", "fixed_size", "score_thresh",
                "detections_per_img")


@dataclass
class Source:
    """Where a run's starting weights come from: `label` says what they are (timm's
    resnet18.a1_in1k, or a file given by path), `path` the file they are read from."""

    key: str  # the config key that asked: model.pretrained or model.init_from
    label: str
    path: Path
    weights: pretrained.Weights | None = None  # model.pretrained's

    def record(self) -> dict[str, Any]:
        """What provenance keeps: the file actually loaded, and its sha256."""
        return {"source": self.label, "file": str(self.path.resolve()),
                "sha256": pretrained.sha256(self.path)}


def source(cfg: DictConfig) -> Source | None:
    """The run's starting weights, or None for a model from random weights; pretrained
    weights missing from every cache are fetched here only with model.download=true
    (validation has refused them otherwise)."""
    model_cfg, init_from = cfg.model, cfg.model.get("init_from")
    _one_source(model_cfg)
    if pretrained.asked_for(model_cfg):
        weights, found = pretrained.locate(model_cfg, cfg.paths.get("weights_cache"))
        if found is None:
            found = pretrained.download(weights, cfg.paths.get("weights_cache"))
        return Source(f"model.{weights.key}", weights.label, found, weights)
    if init_from:
        return Source("model.init_from", f"file {Path(init_from).name}", Path(init_from))
    return None


def _one_source(model_cfg: DictConfig) -> None:
    if pretrained.asked_for(model_cfg) and model_cfg.get("init_from"):
        key, value = pretrained.asked(model_cfg)
        raise ConfigError(f"model.{key}={pretrained.override_text(value)} and model.init_from="
                          f"{model_cfg.init_from} both set the starting weights; keep one")


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file: a .safetensors file (never unpickled), or a torch file
    read with weights_only=True: a labrun checkpoint's inference weights (its `model`, or its
    EMA's with trainer.ema), or a plain state dict."""
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except (SafetensorError, OSError) as error:
            raise ConfigError(f"{path}: not a readable safetensors file ({error})") from None
    try:
        state = read_torch_file(path)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = inference_weights(state)  # a labrun checkpoint: its EMA's with trainer.ema
    except CheckpointError as error:
        raise ConfigError(f"{path}: {error}" if str(path) not in str(error) else str(error)
                          ) from None
    if not (isinstance(state, dict) and state
            and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ConfigError(f"{path}: holds no state dict (a mapping of names to tensors), nor a "
                          f"labrun checkpoint")
    return {_unwrapped(name): tensor for name, tensor in state.items()}


@functools.lru_cache(maxsize=32)
def _shapes(path: str, _mtime_ns: int, _size: int) -> dict[str, tuple[int, ...]]:
    # Validation reads each file once per version, however many sweep jobs name it.
    return {name: tuple(t.shape) for name, t in read_state(Path(path)).items()}


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    stat = path.stat()
    return _shapes(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


def _unwrapped(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def head_keys(model_cfg: DictConfig, model: nn.Module, num_classes: int | None) -> set[str]:
    """The state-dict keys of the model's class head, which the head swap may re-initialise:
    none for a model without classes (a language model's vocabulary is refused elsewhere). A
    transformers model's head is what lies outside its body (BERT's pooler is the body's)."""
    own = model.state_dict()
    classifier = getattr(model, "pretrained_cfg", {}).get("classifier")  # timm's own name
    if classifier:
        names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
        return {key for key in own if any(key.startswith(f"{name}.") for name in names)}
    body = getattr(model, "base_model_prefix", None)  # transformers': the body's attribute
    if body and isinstance(getattr(model, body, None), nn.Module):
        return {key for key in own if not key.startswith(f"{body}.")}
    if num_classes is None:
        return set()
    with torch.device("meta"):
        other = models.build(model_cfg, num_classes + 1)
    return {key for key, tensor in other.state_dict().items()
            if key in own and own[key].shape != tensor.shape}


def _without_unused_aux(model: nn.Module, theirs: dict[str, Any]) -> dict[str, Any]:
    """The file's tensors less torchvision's auxiliary classifiers where the model was built
    without them (None: model.aux_loss=false, GoogLeNet, Inception v3): torchvision trained
    their weights with them, and they are only needed for an auxiliary loss."""
    unused = tuple(f"{name}." for name in AUX_HEADS if getattr(model, name, False) is None)
    return {key: value for key, value in theirs.items() if not key.startswith(unused)}


def _starting_state(start: Source) -> dict[str, torch.Tensor]:
    """The tensors a run starts from: torchvision's weights as its own builder loads them,
    any other file's as they are."""
    if start.weights is not None and start.weights.library == "torchvision":
        return pretrained.load_torchvision(start.weights, start.path).state_dict()
    return read_state(start.path)


def mismatch(own: dict[str, tuple[int, ...]], theirs: dict[str, tuple[int, ...]],
             head: set[str], where: str) -> list[str]:
    """The head tensors to re-initialise, or a ConfigError naming the first tensor that
    cannot load: missing from the file, of another shape, or in the file but not the model."""
    swapped = []
    for key, shape in own.items():
        there = theirs.get(key)
        if key in head and (there is None or there != shape):
            swapped.append(key)
        elif there is None:
            if key.endswith("num_batches_tracked"):
                continue  # a counter older files leave out; torch's BatchNorm fills it in
            raise ConfigError(f"{where}: has no {key} {list(shape)}; is it the weights of "
                              f"another model? (the first of the model's tensors it lacks)")
        elif there != shape:
            raise ConfigError(f"{where}: its {key} is {list(there)} there, {list(shape)} here; "
                              f"only the class head may differ (another model or size?)")
    extra = [key for key in theirs if key not in own and key not in head]
    if extra:
        raise ConfigError(f"{where}: holds {extra[0]} {list(theirs[extra[0]])}, which this "
                          f"model has not ({len(extra)} such tensors; another model?)")
    return swapped


def load(model: nn.Module, model_cfg: DictConfig, start: Source,
         num_classes: int | None) -> list[str]:
    """Load the starting weights into `model` with the head swap; returns the tensors
    re-initialised, which one log line names."""
    state = _without_unused_aux(model, _starting_state(start))
    own = model.state_dict()
    where = f"{start.key}: {start.path}"
    swapped = mismatch({k: tuple(v.shape) for k, v in own.items()},
                       {k: tuple(v.shape) for k, v in state.items()},
                       head_keys(model_cfg, model, num_classes), where)
    for key in swapped:
        state.pop(key, None)
    model.load_state_dict(state, strict=False)
    loaded = len(own) - len(swapped)
    if swapped:
        shapes_here = ", ".join(f"{key} {list(own[key].shape)}" for key in swapped)
        log.info(f"{start.key}: loaded {loaded} tensors of {start.label} ({start.path}); "
                 f"re-initialised the head for {num_classes} classes: {shapes_here}")
    else:
        log.info(f"{start.key}: loaded all {loaded} tensors of {start.label} ({start.path})")
    return swapped


def check(cfg: DictConfig, model: nn.Module, num_classes: int | None) -> None:
    """Validation's part, before any data loads: the pretrained file is in a weights cache
    (or model.download=true), and the starting tensors fit `model` (built on the meta device)
    apart from its head: an init_from file's, or those torchvision's builder loads from its
    weights' file, run on the meta device, whose model must also be set as `model` is."""
    model_cfg, init_from = cfg.model, cfg.model.get("init_from")
    _one_source(model_cfg)
    if pretrained.asked_for(model_cfg):
        weights, found = pretrained.locate(model_cfg, cfg.paths.get("weights_cache"))
        if found is None or weights.library != "torchvision":
            return  # fetched when the run starts (model.download=true); timm's read as they are
        key, value = pretrained.asked(model_cfg)
        where = f"model.{key}={pretrained.override_text(value)}: {found}"
        theirs = pretrained.load_torchvision(weights, found, meta=True)
        their_shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    elif init_from:
        where, path = f"model.init_from={init_from}", Path(init_from)
        if not path.is_file():
            raise ConfigError(f"{where}: no such file")
        theirs, their_shapes = None, shapes(path)
    else:
        return
    mismatch({k: tuple(v.shape) for k, v in model.state_dict().items()},
             _without_unused_aux(model, their_shapes),
             head_keys(model_cfg, model, num_classes), where)
    if theirs is not None:
        _same_settings(model_cfg, model, theirs, num_classes, where)


def _same_settings(model_cfg: DictConfig, model: nn.Module, theirs: nn.Module,
                   num_classes: int | None, where: str) -> None:
    """Refuse a model set otherwise than torchvision's builder sets its own for the weights
    (transform_input, a ViT's image size, a norm's eps): labrun builds it with the arguments it
    knows the builder passes (pretrained.torchvision_arguments), and one it does not know of
    would give the weights to a model unlike theirs without an error. Settings that follow the
    class count (a head's out_features) are the head swap's."""
    with torch.device("meta"):
        other = models.build(model_cfg, num_classes + 1) if num_classes else model
    ours, by_count, builders = (_settings(m) for m in (model, other, theirs))
    for key, value in ours.items():
        if (key in builders and builders[key] != value and by_count.get(key) == value
                and key.rsplit(".", 1)[-1] not in OWN_SETTINGS):
            raise ConfigError(f"{where}: torchvision's builder sets {key}={builders[key]!r} for "
                              f"these weights, labrun's model has {value!r}: labrun does not "
                              f"pass this builder's arguments (models/pretrained.py, "
                              f"torchvision_arguments)")


def _settings(model: nn.Module) -> dict[str, Any]:
    """Every module's own settings by name (transform_input, features.conv0.stride): its
    attributes of plain values."""
    return {f"{name}.{key}" if name else key: value
            for name, module in model.named_modules() for key, value in vars(module).items()
            if not key.startswith("_") and isinstance(value, (bool, int, float, str, tuple))}
