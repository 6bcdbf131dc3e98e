"""Pretrained weights of torchvision and timm models, found offline: the one owner of the
weights cache.

Compute nodes have no internet, so a run never downloads (unless `model.download=true`): it
finds the file the library would have downloaded, in the library's own layout, first under the
lab's shared `paths.weights_cache`, then in the user's own caches:

    torchvision   WEIGHTS/hub/checkpoints/resnet18-f37072fd.pth          as under TORCH_HOME
    timm          WEIGHTS/hub/models--timm--resnet18.a1_in1k/snapshots/  as under HF_HOME
                  REVISION/model.safetensors

so `paths.weights_cache` is a folder a lab could equally name as TORCH_HOME and HF_HOME, and
`labrun weights fetch` (on a login node) fills it with the libraries' own downloaders.
Validation looks the file up before any data loads or any job is submitted.

torchvision's weights are read by torchvision's own builder (`load_torchvision`), which does
more than load a state dict: DenseNet's builder renames its file's old keys, GoogLeNet's drops
its auxiliary heads. The model labrun builds for them takes the constructor arguments their
builder passes (`torchvision_arguments`: GoogLeNet's and Inception's transform_input, a SWAG
ViT's image size), so that `labrun export` and `eval` rebuild it from the run's config alone.

A detector (model=torchvision_det) takes either the whole detector's weights (`model.pretrained`,
COCO's) or its backbone's alone (`model.weights_backbone`, ImageNet's), as torchvision's
detection builders do; both are read by the builder, and the detector is built as the builder
builds it for trained weights (models/detection.py).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock
from urllib.parse import urlparse

from labrun.core.errors import ConfigError, torch_load_reason

if TYPE_CHECKING:
    from torch import nn

# torch.hub's own rule for the published hash in a file name (resnet18-f37072fd.pth): the hex
# digits after the last dash are a prefix of the file's sha256 (torch.hub.HASH_REGEX).
HASH_IN_NAME = re.compile(r"-([a-f0-9]*)\.")
# What timm stores on the Hugging Face hub, in the order timm's own loader tries them.
HF_FILES = ("model.safetensors", "pytorch_model.bin")
SEGMENTATION = "labrun.models.segmentation.torchvision_seg_model"  # torchvision's, by name
DETECTION = "labrun.models.detection.torchvision_det_model"
LIBRARIES = {"labrun.models.torchvision_model": "torchvision", "labrun.models.timm_model": "timm",
             SEGMENTATION: "torchvision", DETECTION: "torchvision"}
# torchvision's kind of model each target builds, and the config group that names it.
KINDS = {SEGMENTATION: ("segmentation", "torchvision_seg"),
         DETECTION: ("detection", "torchvision_det")}


@dataclass
class Weights:
    """One library's pretrained weights for a model: where they come from and where they may
    already be, in the order they are looked for."""

    library: str  # torchvision | timm
    name: str  # ResNet18_Weights.IMAGENET1K_V1 | resnet18.a1_in1k
    model: str  # the model.name they fit
    url: str  # where `labrun weights fetch` downloads them from
    num_classes: int  # of the head they were trained with
    hash_prefix: str | None = None  # torchvision's published sha256 prefix
    hf_repo: str | None = None  # timm on the Hugging Face hub: timm/resnet18.a1_in1k
    candidates: list[Path] = field(default_factory=list)
    key: str = "pretrained"  # the model key that asks for them: weights_backbone, a backbone's

    @property
    def label(self) -> str:
        return f"{self.library}:{self.name}"

    def find(self) -> Path | None:
        return next((path for path in self.candidates if path.is_file()), None)


def asked_for(model_cfg: Any) -> bool:
    return bool(model_cfg.get("pretrained", False) or model_cfg.get("weights_backbone", False))


def asked(model_cfg: Any) -> tuple[str, Any]:
    """The key that asks for a library's weights and its value: model.pretrained, or a
    detector's model.weights_backbone (its backbone's alone)."""
    if model_cfg.get("pretrained", False) and model_cfg.get("weights_backbone", False):
        raise ConfigError(f"model.pretrained={override_text(model_cfg.pretrained)} and "
                          f"model.weights_backbone={override_text(model_cfg.weights_backbone)}: "
                          f"the detector's weights hold its backbone's; keep one")
    if model_cfg.get("weights_backbone", False):
        return "weights_backbone", model_cfg.weights_backbone
    return "pretrained", model_cfg.get("pretrained", False)


def library_of(model_cfg: Any) -> str | None:
    return LIBRARIES.get(model_cfg.get("_target_"))


def resolve(model_cfg: Any, weights_cache: str | None) -> Weights:
    """The weights `model.pretrained` names for `model.name`, with the files they may be in.
    An unknown model or weights name raises ConfigError with the closest names."""
    library = library_of(model_cfg)
    key, value = asked(model_cfg)
    if library is None:
        raise ConfigError(f"model.{key}={override_text(value)}: only torchvision and timm "
                          f"models have pretrained weights here (model={model_cfg._target_}); "
                          f"start from a file with model.init_from=PATH instead")
    caches = [Path(weights_cache).expanduser()] if weights_cache else []
    kind = KINDS.get(model_cfg._target_, ("classification",))[0]
    if key == "weights_backbone":
        if kind != "detection":
            raise ConfigError(f"model.weights_backbone={override_text(value)}: only a "
                              f"detector's backbone has weights of its own; use "
                              f"model.pretrained")
        return _torchvision(model_cfg.name, value, caches, kind, backbone=True)
    if library == "torchvision":
        return _torchvision(model_cfg.name, value, caches, kind)
    return _timm(model_cfg.name, value, caches)


def torchvision_weights(name: str, pretrained: bool | str, kind: str = "classification",
                        backbone: bool = False) -> Any:
    """The member of torchvision's weights enum that `model.pretrained` names for `model.name`
    (ResNet50_Weights.IMAGENET1K_V2), or with `backbone` that a detector's
    `model.weights_backbone` names for its backbone; an unknown model or weights name raises
    ConfigError with the closest names."""
    import torchvision

    # list_models(module=torchvision.models) holds the classifiers only, not the segmentation
    # and detection models of its submodules, whose weights get_model_weights finds all the same.
    module = getattr(torchvision.models, kind) if kind != "classification" else torchvision.models
    if name not in torchvision.models.list_models(module=module):
        raise ConfigError(f"model.name={name} is not a torchvision {kind} model; "
                          f"{_closest(name, torchvision.models.list_models(module=module))}")
    key = "weights_backbone" if backbone else "pretrained"
    enum, default = (backbone_weights(name) if backbone
                     else (torchvision.models.get_model_weights(name), None))
    tag = str(pretrained).split(".")[-1]  # IMAGENET1K_V2, or ResNet50_Weights.IMAGENET1K_V2
    if pretrained is True:
        return default or enum.DEFAULT
    if tag in enum.__members__:
        return enum[tag]
    raise ConfigError(f"model.{key}={pretrained}: {name} has no such weights; "
                      f"{_closest(tag, [w for w in enum.__members__ if w != 'DEFAULT'])}, "
                      f"or true for {(default or enum.DEFAULT).name}")


def backbone_weights(name: str) -> tuple[Any, Any]:
    """The weights enum of detector `name`'s backbone (ResNet50_Weights), read from its
    builder's signature, and the member its builder defaults to (None for the v2 builders,
    whose default is no backbone weights: true then means the enum's DEFAULT)."""
    import inspect
    import typing

    import torchvision

    parameter = inspect.signature(torchvision.models.get_model_builder(name)
                                  ).parameters["weights_backbone"]
    enum = next(a for a in typing.get_args(parameter.annotation) if a is not type(None))
    return enum, parameter.default


