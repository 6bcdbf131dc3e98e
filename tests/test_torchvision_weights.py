"""torchvision's pretrained weights loaded by torchvision's own builder (models/pretrained.py,
load_torchvision), for the families whose builder does more than load a state dict: DenseNet's
renames its file's old keys, GoogLeNet's and Inception v3's set transform_input and handle
their auxiliary heads, a SWAG ViT's is built for 384 px images. Each cache file holds zeros
shaped as the published one (the real files cannot be downloaded here), so a model built from
it is all zeros but for a re-initialised head; torchvision reads an existing cache file without
checking its hash. A file that does not load is refused before data loads.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FAST, PROJECT, PYTHON

CLASSES = 3
# What torchvision's builder passes each model's constructor for these weights, read from its
# source (torchvision/models/googlenet.py, inception.py, vision_transformer.py): the published
# files were saved from such a model. The auxiliary heads are in GoogLeNet's and Inception's
# files; the builders' own DenseNet code renames the file's keys.
FAMILIES = {
    "densenet121": ("true", {}),
    "googlenet": ("true", {"transform_input": True, "aux_logits": True}),
    "inception_v3": ("true", {"transform_input": True, "aux_logits": True}),
    "vit_b_16": ("IMAGENET1K_SWAG_E2E_V1", {"image_size": 384}),
}
# A train step's input: what each model takes at least (Inception v3: 75 px); a ViT takes only
# its own size, 384 px, where a step costs seconds on a CPU, so it is built and not trained.
STEP_SIZE = {"densenet121": 32, "googlenet": 32, "inception_v3": 75}
# DenseNet's module names once held dots (norm.1, conv.2), and so do its published files.
NEW_DENSENET_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))([12]\..*)$")


def write_published_zeros(path: Path, name: str, arguments: dict, categories: int = 1000,
                          **changed: object) -> None:
    """Zeros shaped as the file torchvision publishes for `name`'s weights, at `path`: the
    state dict of the model its builder makes for them (a zero broadcast to each shape: a few
    bytes each), with `changed` tensors. DenseNet's file is older than its module names, than
    BatchNorm's num_batches_tracked and than torch's zip format (torch 1.6)."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None, num_classes=categories,
                                             **arguments)
    state = model.state_dict()  # as torch.save(model.state_dict()) writes it: _metadata too
    for key, tensor in state.items():
        state[key] = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
    old = name.startswith("densenet")
    if old:
        state = {NEW_DENSENET_KEY.sub(r"\1.\2", key): tensor for key, tensor in state.items()
                 if not key.endswith("num_batches_tracked")}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**state, **changed} if changed else state, path,
               _use_new_zipfile_serialization=not old)


def enum_member(name: str, override: str):
    """torchvision's weights that `model.pretrained=OVERRIDE` names."""
    import torchvision

    weights = torchvision.models.get_model_weights(name)
    return weights.DEFAULT if override == "true" else weights[override]


def cache_file(cache: Path, name: str, override: str) -> Path:
    """Where the weights cache holds them: torch.hub's checkpoints folder, under the name of
    the file's URL."""
    return cache / "hub" / "checkpoints" / Path(enum_member(name, override).url).name


@pytest.fixture(scope="module")
def weights_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("weights")
    for name, (override, arguments) in FAMILIES.items():
        write_published_zeros(cache_file(cache, name, override), name, arguments,
                              len(enum_member(name, override).meta["categories"]))
    return cache


@pytest.fixture
def empty_torch_home(monkeypatch, tmp_path) -> Path:
    """torch.hub's own cache empty, where a download would land."""
    home = tmp_path / "torch-home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def validated(composed, *overrides: str):
    """The config of a run, through validation as train.py validates it: dataset._target_
    names a loader that must never run."""
    from labrun.config import validation

    cfg = composed("dataset=synthetic", "dataset._target_=no.such.loader", *overrides)
    validation.validate(cfg)
    return cfg


