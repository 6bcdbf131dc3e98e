"""An image classifier's life after training (labrun.train.task.Classification's deploy hooks,
labrun.deploy.hooks): what its export takes and returns, how it is served and predicted.

    export   export_plan     normalised float NCHW images in, class logits out, the batch
                             dynamic; checked on the run's validation images, as its val loader
                             makes them, at the whole batch and at a batch of one
             metadata        class names, image size, resize ratio, mean, std, decoder
    serving  Predictor       the exported file in its runtime: image bytes in, preprocessed
                             exactly as validation does, the top-k classes out
             add_routes      POST /predict?k=5 (multipart field `file`) -> {"top": [...]}
                             POST /predict/batch?k=5 (fields `files`) -> {"results": [...]}
    predict  IMAGE_OR_DIR... [--k 5] [--csv FILE]: a line per image (`path  class (prob) ...`),
             or a CSV row per (image, rank); an unreadable image is named and skipped (exit 1)

    predictor = Predictor(MODEL)      MODEL: model.onnx | model.torchscript.pt with its metadata
    image = predictor.prepare(jpeg_bytes)   # uint8 3xSxS, exactly as the run's val loader
    predictor.predict([image, ...], k=5) -> [[{"class", "index", "prob"}, ...], ...]
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from fastapi import File, Query, Response, UploadFile

from labrun.config.dataset_schema import ImageDatasetConfig
from labrun.core.errors import LabrunError, one_line
from labrun.data.image import decode as data_decode
from labrun.data.image.transforms import ValTransform, normalize_on_device
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.deploy.export import BATCH_AXIS, Plan, Target, build_data, build_model

log = logging.getLogger(__name__)

TASK = "classification"
REQUIRED_KEYS = ("class_names", "image_size", "val_resize_ratio", "mean", "std")
USAGE = "POST /predict with multipart field 'file' (POST /predict/batch: fields 'files')"
PARITY_IMAGES = 32
TopK = Annotated[int, Query(ge=1, le=1000, description="how many classes to return")]


# ---------------------------------------------------------------------------------------------
# Export


@dataclass
class Preprocessing:
    """What a deployed model needs to see its input as validation showed it to the model."""

    image_size: int
    val_resize_ratio: float
    mean: list[float]
    std: list[float]
    decoder: str  # how the run's loader decodes files; in-memory datasets: the default one

    @classmethod
    def from_dataset(cls, dataset: dict[str, Any]) -> Preprocessing:
        default = ImageDatasetConfig()  # the schema's defaults, for keys an old config lacks
        augment = dataset.get("augment", {})
        return cls(int(dataset.get("image_size", default.image_size)),
                   float(augment.get("val_resize_ratio", default.augment.val_resize_ratio)),
                   list(dataset.get("mean", default.mean)), list(dataset.get("std", default.std)),
                   str(dataset.get("decoder", "turbojpeg")))


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Normalised float NCHW in, class logits out; checked on the run's validation images."""
    if "class_names" not in state:
        raise LabrunError(f"{checkpoint}: the checkpoint has no 'class_names' entry; export "
                          f"needs a checkpoint written by labrun's trainer")
    cfg, class_names = state["config"], list(state["class_names"])
    model = build_model(cfg, {"num_classes": len(class_names)}, state["model"], checkpoint)
    prep = Preprocessing.from_dataset(cfg.get("dataset", {}))
    check = None
    if target.check_data is not None:
        images = parity_images(cfg.get("dataset", {}), prep, target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, images, prep)

    example = torch.randn(2, 3, prep.image_size, prep.image_size, device=target.device,
                          dtype=target.dtype)
    metadata = {
        "input": {"name": "input", "shape": ["batch", 3, prep.image_size, prep.image_size],
                  "layout": "NCHW", "values": "(uint8 / 255 - mean) / std"},
        "output": {"name": "logits", "shape": ["batch", len(class_names)]},
        "class_names": class_names,
        "num_classes": len(class_names),
        **asdict(prep),
    }
    return Plan(model, example, BATCH_AXIS, check, report_parity, metadata)


