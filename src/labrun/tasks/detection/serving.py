"""A served detector (labrun serve, labrun predict): the exported file in its runtime, each
image letterboxed as validation made it, its boxes answered in the image's own pixels."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import numpy as np
import torch
from fastapi import File, Query, Response, UploadFile

from labrun.core.errors import LabrunError, one_line
from labrun.data.detection import transforms
from labrun.data.detection.boxes import Objects
from labrun.data.image import decode as data_decode
from labrun.data.image.transforms import as_rgb, resize_region
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.tasks.detection.graph import TASK, Found, split_rows
from labrun.tasks.mask_images import palette

log = logging.getLogger(__name__)

Threshold = Annotated[float | None, Query(ge=0, le=1, description=(
    "the lowest score answered (default: the export's score_threshold, below which the model "
    "answers nothing)"))]
MaxDetections = Annotated[int | None, Query(ge=1, le=10_000, description=(
    "the most boxes answered, highest scores first (default: the export's "
    "detections_per_image)"))]


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
    predicting.check_out(out, args.inputs, paths,  # before the model loads and writes
                         lambda stem: [f"{stem}.json", f"{stem}_overlay.png"], "answers")
    detector = open_model()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for prepared, skipped in predicting.batches(paths, args.batch_size, detector.prepare):
        failed += skipped
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