@pytest.mark.parametrize("name", list(FAMILIES))
def test_torchvisions_weights_load_as_its_builder_loads_them(name, weights_cache, composed,
                                                             empty_torch_home):
    from omegaconf import OmegaConf

    from labrun import models
    from labrun.train import initial_weights
    from labrun.train.task import Classification

    override, arguments = FAMILIES[name]
    cfg = validated(composed, "model=torchvision", f"model.name={name}",
                    f"model.pretrained={override}", f"paths.weights_cache={weights_cache}")
    start = initial_weights.source(cfg)  # as train/job.py starts a run
    assert start.path == cache_file(weights_cache, name, override)
    model = models.build(cfg.model, CLASSES)
    swapped = initial_weights.load(model, cfg.model, start, CLASSES)

    # The model torchvision's builder makes for these weights, with labrun's head.
    head = {"densenet121": "classifier", "googlenet": "fc", "inception_v3": "fc",
            "vit_b_16": "heads.head"}[name]
    assert swapped == [f"{head}.weight", f"{head}.bias"]
    assert model.get_submodule(head).out_features == CLASSES
    if "transform_input" in arguments:
        assert model.transform_input is True
    if name == "vit_b_16":
        assert model.image_size == 384
        assert model.encoder.pos_embedding.shape == (1, (384 // 16) ** 2 + 1, 768)
    # labrun's classifiers leave the auxiliary heads out, as the googlenet builder does.
    assert not any(key.startswith(("aux1.", "aux2.", "AuxLogits.")) for key in model.state_dict())
    # Every tensor is the file's (zeros) but the head: DenseNet's renamed keys loaded too.
    for key, tensor in model.state_dict().items():
        if not key.startswith(f"{head}.") and tensor.is_floating_point():
            assert not tensor.any(), f"{key} was not loaded"
    # What labrun export rebuilds from the run's config takes the run's weights as they are.
    rebuilt = models.build(OmegaConf.create(OmegaConf.to_container(cfg.model)), CLASSES)
    rebuilt.load_state_dict(model.state_dict())
    assert getattr(rebuilt, "transform_input", None) == getattr(model, "transform_input", None)

    if name in STEP_SIZE:  # a step of training, as the task takes it: logits, not a namedtuple
        images = torch.rand(2, 3, STEP_SIZE[name], STEP_SIZE[name])
        loss = Classification().loss(model.train(), (images, torch.tensor([0, 2])))
        loss.backward()  # the body's zeros give zero features: the head's bias learns
        assert torch.isfinite(loss) and model.get_submodule(head).bias.grad.any()
    assert torch.hub.get_dir() == str(empty_torch_home / "hub")  # torch.hub's folder given back
    assert not empty_torch_home.exists()  # nothing downloaded


@pytest.fixture
def unloadable_cache(tmp_path) -> Path:
    """densenet121's published file, but a first convolution of 32 channels, not 64."""
    write_published_zeros(cache_file(tmp_path / "cache", "densenet121", "true"), "densenet121",
                          {}, **{"features.conv0.weight": torch.zeros(32, 3, 7, 7)})
    return tmp_path / "cache"


def test_a_file_torchvision_cannot_load_is_one_line_before_data_loads(unloadable_cache,
                                                                      composed):
    from labrun.core.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        validated(composed, "model=torchvision", "model.name=densenet121",
                  "model.pretrained=true", f"paths.weights_cache={unloadable_cache}")
    message = str(caught.value)
    assert "\n" not in message
    assert "torchvision:DenseNet121_Weights.IMAGENET1K_V1" in message
    assert "torchvision's densenet121 builder cannot load them" in message
    assert "size mismatch for features.conv0.weight" in message, message


def test_train_py_refuses_it_with_exit_2_before_data_loads(unloadable_cache, tmp_path):
    result = subprocess.run(
        [PYTHON, "train.py", *FAST, "model=torchvision", "model.name=densenet121",
         "model.pretrained=true", f"paths.weights_cache={unloadable_cache}",
         "dataset=synthetic", "dataset._target_=no.such.loader",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=PROJECT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCH_HOME": str(tmp_path / "torch-home")})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "torchvision's densenet121 builder cannot load them" in lines[0]
    assert "no.such.loader" not in result.stdout + result.stderr


class Payload:
    """What torch.load unpickles only with weights_only=False: it leaves a file behind."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_torchvisions_loading_stays_weights_only(tmp_path, composed, empty_torch_home):
    """torch.hub asks torch.load to unpickle anything; labrun's validation and its run both
    refuse a file that holds more than tensors, without running what it holds."""
    from labrun import models
    from labrun.core.errors import ConfigError
    from labrun.train import initial_weights

    marker = tmp_path / "unpickled"
    write_published_zeros(cache_file(tmp_path / "cache", "googlenet", "true"), "googlenet",
                          FAMILIES["googlenet"][1], payload=Payload(marker))
    overrides = ("model=torchvision", "model.name=googlenet", "model.pretrained=true",
                 f"paths.weights_cache={tmp_path / 'cache'}")
    refused = "builder cannot load them: it holds pickled objects that could run code"
    with pytest.raises(ConfigError, match=refused):
        validated(composed, *overrides)
    cfg = composed(*overrides)  # the run's own load, had validation let it through
    with pytest.raises(ConfigError, match=refused):
        initial_weights.load(models.build(cfg.model, CLASSES), cfg.model,
                             initial_weights.source(cfg), CLASSES)
    assert not marker.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # given back too


def test_a_builder_argument_labrun_does_not_pass_is_refused(weights_cache, composed,
                                                            monkeypatch):
    """Were labrun to build GoogLeNet without transform_input, its weights would go into a
    model that feeds them other inputs than they were trained on, with no error: validation
    compares every module's settings with the model torchvision's builder makes."""
    from labrun.core.errors import ConfigError
    from labrun.models import pretrained

    monkeypatch.setattr(pretrained, "torchvision_arguments", lambda name, weights: {})
    with pytest.raises(ConfigError) as caught:
        validated(composed, "model=torchvision", "model.name=googlenet", "model.pretrained=true",
                  f"paths.weights_cache={weights_cache}")
    assert ("torchvision's builder sets transform_input=True for these weights, labrun's model "
            "has False") in str(caught.value)
