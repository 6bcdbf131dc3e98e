"""Detection models for task=detection: torchvision's detectors by name, which take a batch of
images in [0, 1] and, in training mode, their targets ({"boxes", "labels"} per image) and
return a dict of losses; in eval mode a list of {"boxes", "labels", "scores"} per image, in the
input's pixels, after their own box decoding and non-maximum suppression.

Randomly initialised, with no backbone download (torchvision's default for weights_backbone
would fetch ImageNet's): pretrained weights come from the weights cache after the model is
built. Labels count from 1: torchvision's detectors keep 0 for the background, so a dataset of
K classes makes a model of K + 1 (task=detection shifts the indices on the way in and out).

The model's own transform resizes its input to `image_size` (the data's: dataset.image_size),
so that it sees the images at the size they were made for, not torchvision's COCO default of
800 px, and normalises by the mean and std it was built with.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from labrun.core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

FCOS_BACKBONES = ("resnet18", "resnet34", "resnet50")
NORMS = ("group", "batch")
# The detectors whose builders fix the input size (300 and 320 px) rather than take one.
SSD = ("ssd300_vgg16", "ssdlite320_mobilenet_v3_large")


def torchvision_det_model(num_classes: int, name: str, image_size: int,
                          score_threshold: float = 0.05, detections_per_image: int = 100
                          ) -> nn.Module:
    """torchvision's detector `name` for `num_classes` classes (plus its background), at
    `image_size`. score_threshold and detections_per_image: what evaluation keeps of its
    answers (COCOeval ranks up to 100 an image)."""
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models.detection)
    if name not in available:
        close = difflib.get_close_matches(name, available, n=3, cutoff=0.5) or available
        raise ConfigError(f"model.name={name} is not a torchvision detection model; did you "
                          f"mean: {', '.join(close)}")
    arguments = {"weights": None, "weights_backbone": None, "num_classes": num_classes + 1}
    if name in SSD:  # their builders fix the size: set on the model's transform below
        arguments.update(score_thresh=score_threshold, detections_per_img=detections_per_image)
    else:
        arguments.update(min_size=image_size, max_size=image_size)
        arguments.update(_threshold_arguments(name, score_threshold, detections_per_image))
    model = torchvision.models.get_model(name, **arguments)
    if name in SSD:
        # Their builders pass their own size (300, 320) to SSD, which resizes every image to
        # it; the anchors are relative to the image, so the data's size is set on the model.
        model.transform.fixed_size = (image_size, image_size)
        model.transform.min_size, model.transform.max_size = (image_size,), image_size
    return model


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
