"""An object detector's life after training (labrun.train.task.Detection's deploy hooks,
labrun.deploy.hooks): what its export takes and returns, how it is served and predicted.

    export   export_plan     images in, detections out, with the model's box decoding and
                             non-maximum suppression inside the graph (FCOSGraph)
             input           float32 B x 3 x S x S in [0, 1] (uint8 RGB / 255), each image
                             letterboxed as validation made it: scaled so that its long side is
                             S = image_size (aspect kept, antialiased bilinear) and centred on an
                             S x S canvas of gray pad_value (114); the batch B is dynamic
             output          "detections", float32 D x 7, a row per detection of the whole
                             batch: (image, x1, y1, x2, y2, score, label), image the row's index
                             in the batch, the box in the S x S input's pixels, label counting
                             from 1 (torchvision's 0 is the background), each image's rows by
                             score, highest first, at most detections_per_image of them
             parity          the exported file in its runtime against the eager detector (its
                             own forward, as evaluation runs it) on the run's val images, at the
                             whole batch and at a batch of one: each detection matched by a box
                             of IoU >= MIN_IOU, the same class and a score within
                             SCORE_TOLERANCE (module constants)
             metadata        class names, image_size, pad_value, score and NMS thresholds,
                             detections_per_image, the input's and output's description, decoder
    serving  Detector        the exported file in its runtime: image bytes in, letterboxed
                             exactly as validation does, boxes out in the image's OWN pixels
                             (the letterbox undone: its offsets taken off, its scale divided out)
             add_routes      POST /predict?score_threshold=&max_detections= (multipart field
                             `file`) -> {"boxes": [[x1, y1, x2, y2], ...], "labels": [names],
                             "label_ids": [class indices], "scores": [...]}; /predict/batch
                             (fields `files`): one such answer per file, with its filename
    predict  IMAGE_OR_DIR... --out DIR: DIR/<stem>.json (the answer, with the image's size) and
             DIR/<stem>_overlay.png (the boxes drawn with their class names and scores) of each
             image, and a line `path  N boxes: class score ...`

Why the whole batch goes through one graph: torchvision's own postprocessing loops over the
images in Python, which a trace unrolls into a graph of the example's batch size only. FCOSGraph
does the same steps as FCOS.postprocess_detections for the whole batch at once (per level: the
scores, the top candidates, decoding, clipping; then one NMS over every image and class, kept
apart by offsetting each (image, class)'s boxes, as torchvision's batched_nms offsets each class),
so the batch axis stays dynamic and `labrun serve`'s batcher gives concurrent requests one model
call. Only FCOS detectors export (model=fcos, or model=torchvision_det with name=
fcos_resnet50_fpn); the other torchvision detectors are refused with a message saying so.

ONNX goes through the legacy (TorchScript-based) exporter first, the path torchvision documents
for its detectors (opset >= 11: its NMS is registered as ONNX's NonMaxSuppression), and the
dynamo exporter when it fails: both pass the parity check exactly alike (experiment=det_shapes'
FCOS, 16 val images: every detection matched, scores within 6e-7), and the legacy one exports in
half the time (11 s against 22 s on a loaded 2-core machine). TorchScript traces the same graph
(loading it needs torchvision's ops, which Detector imports).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from fastapi import File, Query, Response, UploadFile

from labrun.config.dataset_schema import DetectionDatasetConfig
from labrun.core.errors import LabrunError, one_line
from labrun.data.detection import transforms
from labrun.data.detection.boxes import Objects
from labrun.data.image import decode as data_decode
from labrun.data.image.transforms import as_rgb, resize_region
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.deploy.export import BATCH_AXIS, Plan, Target, build_data, build_model
from labrun.tasks.mask_images import palette

log = logging.getLogger(__name__)

TASK = "detection"
REQUIRED_KEYS = ("class_names", "image_size", "pad_value", "score_threshold",
                 "detections_per_image")
USAGE = ("POST /predict?score_threshold=&max_detections= with multipart field 'file' "
         "(POST /predict/batch: fields 'files'), for boxes")
OUTPUT = "detections"
COLUMNS = ("image", "x1", "y1", "x2", "y2", "score", "label")
# The legacy exporter first: torchvision's documented path for its detectors, twice as fast as
# dynamo here for the same file's figures (module docstring); dynamo when it fails.
EXPORTERS = ("legacy", "dynamo")
PARITY_IMAGES = 16
# A detection of the exported file matches eager PyTorch's: the same class, a box of IoU at
# least MIN_IOU and a score within SCORE_TOLERANCE (fp32 kernels differ in summation order only).
MIN_IOU = 0.99
SCORE_TOLERANCE = 1e-3
Threshold = Annotated[float | None, Query(ge=0, le=1, description=(
    "the lowest score answered (default: the export's score_threshold, below which the model "
    "answers nothing)"))]
MaxDetections = Annotated[int | None, Query(ge=1, le=10_000, description=(
    "the most boxes answered, highest scores first (default: the export's "
    "detections_per_image)"))]


# ---------------------------------------------------------------------------------------------
# Export


def settings(dataset: dict[str, Any]) -> dict[str, Any]:
    """What a served model needs of the run's dataset section (the schema's defaults for keys
    an old config lacks; in-memory datasets name no decoder: the default one)."""
    default = DetectionDatasetConfig()
    return {"image_size": int(dataset.get("image_size", default.image_size)),
            "pad_value": transforms.PAD_VALUE,
            "decoder": str(dataset.get("decoder", "turbojpeg"))}


class FCOSGraph(torch.nn.Module):
    """torchvision's FCOS in eval mode, for a batch of S x S images in [0, 1], as one graph:
    its normalisation, padding to its size_divisible, backbone and head, then its
    postprocess_detections for the whole batch at once (module docstring), answering the
    D x 7 detections (COLUMNS). Its anchors depend on S alone: made once, here."""

    def __init__(self, model: torch.nn.Module, image_size: int):
        super().__init__()
        from torchvision.models.detection.image_list import ImageList

        transform = model.transform
        if (transform.fixed_size is not None or tuple(transform.min_size) != (image_size,)
                or transform.max_size != image_size):
            raise LabrunError(f"the detector resizes its input (min_size {transform.min_size}, "
                              f"max_size {transform.max_size}) where the data's images are "
                              f"{image_size} px: export takes detectors built at "
                              f"dataset.image_size, as model=fcos is")
        self.model = model
        self.size = image_size
        divisible = int(transform.size_divisible)
        padded = -(-image_size // divisible) * divisible
        self.pad = padded - image_size  # bottom and right, as torchvision's batch_images pads
        self.register_buffer("mean", torch.tensor(transform.image_mean).view(1, -1, 1, 1),
                             persistent=False)
        self.register_buffer("std", torch.tensor(transform.image_std).view(1, -1, 1, 1),
                             persistent=False)
        with torch.no_grad():
            blank = torch.zeros(1, 3, padded, padded)
            features = list(model.backbone(blank).values())
            anchors = model.anchor_generator(ImageList(blank, [(image_size, image_size)]),
                                             features)[0]
        self.register_buffer("anchors", anchors, persistent=False)
        self.level_sizes = [f.shape[2] * f.shape[3] for f in features]  # one anchor a place
        self.num_classes = int(model.head.classification_head.num_classes)  # with background
        self.score_threshold = float(model.score_thresh)
        self.nms_threshold = float(model.nms_thresh)
        self.detections_per_image = int(model.detections_per_img)
        self.candidates = int(model.topk_candidates)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        import torchvision
        from torchvision.ops import boxes as box_ops

        model, classes = self.model, self.num_classes
        x = (images - self.mean) / self.std
        if self.pad:
            x = F.pad(x, (0, self.pad, 0, self.pad))
        head = model.head(list(model.backbone(x).values()))
        logits, regression, centerness = (head["cls_logits"], head["bbox_regression"],
                                          head["bbox_ctrness"])
        boxes, scores, labels = [], [], []
        start = 0
        for places in self.level_sizes:
            end = start + places
            # As postprocess_detections: each (place, class)'s score, flattened place-major.
            level = torch.sqrt(torch.sigmoid(logits[:, start:end])
                               * torch.sigmoid(centerness[:, start:end])).flatten(1)
            # Its top candidates, then those above the threshold (below): the same set as
            # torchvision's top candidates among those above it.
            top, index = level.topk(min(self.candidates, places * classes), dim=1)
            place = torch.div(index, classes, rounding_mode="floor")
            codes = regression[:, start:end].gather(1, place.unsqueeze(-1).expand(-1, -1, 4))
            decoded = model.box_coder.decode(codes, self.anchors[start:end][place])
            boxes.append(box_ops.clip_boxes_to_image(decoded, (self.size, self.size)))
            scores.append(top)
            labels.append(index % classes)
            start = end
        boxes, scores, labels = torch.cat(boxes, 1), torch.cat(scores, 1), torch.cat(labels, 1)
        image = torch.ones_like(labels).cumsum(0) - 1  # each candidate's image in the batch
        boxes, scores = boxes.reshape(-1, 4), scores.reshape(-1)
        labels, image = labels.reshape(-1), image.reshape(-1)
        keep = torch.where(scores > self.score_threshold)[0]
        boxes, scores, labels, image = boxes[keep], scores[keep], labels[keep], image[keep]
        # One NMS for every image and class: each (image, class) apart from the others by an
        # offset larger than any box (boxes lie within 0..S), as batched_nms keeps classes apart.
        offsets = (image * classes + labels).to(boxes.dtype) * (self.size + 1)
        kept = torchvision.ops.nms(boxes + offsets[:, None], scores, self.nms_threshold)
        # Kept by score, highest first: each image's first detections_per_image of them.
        image = image[kept]
        batch = torch.ones_like(images[:, 0, 0, 0], dtype=torch.int64).cumsum(0) - 1
        mine = (image[:, None] == batch[None, :]).to(torch.int64)  # D x B
        rank = (mine.cumsum(0) * mine).sum(1) - 1  # the row's place among its image's rows
        within = torch.where(rank < self.detections_per_image)[0]
        kept, image = kept[within], image[within]
        return torch.cat([image.to(boxes.dtype)[:, None], boxes[kept], scores[kept][:, None],
                          labels[kept].to(boxes.dtype)[:, None]], 1)

    def eager(self, images: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """The detector's own eager answer for the batch: what evaluation scores."""
        return self.model(images)


