"""A segmentation model's life after training (labrun.train.task.Segmentation's deploy hooks,
labrun.deploy.hooks): what its export takes and returns, how it is served and predicted.

    export   export_plan     normalised float NCHW in, per-pixel logits out:
             INPUT_AXES      batch, height and width stay dynamic (the logits' axes 0, 2, 3 too)
             example_input   a normalised batch to trace with, image_size x image_size
             parity_images   the run's val images as its val loader made them (SegData's
                             JointEval), or seeded random ones
             parity          exported vs eager logits on them, and on one image at a size no
                             image had (non-square): the argmax must agree on >= 99.9% of the
                             pixels and the logits within export's TOLERANCE
             metadata        class names, ignore_index, mean, std, image_size, eval_size,
                             decoder and a palette: what serving needs, with nothing else
    serving  Segmenter       the exported file in its runtime: image bytes in, preprocessed
                             exactly as validation does, a uint8 mask of class indices at the
                             image's own size out, and the share of pixels of each class
             mask_images     how a mask is drawn: a palette PNG of class indices, an
                             overlay of the image tinted by its classes' colours
             add_routes      POST /predict (multipart field `file`) -> {"mask": base64 PNG,
                             "fractions": {class: share}}; /predict/batch (fields `files`):
                             one such answer per file, with its filename
    predict  IMAGE_OR_DIR... --out DIR: DIR/<stem>.png (the mask: a palette PNG of class
             indices, at the image's size) and DIR/<stem>_overlay.png of each image, and a line
             `path  class share ...`; DIR must be none of the images' own folders

eval_size=fixed (validation resized each image whole to image_size x image_size): the model sees
that, and its mask is resized back to the image's size by nearest-exact, which keeps class
indices (no blend of two classes), as the masks of training were resized. eval_size=full: the
model sees the image at its own size.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from fastapi import File, Response, UploadFile

from labrun.config.dataset_schema import SegmentationDatasetConfig
from labrun.core.errors import LabrunError, one_line
from labrun.data.image import decode as data_decode
from labrun.data.image.transforms import as_rgb, normalize_on_device, resize_region
from labrun.deploy import predict as predicting
from labrun.deploy import runtime
from labrun.deploy.export import Plan, Target, build_data, build_model
from labrun.tasks.mask_images import mask_png, overlay_png, palette
from labrun.train.task import logits_of

log = logging.getLogger(__name__)

TASK = "segmentation"
REQUIRED_KEYS = ("class_names", "image_size", "eval_size", "mean", "std")
USAGE = ("POST /predict with multipart field 'file' (POST /predict/batch: fields 'files'), "
         "for a mask")
# The input's dynamic axes, with their largest size (none); the logits follow axes 0, 2 and 3.
INPUT_AXES: dict[int, tuple[str, int | None]] = {0: ("batch", None), 2: ("height", None),
                                                 3: ("width", None)}
PARITY_IMAGES = 16
# The share of pixels whose class (the argmax) the exported file must give as eager PyTorch
# does: fp32 kernels differ in summation order only, which flips a pixel only at a near tie.
MIN_AGREEMENT = 0.999
MAX_CLASSES = 256  # masks are uint8 (and PNG palettes hold 256 colours)


# ---------------------------------------------------------------------------------------------
# Export


class LogitsOnly(torch.nn.Module):
    """The model with one output, its logits: torchvision's models answer {"out": ..., "aux":
    ...}, and an export (and serving) needs the one tensor that the metrics score."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.model(x))


def settings(dataset: dict[str, Any]) -> dict[str, Any]:
    """What a served model needs of the run's dataset section (the schema's defaults for keys
    an old config lacks; in-memory datasets name no decoder: the default one)."""
    default = SegmentationDatasetConfig()
    return {"image_size": int(dataset.get("image_size", default.image_size)),
            "eval_size": str(dataset.get("eval_size", default.eval_size)),
            "mean": list(dataset.get("mean", default.mean)),
            "std": list(dataset.get("std", default.std)),
            "decoder": str(dataset.get("decoder", "turbojpeg"))}


