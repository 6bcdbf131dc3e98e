"""Joint transforms: an image and its mask cropped, flipped and resized together.

The crop and flip are drawn once, by the image transforms' own box() (data/image/transforms.py),
and applied to both: the image resized with the antialiased bilinear kernel classification
uses, the mask with nearest-exact, so that it keeps class indices (no blend of two classes) and
samples each output pixel at its centre, where the bilinear kernel centres it too ("nearest"
would shift the mask by up to half a source pixel against the image).

A JPEG may decode its crop at a reduced DCT scale: both are still the same region of the same
picture, resized to the same output size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from labrun.data.image.transforms import (
    Box,
    Image,
    TrainTransform,
    apply_box,
    as_rgb,
    resize_region,
)
from labrun.data.segmentation.masks import PngMask


def mask_box(mask: np.ndarray | PngMask, box: Box, height: int, width: int) -> torch.Tensor:
    """uint8 HxW: the box's region of `mask` resized to height x width by nearest-exact,
    mirrored if box.flip. A PngMask decodes no row below the box."""
    if isinstance(mask, PngMask):
        region = mask.crop(box.top, box.left, box.height, box.width)
    else:
        region = mask[box.top:box.top + box.height, box.left:box.left + box.width]
    region = torch.from_numpy(np.ascontiguousarray(region))
    if region.shape != (height, width):
        region = F.interpolate(region[None, None], size=(height, width),
                               mode="nearest-exact")[0, 0]
    return region.flip(1) if box.flip else region


class JointTrain(TrainTransform):
    """RandomResizedCrop of image and mask to size x size, then a random horizontal flip: the
    image transform's own fields and box(), the draws dataset.decode=cpu|cuda
    (data/image/batched.py) repeats, applied to the mask too."""

    def __call__(self, image: Image, mask: np.ndarray | PngMask, rng: np.random.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        image = as_rgb(image)
        box = self.box(image.shape[0], image.shape[1], rng)
        return apply_box(image, box, self.size), mask_box(mask, box, self.size, self.size)


@dataclass
class JointEval:
    """The whole image and mask: resized to size x size (fixed), or as they are (size None),
    so that every pixel of the picture is scored."""

    size: int | None

    def box(self, height: int, width: int, rng: np.random.Generator | None = None) -> Box:
        return Box(0, 0, height, width, flip=False)

    def __call__(self, image: Image, mask: np.ndarray | PngMask,
                 rng: np.random.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        image = as_rgb(image)
        height, width = image.shape[:2]
        out_h, out_w = (self.size, self.size) if self.size else (height, width)
        return (resize_region(image, 0, 0, height, width, out_h, out_w),
                mask_box(mask, self.box(height, width), out_h, out_w))


@dataclass
class PadCollate:
    """A collate_fn for images of different sizes (dataset.eval_size=full): each batch padded
    to its largest height and width, images with zeros and masks with `ignore_index`, so that
    padding is never scored."""

    ignore_index: int

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        height = max(image.shape[1] for image, _ in samples)
        width = max(image.shape[2] for image, _ in samples)
        images = torch.zeros(len(samples), 3, height, width, dtype=torch.uint8)
        masks = torch.full((len(samples), height, width), self.ignore_index, dtype=torch.uint8)
        for i, (image, mask) in enumerate(samples):
            images[i, :, :image.shape[1], :image.shape[2]] = image
            masks[i, :mask.shape[0], :mask.shape[1]] = mask
        return images, masks