def _torchvision(name: str, pretrained: bool | str, caches: list[Path],
                 kind: str = "classification", backbone: bool = False) -> Weights:
    import torch

    chosen = torchvision_weights(name, pretrained, kind, backbone)
    filename = Path(urlparse(chosen.url).path).name
    hub = Path(torch.hub.get_dir())  # $TORCH_HOME/hub
    found = HASH_IN_NAME.search(filename)
    return Weights("torchvision", f"{type(chosen).__name__}.{chosen.name}", name, chosen.url,
                   len(chosen.meta["categories"]), hash_prefix=found.group(1) if found else None,
                   candidates=[*(c / "hub" / "checkpoints" / filename for c in caches),
                               hub / "checkpoints" / filename],
                   key="weights_backbone" if backbone else "pretrained")


def _timm(name: str, pretrained: bool | str, caches: list[Path]) -> Weights:
    import timm
    from huggingface_hub import constants

    arch, _, named_tag = name.partition(".")  # model.name may carry the tag: resnet18.a1_in1k
    if not timm.is_model(arch):
        raise ConfigError(f"model.name={name} is not a timm model; "
                          f"{_closest(arch, timm.list_models())}")
    tags = [one.split(".", 1)[1] for one in timm.list_pretrained(f"{arch}.*")]
    tag = (named_tag or None) if pretrained is True else str(pretrained)
    if not tags:
        raise ConfigError(f"model.name={arch}: timm has no pretrained weights for it; "
                          f"{_closest(arch, timm.list_pretrained())}")
    if tag is not None and tag not in tags:
        raise ConfigError(f"model.pretrained={pretrained}: timm has no {arch}.{tag} weights; "
                          f"{_closest(tag, tags)}, or true for its default")
    cfg = timm.models.get_pretrained_cfg(f"{arch}.{tag}" if tag else arch)
    label = f"{arch}.{cfg.tag}" if cfg.tag else arch
    if cfg.hf_hub_id:
        # Hugging Face's layout, read by its own lookup (refs/main names the snapshot).
        repo = cfg.hf_hub_id.split("@")[0]
        files = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HF_FILES
        return Weights("timm", label, arch, f"https://huggingface.co/{repo}", cfg.num_classes,
                       hf_repo=repo,
                       candidates=[path for hub in [*(c / "hub" for c in caches),
                                                    Path(constants.HF_HUB_CACHE)]
                                   for path in _hf_cached(repo, files, hub)])
    import torch

    filename = Path(urlparse(cfg.url).path).name
    found = HASH_IN_NAME.search(filename)
    return Weights("timm", label, arch, cfg.url, cfg.num_classes,
                   hash_prefix=found.group(1) if found else None,
                   candidates=[*(c / "hub" / "checkpoints" / filename for c in caches),
                               Path(torch.hub.get_dir()) / "checkpoints" / filename])


