"""Detection data: images with a varying number of boxes each (boxes.py), read from COCO's layout
(coco.py) or ultralytics' YOLO layout (yolo.py). A format's reader gives a DetectionSplit per
split: its items (an image file, its size and its objects) and its class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labrun.data.detection.boxes import Cleaned, Objects


@dataclass(frozen=True)
class DetectionItem:
    path: Path  # the image file
    width: int
    height: int
    objects: Objects
    image_id: int | None = None  # COCO's id of the image (evaluation); None: a YOLO image


@dataclass
class DetectionSplit:
    name: str
    items: list[DetectionItem]
    class_names: list[str]
    category_ids: list[int] | None  # class index -> COCO category id; None: the index itself
    cleaned: Cleaned
