"""COCO box mAP (issue 55, item 3): labrun's figures equal pycocotools' COCOeval on the same
ground truth and detections to 1e-6, whichever library computes them (faster-coco-eval, or
pycocotools where it is missing); crowd regions ignored, each class's AP read off the same
precision array. In process, on a fixture of three images, two classes."""

from __future__ import annotations

import builtins
import contextlib
import io

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from labrun.data.detection import DetectionItem
from labrun.data.detection.boxes import Objects
from labrun.train import coco_map
from labrun.train.coco_map import Detections

CLASSES = ["circle", "square"]


def item(boxes, labels, crowd=None) -> DetectionItem:
    return DetectionItem(None, 100, 80, Objects(np.array(boxes, np.float32).reshape(-1, 4),
                                                 np.array(labels, np.int64),
                                                 None if crowd is None else np.array(crowd)))


ITEMS = [item([[10, 10, 50, 40], [60, 20, 90, 70]], [0, 1]),
         item([[5, 5, 30, 30], [40, 40, 95, 75]], [0, 0], crowd=[False, True]),
         item([], [])]
FOUND = [Detections(np.array([[12, 11, 50, 42], [58, 22, 88, 69], [0, 0, 20, 20]], float),
                    np.array([0, 1, 1]), np.array([0.9, 0.8, 0.3])),
         Detections(np.array([[6, 4, 31, 29], [42, 41, 90, 74], [5, 5, 15, 15]], float),
                    np.array([0, 0, 0]), np.array([0.7, 0.6, 0.5])),
         Detections(np.array([[1, 1, 30, 30]], float), np.array([1]), np.array([0.95]))]


def pycocotools_figures() -> tuple[float, float, np.ndarray]:
    """COCOeval itself on the same dictionaries."""
    dataset, results = coco_map.as_coco(ITEMS, FOUND, len(CLASSES))
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = dataset
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return evaluation.stats[0], evaluation.stats[1], evaluation.eval["precision"]


def test_labruns_map_equals_pycocotools_cocoeval():
    figures = coco_map.coco_map(ITEMS, FOUND, CLASSES)
    assert figures["evaluator"] == "faster-coco-eval"
    expected_map, expected_50, precision = pycocotools_figures()
    assert 0.2 < expected_map < 0.9  # a fixture with hits and misses, not all or nothing
    assert figures["map"] == pytest.approx(expected_map, abs=1e-6)
    assert figures["map_50"] == pytest.approx(expected_50, abs=1e-6)
    for index, name in enumerate(CLASSES):
        per_class = precision[:, :, index, 0, -1]
        assert figures[f"ap/{name}"] == pytest.approx(per_class[per_class > -1].mean(), abs=1e-6)
    assert figures["ap/circle"] != figures["ap/square"]


def test_without_faster_coco_eval_pycocotools_gives_the_same_figures(monkeypatch):
    real_import = builtins.__import__

    def no_faster(name, *args, **kwargs):
        if name.startswith("faster_coco_eval"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    faster = coco_map.coco_map(ITEMS, FOUND, CLASSES)
    monkeypatch.setattr(builtins, "__import__", no_faster)
    slow = coco_map.coco_map(ITEMS, FOUND, CLASSES)
    assert slow["evaluator"] == "pycocotools" and slow["evaluator_version"]
    for key in ("map", "map_50", "ap/circle", "ap/square"):
        assert slow[key] == pytest.approx(faster[key], abs=1e-6), key


def test_a_detection_matched_to_a_crowd_region_is_no_false_positive():
    """Image 1's crowd region (40, 40, 95, 75) and the detection on it: COCOeval ignores the
    pair. Counted as a real object, the detection would be a true positive and raise the AP;
    without the crowd flag the figure moves."""
    as_crowd = coco_map.coco_map(ITEMS, FOUND, CLASSES)["ap/circle"]
    plain = [ITEMS[0], item([[5, 5, 30, 30], [40, 40, 95, 75]], [0, 0]), ITEMS[2]]
    assert coco_map.coco_map(plain, FOUND, CLASSES)["ap/circle"] != pytest.approx(as_crowd)


def test_no_detection_at_all_scores_zero():
    none = [Detections(np.zeros((0, 4)), np.zeros(0, int), np.zeros(0))] * len(ITEMS)
    figures = coco_map.coco_map(ITEMS, none, CLASSES)
    assert (figures["map"], figures["map_50"], figures["ap/circle"]) == (0.0, 0.0, 0.0)
