"""Segmentation models (models/segmentation.py): the UNet answers any image size with a mask of
that size, eagerly, traced and exported to ONNX; torchvision's models build with no network and
find their COCO_WITH_VOC_LABELS_V1 weights in the weights cache, the class heads swapped.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from labrun.core.errors import ConfigError
from labrun.models import build
from labrun.models.segmentation import UNet, torchvision_seg_model

# Each test builds its own small models: none shares a fixture.
SPREAD_OVER_WORKERS = True

CLASSES = 3


@pytest.fixture
def no_network_caches(monkeypatch, tmp_path) -> Path:
    """The libraries' download caches pointed at an empty folder: anything fetched lands there."""
    home = tmp_path / "caches"
    home.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(home / "torch"))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    return home


@pytest.mark.parametrize("name", ["fcn_resnet50", "deeplabv3_resnet50",
                                  "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"])
def test_torchvision_models_build_offline_and_answer_at_the_input_size(name, no_network_caches):
    torch.manual_seed(0)
    model = torchvision_seg_model(CLASSES, name).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 64, 48))
    assert out["out"].shape == (1, CLASSES, 64, 48)
    assert "aux" not in out  # aux_loss defaults to false
    assert list(no_network_caches.iterdir()) == []  # no backbone weights were fetched


def test_the_auxiliary_head_only_where_torchvision_has_one(no_network_caches):
    model = torchvision_seg_model(CLASSES, "deeplabv3_mobilenet_v3_large", aux_loss=True).eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32))
    assert out["aux"].shape == (1, CLASSES, 32, 32)
    with pytest.raises(ConfigError, match="lraspp_mobilenet_v3_large has no auxiliary head"):
        torchvision_seg_model(CLASSES, "lraspp_mobilenet_v3_large", aux_loss=True)


def test_an_unknown_name_is_one_line_naming_the_closest():
    with pytest.raises(ConfigError) as refusal:
        torchvision_seg_model(CLASSES, "deeplabv3_resnet5")
    message = str(refusal.value)
    assert "\n" not in message
    assert "not a torchvision segmentation model" in message
    assert "deeplabv3_resnet50" in message


@pytest.mark.parametrize("size", [(37, 50), (64, 64), (9, 1)])
def test_unet_answers_with_a_mask_of_the_input_size_and_trains(size):
    torch.manual_seed(0)
    model = UNet(CLASSES, width=8, depth=3)
    x = torch.randn(2, 3, *size)
    logits = model(x)
    assert logits.shape == (2, CLASSES, *size)
    loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, CLASSES, (2, *size)))
    loss.backward()
    # Every parameter gets a gradient: the first level's convs through the skip, the
    # deepest through the upsampling path.
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_unet_holds_one_sample_apart_from_the_others_in_its_batch():
    # GroupNorm, not BatchNorm: a sample's logits do not depend on the batch it came in,
    # which keeps gradient accumulation and DDP equal to one big batch.
    torch.manual_seed(0)
    model = UNet(CLASSES).train()
    batch = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(batch)[:1], model(batch[:1]), atol=1e-5)


def test_traced_and_onnx_unet_match_eager_at_another_size(tmp_path):
    torch.manual_seed(0)
    model = UNet(CLASSES, width=8).eval()
    example, other = torch.randn(1, 3, 64, 64), torch.randn(2, 3, 45, 70)
    with torch.no_grad():
        expected = model(other)
        traced = torch.jit.trace(model, example)
        assert torch.allclose(traced(other), expected, atol=1e-5)
    if importlib.util.find_spec("onnxruntime") is None:
        pytest.skip("onnxruntime is not installed: the ONNX half of this check cannot run")
    import onnxruntime

    path = tmp_path / "unet.onnx"
    axes = {0: "batch", 2: "height", 3: "width"}
    torch.onnx.export(model, (example,), str(path), dynamo=False, input_names=["input"],
                      output_names=["logits"], dynamic_axes={"input": axes, "logits": axes})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": other.numpy()})
    assert got.shape == (2, CLASSES, 45, 70)
    assert torch.allclose(torch.from_numpy(got), expected, atol=1e-4)


