"""Detection models for task=detection: torchvision's detectors by name, which take a batch of
images in [0, 1] and, in training mode, their targets ({"boxes", "labels"} per image) and
return a dict of losses; in eval mode a list of {"boxes", "labels", "scores"} per image, in the
input's pixels, after their own box decoding and non-maximum suppression.

Randomly initialised, with no backbone download (torchvision's default for weights_backbone
would fetch ImageNet's); or, for `model.pretrained` (the whole detector's weights, COCO's) or
`model.weights_backbone` (its backbone's, ImageNet's), built as torchvision's builder builds the
model it loads such weights into (as_for_trained_weights), the weights, found in the weights
cache, loaded after the build by the builder itself (models/pretrained.py).

Labels count from 1: torchvision's detectors keep 0 for the background, so a dataset of K
classes makes a model of K + 1 (task=detection shifts the indices on the way in and out).

The model's own transform resizes its input to `image_size` (the data's: dataset.image_size),
so that it sees the images at the size they were made for, not torchvision's COCO default of
800 px, and normalises by the mean and std it was built with.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from unittest import mock

from labrun.core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

FCOS_BACKBONES = ("resnet18", "resnet34", "resnet50")
NORMS = ("group", "batch")
# The detectors whose builders fix the input size (300 and 320 px) rather than take one.
SSD = ("ssd300_vgg16", "ssdlite320_mobilenet_v3_large")


def torchvision_det_model(num_classes: int, name: str, image_size: int | None = None,
                          score_threshold: float = 0.05, detections_per_image: int = 100,
                          pretrained: bool | str = False, weights_backbone: bool | str = False
                          ) -> nn.Module:
    """torchvision's detector `name` for `num_classes` classes (plus its background), at
    `image_size` (a run passes the data's; None: torchvision's own sizes, as when only its
    tensors matter). score_threshold and detections_per_image: what evaluation keeps of its
    answers (COCOeval ranks up to 100 an image). pretrained, weights_backbone: the model is
    the one the builder makes for such weights (as_for_trained_weights), without them."""
    import torchvision

    from labrun.models.pretrained import torchvision_weights

    available = torchvision.models.list_models(module=torchvision.models.detection)
    if name not in available:
        close = difflib.get_close_matches(name, available, n=3, cutoff=0.5) or available
        raise ConfigError(f"model.name={name} is not a torchvision detection model; did you "
                          f"mean: {', '.join(close)}")
    arguments = {"weights": None, "weights_backbone": None, "num_classes": num_classes + 1}
    if name in SSD:  # their builders fix the size: set on the model's transform below
        arguments.update(score_thresh=score_threshold, detections_per_img=detections_per_image)
    else:
        if image_size is not None:
            arguments.update(min_size=image_size, max_size=image_size)
        arguments.update(_threshold_arguments(name, score_threshold, detections_per_image))
    trained = contextlib.nullcontext()
    if pretrained:
        arguments["weights"] = torchvision_weights(name, pretrained, "detection")
        arguments["weights_backbone"] = None  # the builder's own rule: the whole model's hold it
        trained = as_for_trained_weights(arguments["weights"], num_classes + 1)
    elif weights_backbone:
        arguments["weights_backbone"] = torchvision_weights(name, weights_backbone, "detection",
                                                            backbone=True)
        trained = as_for_trained_weights()
    with trained:
        model = torchvision.models.get_model(name, **arguments)
    if name in SSD and image_size is not None:
        # Their builders pass their own size (300, 320) to SSD, which resizes every image to
        # it; the anchors are relative to the image, so the data's size is set on the model.
        model.transform.fixed_size = (image_size, image_size)
        model.transform.min_size, model.transform.max_size = (image_size,), image_size
    return model


@contextlib.contextmanager
def as_for_trained_weights(weights: Any = None, classes: int | None = None) -> Iterator[None]:
    """While it lasts, a torchvision builder asked for weights builds the model it would load
    them into, and reads no file: labrun loads them after the build, from the file it found
    offline, through the builder itself (models/pretrained.py), and validation compares both
    models' tensors and settings (train/initial_weights.py).

    Why the builder: it builds another model for trained weights than for none, and takes no
    argument for the difference (the backbone's BatchNorm frozen as FrozenBatchNorm2d, its
    first layers without gradients, SSDlite's backbone with or without its reduced tail, which
    differ again between the whole detector's weights and the backbone's). For the whole
    detector's `weights`, the builder is told they have `classes` categories, so it builds
    their model with the run's head (it refuses any other class count for them)."""
    from torch import nn
    from torchvision.models import WeightsEnum

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(WeightsEnum, "get_state_dict",
                                              lambda self, *a, **k: {}))
        stack.enter_context(mock.patch.object(nn.Module, "load_state_dict",
                                              lambda self, *a, **k: None))
        if weights is not None:
            stack.enter_context(mock.patch.dict(weights.meta,
                                                {"categories": [None] * classes}))
        yield