def _hf_cached(repo: str, files: tuple[str, ...], hub: Path) -> list[Path]:
    """Where the hub cache under `hub` holds `repo`'s files: huggingface_hub's own lookup when
    the snapshot exists, else the path it would be at (named in the refusal)."""
    from huggingface_hub import try_to_load_from_cache

    paths = []
    for filename in files:
        found = try_to_load_from_cache(repo, filename, cache_dir=hub)
        folder = hub / f"models--{repo.replace('/', '--')}"
        paths.append(Path(found) if isinstance(found, str)
                     else folder / "snapshots" / "REVISION" / filename)
    return paths


def _closest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=5, cutoff=0.5) or options[:5]
    return f"did you mean: {', '.join(close)}"


def locate(model_cfg: Any, weights_cache: str | None) -> tuple[Weights, Path | None]:
    """The weights and their file, or a ConfigError of one line naming where it looked and
    the command that fetches them; None as the file when the run may download
    (`model.download=true`)."""
    weights = resolve(model_cfg, weights_cache)
    found = weights.find()
    if found is None and not model_cfg.get("download", False):
        key, value = asked(model_cfg)
        value = override_text(value)
        others = len(weights.candidates) - 1
        # The config group that names the model: torchvision's segmentation and detection models
        # have their own.
        group = KINDS.get(model_cfg.get("_target_"), (None, weights.library))[1]
        raise ConfigError(
            f"model.{key}={value}: no {weights.label} weights in the weights cache (looked "
            f"for {weights.candidates[0]}{f' and {others} more places' if others else ''}); "
            f"fetch them on a machine with internet: labrun weights fetch "
            f"model={group} model.name={weights.model} model.{key}={value}"
            f"{f' paths.weights_cache={weights_cache}' if weights_cache else ''} "
            f"(or set model.download=true where this machine has internet)")
    return weights, found


