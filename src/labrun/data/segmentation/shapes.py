"""dataset=shapes: circles, rectangles and triangles on textured backgrounds, with their masks.

Made when loaded, from (split, index), as dataset=synthetic makes its images: no memory, no
files, the same sample in every worker and every run. The textures (stripes at random angles
and colours, plus noise) and the shapes' random colours make colour alone a poor guide, so a
model must learn shape: the majority class (background) alone scores a mean IoU of about 0.2.
"""

from __future__ import annotations

import numpy as np

CLASS_NAMES = ["background", "circle", "rectangle", "triangle"]
SPLIT_SEEDS = {"train": 11, "val": 12, "test": 13}


def draw(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One uint8 size x size x 3 image and its uint8 size x size mask."""
    y, x, image = texture(rng, size)
    mask = np.zeros((size, size), np.uint8)
    for _ in range(int(rng.integers(1, 4))):
        label = int(rng.integers(1, len(CLASS_NAMES)))
        cy, cx = rng.uniform(0.2, 0.8, size=2)
        radius = rng.uniform(0.14, 0.28)
        inside = shape_pixels(CLASS_NAMES[label], y, x, cy, cx, radius, rng)
        mask[inside] = label
        image[inside] = rng.uniform(40, 255, size=3)
    image += rng.normal(0, 12, size=image.shape)
    return np.clip(image, 0, 255).astype(np.uint8), mask


def texture(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, x, image): the pixels' coordinates in [0, 1) and a float32 size x size x 3
    background of two gratings of random angle, frequency and colour (dataset=shapes_boxes
    draws on the same)."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    image = np.zeros((size, size, 3), np.float32)
    for _ in range(2):
        angle, freq = rng.uniform(0, np.pi), rng.uniform(2, 8)
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (x * np.cos(angle) + y * np.sin(angle)))
        image += wave[..., None] * rng.uniform(20, 90, size=3)
    return y, x, image


def shape_pixels(kind: str, y: np.ndarray, x: np.ndarray, cy: float, cx: float, radius: float,
                 rng: np.random.Generator) -> np.ndarray:
    """Where a circle, rectangle (sides drawn from the radius) or triangle (turned at random)
    centred at (cy, cx) lies: a bool mask of the grid (y, x)."""
    if kind == "circle":
        return (y - cy) ** 2 + (x - cx) ** 2 <= radius ** 2
    if kind == "rectangle":
        half_h, half_w = radius * rng.uniform(0.6, 1.0, size=2)
        return (np.abs(y - cy) <= half_h) & (np.abs(x - cx) <= half_w)
    return _triangle(y, x, cy, cx, radius, rng.uniform(0, 2 * np.pi))


def _triangle(y: np.ndarray, x: np.ndarray, cy: float, cx: float, radius: float,
              angle: float) -> np.ndarray:
    """Points inside the triangle whose corners lie on a circle, the first at `angle`."""
    corners = [(cy + radius * np.sin(angle + k * 2 * np.pi / 3),
                cx + radius * np.cos(angle + k * 2 * np.pi / 3)) for k in range(3)]
    sides = []
    for (y0, x0), (y1, x1) in zip(corners, corners[1:] + corners[:1], strict=True):
        sides.append((x1 - x0) * (y - y0) - (y1 - y0) * (x - x0) >= 0)
    return (sides[0] & sides[1] & sides[2]) | (~sides[0] & ~sides[1] & ~sides[2])


class ShapesSource:
    dense = True  # its labels are masks (labrun.data.segmentation)

    def __init__(self, split: str, size: int, image_size: int):
        self.name, self.split, self.size, self.image_size = f"shapes/{split}", split, size, image_size
        self.class_names = list(CLASS_NAMES)

    def __len__(self) -> int:
        return self.size

    def open(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return draw(np.random.default_rng([SPLIT_SEEDS[self.split], index]), self.image_size)

    def describe(self, index: int) -> str:
        return f"{self.name}[{index}]"


def load(image_size: int, num_train: int, num_val: int, num_test: int = 0
         ) -> dict[str, ShapesSource]:
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    return {split: ShapesSource(split, n, image_size) for split, n in sizes.items() if n}