def test_the_model_configs_build_through_models_build(composed):
    unet = build(composed("model=unet").model, CLASSES)
    assert isinstance(unet, UNet) and unet.head.out_channels == CLASSES
    cfg = composed("model=torchvision_seg", "model.name=lraspp_mobilenet_v3_large")
    assert cfg.model.aux_loss is False and cfg.model.pretrained is False
    model = build(cfg.model, CLASSES)
    assert model.classifier.low_classifier.out_channels == CLASSES


def fake_torchvision_file(cache: Path, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """A file under torchvision's own name for the model's COCO_WITH_VOC_LABELS_V1 weights,
    shaped as they are (21 classes, the auxiliary head where the model has one), holding
    seeded random tensors: the real file cannot be downloaded here."""
    import torchvision

    weights = torchvision.models.get_model_weights(name).COCO_WITH_VOC_LABELS_V1
    torch.manual_seed(7)
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                         num_classes=21,
                                         **({"aux_loss": True} if "lraspp" not in name else {}))
    state = model.state_dict()
    path = cache / "hub" / "checkpoints" / Path(weights.url).name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path, state


@pytest.mark.parametrize("name, head", [
    ("lraspp_mobilenet_v3_large", {"classifier.low_classifier.weight",
                                   "classifier.low_classifier.bias",
                                   "classifier.high_classifier.weight",
                                   "classifier.high_classifier.bias"}),
    ("deeplabv3_mobilenet_v3_large", {"classifier.4.weight", "classifier.4.bias"}),
])
def test_pretrained_weights_come_from_the_cache_with_the_head_swapped(
        name, head, composed, no_network_caches, tmp_path):
    from labrun.train import fine_tuning, initial_weights

    cache = tmp_path / "weights"
    path, theirs = fake_torchvision_file(cache, name)
    cfg = composed("model=torchvision_seg", f"model.name={name}", "model.pretrained=true",
                   f"paths.weights_cache={cache}")
    # Validation's check (on the meta device), then the run's load.
    fine_tuning.check(cfg, lambda: build(cfg.model, CLASSES), CLASSES)
    start = initial_weights.source(cfg)
    assert start.path == path
    assert start.label.endswith("_Weights.COCO_WITH_VOC_LABELS_V1")
    model = build(cfg.model, CLASSES)
    swapped = initial_weights.load(model, cfg.model, start, CLASSES)
    assert set(swapped) == head
    own = model.state_dict()
    assert all(own[key].shape[0] == CLASSES for key in head)
    kept = [key for key in own if key not in head]
    assert kept and all(torch.equal(own[key], theirs[key]) for key in kept)
    # The file's auxiliary head (DeepLabV3's) is left out of a model built without one.
    assert not any(key.startswith("aux_classifier.") for key in own)
    assert list(no_network_caches.iterdir()) == []


def test_fcn_pretrained_looks_for_torchvisions_coco_file(composed, tmp_path):
    from labrun.models import pretrained

    cache = tmp_path / "weights"
    cfg = composed("model=torchvision_seg", "model.name=fcn_resnet50", "model.pretrained=true",
                   f"paths.weights_cache={cache}")
    with pytest.raises(ConfigError) as refusal:
        pretrained.locate(cfg.model, str(cache))
    message = str(refusal.value)
    assert str(cache / "hub" / "checkpoints" / "fcn_resnet50_coco-1167a1af.pth") in message
    assert "labrun weights fetch model=torchvision_seg model.name=fcn_resnet50" in message
    weights = pretrained.resolve(cfg.model, str(cache))
    assert (weights.label, weights.num_classes, weights.hash_prefix) == (
        "torchvision:FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1", 21, "1167a1af")
    with pytest.raises(ConfigError, match="not a torchvision segmentation model"):
        pretrained.resolve(composed("model=torchvision_seg", "model.name=resnet18",
                                    "model.pretrained=true").model, None)
