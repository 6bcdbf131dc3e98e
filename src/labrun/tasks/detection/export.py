"""A detector's export plan (labrun.deploy.export.Plan): FCOSGraph with the checkpoint's
weights, its metadata, and the parity check of the exported file against the eager detector by
matched boxes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from labrun.config.dataset_schema import DetectionDatasetConfig
from labrun.core.errors import LabrunError, one_line
from labrun.data.detection import transforms
from labrun.deploy.export import BATCH_AXIS, Plan, Target, build_data, build_model
from labrun.tasks.detection.graph import COLUMNS, OUTPUT, FCOSGraph, Found, graph_of, split_rows

log = logging.getLogger(__name__)

# The legacy exporter first: torchvision's documented path for its detectors, twice as fast as
# dynamo here for the same file's figures (module docstring); dynamo when it fails.
EXPORTERS = ("legacy", "dynamo")
PARITY_IMAGES = 16
# A detection of the exported file matches eager PyTorch's: the same class, a box of IoU at
# least MIN_IOU and a score within SCORE_TOLERANCE (fp32 kernels differ in summation order only).
MIN_IOU = 0.99
SCORE_TOLERANCE = 1e-3


def settings(dataset: dict[str, Any]) -> dict[str, Any]:
    """What a served model needs of the run's dataset section (the schema's defaults for keys
    an old config lacks; in-memory datasets name no decoder: the default one)."""
    default = DetectionDatasetConfig()
    return {"image_size": int(dataset.get("image_size", default.image_size)),
            "pad_value": transforms.PAD_VALUE,
            "decoder": str(dataset.get("decoder", "turbojpeg"))}


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Letterboxed images in [0, 1] in, D x 7 detections out, the batch dynamic; checked on
    the run's val images against the eager detector."""
    if "class_names" not in state:
        raise LabrunError(f"{checkpoint}: the checkpoint has no 'class_names' entry; export "
                          f"needs a checkpoint written by labrun's trainer")
    cfg = state["config"]
    prep = settings(cfg.get("dataset", {}))
    sizes = {"num_classes": len(state["class_names"]), "image_size": prep["image_size"]}
    detector = build_model(cfg, sizes, state["model"], checkpoint)
    graph = graph_of(detector, prep["image_size"],
                     str(cfg["model"].get("name") or cfg["model"].get("_target_"))).eval()
    meta = metadata(state, graph, prep)
    check = None
    if target.check_data is not None:
        images = parity_images(cfg.get("dataset", {}), meta, target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, images, meta)

    example = torch.rand(2, 3, prep["image_size"], prep["image_size"],
                         generator=torch.Generator().manual_seed(0))
    return Plan(graph, example.to(device=target.device, dtype=target.dtype), BATCH_AXIS, check,
                report_parity, meta, output=OUTPUT, output_axes={0: OUTPUT},
                exporters=EXPORTERS)


def metadata(state: dict[str, Any], graph: FCOSGraph, prep: dict[str, Any]) -> dict[str, Any]:
    """What the export's metadata carries for serving, beside the keys every export has."""
    class_names = list(state["class_names"])
    size = prep["image_size"]
    return {"input": {"name": "input", "shape": ["batch", 3, size, size], "layout": "NCHW",
                      "values": f"uint8 RGB / 255, letterboxed: the image scaled so that its "
                                f"long side is {size} (aspect kept), centred on a {size} x "
                                f"{size} canvas of gray {prep['pad_value']}"},
            "output": {"name": OUTPUT, "shape": [OUTPUT, len(COLUMNS)], "columns": list(COLUMNS),
                       "values": "a row per detection of the batch: its image's index, the box "
                                 "in the input's pixels, its score and its label (class index "
                                 "+ 1; 0 is the background); each image's rows by score, "
                                 "highest first"},
            "class_names": class_names, "num_classes": len(class_names),
            "label_offset": 1, **prep,
            "score_threshold": graph.score_threshold, "nms_threshold": graph.nms_threshold,
            "detections_per_image": graph.detections_per_image}