def export_plan(state: dict[str, Any], checkpoint: Path, target: Target) -> Plan:
    """Normalised float NCHW in, per-pixel logits out, batch, height and width dynamic;
    checked on the run's val images and an odd size."""
    sizes = {"num_classes": len(state["class_names"])}
    model = LogitsOnly(build_model(state["config"], sizes, state["model"], checkpoint)).eval()
    meta = metadata(state)
    check = None
    if target.check_data is not None:
        images = parity_images(state["config"].get("dataset", {}), meta, target.check_data)

        def check(path: Path, reference: torch.nn.Module) -> dict[str, Any]:
            return parity(path, target, reference, images, meta)

    return Plan(model, example_input(meta["image_size"], target.device, target.dtype),
                INPUT_AXES, check, report_parity, meta)


def example_input(size: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """2 normalised images of size x size to trace with (sizes other than 0 and 1, which
    torch.export would take for constants)."""
    return torch.randn(2, 3, size, size, device=device, dtype=dtype)


def parity_images(dataset: dict[str, Any], meta: dict[str, Any], data: str
                  ) -> tuple[list[torch.Tensor], str]:
    """uint8 CxHxW images: the run's val images as its val loader made them, or seeded random
    ones when those cannot be read; with where they came from."""
    reason = "random input requested"
    if data == "val":
        try:
            return validation_images(dataset)
        except Exception as error:  # noqa: BLE001 - any data problem falls back to random input
            reason = f"validation images unavailable: {one_line(error)}"
    size = meta["image_size"]
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (PARITY_IMAGES, 3, size, size), dtype=torch.uint8,
                           generator=generator)
    return list(images), f"{PARITY_IMAGES} random images ({reason})"


def validation_images(dataset: dict[str, Any]) -> tuple[list[torch.Tensor], str]:
    """Validation images spread over the split, through the run's own data (SegData): the same
    source, decoder and eval transform (JointEval) as its val loader."""
    built = build_data(dataset)
    source, transform = built.splits["val"], built.transform("val")
    indices = np.unique(np.linspace(0, len(source) - 1, PARITY_IMAGES).round().astype(int))
    images = [transform(*source.open(int(i)))[0] for i in indices]
    return images, f"{len(indices)} validation images of {source.name}"