def _threshold_arguments(name: str, score_threshold: float, detections_per_image: int
                         ) -> dict[str, float | int]:
    """The constructor arguments each family names its score threshold and detections per
    image by (Faster R-CNN's box_*; RetinaNet's and FCOS's plain)."""
    if name.startswith(("fasterrcnn", "maskrcnn", "keypointrcnn")):
        return {"box_score_thresh": score_threshold,
                "box_detections_per_img": detections_per_image}
    return {"score_thresh": score_threshold, "detections_per_img": detections_per_image}


def fcos(num_classes: int, image_size: int, backbone: str = "resnet18", fpn_channels: int = 64,
         norm: str = "group", score_threshold: float = 0.05, detections_per_image: int = 100
         ) -> nn.Module:
    """torchvision's FCOS (anchor-free, one stage, no random sampling in its loss) on a small
    ResNet with a feature pyramid of `fpn_channels`: what trains on a CPU in minutes
    (experiment=det_shapes), where torchvision's own builder fixes ResNet-50 and 256 channels.

    norm=group puts GroupNorm in the backbone (its head has it already): each image is
    normalised alone, so two DDP processes train as one and gradient accumulation is exact,
    which BatchNorm's batch statistics break; norm=batch is torchvision's default."""
    import torchvision
    from torch import nn
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN

    check_fcos(backbone, norm)
    layer = (lambda channels: nn.GroupNorm(32, channels)) if norm == "group" else None
    trunk = torchvision.models.get_model(backbone, weights=None,
                                         **({"norm_layer": layer} if layer else {}))
    expansion = 4 if backbone == "resnet50" else 1  # Bottleneck blocks widen 4 times
    widths = [128 * expansion, 256 * expansion, 512 * expansion]
    # P3 to P5 (strides 8 to 32), without torchvision's P6 and P7: at the few hundred pixels
    # a CPU trains on, those maps are 1 or 2 pixels wide, where the head's GroupNorm divides
    # by the spread of two values (gradients that amplify float noise: two DDP processes
    # drifted 1e-3 apart in 16 steps), and no object is large enough to need them.
    features = BackboneWithFPN(
        trunk, return_layers={"layer2": "0", "layer3": "1", "layer4": "2"},
        in_channels_list=widths, out_channels=fpn_channels)
    features.fpn.extra_blocks = None  # BackboneWithFPN adds a max-pooled level for None
    # One size a level, as FCOS's own (8 to 128): objects are assigned to a level by size.
    anchors = AnchorGenerator(((8,), (16,), (32,)), ((1.0,),) * 3)
    return FCOS(features, num_classes=num_classes + 1, min_size=image_size,
                max_size=image_size, anchor_generator=anchors, score_thresh=score_threshold,
                detections_per_img=detections_per_image)


def check_fcos(backbone: str, norm: str) -> None:
    """Refuse, before any data loads, a backbone or norm model=fcos does not build."""
    if backbone not in FCOS_BACKBONES:
        raise ConfigError(f"model.backbone={backbone}: model=fcos takes one of "
                          f"{', '.join(FCOS_BACKBONES)}")
    if norm not in NORMS:
        raise ConfigError(f"model.norm={norm}: use group (each image normalised alone) or "
                          f"batch (BatchNorm)")


def check(model_cfg: Any) -> None:
    """What validation checks of a detection model's section (task=detection)."""
    if model_cfg.get("_target_") == "labrun.models.detection.fcos":
        check_fcos(model_cfg.get("backbone", "resnet18"), model_cfg.get("norm", "group"))