def parity_images(dataset: dict[str, Any], meta: dict[str, Any], data: str
                  ) -> tuple[list[torch.Tensor], str]:
    """uint8 3 x S x S images: the run's val images letterboxed as its val loader makes them,
    or seeded random ones when those cannot be read; with where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            return validation_images(dataset, meta["image_size"])
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random input
            reason = f"validation images unavailable: {one_line(error)}"
    size = meta["image_size"]
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (PARITY_IMAGES, 3, size, size), dtype=torch.uint8,
                           generator=generator)
    return list(images), f"{PARITY_IMAGES} random images ({reason})"


def validation_images(dataset: dict[str, Any], size: int) -> tuple[list[torch.Tensor], str]:
    """Validation images spread over the split, through the run's own data: the same source
    and letterbox as its val loader (DetectionDataset)."""
    source = build_data(dataset).splits["val"]
    indices = np.unique(np.linspace(0, len(source) - 1, PARITY_IMAGES).round().astype(int))
    images = [transforms.letterbox(*source.open(int(i)), size)[0] for i in indices]
    return images, f"{len(indices)} validation images of {source.name}"


def matched(eager: Found, exported: Found) -> tuple[list[tuple[int, int]], float]:
    """Pairs (eager, exported) of detections that match (same class, IoU >= MIN_IOU, scores
    within SCORE_TOLERANCE), greedily by eager score; and the lowest IoU of a pair."""
    from torchvision.ops import box_iou

    if len(eager.scores) == 0 or len(exported.scores) == 0:
        return [], 1.0
    iou = box_iou(eager.boxes.float(), exported.boxes.float())
    fits = ((iou >= MIN_IOU) & (eager.labels[:, None] == exported.labels[None, :])
            & ((eager.scores[:, None] - exported.scores[None, :]).abs() <= SCORE_TOLERANCE))
    pairs, taken, lowest = [], set(), 1.0
    for i in range(len(eager.scores)):
        candidates = [j for j in torch.nonzero(fits[i]).flatten().tolist() if j not in taken]
        if candidates:
            j = max(candidates, key=lambda c: float(iou[i, c]))
            taken.add(j)
            pairs.append((i, j))
            lowest = min(lowest, float(iou[i, j]))
    return pairs, lowest


def at_margin(found: Found, index: int, meta: dict[str, Any]) -> bool:
    """Whether a detection lies where a difference within SCORE_TOLERANCE could keep it on
    one side and drop it on the other: at the score threshold, or at the lowest score of an
    image that has its detections_per_image."""
    score = float(found.scores[index])
    if score <= meta["score_threshold"] + SCORE_TOLERANCE:
        return True
    full = len(found.scores) >= meta["detections_per_image"]
    return full and score <= float(found.scores.min()) + SCORE_TOLERANCE


def describe_detection(found: Found, index: int, meta: dict[str, Any]) -> str:
    label = int(found.labels[index])
    name = meta["class_names"][label - 1] if label >= 1 else "background"
    box = ", ".join(f"{v:.1f}" for v in found.boxes[index].tolist())
    return f"{name} {float(found.scores[index]):.4f} at ({box})"


def parity(path: Path, target: Target, reference: FCOSGraph,
           images: tuple[list[torch.Tensor], str], meta: dict[str, Any]) -> dict[str, Any]:
    """The exported file in its runtime against the eager detector (its own forward, as
    evaluation runs it), on the images as one batch and on the first alone (which proves the
    batch axis dynamic). Every detection on either side must match one on the other, except
    at a margin (at_margin): there a score within the tolerance may fall either way."""
    pictures, images_from = images
    run = target.runtime(path)
    batches = [torch.stack(pictures), pictures[0][None]]
    counts = {"eager": 0, "exported": 0, "matched": 0, "unmatched_at_margin": 0}
    unmatched, lowest_iou, score_diff, box_diff = [], 1.0, 0.0, 0.0
    for batch in batches:
        x = batch.to(target.device).float().div_(255)
        with torch.inference_mode():
            answers = reference.eager(x)
        exported = split_rows(run(x.to(target.dtype).cpu().numpy()), len(batch))
        for i, (answer, theirs) in enumerate(zip(answers, exported, strict=True)):
            ours = Found(answer["boxes"].float().cpu(), answer["scores"].float().cpu(),
                         answer["labels"].cpu())
            pairs, lowest = matched(ours, theirs)
            lowest_iou = min(lowest_iou, lowest)
            for a, b in pairs:
                score_diff = max(score_diff, abs(float(ours.scores[a] - theirs.scores[b])))
                box_diff = max(box_diff, float((ours.boxes[a] - theirs.boxes[b]).abs().max()))
            counts["eager"] += len(ours.scores)
            counts["exported"] += len(theirs.scores)
            counts["matched"] += len(pairs)
            for side, found, paired in (("eager", ours, {a for a, _ in pairs}),
                                        ("exported", theirs, {b for _, b in pairs})):
                for k in set(range(len(found.scores))) - paired:
                    if at_margin(found, k, meta):
                        counts["unmatched_at_margin"] += 1
                    else:
                        unmatched.append(f"{side} image {i} of the batch of {len(batch)}: "
                                         f"{describe_detection(found, k, meta)}")
    passed = not unmatched
    return {"images": len(pictures), "images_from": images_from,
            "shapes": [list(batch.shape) for batch in batches], **counts,
            "unmatched": len(unmatched), "min_iou": lowest_iou, "max_score_diff": score_diff,
            "max_box_diff": box_diff, "iou_needed": MIN_IOU, "score_tolerance": SCORE_TOLERANCE,
            "passed": passed,
            "failure": None if passed else (
                f"parity check failed: {len(unmatched)} of {counts['eager']} eager and "
                f"{counts['exported']} exported detections have no match (same class, IoU >= "
                f"{MIN_IOU}, score within {SCORE_TOLERANCE:g}), first {unmatched[0]}")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    shapes = " and ".join("x".join(map(str, shape)) for shape in check["shapes"])
    log.info(f"parity ({exporter}): {check['images_from']}, input {shapes}: {check['matched']} "
             f"of {check['eager']} eager and {check['exported']} exported detections matched "
             f"({check['unmatched_at_margin']} unmatched at the score margin, "
             f"{check['unmatched']} elsewhere), IoU >= {check['min_iou']:.5f}, max score diff "
             f"{check['max_score_diff']:.2e}, max box diff {check['max_box_diff']:.2e} px "
             f"-> {verdict}")
