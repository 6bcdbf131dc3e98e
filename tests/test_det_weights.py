"""A torchvision detector from pretrained weights, found offline (model=torchvision_det with
model.pretrained: the whole detector's, COCO's; or model.weights_backbone: its backbone's,
ImageNet's), read by torchvision's own builder, the head sized to the dataset's classes.

The published files cannot be downloaded here: each cache file holds zeros shaped as the
published one (a zero broadcast to each shape, a few bytes a tensor), written from torchvision's
own model without labrun's code; torchvision reads an existing cache file without checking its
hash. The run's model must be the one the builder makes for trained weights (its backbone's
BatchNorm frozen and its first layers without gradients, which no builder argument asks for),
and only the class head may differ from the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from labrun import cli

CLASSES = 3  # dataset=shapes_boxes: circle, rectangle, triangle
SIZE = 96
# One detector whose builder freezes its backbone's BatchNorm for trained weights and one whose
# builder keeps its own BatchNorm (SSDlite), both light enough to build in a second.
DETECTORS = ("fasterrcnn_mobilenet_v3_large_fpn", "ssdlite320_mobilenet_v3_large")


def published_zeros(path: Path, name: str, **arguments) -> None:
    """Zeros shaped as torchvision's published file of `name` (a detector at COCO's 91
    classes, or a backbone's classifier at 1000), at `path`."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.get_model(name, weights=None, **arguments)
    state = {key: torch.zeros((), dtype=t.dtype).expand(t.shape)
             for key, t in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def cache_file(cache: Path, weights) -> Path:
    return cache / "hub" / "checkpoints" / Path(weights.url).name


def builders_model(name: str, weights: str, path: Path):
    """The model torchvision's builder makes for these weights, on the meta device (their
    file's tensors are never read), at 91 classes."""
    from labrun.models import pretrained

    return pretrained.load_torchvision(pretrained.Weights("torchvision", weights, name, "", 91),
                                       path, meta=True)


def run_model(cfg):
    """The run's model, as task=detection builds it for the data."""
    from labrun.train.detection_task import Detection

    return Detection().build_model(cfg.model, {"class_names": ["circle", "rectangle",
                                                               "triangle"], "image_size": SIZE})


@pytest.fixture(scope="module")
def weights_cache(tmp_path_factory) -> Path:
    import torchvision

    cache = tmp_path_factory.mktemp("weights")
    for name in DETECTORS:
        coco = torchvision.models.get_model_weights(name).DEFAULT
        published_zeros(cache_file(cache, coco), name, num_classes=91, weights_backbone=None)
    backbone = torchvision.models.MobileNet_V3_Large_Weights.IMAGENET1K_V1
    published_zeros(cache_file(cache, backbone), "mobilenet_v3_large")
    return cache


def validated(composed, *overrides: str):
    """A detection run's config through validation, as train.py validates it: dataset.
    _target_ names a loader that must never run."""
    from labrun.config import validation

    cfg = composed("task=detection", "dataset=shapes_boxes", f"dataset.image_size={SIZE}",
                   "dataset._target_=no.such.loader", "model=torchvision_det", *overrides)
    validation.validate(cfg)
    return cfg


@pytest.mark.parametrize("name", DETECTORS)
def test_a_coco_detector_loads_as_its_builder_loads_it_with_a_head_for_the_data(
        name, weights_cache, composed, tmp_path, monkeypatch):
    import torchvision

    from labrun.train import initial_weights
    from labrun.train.detection_task import Detection

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # where a download would go
    cfg = validated(composed, f"model.name={name}", "model.pretrained=true",
                    f"paths.weights_cache={weights_cache}")
    start = initial_weights.source(cfg)  # as train/job.py starts a run
    coco = torchvision.models.get_model_weights(name).DEFAULT
    assert start.path == cache_file(weights_cache, coco)
    assert start.label == f"torchvision:{type(coco).__name__}.COCO_V1"
    model = run_model(cfg)
    swapped = initial_weights.load(model, cfg.model, start, CLASSES)

    # The builder's model for these weights, module by module: its norms and which parameters
    # train (the builder's trainable_backbone_layers), with only the class head changed.
    theirs = builders_model(name, f"{type(coco).__name__}.COCO_V1", start.path)
    assert {n: type(m) for n, m in model.named_modules()} == \
        {n: type(m) for n, m in theirs.named_modules()}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == \
        {n: p.requires_grad for n, p in theirs.named_parameters()}
    if name.startswith("fasterrcnn"):
        assert isinstance(model.backbone.body.get_submodule("0.1"),
                          torchvision.ops.misc.FrozenBatchNorm2d)
        assert not model.backbone.body.get_submodule("0.0").weight.requires_grad
    # Every tensor is the file's (zeros) but the class head's, sized to the data's classes.
    assert swapped and all("cls" in key or "box_predictor" in key or "classification" in key
                           for key in swapped), swapped
    for key, tensor in model.state_dict().items():
        if key not in swapped and tensor.is_floating_point():
            assert not tensor.any(), f"{key} was not loaded"
    assert any(model.state_dict()[key].any() for key in swapped)  # re-initialised, not zeros
    # What labrun export and eval rebuild from the run's config takes its weights as they are,
    # without the file.
    rebuilt = run_model(cfg)
    rebuilt.load_state_dict(model.state_dict())

    if name != DETECTORS[0]:
        return  # one detector's step is proof enough: the rest is torchvision's own code
    # A step of training as the task takes it: the head learns from the data's classes.
    task = Detection()
    images = torch.randint(0, 256, (2, 3, SIZE, SIZE), dtype=torch.uint8)
    targets = [{"boxes": torch.tensor([[10.0, 12.0, 50.0, 60.0]]), "labels": torch.tensor([c]),
                "crowd": torch.tensor([False]), "image_id": i} for i, c in enumerate((0, 2))]
    task.setup({"class_names": ["circle", "rectangle", "triangle"]}, torch.device("cpu"),
               torch.contiguous_format)
    loss = task.loss(model.train(), task.prepare((images, targets), torch.device("cpu")))
    loss.backward()
    assert torch.isfinite(loss)
    assert not (tmp_path / "torch-home").exists()  # nothing downloaded


def test_a_backbones_weights_alone_load_into_the_builders_detector(weights_cache, composed):
    import torchvision

    from labrun.train import initial_weights

    name = "fasterrcnn_mobilenet_v3_large_fpn"
    cfg = validated(composed, f"model.name={name}", "model.weights_backbone=true",
                    f"paths.weights_cache={weights_cache}")
    start = initial_weights.source(cfg)
    assert (start.key, start.label) == ("model.weights_backbone",
                                        "torchvision:MobileNet_V3_Large_Weights.IMAGENET1K_V1")
    model = run_model(cfg)
    initial_weights.load(model, cfg.model, start, CLASSES)
    state = model.state_dict()
    body = [k for k in state if k.startswith("backbone.body.") and state[k].is_floating_point()]
    rest = [k for k in state if k.endswith(".weight") and not k.startswith("backbone.body.")]
    assert body and not any(state[k].any() for k in body)  # ImageNet's (here zeros)
    assert rest and all(state[k].any() for k in rest)  # the builder's own initialisation
    assert isinstance(model.backbone.body.get_submodule("0.1"),
                      torchvision.ops.misc.FrozenBatchNorm2d)


def test_weights_fetch_knows_where_a_detectors_files_come_from_and_go(tmp_path, capsys,
                                                                      weights_cache):
    from omegaconf import OmegaConf

    from labrun.models import pretrained

    coco = pretrained.resolve(OmegaConf.create({
        "_target_": "labrun.models.detection.torchvision_det_model",
        "name": "fcos_resnet50_fpn", "pretrained": True}), str(tmp_path))
    assert coco.url == "https://download.pytorch.org/models/fcos_resnet50_fpn_coco-99b0c9b7.pth"
    assert coco.candidates[0] == tmp_path / "hub/checkpoints/fcos_resnet50_fpn_coco-99b0c9b7.pth"
    backbone = pretrained.resolve(OmegaConf.create({
        "_target_": "labrun.models.detection.torchvision_det_model",
        "name": "retinanet_resnet50_fpn_v2", "weights_backbone": "IMAGENET1K_V2"}), None)
    assert backbone.label == "torchvision:ResNet50_Weights.IMAGENET1K_V2"
    # A cached file is checked against the published hash: the zeros here are not COCO's.
    cache = f"paths.weights_cache={weights_cache}"
    assert cli.main(["weights", "fetch", "model=torchvision_det",
                     "model.name=ssdlite320_mobilenet_v3_large", "model.pretrained=true",
                     cache]) == 2
    assert "does not match the published" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, message", [
    (["model.name=fasterrcnn_mobilenet_v3_large_fpn", "model.pretrained=true"],
     "model.pretrained=true: no torchvision:FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1 "
     "weights in the weights cache"),
    (["model.name=fasterrcnn_mobilenet_v3_large_fpn", "model.weights_backbone=true"],
     "labrun weights fetch model=torchvision_det model.name=fasterrcnn_mobilenet_v3_large_fpn "
     "model.weights_backbone=true"),
    (["model.name=fasterrcnn_mobilenet_v3_large_fpn", "model.pretrained=true",
      "model.weights_backbone=true"], "the detector's weights hold its backbone's; keep one"),
    (["model.name=fcos_resnet50_fpn", "model.pretrained=IMAGENET1K_V1"],
     "model.pretrained=IMAGENET1K_V1: fcos_resnet50_fpn has no such weights"),
], ids=["missing", "missing-backbone", "both", "unknown"])
def test_a_detectors_weights_mistake_is_one_line_before_data_loads(overrides, message,
                                                                   composed, tmp_path):
    from labrun.core.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        validated(composed, *overrides, f"paths.weights_cache={tmp_path / 'empty'}")
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