def graph_of(model: torch.nn.Module, image_size: int, name: str) -> FCOSGraph:
    from torchvision.models.detection import FCOS

    if not isinstance(model, FCOS):
        raise LabrunError(f"{name} ({type(model).__name__}) has no export with its decoding "
                          f"and NMS in the graph yet: FCOS detectors export (model=fcos, or "
                          f"model=torchvision_det model.name=fcos_resnet50_fpn)")
    return FCOSGraph(model, image_size)


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


class Found(NamedTuple):
    """One image's detections: boxes N x 4, scores N, labels N (1-based), by score."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor


def split_rows(rows: np.ndarray | torch.Tensor, count: int) -> list[Found]:
    """The output's rows (COLUMNS) as each of `count` images' detections, in order."""
    rows = torch.as_tensor(np.asarray(rows, dtype=np.float32)).reshape(-1, len(COLUMNS))
    image = rows[:, 0].round().long()
    return [Found(rows[image == i, 1:5], rows[image == i, 5], rows[image == i, 6].round().long())
            for i in range(count)]


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


# ---------------------------------------------------------------------------------------------
# Serving


class Letterbox(NamedTuple):
    """Where an image went on the model's canvas: x_model = x * scale_x + left (y likewise)."""

    scale_x: float
    scale_y: float
    left: float
    top: float


