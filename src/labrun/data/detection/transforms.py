"""Transforms that move boxes: each takes an image and its Objects and gives both, the boxes
where the pixels went. Run in the DataLoader workers, in uint8 (the task normalises on the
device), each random draw from the sample's rng, which the dataset derives from (seed, epoch,
index): a sample looks the same in any worker and after a resume.

    letterbox(image, objects, size)          the whole image scaled to fit size x size, aspect
                                             kept, padded with gray 114 (as YOLO): eval always
    scale_crop(image, objects, size, ...)    train: the letterbox scale times a random factor
                                             of `scale`, then a random window of at most
                                             size x size; pad() letterboxes it after
    mosaic(samples, size, ...)               train: four images in one, YOLO's way: a random
                                             centre, each image scaled into its quadrant
    hflip(pixels, objects)                   a mirror image
    jitter(pixels, rng, ...)                 brightness, contrast, saturation, hue (0 = off)

Boxes cut by a crop or a quadrant are clipped to what is left; one left with less than
`min_visible` of its area, or thinner than MIN_SIDE pixels, is dropped (what is left of an
object is no longer the object). letterbox never drops: evaluation scores every box.

Every resize goes through data/image/transforms.resize_region (torch's antialiased bilinear
uint8 kernel, HWC in, CHW out) on the integer region that is kept, and the boxes are mapped by
the same ratio, output size / region size, per axis: pixels and boxes agree exactly. Pure
numpy and torch: torchvision.transforms.v2 is the baseline the benchmark compares with.
"""

from __future__ import annotations

import numpy as np
import torch

from labrun.data.detection.boxes import Objects
from labrun.data.image.transforms import Image, as_rgb, resize_region

PAD_VALUE = 114  # YOLO's gray: the padding a letterboxed image is trained and scored with
MIN_SIDE = 2.0  # pixels: a thinner box is no object left to learn (YOLO's wh_thr)


# -- boxes -----------------------------------------------------------------------------------

def moved(objects: Objects, scale_x: float, scale_y: float, dx: float, dy: float) -> Objects:
    """The objects with x scaled by scale_x then shifted by dx (y likewise)."""
    factors = np.array([scale_x, scale_y, scale_x, scale_y], np.float32)
    shifts = np.array([dx, dy, dx, dy], np.float32)
    return Objects((objects.boxes * factors + shifts).astype(np.float32), objects.labels,
                   objects.crowd)


def clipped(objects: Objects, x0: float, y0: float, x1: float, y1: float,
            min_visible: float) -> Objects:
    """The objects clipped to the rectangle (x0, y0, x1, y1); those with less than
    `min_visible` of their area left inside, or a side under MIN_SIDE, dropped."""
    boxes = objects.boxes
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    inside = np.clip(boxes, [x0, y0, x0, y0], [x1, y1, x1, y1]).astype(np.float32)
    width, height = inside[:, 2] - inside[:, 0], inside[:, 3] - inside[:, 1]
    keep = ((width >= MIN_SIDE) & (height >= MIN_SIDE)
            & (width * height >= min_visible * np.maximum(area, 1e-6)))
    return Objects(inside[keep], objects.labels[keep], objects.crowd[keep])


def joined(parts: list[Objects]) -> Objects:
    return Objects(np.concatenate([p.boxes for p in parts]).reshape(-1, 4).astype(np.float32),
                   np.concatenate([p.labels for p in parts]).astype(np.int64),
                   np.concatenate([p.crowd for p in parts]).astype(bool))


# -- geometry --------------------------------------------------------------------------------

def resized(image: Image, objects: Objects, top: int, left: int, height: int, width: int,
            out_height: int, out_width: int) -> tuple[torch.Tensor, Objects]:
    """image[top:top+height, left:left+width] resized to uint8 3 x out_height x out_width, and
    the objects mapped onto it (not clipped)."""
    pixels = resize_region(image, top, left, height, width, out_height, out_width)
    scale_x, scale_y = out_width / width, out_height / height
    return pixels, moved(objects, scale_x, scale_y, -left * scale_x, -top * scale_y)


def pad(pixels: torch.Tensor, objects: Objects, size: int) -> tuple[torch.Tensor, Objects]:
    """uint8 3 x h x w (h, w <= size) centred on a size x size canvas of PAD_VALUE."""
    height, width = pixels.shape[1:]
    top, left = (size - height) // 2, (size - width) // 2
    canvas = torch.full((3, size, size), PAD_VALUE, dtype=torch.uint8)
    canvas[:, top:top + height, left:left + width] = pixels
    return canvas, moved(objects, 1.0, 1.0, left, top)


def letterbox(image: Image, objects: Objects, size: int) -> tuple[torch.Tensor, Objects]:
    """The whole image scaled so that its long side is `size` (aspect ratio kept), centred on
    a size x size canvas of gray; every box kept."""
    image = as_rgb(image)
    height, width = image.shape[:2]
    ratio = size / max(height, width)
    out_h, out_w = max(1, round(height * ratio)), max(1, round(width * ratio))
    pixels, objects = resized(image, objects, 0, 0, height, width, out_h, out_w)
    # Rounding of float32 products may put a corner a hair past the edge: clip, drop nothing.
    objects = Objects(np.clip(objects.boxes, 0, [out_w, out_h, out_w, out_h]).astype(np.float32),
                      objects.labels, objects.crowd)
    return pad(pixels, objects, size)


