"""Segmentation models for task=segmentation: per-pixel logits N x num_classes x H x W at the
input's own H, W (or torchvision's {"out": logits, "aux": logits}).

UNet is the small built-in: it trains on a CPU in a minute at 64x64 px, and answers an image of
any size (a served photo is no multiple of anything) with a mask of that size. torchvision's
models come by name, randomly initialised and with no backbone download; their pretrained
weights are loaded after they are built, from a file found offline (models/pretrained.py).
"""

from __future__ import annotations

import difflib
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from labrun.core.errors import ConfigError


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    def norm(channels: int) -> nn.GroupNorm:
        # GroupNorm, not BatchNorm: each sample is normalised on its own, so two DDP processes
        # equal one, gradient accumulation is exact, and a batch of one trains.
        return nn.GroupNorm(math.gcd(8, channels), channels)

    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), norm(c_out), nn.ReLU(inplace=True),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), norm(c_out), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """A small U-Net: `depth` levels down (channels doubling from `width`), as many up, each
    joined to its level's skip connection, and a 1x1 head."""

    def __init__(self, num_classes: int, width: int = 16, depth: int = 3, in_chans: int = 3):
        super().__init__()
        self.depth = depth
        channels = [width * 2**level for level in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(in_chans, channels[0])] + [
            _double_conv(channels[level - 1], channels[level]) for level in range(1, depth + 1)])
        self.up = nn.ModuleList([
            _double_conv(channels[level + 1] + channels[level], channels[level])
            for level in reversed(range(depth))])
        self.head = nn.Conv2d(channels[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[-2], x.shape[-1]
        # Padded up to a multiple of 2**depth, so that every pooling halves exactly and each
        # upsampled map meets its skip at the same size; the logits are cropped back. Zeros,
        # not reflect: reflection needs a pad smaller than the image (a 1 px wide one). The
        # shape's values go straight into F.pad and the crop, which tracing and both ONNX
        # exporters record as arithmetic on the input's size: H and W stay dynamic.
        multiple = 2**self.depth
        x = F.pad(x, (0, (multiple - width % multiple) % multiple,
                      0, (multiple - height % multiple) % multiple))
        skips = []
        for level, block in enumerate(self.down):
            x = block(x if level == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        skips.pop()  # the bottom level has no skip: it is x
        for block in self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="bilinear", align_corners=False)
            x = block(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)[..., :height, :width]


def torchvision_seg_model(num_classes: int, name: str, aux_loss: bool = False) -> nn.Module:
    """Any torchvision segmentation model, randomly initialised and with no backbone weights
    (torchvision's default would download ImageNet's): pretrained weights are loaded after it
    is built (train/initial_weights.py). Returns {"out": logits, "aux": logits} (aux only
    with `aux_loss`)."""
    # Imported on use: torchvision imports slowly, and a UNet run does not need it.
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models.segmentation)
    if name not in available:
        close = difflib.get_close_matches(name, available, n=3, cutoff=0.5) or available
        raise ConfigError(f"model.name={name} is not a torchvision segmentation model; "
                          f"did you mean: {', '.join(close)}")
    extra = {}
    # LRASPP has no auxiliary head (its builder refuses the argument); FCN and DeepLabV3 do.
    if "aux_loss" in inspect.signature(torchvision.models.get_model_builder(name)).parameters:
        extra["aux_loss"] = aux_loss
    elif aux_loss:
        raise ConfigError(f"model.aux_loss=true: {name} has no auxiliary head (FCN and "
                          f"DeepLabV3 have one); set model.aux_loss=false")
    return torchvision.models.get_model(name, weights=None, weights_backbone=None,
                                        num_classes=num_classes, **extra)
