"""`labrun bench det-map`: the COCO box mAP of a validation, labrun's evaluator against
pycocotools' COCOeval, on the same ground truth and detections.

Generated and seeded: --images images of 640x480, each with a few ground-truth boxes of
--classes classes (one in fifty a crowd region, which both ignore), and --detections per image,
most of them ground-truth boxes jittered by a few percent of their size (some of them with
another class), the rest random false positives, with random scores. Both sides evaluate them
from the same in-memory labrun objects (boxes.Objects and coco_map.Detections, what a
validation holds), through labrun.train.coco_map.coco_map, the function a run calls: the
ground truth and the detections made into COCO's dictionaries, the COCO objects built
(createIndex, loadRes), evaluate, accumulate and summarize, and each class's AP read from the
precision array:
  1. pycocotools: coco_map with pycocotools' COCO and COCOeval, the evaluator it falls back to
     where faster-coco-eval is missing, so that its every step is the one labrun runs;
  2. labrun: coco_map as a run calls it (faster-coco-eval's COCO and COCOeval_faster).
Both must agree on mAP@[.5:.95] and mAP@.5 to 1e-6, or the benchmark stops (two evaluators that
disagree time nothing comparable). speedup = pycocotools seconds / labrun seconds, each its best
of --rounds interleaved rounds (DET_MAP_TARGETS: goal >= 5). Both print progress and tables
(pycocotools to stdout, faster-coco-eval through logging): coco_map silences both, so the
output stays a table.

This is a module of its own, not part of det_data.py: it times an evaluator, not a loader,
shares none of its code or arguments, and det_data.py is long enough.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from labrun.bench import write_json
from labrun.bench.targets import Target, Verdict, judge
from labrun.core.errors import LabrunError

WIDTH, HEIGHT = 640, 480  # the generated images' size: COCO's typical one
CROWD = 0.02  # the share of ground-truth boxes that are crowd regions (COCO: about 1%)
TRUE_SHARE = 0.3  # of an image's detections, the share made from its ground truth
TOLERANCE = 1e-6  # how far the two mAPs may differ

# The goal: labrun's evaluation 5x as fast as pycocotools' on the same detections. The floor:
# five runs of `labrun bench det-map` here (2 cores shared with other engineers' tests, load
# 2-3) gave 4.41 4.82 4.08 4.43 4.05 (pycocotools 3.3-3.8 s, labrun 0.74-0.89 s; both mAP
# 0.127487, mAP@.5 0.186083), the worst moved by targets.MARGIN (15%: the runs spread by 19%)
# -> 3.4. About 0.6 s of labrun's is Python both sides share (as_coco, loadRes), which holds the
# ratio under the goal. It catches labrun falling back to pycocotools (a ratio of 1) or a slower
# path around faster-coco-eval that costs a quarter of its speed; a smaller loss passes it.
DET_MAP_TARGETS = (Target("speedup", ">=", floor=3.4, goal=5.0, of=("pycocotools", "labrun"),
                          runs=(4.41, 4.82, 4.08, 4.43, 4.05)),)

log = logging.getLogger(__name__)


def configure_det_map(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--images", type=int, default=500, metavar="N",
                        help="generated images (default: 500)")
    parser.add_argument("--classes", type=int, default=8, help="classes (default: 8)")
    parser.add_argument("--boxes", type=int, default=7, metavar="B",
                        help="ground-truth boxes an image, at most (at least 1; default: 7)")
    parser.add_argument("--detections", type=int, default=100, metavar="D",
                        help="detections an image (default: 100, COCO's maximum)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; each side keeps its best (default: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE as JSON")


def run_det_map(args: argparse.Namespace) -> list[Verdict]:
    from rich.console import Console

    from labrun.train.coco_map import coco_map, evaluator

    console = Console(soft_wrap=True)
    for flag in ("images", "classes", "boxes", "detections", "rounds"):
        if getattr(args, flag) <= 0:
            raise LabrunError(f"--{flag} must be a positive number")
    name, _, _ = evaluator()
    if name != "faster-coco-eval":
        raise LabrunError("faster-coco-eval is not installed: labrun's evaluator is then "
                          "pycocotools itself; install it (pip install faster-coco-eval)")
    items, detections = generate(args.images, args.classes, args.boxes, args.detections,
                                 args.seed)
    class_names = [f"class{c}" for c in range(args.classes)]
    console.print(f"labrun bench det-map: {args.images} images of {WIDTH}x{HEIGHT}, "
                  f"{args.classes} classes, {sum(len(i.objects) for i in items)} ground-truth "
                  f"boxes, {sum(len(d.scores) for d in detections)} detections (seed "
                  f"{args.seed}); COCO box mAP, best of {args.rounds} round(s)", highlight=False)
    sides = {"pycocotools": lambda: pycocotools_map(items, detections, class_names),
             "labrun": lambda: coco_map(items, detections, class_names)}
    seconds, maps = dict.fromkeys(sides, float("inf")), {}
    for round_number in range(args.rounds):
        for side, evaluate in sides.items():
            start = time.perf_counter()
            figures = evaluate()
            seconds[side] = min(seconds[side], time.perf_counter() - start)
            maps[side] = (float(figures["map"]), float(figures["map_50"]))
            log.info(f"  round {round_number + 1}: {side:<12} {seconds[side]:8.3f} s "
                     f"(best so far)")
    check_agree(maps)
    results = {**seconds, "map": maps["labrun"][0], "map_50": maps["labrun"][1],
               "speedup": seconds["pycocotools"] / seconds["labrun"]}
    print_results(console, results)
    write_json(args.json, {k: round(v, 6) for k, v in results.items()})
    return judge("det-map", results, DET_MAP_TARGETS)


def pycocotools_map(items, detections, class_names) -> dict:
    """coco_map with pycocotools' COCO and COCOeval, the evaluator it falls back to where
    faster-coco-eval is missing (its evaluator() answers them while this runs): every step the
    one a run takes, on the other library."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from labrun.train import coco_map as module

    chosen = module.evaluator
    module.evaluator = lambda: ("pycocotools", COCO, COCOeval)
    try:
        return module.coco_map(items, detections, class_names)
    finally:
        module.evaluator = chosen