class Prepared(NamedTuple):
    image: torch.Tensor  # uint8 3 x S x S, what the model sees (validation's letterbox)
    size: tuple[int, int]  # the picture's own height and width
    place: Letterbox  # how to take a box back to the picture's pixels
    picture: Any  # the decoded picture (pixels, or a JPEG decoded on demand): for an overlay


def letterboxed(picture: Any, size: int) -> tuple[torch.Tensor, Letterbox]:
    """The picture letterboxed by validation's own transform, and where it went: the whole
    picture as a box, moved by the same transform, gives its scale and offsets."""
    height, width = picture.shape[:2]
    whole = Objects(np.array([[0, 0, width, height]], np.float32), np.zeros(1, np.int64))
    image, moved = transforms.letterbox(picture, whole, size)
    x1, y1, x2, y2 = (float(v) for v in moved.boxes[0])
    return image, Letterbox((x2 - x1) / width, (y2 - y1) / height, x1, y1)


class Detector:
    """An exported detector (labrun export of a task=detection run), from the metadata alone:
    an image in, its boxes in its own pixels out."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = meta = runtime.read_metadata(self.model_path, task=TASK)
        self.class_names: list[str] = list(meta["class_names"])
        self.size = int(meta["image_size"])
        self.score_threshold = float(meta["score_threshold"])
        self.max_detections = int(meta["detections_per_image"])
        self.dtype = torch.float16 if meta.get("dtype") == "float16" else torch.float32
        self.decoder = data_decode.resolve(meta.get("decoder", "turbojpeg"))
        # Each class's colour in an overlay: VOC's, from 1 (0 is black, the background's).
        self.colours = [tuple(c) for c in palette(self.num_classes + 1)[1:]]
        if meta["format"] == "torchscript":
            import torchvision  # noqa: F401 - registers torchvision::nms, which the graph calls
        self.runtime = runtime.open_runtime(self.model_path, meta["format"], threads)
        # One real inference now: a model that cannot run fails at start-up, not per request.
        self.detect([torch.full((3, self.size, self.size), int(meta["pad_value"]),
                                dtype=torch.uint8)])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> str:
        """Where the model runs: "cuda" or "cpu"."""
        return self.runtime.device

    def prepare(self, data: bytes) -> Prepared:
        """Image bytes -> what the model sees of them, as the run's val loader made it: its
        decoder, then the letterbox. ImageError for bytes that are not an image."""
        picture = as_rgb(runtime.open_image(data, self.decoder))
        height, width = picture.shape[:2]
        try:  # a JPEG decodes here
            image, place = letterboxed(picture, self.size)
        except Exception as error:  # noqa: BLE001 - whatever a decoder raises, the file is bad
            raise runtime.ImageError(f"corrupt or truncated image ({one_line(error)})") from None
        return Prepared(image, (height, width), place, picture)

    def detect(self, images: list[torch.Tensor]) -> list[Found]:
        """Each letterboxed image's detections in the model's pixels, in order, from one model
        call for them all. The batcher's call."""
        batch = torch.stack(images).float().div_(255).to(self.dtype)
        return split_rows(self.runtime(batch.numpy()), len(images))

    def answer(self, found: Found, prepared: Prepared, score_threshold: float | None = None,
               max_detections: int | None = None) -> dict[str, Any]:
        """POST /predict's answer: the image's classes' boxes (the background's left out) at
        score_threshold or above, at most max_detections, highest scores first, in the
        picture's own pixels."""
        threshold = self.score_threshold if score_threshold is None else score_threshold
        limit = self.max_detections if max_detections is None else max_detections
        keep = torch.nonzero((found.labels >= 1) & (found.scores >= threshold)).flatten()[:limit]
        boxes = found.boxes[keep].double()
        place = prepared.place
        height, width = prepared.size
        boxes[:, 0::2] = ((boxes[:, 0::2] - place.left) / place.scale_x).clamp(0, width)
        boxes[:, 1::2] = ((boxes[:, 1::2] - place.top) / place.scale_y).clamp(0, height)
        ids = (found.labels[keep] - 1).tolist()
        return {"boxes": [[round(v, 3) for v in box] for box in boxes.tolist()],
                "labels": [self.class_names[i] for i in ids], "label_ids": ids,
                "scores": [round(float(s), 6) for s in found.scores[keep]]}

    def detections(self, data: bytes, score_threshold: float | None = None,
                   max_detections: int | None = None) -> dict[str, Any]:
        """Image bytes -> its answer (as POST /predict gives it)."""
        prepared = self.prepare(data)
        return self.answer(self.detect([prepared.image])[0], prepared, score_threshold,
                           max_detections)

    def overlay_png(self, picture: Any, answer: dict[str, Any]) -> bytes:
        """The picture (as Prepared holds it) with the answer's boxes drawn, each with its
        class name and score, in its class's colour."""
        from PIL import Image, ImageDraw

        height, width = picture.shape[:2]
        pixels = resize_region(picture, 0, 0, height, width, height, width).permute(1, 2, 0)
        image = Image.fromarray(np.ascontiguousarray(pixels.numpy()))
        draw = ImageDraw.Draw(image)
        line = max(1, round(max(width, height) / 250))
        for box, name, index, score in zip(answer["boxes"], answer["labels"],
                                           answer["label_ids"], answer["scores"], strict=True):
            colour = self.colours[index]
            draw.rectangle(box, outline=colour, width=line)
            text = f"{name} {score:.2f}"
            left, top, right, bottom = draw.textbbox((0, 0), text)
            x = box[0]
            y = box[1] - (bottom - top) - 2  # above the box, or inside it at the top edge
            y = y if y >= 0 else box[1]
            draw.rectangle((x, y, x + right - left + 2, y + bottom - top + 2), fill=colour)
            draw.text((x + 1 - left, y + 1 - top), text, fill=(255, 255, 255))
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()