def override_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def torchvision_arguments(name: str, pretrained: bool | str) -> dict[str, Any]:
    """The constructor arguments torchvision's builder gives `name`'s model for the weights
    `model.pretrained` names, besides their class count (the head swap's business): GoogLeNet
    and Inception v3 were trained on inputs in [-1, 1] and turn ImageNet-normalised ones into
    those (transform_input); a ViT or MaxViT is built for its weights' image size (384 px for
    SWAG_E2E). Nothing for a model from random weights, as the builder gives nothing. Validation
    compares every module's settings with the builder's own model (train/initial_weights.py),
    so a builder that sets more than this is refused, not trained from the wrong model."""
    if not pretrained:
        return {}
    weights = torchvision_weights(name, pretrained)
    if name in ("googlenet", "inception_v3"):
        return {"transform_input": True}
    if name.startswith("vit_"):
        return {"image_size": weights.meta["min_size"][0]}
    if name.startswith("maxvit_"):
        return {"input_size": weights.meta["min_size"]}
    return {}


def load_torchvision(weights: Weights, path: Path, meta: bool = False) -> nn.Module:
    """The model torchvision's builder makes for `weights`, at their own class count, with the
    file labrun located (`path`) read by torchvision's own loading code: the builder's renames
    (DenseNet's old keys) and what it changes after loading (GoogLeNet's auxiliary heads
    dropped) included. On the meta device (`meta`: validation's check) the file is
    memory-mapped and its tensors never read, while every key and shape is checked as the real
    load checks it (a file torch saved before 1.6, not yet a zip file, is read whole: torch
    cannot memory-map it). A file that does not load raises ConfigError with torchvision's
    reason."""
    import torch
    import torchvision
    from torch.utils.serialization import config as serialization

    # Rather than copy the builders' steps, labrun runs them: torch.hub reads an existing file
    # of its checkpoints folder without downloading it or checking its hash, so its folder is
    # pointed at the one that holds `path` (WEIGHTS/hub/checkpoints/NAME) for the build. The
    # setting is patched, not set_dir: set_dir cannot be undone, and TORCH_HOME is read again
    # only while no folder was set. torch.hub asks torch.load to unpickle anything
    # (weights_only=False); TORCH_FORCE_WEIGHTS_ONLY_LOAD is torch.load's own switch to refuse.
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.hub, "_hub_dir", str(path.parent.parent)))
        stack.enter_context(mock.patch.dict(os.environ, {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}))
        if meta:
            stack.enter_context(torch.device("meta"))
            if zipfile.is_zipfile(path):
                stack.enter_context(serialization.patch({"load.mmap": True}))
            stack.enter_context(warnings.catch_warnings())  # one per tensor, for a no-op copy
            warnings.filterwarnings("ignore", r"for .*: copying from a non-meta parameter")
        chosen = torchvision.models.get_weight(weights.name)
        # A detector's backbone weights: the detector its builder makes around them.
        asking = ({"weights": None, "weights_backbone": chosen}
                  if weights.key == "weights_backbone" else {"weights": chosen})
        try:
            return torchvision.models.get_model(weights.model, progress=False, **asking)
        except Exception as error:  # whatever the builder's load raises: the file does not fit
            raise ConfigError(f"{weights.label} ({path}): torchvision's {weights.model} builder "
                              f"cannot load them: {_reason(error)}; is the file another "
                              f"model's, or damaged? (labrun weights fetch checks it against "
                              f"the published hash)") from None