def odd_size(image: torch.Tensor, size: int) -> torch.Tensor:
    """A batch of one: `image` resized to a non-square size that neither the example nor an
    eval_size=fixed image has, and that is no multiple of 2 (a model's padding is exercised)."""
    resized = F.interpolate(image[None].float(), size=(size // 2 + 3, size + 5),
                            mode="bilinear", antialias=True, align_corners=False)
    return resized.round().clamp(0, 255).to(torch.uint8)


def parity(path: Path, target: Target, reference: torch.nn.Module,
           images: tuple[list[torch.Tensor], str], meta: dict[str, Any]) -> dict[str, Any]:
    """The exported file in its own runtime against the eager fp32 model: the images of each
    size as one batch, and one image alone at an odd, non-square size (which proves the batch,
    height and width axes dynamic: a traced or exported constant would fail it).

    The tolerance is relative to the largest eager logit (at least 1)."""
    pictures, images_from = images
    run = target.runtime(path)
    device, dtype = target.device, target.dtype
    mean = torch.tensor(meta["mean"], device=device).view(1, -1, 1, 1)
    std = torch.tensor(meta["std"], device=device).view(1, -1, 1, 1)
    by_size: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for image in pictures:
        by_size.setdefault(tuple(image.shape), []).append(image)
    batches = [torch.stack(group) for group in by_size.values()]
    batches.append(odd_size(pictures[0], meta["image_size"]))
    diff, allowed, agree, pixels = 0.0, 0.0, 0, 0
    for batch in batches:
        x = normalize_on_device(batch.to(device), mean, std, torch.float32)
        with torch.inference_mode():
            eager = reference(x).float().cpu()
        exported = torch.from_numpy(run(x.to(dtype).cpu().numpy()))
        if exported.shape != eager.shape:
            raise LabrunError(f"the exported model's logits for input {list(batch.shape)} are "
                              f"{list(exported.shape)}, eager PyTorch's {list(eager.shape)}")
        allowed = max(allowed, target.tolerance * max(1.0, eager.abs().max().item()))
        diff = max(diff, (exported - eager).abs().max().item())
        agree += int((exported.argmax(1) == eager.argmax(1)).sum())
        pixels += eager[:, 0].numel()
    share = agree / pixels
    passed = share >= MIN_AGREEMENT and diff <= allowed
    return {"images": len(pictures), "images_from": images_from,
            "shapes": [list(batch.shape) for batch in batches], "pixels": pixels,
            "argmax_agree": agree, "argmax_agreement": share, "min_agreement": MIN_AGREEMENT,
            "max_abs_diff": diff, "tolerance": allowed, "passed": passed,
            "failure": None if passed else (
                f"parity check failed: the argmax agrees on {share:.4%} of the pixels (at "
                f"least {MIN_AGREEMENT:.1%} needed), max abs logit diff {diff:.2e} "
                f"(tolerance {allowed:.2e})")}


def report_parity(check: dict[str, Any], exporter: str) -> None:
    verdict = "ok" if check["passed"] else "FAILED"
    shapes = " and ".join("x".join(map(str, shape)) for shape in check["shapes"])
    log.info(f"parity ({exporter}): {check['images_from']}, input {shapes}: argmax agrees on "
             f"{check['argmax_agree']}/{check['pixels']} pixels ({check['argmax_agreement']:.4%}"
             f", at least {check['min_agreement']:.1%} needed), max abs logit diff "
             f"{check['max_abs_diff']:.2e} (tolerance {check['tolerance']:.2e}) -> {verdict}")


def metadata(state: dict[str, Any]) -> dict[str, Any]:
    """What the export's metadata carries for serving, beside the keys every export has."""
    class_names = list(state["class_names"])
    prep = settings(state["config"].get("dataset", {}))
    return {"input": {"name": "input", "shape": ["batch", 3, "height", "width"],
                      "layout": "NCHW", "values": "(uint8 / 255 - mean) / std"},
            "output": {"name": "logits", "shape": ["batch", len(class_names), "height", "width"],
                       "values": "per-pixel class logits at the input's height and width"},
            "class_names": class_names, "num_classes": len(class_names),
            "ignore_index": int(state.get("ignore_index", 255)), **prep,
            "palette": palette(len(class_names))}


# ---------------------------------------------------------------------------------------------
# Serving


class Prepared(NamedTuple):
    image: torch.Tensor  # uint8 3xHxW, what the model sees (validation's resize)
    size: tuple[int, int]  # the picture's own height and width: its mask's size
    picture: Any  # the decoded picture (pixels, or a JPEG decoded on demand): for an overlay


class Segmenter:
    """An exported segmentation model (labrun export of a task=segmentation run), from the
    metadata alone: an image in, its mask of class indices out."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = meta = runtime.read_metadata(self.model_path, task=TASK)
        self.class_names: list[str] = list(meta["class_names"])
        if not 1 <= len(self.class_names) <= MAX_CLASSES:
            raise LabrunError(f"{self.model_path}: {len(self.class_names)} classes; a mask "
                              f"holds 1 to {MAX_CLASSES} (uint8): export the model again")
        # fixed: every image resized to image_size x image_size, as validation did; full: none.
        self.size = int(meta["image_size"]) if meta["eval_size"] == "fixed" else None
        self.mean = torch.tensor(meta["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(meta["std"], dtype=torch.float32).view(1, -1, 1, 1)
        self.dtype = torch.float16 if meta.get("dtype") == "float16" else torch.float32
        self.decoder = data_decode.resolve(meta.get("decoder", "turbojpeg"))
        # The classes' colours, then VOC's for the other indices a palette PNG has.
        colours = list(meta.get("palette") or palette(self.num_classes))
        self.colours = np.array(colours + palette(256)[len(colours):], dtype=np.uint8)
        self.runtime = runtime.open_runtime(self.model_path, meta["format"], threads)
        # One real inference now: a model that cannot run fails at start-up, not per request.
        size = int(meta["image_size"])
        self.masks([torch.zeros(3, size, size, dtype=torch.uint8)])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def device(self) -> str:
        """Where the model runs: "cuda" or "cpu"."""
        return self.runtime.device

    def prepare(self, data: bytes) -> Prepared:
        """Image bytes -> what the model sees of them, as the run's val loader (JointEval)
        made it: its decoder, the whole image resized to image_size x image_size (bilinear,
        antialiased; eval_size=full: as it is). ImageError for bytes that are not an image."""
        picture = as_rgb(runtime.open_image(data, self.decoder))
        height, width = picture.shape[:2]
        out = (self.size, self.size) if self.size else (height, width)
        try:  # a JPEG decodes here, at the smallest DCT scale that keeps the model's size
            image = resize_region(picture, 0, 0, height, width, *out)
        except Exception as error:  # noqa: BLE001 - whatever a decoder raises, the file is bad
            raise runtime.ImageError(f"corrupt or truncated image ({one_line(error)})") from None
        return Prepared(image, (height, width), picture)

    def logits(self, batch: torch.Tensor) -> np.ndarray:
        """uint8 NCHW -> N x classes x H x W logits."""
        return self.runtime(normalize_on_device(batch, self.mean, self.std, self.dtype).numpy())

    def masks(self, images: list[torch.Tensor]) -> list[np.ndarray]:
        """Each prepared image's uint8 mask at the model's input size, in order: the images of
        one size in one model call (eval_size=fixed: all of them). The batcher's call."""
        masks: list[np.ndarray | None] = [None] * len(images)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_size.setdefault(tuple(image.shape), []).append(i)
        for indices in by_size.values():
            logits = self.logits(torch.stack([images[i] for i in indices]))
            for i, mask in zip(indices, logits.argmax(1).astype(np.uint8), strict=True):
                masks[i] = mask
        return masks

    def restore(self, mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """The mask at the picture's own size: nearest-exact keeps class indices."""
        if mask.shape == size:
            return mask
        resized = F.interpolate(torch.from_numpy(mask)[None, None], size=size,
                                mode="nearest-exact")
        return resized[0, 0].numpy()

    def segment(self, data: bytes) -> np.ndarray:
        """Image bytes -> uint8 HxW class indices at the image's own size."""
        prepared = self.prepare(data)
        return self.restore(self.masks([prepared.image])[0], prepared.size)

    def fractions(self, mask: np.ndarray) -> dict[str, float]:
        """Each class's share of the mask's pixels, in class order (they add up to 1)."""
        counts = np.bincount(mask.ravel(), minlength=self.num_classes)[:self.num_classes]
        return {name: round(float(count) / mask.size, 6)
                for name, count in zip(self.class_names, counts, strict=True)}

    def answer(self, mask: np.ndarray, size: tuple[int, int]) -> dict[str, Any]:
        """POST /predict's answer for a mask at the model's size, of a picture of `size`."""
        mask = self.restore(mask, size)
        return {"mask": base64.b64encode(self.mask_png(mask)).decode("ascii"),
                "fractions": self.fractions(mask)}

    def mask_png(self, mask: np.ndarray) -> bytes:
        return mask_png(mask, self.colours)

    def overlay_png(self, picture: Any, mask: np.ndarray) -> bytes:
        """The picture (as Prepared holds it) tinted by its mask's classes' colours."""
        height, width = picture.shape[:2]
        pixels = resize_region(picture, 0, 0, height, width, height, width).permute(1, 2, 0)
        return overlay_png(pixels.numpy(), mask, self.colours)


def load(path: Path, threads: int | None = None) -> Segmenter:
    return Segmenter(path, threads)


def describe(segmenter: Segmenter) -> str:
    return (f"segmentation, {segmenter.num_classes} classes, "
            f"{segmenter.metadata['image_size']} px, eval_size={segmenter.metadata['eval_size']}")


def health(segmenter: Segmenter) -> dict[str, Any]:
    return {"num_classes": segmenter.num_classes}


def add_routes(app, segmenter: Segmenter, server) -> None:
    # The batcher's call stacks the images of each size (eval_size=fixed: one size).
    batcher = server.batcher(segmenter.masks)

    async def answers(prepared: list[Prepared], response: Response) -> list[dict[str, Any]]:
        """Each image's mask (the batcher's model call), then its answer in the thread pool:
        the mask back at its picture's size, as a PNG."""
        from starlette.concurrency import run_in_threadpool

        masks = await server.batched(batcher, [p.image for p in prepared], response)
        return await run_in_threadpool(lambda: [
            segmenter.answer(mask, p.size) for mask, p in zip(masks, prepared, strict=True)])

    @app.post("/predict")
    async def predict(file: Annotated[UploadFile, File(description="the image")],
                      response: Response) -> dict[str, Any]:
        return (await answers(await server.prepared([file], ["file"]), response))[0]

    @app.post("/predict/batch")
    async def predict_batch(files: Annotated[list[UploadFile], File(description="the images")],
                            response: Response) -> dict[str, Any]:
        server.check_batch(files)
        prepared = await server.prepared(files, [f"files[{i}]" for i in range(len(files))])
        return {"results": [{"filename": f.filename, **answer} for f, answer
                            in zip(files, await answers(prepared, response), strict=True)]}


# ---------------------------------------------------------------------------------------------
# labrun predict


def predict_arguments(parser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, metavar="IMAGE_OR_DIR",
                        help="image files, or folders searched recursively for images")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="where the masks go: DIR/<stem>.png (class indices) and "
                             "DIR/<stem>_overlay.png; not the images' own folder")
    parser.add_argument("--batch-size", type=int, default=32)


def predict(args, open_model: Callable[[], Segmenter]) -> int:
    """OUT/<stem>.png and OUT/<stem>_overlay.png of each image, a line of its classes' shares
    printed; 1 when an image was skipped."""
    if args.batch_size < 1:
        raise LabrunError("--batch-size must be 1 or more")
    out = args.out
    if out is None:
        raise LabrunError("a segmentation model writes mask PNGs: add --out DIR (a folder "
                          "other than the images' own)")
    paths = predicting.image_files(args.inputs)
    predicting.check_out(out, args.inputs, paths,  # before the model loads and writes
                         lambda stem: [f"{stem}.png", f"{stem}_overlay.png"], "masks")
    segmenter = open_model()
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for prepared, skipped in predicting.batches(paths, args.batch_size, segmenter.prepare):
        failed += skipped
        masks = segmenter.masks([p.image for _, p in prepared]) if prepared else []
        for (path, image), mask in zip(prepared, masks, strict=True):
            mask = segmenter.restore(mask, image.size)
            (out / f"{path.stem}.png").write_bytes(segmenter.mask_png(mask))
            (out / f"{path.stem}_overlay.png").write_bytes(
                segmenter.overlay_png(image.picture, mask))
            print(f"{path}  " + "  ".join(f"{name} {share:.4f}" for name, share
                                          in segmenter.fractions(mask).items()))
    log.info("%d images segmented, %d skipped -> %s", len(paths) - failed, failed, out)
    return 1 if failed else 0