def load(path: Path, threads: int | None = None) -> Detector:
    return Detector(path, threads)


def describe(detector: Detector) -> str:
    return (f"detection, {detector.num_classes} classes, {detector.size} px letterboxed, "
            f"score >= {detector.score_threshold:g}, at most {detector.max_detections} boxes")


def health(detector: Detector) -> dict[str, Any]:
    return {"num_classes": detector.num_classes, "image_size": detector.size}


def add_routes(app, detector: Detector, server) -> None:
    # The batcher's call: concurrent requests' letterboxed images in one model call (the
    # graph's batch axis is dynamic).
    batcher = server.batcher(detector.detect)

    async def answers(prepared: list[Prepared], response: Response,
                      score_threshold: float | None, max_detections: int | None
                      ) -> list[dict[str, Any]]:
        found = await server.batched(batcher, [p.image for p in prepared], response)
        return [detector.answer(f, p, score_threshold, max_detections)
                for f, p in zip(found, prepared, strict=True)]

    @app.post("/predict")
    async def predict(file: Annotated[UploadFile, File(description="the image")],
                      response: Response, score_threshold: Threshold = None,
                      max_detections: MaxDetections = None) -> dict[str, Any]:
        prepared = await server.prepared([file], ["file"])
        return (await answers(prepared, response, score_threshold, max_detections))[0]

    @app.post("/predict/batch")
    async def predict_batch(files: Annotated[list[UploadFile], File(description="the images")],
                            response: Response, score_threshold: Threshold = None,
                            max_detections: MaxDetections = None) -> dict[str, Any]:
        server.check_batch(files)
        prepared = await server.prepared(files, [f"files[{i}]" for i in range(len(files))])
        found = await answers(prepared, response, score_threshold, max_detections)
        return {"results": [{"filename": f.filename, **answer}
                            for f, answer in zip(files, found, strict=True)]}


