"""Detection sources (the protocol in data/detection/__init__.py) over the splits the file
readers give (coco.read_split, yolo.read_split): each image decoded by labrun's decoder
(dataset.decoder, as image folders are), its objects as the reader checked them.

An image is decoded whole (not a JpegImage decoded by region): a training sample of
detection may hold four images (mosaic), and an image that cannot be decoded must be named
where it is read, not later in a transform that cannot tell which of them failed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from labrun.core.errors import DataError, one_line
from labrun.data.detection import DetectionSplit
from labrun.data.detection.boxes import Objects
from labrun.data.image.decode import decode


class SplitSource:
    """One DetectionSplit's images, decoded with `decoder` (data/image/decode.py)."""

    boxes = True  # a detection source (labrun.data.build)

    def __init__(self, split: DetectionSplit, decoder: str, name: str):
        self.split, self.decoder, self.name = split, decoder, name
        self.class_names = split.class_names
        self.category_ids = split.category_ids
        self.cleaned = split.cleaned

    def __len__(self) -> int:
        return len(self.split.items)

    def open(self, index: int) -> tuple[np.ndarray, Objects]:
        item = self.split.items[index]
        try:
            image = decode(item.path.read_bytes(), self.decoder)
        except Exception as error:  # OSError, Pillow's and TurboJPEG's errors alike
            raise DataError(f"{item.path}: not a readable image ({one_line(error)}); replace "
                            f"the file or remove it and its labels") from None
        if image.shape[:2] != (item.height, item.width):
            # The boxes are in the size the labels give: another size would misplace them.
            raise DataError(f"{item.path}: the image is {image.shape[1]}x{image.shape[0]}, "
                            f"its labels say {item.width}x{item.height}; fix the annotation's "
                            f"width and height")
        return image, item.objects

    def image_id(self, index: int) -> int:
        item = self.split.items[index]
        return index if item.image_id is None else int(item.image_id)

    def describe(self, index: int) -> str:
        return str(self.split.items[index].path)


class Subset:
    """Some images of another source: a val split held out of train."""

    boxes = True

    def __init__(self, source: Any, indices: np.ndarray, name: str):
        self.source, self.indices, self.name = source, np.sort(indices), name
        self.class_names, self.category_ids = source.class_names, source.category_ids
        self.cleaned = source.cleaned  # the whole split's, logged once for it

    def __len__(self) -> int:
        return len(self.indices)

    def open(self, index: int) -> tuple[Any, Objects]:
        return self.source.open(int(self.indices[index]))

    def image_id(self, index: int) -> int:
        return self.source.image_id(int(self.indices[index]))

    def describe(self, index: int) -> str:
        return self.source.describe(int(self.indices[index]))


def hold_out(train: Any, fraction: float, seed: int = 0) -> tuple[Subset, Subset]:
    """(train, val) out of a format's train split: a seeded `fraction` held out, drawn as
    segmentation's split_off draws it."""
    if fraction <= 0:
        raise DataError(f"{train.name} has no val split; set dataset.val_fraction (for example "
                        f"0.1) to hold out part of train")
    order = np.random.default_rng(seed).permutation(len(train))
    n_val = round(len(train) * fraction)
    return (Subset(train, order[n_val:], f"{train.name}[train part]"),
            Subset(train, order[:n_val], f"{train.name}[val part]"))