def parity_images(dataset: dict[str, Any], prep: Preprocessing, data: str
                  ) -> tuple[torch.Tensor, str]:
    """A uint8 NCHW batch of validation images, or random images when those cannot be read,
    with a description of where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            return validation_images(dataset, prep)
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random input
            reason = f"validation images unavailable: {one_line(error)}"
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (PARITY_IMAGES, 3, prep.image_size, prep.image_size),
                           dtype=torch.uint8, generator=generator)
    return images, f"{PARITY_IMAGES} random images ({reason})"


def validation_images(dataset: dict[str, Any], prep: Preprocessing
                      ) -> tuple[torch.Tensor, str]:
    """The val loader's view of some validation images: same source, decoder and transform."""
    source = build_data(dataset).splits["val"]
    transform = ValTransform(prep.image_size, prep.val_resize_ratio)
    # Spread over the split rather than its first images, which may all share one class.
    indices = np.unique(np.linspace(0, len(source) - 1, PARITY_IMAGES).round().astype(int))
    images = torch.stack([transform(source.open(int(i))) for i in indices])  # as the val loader
    return images, f"{len(indices)} validation images of {source.name}"


def parity(path: Path, target: Target, reference: torch.nn.Module,
           images: tuple[torch.Tensor, str], prep: Preprocessing) -> dict[str, Any]:
    """The exported file in its own runtime vs the eager fp32 model, on the whole batch and on
    a batch of one (which proves the batch axis is really dynamic)."""
    batch, images_from = images
    run = target.runtime(path)
    mean = torch.tensor(prep.mean, device=target.device).view(1, -1, 1, 1)
    std = torch.tensor(prep.std, device=target.device).view(1, -1, 1, 1)
    x = normalize_on_device(batch.to(target.device), mean, std, torch.float32)
    with torch.inference_mode():
        eager = reference(x).float().cpu()
    x_exported = x.to(target.dtype).cpu().numpy()
    exported = torch.from_numpy(run(x_exported))
    single = torch.from_numpy(run(x_exported[:1]))
    diff = max((exported - eager).abs().max().item(), (single - eager[:1]).abs().max().item())
    tolerance = target.tolerance * max(1.0, eager.abs().max().item())
    # A top-1 flip only counts where the eager top-2 margin exceeds what the tolerance allows.
    top2 = eager.topk(min(2, eager.shape[1]), dim=1).values
    margin = top2[:, 0] - top2[:, -1]
    differs = exported.argmax(1) != eager.argmax(1)
    mismatches = int((differs & (margin > 2 * tolerance)).sum())
    passed = diff <= tolerance and mismatches == 0
    return {"images": len(batch), "images_from": images_from, "batch_sizes": [len(batch), 1],
            "max_abs_diff": diff, "tolerance": tolerance,
            "top1_agree": int((~differs).sum()), "top1_mismatches": mismatches,
            "passed": passed,
            "failure": None if passed else (
                f"parity check failed: max abs diff {diff:.2e} > {tolerance:.2e} or top-1 "
                f"differs on {mismatches} image(s)")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    log.info(f"parity ({exporter}): {check['images_from']}, batch sizes "
             f"{check['batch_sizes'][0]} and 1: max abs diff {check['max_abs_diff']:.2e} "
             f"(tolerance {check['tolerance']:.2e}), top-1 agrees on "
             f"{check['top1_agree']}/{check['images']} -> {verdict}")


# ---------------------------------------------------------------------------------------------
# Serving


class Predictor:
    """An exported image classifier with the preprocessing it was trained with."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = meta = runtime.read_metadata(self.model_path, task=TASK)
        self.class_names: list[str] = list(meta["class_names"])
        self.transform = ValTransform(int(meta["image_size"]), float(meta["val_resize_ratio"]))
        self.mean = torch.tensor(meta["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(meta["std"], dtype=torch.float32).view(1, -1, 1, 1)
        self.dtype = torch.float16 if meta.get("dtype") == "float16" else torch.float32
        self.decoder = data_decode.resolve(meta.get("decoder", "turbojpeg"))
        self.runtime = runtime.open_runtime(self.model_path, meta["format"], threads)
        # One real inference now: a model that cannot run fails at start-up, not per request.
        size = self.transform.size
        self.logits(torch.zeros(1, 3, size, size, dtype=torch.uint8))

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> str:
        """Where the model runs: "cuda" or "cpu"."""
        return self.runtime.device

    def prepare(self, data: bytes) -> torch.Tensor:
        """Image bytes -> uint8 3xSxS, the pixels the run's val loader makes of them: its
        decoder, the validation resize and centre crop. A JPEG decodes only the crop's
        rectangle, at the smallest DCT scale that keeps it at least the model's size."""
        return runtime.decoding(self.transform, runtime.open_image(data, self.decoder))

    def normalize(self, batch: torch.Tensor) -> np.ndarray:
        """uint8 NCHW -> the model's input, normalised as the trainer does on its device."""
        return normalize_on_device(batch, self.mean, self.std, self.dtype).numpy()

    def logits(self, batch: torch.Tensor) -> np.ndarray:
        return self.runtime(self.normalize(batch))

    def predict(self, images: Sequence[torch.Tensor], k: int = 5) -> list[list[dict[str, Any]]]:
        """The k most likely classes of each prepared image, most likely first."""
        return self.top_k(self.logits(torch.stack(list(images))), k)

    def top_k(self, logits: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        probs = torch.from_numpy(logits).double().softmax(dim=1)
        values, indices = probs.topk(min(k, self.num_classes), dim=1)
        return [[{"class": self.class_names[i], "index": i, "prob": round(p, 6)}
                 for p, i in zip(row_p.tolist(), row_i.tolist(), strict=True)]
                for row_p, row_i in zip(values, indices, strict=True)]


def load(path: Path, threads: int | None = None) -> Predictor:
    return Predictor(path, threads)


def describe(predictor: Predictor) -> str:
    return f"{predictor.num_classes} classes, {predictor.metadata['image_size']} px"


def health(predictor: Predictor) -> dict[str, Any]:
    return {"num_classes": predictor.num_classes}


def add_routes(app, predictor: Predictor, server) -> None:
    # The batcher's call: concurrent requests' images in one model call.
    batcher = server.batcher(lambda images: predictor.logits(torch.stack(images)))

    @app.post("/predict")
    async def predict(file: Annotated[UploadFile, File(description="the image")],
                      response: Response, k: TopK = 5) -> dict[str, Any]:
        images = await server.prepared([file], ["file"])
        logits = await server.batched(batcher, images, response)
        return {"top": predictor.top_k(logits[0][None], k)[0]}

    @app.post("/predict/batch")
    async def predict_batch(files: Annotated[list[UploadFile], File(description="the images")],
                            response: Response, k: TopK = 5) -> dict[str, Any]:
        server.check_batch(files)
        images = await server.prepared(files, [f"files[{i}]" for i in range(len(files))])
        tops = predictor.top_k(np.stack(await server.batched(batcher, images, response)), k)
        return {"results": [{"filename": f.filename, "top": top}
                            for f, top in zip(files, tops, strict=True)]}


# ---------------------------------------------------------------------------------------------
# labrun predict


def predict_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, metavar="IMAGE_OR_DIR",
                        help="image files, or folders searched recursively for images")
    parser.add_argument("--k", type=int, default=5, help="classes per image (default 5)")
    parser.add_argument("--csv", type=Path, default=None, metavar="FILE",
                        help="write path,rank,class,index,prob rows here instead of printing")
    parser.add_argument("--batch-size", type=int, default=32)


def predict(args, open_model: Callable[[], Predictor]) -> int:
    """Print (or write as CSV) the top-k classes of each image; 1 when an image was skipped."""
    if args.k < 1 or args.batch_size < 1:
        raise LabrunError("--k and --batch-size must be 1 or more")
    paths = predicting.image_files(args.inputs)
    predictor = open_model()
    rows, failed = [], 0
    for path, top in predict_files(predictor, paths, args.k, args.batch_size):
        if top is None:
            failed += 1
            continue
        if args.csv is None:
            print(f"{path}  " + "  ".join(f"{t['class']} ({t['prob']:.4f})" for t in top))
        rows += [(str(path), rank, t["class"], t["index"], t["prob"])
                 for rank, t in enumerate(top, start=1)]
    if args.csv is not None:
        predicting.write_csv(args.csv, ["path", "rank", "class", "index", "prob"], rows)
        log.info("%d images predicted, %d skipped -> %s", len(paths) - failed, failed, args.csv)
    elif failed:
        log.warning("%d of %d images skipped", failed, len(paths))
    return 1 if failed else 0


def predict_files(predictor: Predictor, paths: list[Path], k: int, batch_size: int
                  ) -> Iterator[tuple[Path, list[dict] | None]]:
    """(path, top-k) per file, in order; top-k is None for a file that is not a usable image."""
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        images = [predicting.read_input(path, predictor.prepare) for path in chunk]
        good = [image for image in images if image is not None]
        tops = iter(predictor.predict(good, k) if good else [])
        for path, image in zip(chunk, images, strict=True):
            yield path, None if image is None else next(tops)