def _reason(error: Exception) -> str:
    """One line of a loading error: torch's load_state_dict names its reasons on the lines
    after its first ("Error(s) in loading state_dict for DenseNet:"), each with every key;
    torch.load's are worded as labrun words them for a checkpoint."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if not (lines[0].endswith(":") and len(lines) > 1):
        return torch_load_reason(error)
    line = lines[1].rstrip(".")
    return line if len(line) <= 300 else f"{line[:300]}..."


def download(weights: Weights, weights_cache: str | None, progress: bool = True) -> Path:
    """Fetch the weights into `weights_cache` (else the library's own cache) with the
    library's own downloader, which shows a progress bar and checks what was published:
    torch.hub the sha256 prefix in the file name, huggingface_hub the file's size and sha256
    against the hub's record."""
    if weights.hf_repo:
        from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
        from huggingface_hub.errors import RemoteEntryNotFoundError

        hub = Path(weights_cache).expanduser() / "hub" if weights_cache else None
        for filename in [Path(c).name for c in weights.candidates[:len(HF_FILES)]]:
            # Asked once first: hf_hub_download retries an unreachable hub for half a minute
            # before it says so, and this fails at once.
            try:
                get_hf_file_metadata(hf_hub_url(weights.hf_repo, filename))
            except RemoteEntryNotFoundError:  # the hub has no such file: try the next name
                continue
            except Exception as error:  # httpx's transport errors: no route, no name, refused
                raise ConnectionError(str(error) or type(error).__name__) from error
            return Path(hf_hub_download(weights.hf_repo, filename, cache_dir=hub))
        raise ConfigError(f"{weights.hf_repo} holds none of {', '.join(HF_FILES)}")
    import torch

    target = weights.candidates[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.hub.download_url_to_file(weights.url, str(target), hash_prefix=weights.hash_prefix,
                                   progress=progress)
    return target


def verify(weights: Weights, path: Path) -> str:
    """Check a cached file against what its library published: the sha256 prefix in a
    torch.hub file name, or the Hugging Face blob it links to (named by its sha256). Returns
    the file's sha256; raises ConfigError on a mismatch."""
    digest = sha256(path)
    expected = weights.hash_prefix
    if weights.hf_repo and path.is_symlink():
        blob = path.resolve().name
        expected = blob if len(blob) == 64 else None  # git objects (small files) use sha1
    if expected and not digest.startswith(expected):
        raise ConfigError(f"{path}: its sha256 {digest[:16]}... does not match the published "
                          f"{expected[:16]}: the file is damaged or not these weights; remove "
                          f"it and fetch again")
    return digest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class CachedFile:
    library: str
    name: str  # the file name, or the Hugging Face repository and file
    path: Path
    size: int


def cached_files(weights_cache: str | None) -> Iterator[CachedFile]:
    """What a weights cache holds, in both libraries' layouts (`labrun weights list`)."""
    import torch
    from huggingface_hub import constants

    roots = ([Path(weights_cache).expanduser() / "hub"] if weights_cache
             else [Path(torch.hub.get_dir()), Path(constants.HF_HUB_CACHE)])
    for hub in dict.fromkeys(roots):
        checkpoints = hub / "checkpoints"
        if checkpoints.is_dir():
            for path in sorted(checkpoints.iterdir()):
                if path.is_file():
                    yield CachedFile("torch.hub", path.name, path, path.stat().st_size)
        for repo in sorted(hub.glob("models--*")):
            name = repo.name.removeprefix("models--").replace("--", "/")
            for path in sorted(repo.glob("snapshots/*/*")):
                if path.is_file():
                    yield CachedFile("hf hub", f"{name}/{path.name}", path,
                                     path.stat().st_size)

