"""COCO's box mAP of a split's detections: mAP@[.5:.95], mAP@.5 and each class's AP, as COCOeval
computes them (crowd regions ignored, 100 detections an image, all areas), by faster-coco-eval
(which reproduces COCOeval several times faster) or, where it is missing, pycocotools; the
result names which one and its version, as a run records it.

Neither library is written again here: this module only turns labrun's objects and detections
into COCO's dictionaries, and reads the precision array both fill the same way.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Detections:
    """One image's detections: corner boxes in its pixels, class indices and scores."""

    boxes: np.ndarray  # float [N, 4] x1 y1 x2 y2
    labels: np.ndarray  # int [N]
    scores: np.ndarray  # float [N]


def evaluator() -> tuple[str, type, type]:
    """(the package's name, its COCO class, its COCOeval class): faster-coco-eval first."""
    try:
        from faster_coco_eval import COCO, COCOeval_faster

        return "faster-coco-eval", COCO, COCOeval_faster
    except ImportError:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        return "pycocotools", COCO, COCOeval


def as_coco(items: Sequence, detections: Sequence[Detections], num_classes: int
            ) -> tuple[dict, list[dict]]:
    """The ground truth of `items` (each with width, height and objects: boxes.Objects) as a
    COCO dataset, and `detections` (one per item, in the same order) as COCO results. Image ids
    are the items' positions; category ids their class indices + 1 (COCO reserves 0)."""
    images, annotations, results = [], [], []
    for image_id, (item, found) in enumerate(zip(items, detections, strict=True)):
        images.append({"id": image_id, "width": int(item.width), "height": int(item.height)})
        objects = item.objects
        for box, label, crowd in zip(objects.boxes, objects.labels, objects.crowd, strict=True):
            x1, y1, x2, y2 = (float(v) for v in box)
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(label) + 1, "iscrowd": int(crowd),
                                "bbox": [x1, y1, x2 - x1, y2 - y1],
                                "area": (x2 - x1) * (y2 - y1)})
        for box, label, score in zip(found.boxes, found.labels, found.scores, strict=True):
            x1, y1, x2, y2 = (float(v) for v in box)
            results.append({"image_id": image_id, "category_id": int(label) + 1,
                            "bbox": [x1, y1, x2 - x1, y2 - y1], "score": float(score)})
    dataset = {"images": images, "annotations": annotations,
               "categories": [{"id": c + 1, "name": str(c)} for c in range(num_classes)]}
    return dataset, results


def coco_map(items: Sequence, detections: Sequence[Detections], class_names: Sequence[str]
             ) -> dict[str, float | str]:
    """map (mAP@[.5:.95]), map_50, ap/CLASS for each class (NaN: a class with no ground truth
    in the split), and evaluator/evaluator_version."""
    name, coco_class, eval_class = evaluator()
    dataset, results = as_coco(items, detections, len(class_names))
    figures: dict[str, float | str] = {"evaluator": name,
                                       "evaluator_version": importlib.metadata.version(name)}
    if not results:  # COCO's loadRes refuses an empty list; no detection scores 0
        figures.update({"map": 0.0, "map_50": 0.0})
        figures.update({f"ap/{c}": 0.0 for c in class_names})
        return figures
    # Both print their progress and summary (faster-coco-eval through logging, at INFO): a
    # run's log would hold a dozen lines of it at every validation.
    logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()):
        truth = coco_class()  # pycocotools' takes a file name only: the dataset is set
        truth.dataset = dataset
        truth.createIndex()
        found = truth.loadRes(results)
        evaluation = eval_class(truth, found, "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    figures["map"], figures["map_50"] = float(evaluation.stats[0]), float(evaluation.stats[1])
    # precision [thresholds, recall, class, area, max dets]: all areas (0), 100 detections (-1);
    # -1 where a class has no ground truth, as COCOeval's own summary leaves it out.
    precision = evaluation.eval["precision"][:, :, :, 0, -1]
    for index, class_name in enumerate(class_names):
        kept = precision[:, :, index][precision[:, :, index] > -1]
        figures[f"ap/{class_name}"] = float(kept.mean()) if kept.size else float("nan")
    return figures