def scale_crop(image: Image, objects: Objects, size: int, scale: tuple[float, float],
               min_visible: float, rng: np.random.Generator) -> tuple[torch.Tensor, Objects]:
    """The image at its letterbox scale times a random factor of `scale`, then a random window
    of size x size (the whole side where the scaled image is shorter): uint8 3 x h x w with
    h, w <= size, and its objects clipped and filtered (module docstring)."""
    image = as_rgb(image)
    height, width = image.shape[:2]
    factor = size / max(height, width) * rng.uniform(*scale)
    window = []  # (start, length, output length) per axis, in the image's integer pixels
    for extent in (height, width):
        length = min(extent, max(1, round(size / factor)))
        start = int(rng.integers(0, extent - length + 1))
        window.append((start, length, min(size, max(1, round(length * factor)))))
    (top, h, out_h), (left, w, out_w) = window
    pixels, objects = resized(image, objects, top, left, h, w, out_h, out_w)
    return pixels, clipped(objects, 0, 0, out_w, out_h, min_visible)


def mosaic(samples: list[tuple[Image, Objects]], size: int, scale: tuple[float, float],
           min_visible: float, rng: np.random.Generator) -> tuple[torch.Tensor, Objects]:
    """Four images in one size x size image, as YOLO's mosaic: a random centre, and around it
    one image per quadrant (top-left, top-right, bottom-left, bottom-right), each touching the
    centre with a corner, scaled so that its long side is size / 2 times a random factor of
    `scale` (one for the four, as YOLO's one affine zoom), and cut where it leaves its quadrant.
    What no image covers is gray."""
    canvas = torch.full((3, size, size), PAD_VALUE, dtype=torch.uint8)
    centre_x, centre_y = (int(rng.uniform(0.25, 0.75) * size) for _ in range(2))
    zoom = rng.uniform(*scale)
    parts = []
    for quadrant, (image, objects) in enumerate(samples):
        image = as_rgb(image)
        height, width = image.shape[:2]
        factor = size / 2 / max(height, width) * zoom
        right, bottom = quadrant % 2 == 1, quadrant >= 2
        room_w = size - centre_x if right else centre_x
        room_h = size - centre_y if bottom else centre_y
        # The part of the image that fits its quadrant: the side nearest the centre.
        w = min(width, max(1, round(room_w / factor)))
        h = min(height, max(1, round(room_h / factor)))
        left, top = (0 if right else width - w), (0 if bottom else height - h)
        out_w, out_h = min(room_w, max(1, round(w * factor))), min(room_h, max(1, round(h * factor)))
        x = centre_x if right else centre_x - out_w
        y = centre_y if bottom else centre_y - out_h
        pixels, placed = resized(image, objects, top, left, h, w, out_h, out_w)
        canvas[:, y:y + out_h, x:x + out_w] = pixels
        parts.append(clipped(moved(placed, 1.0, 1.0, x, y), x, y, x + out_w, y + out_h,
                             min_visible))
    return canvas, joined(parts)


def hflip(pixels: torch.Tensor, objects: Objects) -> tuple[torch.Tensor, Objects]:
    """The mirror image: x -> width - x, the corners swapped so that x1 < x2 still."""
    width = pixels.shape[2]
    boxes = objects.boxes
    flipped = np.stack([width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]],
                       axis=1).astype(np.float32).reshape(-1, 4)
    return pixels.flip(2), Objects(flipped, objects.labels, objects.crowd)


# -- colour ----------------------------------------------------------------------------------

# RGB <-> YIQ: a hue shift is a rotation of the (I, Q) chroma plane, one 3x3 matrix for the
# whole image; cheaper than a round trip through HSV, and close to it for small shifts.
_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
_FROM_YIQ = np.linalg.inv(_TO_YIQ)
_LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601, as torchvision's grayscale


def jitter(pixels: torch.Tensor, rng: np.random.Generator, brightness: float = 0.0,
           contrast: float = 0.0, saturation: float = 0.0, hue: float = 0.0) -> torch.Tensor:
    """uint8 3 x H x W with brightness, contrast and saturation scaled by random factors of
    [1 - x, 1 + x] and the hue turned by a random fraction of [-hue, hue] of the colour wheel,
    in that order; a key at 0 draws nothing and changes nothing.

    Each of the four is linear in the colour, so together they are one map, a 3x3 matrix and
    an offset, applied in one pass and clamped once at the end (torchvision clamps after each:
    the same unless a step overshoots 0..255). Four passes of float arithmetic over a 640 x
    640 image took 130 ms, longer than the rest of a sample's transforms."""
    if not (brightness or contrast or saturation or hue):
        return pixels
    matrix, offset = np.eye(3), np.zeros(3)
    if brightness:
        factor = rng.uniform(1 - brightness, 1 + brightness)
        matrix, offset = factor * matrix, factor * offset
    if contrast:  # towards the mean gray of the image as it is by then
        mean_rgb = pixels.float().mean(dim=(1, 2)).double().numpy()
        mean = _LUMA @ (matrix @ mean_rgb + offset)
        factor = rng.uniform(1 - contrast, 1 + contrast)
        matrix, offset = factor * matrix, factor * offset + (1 - factor) * mean
    if saturation:  # towards each pixel's own gray
        factor = rng.uniform(1 - saturation, 1 + saturation)
        blend = factor * np.eye(3) + (1 - factor) * np.outer(np.ones(3), _LUMA)
        matrix, offset = blend @ matrix, blend @ offset
    if hue:
        angle = 2 * np.pi * rng.uniform(-hue, hue)
        turn = np.array([[1, 0, 0], [0, np.cos(angle), -np.sin(angle)],
                         [0, np.sin(angle), np.cos(angle)]])
        rotation = _FROM_YIQ @ turn @ _TO_YIQ
        matrix, offset = rotation @ matrix, rotation @ offset
    flat = pixels.reshape(3, -1).float()
    out = torch.addmm(torch.from_numpy(offset).float()[:, None],
                      torch.from_numpy(matrix).float(), flat)
    return out.clamp_(0, 255).round_().to(torch.uint8).reshape(pixels.shape)