def check_agree(maps: dict[str, tuple[float, float]]) -> None:
    """LabrunError unless both evaluators give the same mAP@[.5:.95] and mAP@.5."""
    for index, figure in enumerate(("mAP@[.5:.95]", "mAP@.5")):
        ours, theirs = maps["labrun"][index], maps["pycocotools"][index]
        if not abs(ours - theirs) <= TOLERANCE:
            raise LabrunError(f"the evaluators disagree: {figure} {ours:.9f} (labrun) against "
                              f"{theirs:.9f} (pycocotools); their times compare nothing")


def print_results(console, results: dict[str, float]) -> None:
    from rich.table import Table

    table = Table(title="seconds for one evaluation (both: mAP "
                        f"{results['map']:.4f}, mAP@.5 {results['map_50']:.4f})",
                  title_justify="left")
    table.add_column("evaluator")
    table.add_column("seconds", justify="right")
    rows = {"pycocotools": "1 pycocotools COCOeval", "labrun": "2 labrun (faster-coco-eval)"}
    for key, label in rows.items():
        table.add_row(label, f"{results[key]:.3f}")
    console.print(table)
    console.print(f"speedup (1/2): {results['speedup']:.2f}", highlight=False)


# ---------------------------------------------------------------------------------------------
# Ground truth and detections


def generate(images: int, classes: int, max_boxes: int, per_image: int, seed: int):
    """(items with width, height and objects, as coco_map takes them; Detections per item)."""
    from labrun.data.detection import DetectionItem
    from labrun.data.detection.boxes import Objects
    from labrun.train.coco_map import Detections

    rng = np.random.default_rng(seed)
    items, detections = [], []
    for index in range(images):
        truth = random_boxes(rng, int(rng.integers(1, max_boxes + 1)))
        labels = rng.integers(0, classes, len(truth))
        objects = Objects(truth, labels.astype(np.int64), rng.random(len(truth)) < CROWD)
        items.append(DetectionItem(path=None, width=WIDTH, height=HEIGHT, objects=objects,
                                   image_id=index))
        # Found objects: ground truth jittered by up to 10% of its sides (a few of another
        # class); the rest false positives anywhere. Scores are random: no ties.
        found = int(round(per_image * TRUE_SHARE))
        picks = rng.integers(0, len(truth), found)
        sides = np.tile(truth[picks, 2:] - truth[picks, :2], (1, 2))  # w h w h
        near = truth[picks] + rng.uniform(-0.1, 0.1, (found, 4)) * sides
        near_labels = np.where(rng.random(found) < 0.1, rng.integers(0, classes, found),
                               labels[picks])
        boxes = np.concatenate([near, random_boxes(rng, per_image - found)])
        boxes = np.clip(boxes, 0, [WIDTH, HEIGHT, WIDTH, HEIGHT]).astype(np.float32)
        detections.append(Detections(boxes, np.concatenate(
            [near_labels, rng.integers(0, classes, per_image - found)]).astype(np.int64),
            rng.random(per_image).astype(np.float32)))
    return items, detections


def random_boxes(rng: np.random.Generator, count: int) -> np.ndarray:
    """float32 [count, 4] x1 y1 x2 y2 inside the image, 10 to 300 pixels a side: small, medium
    and large objects, as COCOeval's areas split them."""
    size = rng.uniform(10, 300, (count, 2))
    corner = rng.uniform(0, 1, (count, 2)) * ([WIDTH, HEIGHT] - size)
    return np.concatenate([corner, corner + size], axis=1).astype(np.float32)
