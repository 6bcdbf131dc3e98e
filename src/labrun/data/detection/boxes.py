"""Boxes as detection data holds them: an image's objects as float32 [N, 4] corners (x1, y1, x2,
y2, in the image's own pixels, as torchvision's detectors take them), int64 class indices [N]
and a bool [N] marking COCO's crowd regions (kept for evaluation, which ignores detections
matched to them, and left out of training, as torchvision's COCO reference does).

Real labels are imperfect. A corner a hair outside its image (1.0000001 of its width, from
rounding in a labelling tool) is clipped, and a box left with no width or height is dropped:
both are counted, and a run logs the count once. Beyond OUTSIDE_TOLERANCE of the image's side
the label is wrong, not rounded: the box is refused, naming where it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from labrun.core.errors import DataError

# How far outside its image a corner may lie, as a share of the image's side, and still be
# clipped: rounding in labelling tools and exports stays far under it; a box in the wrong image
# or in normalised units where pixels were meant lies far beyond.
OUTSIDE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Objects:
    """One image's objects (module docstring)."""

    boxes: np.ndarray  # float32 [N, 4] x1 y1 x2 y2, pixels
    labels: np.ndarray  # int64 [N] class indices
    crowd: np.ndarray = field(default=None)  # bool [N]; None: no crowd regions

    def __post_init__(self):
        if self.crowd is None:
            object.__setattr__(self, "crowd", np.zeros(len(self.labels), dtype=bool))

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def none() -> Objects:
        """An image without objects (a background image: COCO's images without annotations,
        YOLO's images without a label file), kept: it teaches the detector what is no object."""
        return Objects(np.zeros((0, 4), np.float32), np.zeros(0, np.int64))


@dataclass
class Cleaned:
    """What checked() fixed of a split's labels: counts a run logs once."""

    clipped: int = 0  # boxes moved inside their image by at most OUTSIDE_TOLERANCE
    dropped: int = 0  # boxes without width or height (after clipping)

    def line(self, split: str) -> str | None:
        """The one log line for the split, or None when nothing was fixed."""
        if not (self.clipped or self.dropped):
            return None
        return (f"{split}: {self.clipped} box(es) clipped to their image (corners at most "
                f"{OUTSIDE_TOLERANCE:.0%} outside it), {self.dropped} without width or height "
                f"dropped")


def checked(boxes: np.ndarray, labels: np.ndarray, width: int, height: int, num_classes: int,
            where: Callable[[int], str], cleaned: Cleaned,
            crowd: np.ndarray | None = None) -> Objects:
    """The objects of one image of `width` x `height`, from corner boxes in pixels: clipped
    and degenerate boxes fixed (counted in `cleaned`), a box beyond OUTSIDE_TOLERANCE or a
    class index outside 0..num_classes-1 refused as DataError, naming `where(i)` (the file and
    line, or the annotation, of box i) and the fix."""
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    labels = np.asarray(labels, np.int64).reshape(-1)
    crowd = np.zeros(len(labels), bool) if crowd is None else np.asarray(crowd, bool)
    for i in np.flatnonzero((labels < 0) | (labels >= num_classes)):
        raise DataError(f"{where(i)}: class {labels[i]}, but the data names {num_classes} "
                        f"classes (0-{num_classes - 1}); fix the label or the class names")
    finite = np.isfinite(boxes).all(axis=1)
    for i in np.flatnonzero(~finite):
        raise DataError(f"{where(i)}: box {boxes[i].tolist()} is not a number; fix the label")
    slack = OUTSIDE_TOLERANCE * np.array([width, height, width, height], np.float32)
    low, high = -slack, np.array([width, height, width, height], np.float32) + slack
    outside = ((boxes < low) | (boxes > high)).any(axis=1)
    reversed_ = (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    for i in np.flatnonzero(outside | reversed_):
        box = ", ".join(f"{v:g}" for v in boxes[i])
        why = ("its corners are reversed (x2 < x1 or y2 < y1)" if reversed_[i] else
               f"it lies outside the {width}x{height} image by more than "
               f"{OUTSIDE_TOLERANCE:.0%} of its side")
        raise DataError(f"{where(i)}: box ({box}): {why}; fix the label (corners x1 y1 x2 y2 "
                        f"in the image's pixels)")
    inside = np.clip(boxes, 0, [width, height, width, height]).astype(np.float32)
    cleaned.clipped += int((inside != boxes).any(axis=1).sum())
    kept = (inside[:, 2] > inside[:, 0]) & (inside[:, 3] > inside[:, 1])
    cleaned.dropped += int((~kept).sum())
    return Objects(inside[kept], labels[kept], crowd[kept])


def corners_from_center(center_boxes: np.ndarray, width: int, height: int) -> np.ndarray:
    """YOLO's normalised (cx, cy, w, h) as corners in pixels."""
    cx, cy, w, h = np.asarray(center_boxes, np.float64).reshape(-1, 4).T
    return np.stack([(cx - w / 2) * width, (cy - h / 2) * height,
                     (cx + w / 2) * width, (cy + h / 2) * height], axis=1).astype(np.float32)


def corners_from_corner_size(boxes: np.ndarray) -> np.ndarray:
    """COCO's (x, y, w, h) in pixels as corners."""
    x, y, w, h = np.asarray(boxes, np.float64).reshape(-1, 4).T
    return np.stack([x, y, x + w, y + h], axis=1).astype(np.float32)
