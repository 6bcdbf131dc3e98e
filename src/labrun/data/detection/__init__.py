"""Detection data: images with a varying number of boxes each (boxes.py), read from COCO's layout
(coco.py) or ultralytics' YOLO layout (yolo.py), or drawn in memory (shapes.py); DetectionData
(data.py), which the Trainer gets for them (labrun.data.build):

    DetectionData.info              class names, COCO category ids, the square image size
    DetectionData.loader(split...)  a DataLoader of (images, targets): uint8 B x 3 x S x S
                                    letterboxed images and one dict per image
    DetectionData.start(max_epochs), state_dict(), load_state_dict(d)
                                    the epoch mosaic stops at (close_mosaic), run state

A file reader gives a DetectionSplit per split: its items (an image file, its size and its
objects) and its class names; sources.py makes those into sources.

The source protocol. A detection format's loader (the function `dataset._target_` names)
returns {split: source}, each source with `boxes = True` (what tells labrun.data.build that the
data is detection) and:
    name            "coco/train2017", "shapes_boxes/val"...: for messages
    class_names     list[str]; class index i is class_names[i]
    category_ids    list[int] | None: class index -> COCO category id (what COCO evaluation
                    and exported predictions name); None: the index is the id
    cleaned         a boxes.Cleaned: what reading fixed of the split's labels, logged once
    __len__()
    open(i) -> (image, Objects)   uint8 HxWx3 pixels (or what labrun's decoders give that
                    data/image/transforms.as_rgb takes), and its objects in its own pixels
    image_id(i) -> int   COCO's id of image i (the index itself where the format has none)
    describe(i) -> str   where image i comes from (its file), for messages

Reading an image that fails is a DataError of one line naming its file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def holds_boxes(splits: dict[str, Any]) -> bool:
    """Whether a format's splits are detection sources (the protocol above)."""
    return all(getattr(source, "boxes", False) for source in splits.values())
