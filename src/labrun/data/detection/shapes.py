"""dataset=shapes_boxes: circles, rectangles and triangles on textured backgrounds, with the
tight box of each shape: a detection set made in memory, for tests, benchmarks and a first run.

Made when loaded, from (split, index), as dataset=shapes makes its masks (and with its
textures, gratings of random angle and colour plus noise, so that colour alone is a poor
guide): no files, the same sample in every worker and every run. Each image holds 1 to 4
shapes, each in its own cell of a 2x2 grid, jittered within it: shapes never overlap, so every
box is the tight box of its shape's own pixels and no object hides another. Sizes vary (a
radius of 0.08 to 0.22 of the side), as objects near and far do.
"""

from __future__ import annotations

import numpy as np

from labrun.data.detection.boxes import Cleaned, Objects
from labrun.data.segmentation.shapes import shape_pixels, texture

CLASS_NAMES = ["circle", "rectangle", "triangle"]
SPLIT_SEEDS = {"train": 21, "val": 22, "test": 23}
RADIUS = (0.08, 0.22)  # of the image's side; 2 x 0.22 < 0.5: a shape fits in its cell


def draw(rng: np.random.Generator, size: int) -> tuple[np.ndarray, Objects]:
    """One uint8 size x size x 3 image and its objects."""
    y, x, image = texture(rng, size)
    boxes, labels = [], []
    count = int(rng.integers(1, 5))
    for cell in rng.permutation(4)[:count]:  # distinct cells of the 2x2 grid
        label = int(rng.integers(0, len(CLASS_NAMES)))
        radius = rng.uniform(*RADIUS)
        # The centre anywhere in the cell that keeps the shape inside it.
        cy = (cell // 2) * 0.5 + radius + rng.uniform(0, 0.5 - 2 * radius)
        cx = (cell % 2) * 0.5 + radius + rng.uniform(0, 0.5 - 2 * radius)
        inside = shape_pixels(CLASS_NAMES[label], y, x, cy, cx, radius, rng)
        rows, cols = np.nonzero(inside)
        if len(rows) == 0:  # too small for the pixel grid (a tiny image_size)
            continue
        image[inside] = rng.uniform(40, 255, size=3)
        # The tight box of the pixels: corners on pixel edges, as labelling tools draw them.
        boxes.append([cols.min(), rows.min(), cols.max() + 1, rows.max() + 1])
        labels.append(label)
    image += rng.normal(0, 12, size=image.shape)
    objects = Objects(np.array(boxes, np.float32).reshape(-1, 4), np.array(labels, np.int64))
    return np.clip(image, 0, 255).astype(np.uint8), objects


class ShapesBoxesSource:
    boxes = True  # a detection source (labrun.data.build)

    def __init__(self, split: str, size: int, image_size: int):
        self.name, self.split, self.size = f"shapes_boxes/{split}", split, size
        self.image_size = image_size
        self.class_names, self.category_ids = list(CLASS_NAMES), None
        self.cleaned = Cleaned()  # drawn exactly: nothing to fix

    def __len__(self) -> int:
        return self.size

    def open(self, index: int) -> tuple[np.ndarray, Objects]:
        return draw(np.random.default_rng([SPLIT_SEEDS[self.split], index]), self.image_size)

    def image_id(self, index: int) -> int:
        return index

    def describe(self, index: int) -> str:
        return f"{self.name}[{index}]"


def load(image_size: int, num_train: int, num_val: int, num_test: int = 0
         ) -> dict[str, ShapesBoxesSource]:
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    return {split: ShapesBoxesSource(split, n, image_size) for split, n in sizes.items() if n}
