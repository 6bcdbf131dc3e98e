"""Augmentations on uint8 HxWxC images, run in the DataLoader workers.

Everything stays uint8 here; the session turns a batch into normalised floats on the device.
Randomness comes from the `rng` argument, which the dataset derives from (seed, epoch, index),
so a sample looks the same whichever worker loads it and after a resume.

Both transforms pick the region they need first and resize only that region, in one pass that
also turns HWC into CHW: torch's uint8 antialiased bilinear resize, the same kernel (and so the
same pixels) as torchvision's RandomResizedCrop/Resize on tensors, with a SIMD path for
channels-last uint8 that is several times faster than OpenCV's INTER_AREA.

An image is pixels or a JpegImage (labrun.data.image.decode), which is known by its size alone until
the crop is chosen and then decodes only that region: the box is sampled from the full-size
dimensions either way, so both give the same crops.

A transform's box() is where it draws its randomness (the crop, the flip): dataset.decode=cpu|cuda
(data/image/batched.py) draws the same boxes in the workers from the header's size alone, and crops
and resizes in the main process after decoding the whole batch there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from labrun.data.image.decode import JpegImage

Image = np.ndarray | JpegImage  # uint8 HxWxC pixels, or a JPEG not decoded yet


def resize_region(image: Image, top: int, left: int, height: int, width: int,
                  out_height: int, out_width: int) -> torch.Tensor:
    """image[top:top+height, left:left+width] resized to a uint8 CxHxW tensor."""
    region = crop(image, top, left, height, width, min(out_height, out_width))
    if not region.flags.writeable:
        region = region.copy()  # torch.from_numpy warns about read-only arrays
    # HWC memory viewed as NCHW is channels-last: the layout the fast uint8 kernel wants.
    chw = torch.from_numpy(region).permute(2, 0, 1)
    if region.shape[:2] == (out_height, out_width):
        return chw.contiguous()
    return F.interpolate(chw[None], size=(out_height, out_width), mode="bilinear",
                         antialias=True, align_corners=False)[0].contiguous()


def crop(image: Image, top: int, left: int, height: int, width: int, min_size: int
         ) -> np.ndarray:
    """The region's pixels; a JpegImage decodes only the region, at a reduced DCT scale when
    both of its sides stay >= min_size (the output size: no detail is lost)."""
    if isinstance(image, JpegImage):
        return image.crop(top, left, height, width, min_size)
    return image[top:top + height, left:left + width]


class Box(NamedTuple):
    """A transform's region of an image, in the image's own pixels, and whether to mirror it."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def apply_box(image: Image, box: Box, size: int) -> torch.Tensor:
    """uint8 CxSxS: the box's region resized to size x size, mirrored if box.flip."""
    out = resize_region(image, box.top, box.left, box.height, box.width, size, size)
    return out.flip(2) if box.flip else out


def random_resized_crop_box(height: int, width: int, rng: np.random.Generator,
                            scale: tuple[float, float], ratio: tuple[float, float]
                            ) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a crop, sampled as torchvision's RandomResizedCrop does."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    # Fallback: the largest centred crop within the ratio range.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, size: int, resize_ratio: float
                    ) -> tuple[int, int, int, int]:
    """(top, left, h, w) of the region that "resize the short side to size / resize_ratio, then
    centre-crop size x size" keeps, in the image's own pixels."""
    side = min(height, width) * resize_ratio  # = size / (scale to the resized short side)
    h, w = min(height, max(1, round(side))), min(width, max(1, round(side)))
    return (height - h) // 2, (width - w) // 2, h, w


@dataclass
class TrainTransform:
    """RandomResizedCrop to size x size, then a random horizontal flip."""

    size: int
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: bool = True

    def crop_box(self, height: int, width: int, rng: np.random.Generator):
        return random_resized_crop_box(height, width, rng, self.scale, self.ratio)

    def box(self, height: int, width: int, rng: np.random.Generator) -> Box:
        """The crop and flip for an image of this size: the only draws from `rng`, shared with
        the batched decode (data/image/batched.py), which must crop exactly as the workers do."""
        top, left, h, w = self.crop_box(height, width, rng)
        return Box(top, left, h, w, bool(self.hflip and rng.random() < 0.5))

    def __call__(self, image: Image, rng: np.random.Generator) -> torch.Tensor:
        image = as_rgb(image)
        return apply_box(image, self.box(image.shape[0], image.shape[1], rng), self.size)


@dataclass
class ValTransform:
    """Resize the short side to size / resize_ratio, then centre-crop size x size."""

    size: int
    resize_ratio: float = 0.875

    @property
    def min_size(self) -> int:
        """The resized short side: a decoder may scale down to it at no cost in detail."""
        return math.ceil(self.size / self.resize_ratio)

    def box(self, height: int, width: int, rng: np.random.Generator | None = None) -> Box:
        return Box(*center_crop_box(height, width, self.size, self.resize_ratio), flip=False)

    def __call__(self, image: Image, rng: np.random.Generator | None = None) -> torch.Tensor:
        return center_crop(as_rgb(image), self.size, self.resize_ratio)


def center_crop(image: Image, size: int, resize_ratio: float) -> torch.Tensor:
    """uint8 HxWxC -> uint8 CxSxS: the ValTransform's resize and centre crop."""
    top, left, h, w = center_crop_box(image.shape[0], image.shape[1], size, resize_ratio)
    return resize_region(image, top, left, h, w, size, size)


def as_rgb(image: Image) -> Image:
    """HxW or HxWx1 grey -> HxWx3, so every model takes every image (a JpegImage is RGB)."""
    if isinstance(image, JpegImage):
        return image
    if image.ndim == 2:
        image = image[:, :, None]
    return np.repeat(image, 3, axis=2) if image.shape[2] == 1 else image


def normalize_on_device(batch: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                        dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """uint8 NCHW (already on the device) -> normalised floats, in `out` when it is given.

    `mean` and `std` are per-channel tensors on the device, in the 0..1 range of the config.
    """
    floats = batch.to(dtype) if out is None else out.copy_(batch)
    return floats.sub_(mean * 255).div_(std * 255)


class BatchNormalizer:
    """normalize_on_device for a stream of batches, as the trainer receives them.

    On the CPU every batch goes into one reused buffer, so each result is valid only until the
    next call. A fresh float batch is a large allocation, which glibc maps anew and the kernel
    zeroes every time: that took 4x as long as the arithmetic (224 px, batch 64, measured).
    CUDA's caching allocator reuses its memory by itself.
    """

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.mean, self.std, self.dtype = mean, std, dtype
        self.buffer: torch.Tensor | None = None

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.device.type != "cpu":
            return normalize_on_device(batch, self.mean, self.std, self.dtype)
        if self.buffer is None or self.buffer.shape != batch.shape:
            self.buffer = torch.empty(batch.shape, dtype=self.dtype)
        return normalize_on_device(batch, self.mean, self.std, self.dtype, out=self.buffer)