# ---------------------------------------------------------------------------------------------
# labrun predict


def predict_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, metavar="IMAGE_OR_DIR",
                        help="image files, or folders searched recursively for images")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where the answers go: DIR/<stem>.json and DIR/<stem>_overlay.png "
                             "(the boxes drawn); not the images' own folder")
    parser.add_argument("--score-threshold", type=float, default=None, metavar="SCORE",
                        help="the lowest score kept (default: the export's score_threshold)")
    parser.add_argument("--max-detections", type=int, default=None, metavar="N",
                        help="the most boxes kept per image (default: the export's "
                             "detections_per_image)")
    parser.add_argument("--batch-size", type=int, default=16)


def predict(args, open_model: Callable[[], Detector]) -> int:
    """OUT/<stem>.json and OUT/<stem>_overlay.png of each image, a line of its boxes printed;
    1 when an image was skipped."""
    if args.batch_size < 1:
        raise LabrunError("--batch-size must be 1 or more")
    if args.max_detections is not None and args.max_detections < 1:
        raise LabrunError("--max-detections must be 1 or more")
    if args.score_threshold is not None and not 0 <= args.score_threshold <= 1:
        raise LabrunError("--score-threshold must be between 0 and 1")
    out = args.out
    if out is None:
        raise LabrunError("a detector writes a JSON and an overlay PNG per image: add --out DIR "
                          "(a folder other than the images' own)")
    paths = predicting.image_files(args.inputs)
    check_out(out, args.inputs, paths)  # before the model loads and anything is written
    detector = open_model()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for start in range(0, len(paths), args.batch_size):
        prepared = []
        for path in paths[start:start + args.batch_size]:
            image = predicting.read_input(path, detector.prepare)
            if image is None:
                failed += 1
            else:
                prepared.append((path, image))
        found = detector.detect([p.image for _, p in prepared]) if prepared else []
        for (path, image), boxes in zip(prepared, found, strict=True):
            answer = detector.answer(boxes, image, args.score_threshold, args.max_detections)
            height, width = image.size
            (out / f"{path.stem}.json").write_text(json.dumps(
                {"image": str(path), "width": width, "height": height, **answer}, indent=1))
            (out / f"{path.stem}_overlay.png").write_bytes(
                detector.overlay_png(image.picture, answer))
            print(f"{path}  {len(answer['boxes'])} boxes" + "".join(
                f"  {name} {score:.3f}" for name, score
                in zip(answer["labels"], answer["scores"], strict=True)))
    log.info("%d images detected, %d skipped -> %s", len(paths) - failed, failed, out)
    return 1 if failed else 0


def check_out(out: Path, inputs: list[Path], paths: list[Path]) -> None:
    """Refuse an --out that is an image's own folder (or a folder given), or that would get two
    files of one name (the same stem in two folders)."""
    folders = {path.parent.resolve() for path in paths}
    folders |= {item.resolve() for item in inputs if item.is_dir()}
    if out.resolve() in folders:
        raise LabrunError(f"--out {out} is a folder of the input images; answers never go "
                          f"among them: give another folder, such as "
                          f"{out.parent / (out.name + '-boxes')}")
    if out.exists() and not out.is_dir():
        raise LabrunError(f"--out {out} is a file; give a folder (it is made if missing)")
    stems: dict[str, Path] = {}
    for path in paths:
        if path.stem in stems:
            raise LabrunError(f"{stems[path.stem]} and {path} would both write "
                              f"{out / path.stem}.json; predict them into separate --out folders")
        stems[path.stem] = path
