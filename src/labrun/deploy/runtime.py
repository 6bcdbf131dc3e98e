"""Load an exported model, preprocess images exactly as validation does, and predict.

    predictor = Predictor(MODEL)      MODEL: model.onnx | model.torchscript.pt, each with its
                                      metadata JSON beside it (labrun.deploy.load also takes a
                                      run folder or a checkpoint, exporting it first)
    image = predictor.prepare(jpeg_bytes)   # uint8 3xSxS, exactly as the run's val loader
    predictor.predict([image, ...], k=5) -> [[{"class", "index", "prob"}, ...], ...]

`labrun serve`, `labrun predict`, the parity check of `labrun export` and the serving benchmark
all go through this module (a language model's export is served by labrun.deploy.lm, on the
same runtimes and metadata reader), so a served answer and an offline answer cannot drift apart.

The exported model takes normalised float NCHW input, as the eager model does; the
preprocessing (decode, ValTransform, normalise) lives here and reads its settings (size,
resize ratio, mean, std) from the metadata JSON that `labrun export` writes beside the model.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from labrun.core.errors import LabrunError, one_line
from labrun.data.image import decode as data_decode
from labrun.data.image.transforms import ValTransform, normalize_on_device

# An upload may be a small file that decodes into a huge image (a "decompression bomb");
# 50 megapixels covers any camera photo and bounds the memory one request can take (150 MB).
MAX_IMAGE_PIXELS = 50_000_000
# Validation resizes the short side to the model's size, so a 1 x 50,000 px sliver would grow
# into gigabytes; no photo is anywhere near this elongated.
MAX_ASPECT_RATIO = 20


class ImageError(LabrunError):
    """Bytes that are not a usable image; the message says why, for a 4xx answer or a skip line."""


def metadata_path(model_path: str | Path) -> Path:
    """The metadata JSON written beside an exported model: model.onnx -> model.onnx.json.

    The full file name is kept so that best.onnx and best.torchscript.pt can share a folder.
    """
    model_path = Path(model_path)
    return model_path.with_name(model_path.name + ".json")


# ---------------------------------------------------------------------------------------------
# Decoding


def open_image(data: bytes, decoder: str = "turbojpeg") -> np.ndarray | data_decode.JpegImage:
    """Encoded image bytes -> what the validation transform takes, as the training data
    pipeline opens them (labrun.data.image.decode.open_image: a JPEG that TurboJPEG decodes stays
    undecoded until the transform has chosen its crop; other formats are decoded by Pillow);
    ImageError for anything that is not a usable image.

    The size is read from the header first, so an oversized image is refused before any
    memory is taken for it.
    """
    if not data:
        raise ImageError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as probe:  # reads the header only
            width, height = probe.size
    except UnidentifiedImageError:
        raise ImageError("not an image (unknown or unsupported format)") from None
    except Exception as error:  # noqa: BLE001 - any header that Pillow cannot parse
        raise ImageError(f"corrupt image header ({one_line(error)})") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image is {width}x{height}, more than "
                         f"{MAX_IMAGE_PIXELS // 1_000_000} megapixels")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(f"image is {width}x{height}, more elongated than "
                         f"{MAX_ASPECT_RATIO}:1")
    return _decoding(data_decode.open_image, data, decoder)


def _decoding(decode: Callable, *args: Any) -> Any:
    """decode(*args), with whatever a decoder raises on bad data as one ImageError."""
    try:
        return decode(*args)
    except Exception as error:  # noqa: BLE001 - whatever a decoder raises, the upload is bad
        raise ImageError(f"corrupt or truncated image ({one_line(error)})") from None


# ---------------------------------------------------------------------------------------------
# Runtimes: each maps a normalised float NCHW array (any batch size N: exported models have a
# dynamic batch axis) to logits (N, num_classes) as float32; its `device` attribute says where
# the model runs ("cuda" or "cpu").


def onnx_runtime(path: Path, threads: int | None = None) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    # Idle pool threads would otherwise spin between calls, taking the cores that concurrent
    # requests need for decoding and for their own inference (measured: faster when off).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # Prefer the GPU when this onnxruntime build has it (onnxruntime-gpu); the CPU always works.
    providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                 if p in ort.get_available_providers()]
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as error:  # onnxruntime raises its own untyped errors for bad files
        raise LabrunError(f"{path}: onnxruntime cannot load it ({one_line(error)}); "
                          f"re-export it with `labrun export RUN_DIR --format onnx`") from None
    input_name = session.get_inputs()[0].name

    def run(batch: np.ndarray) -> np.ndarray:
        return session.run(None, {input_name: batch})[0].astype(np.float32, copy=False)

    run.device = "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    return run


def torchscript_runtime(path: Path, threads: int | None = None
                        ) -> Callable[[np.ndarray], np.ndarray]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if threads:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            # torch marks TorchScript deprecated; it is still the format the issue asks for.
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(str(path), map_location=device).eval()
    except Exception as error:
        raise LabrunError(f"{path}: not a TorchScript model ({one_line(error)}); "
                          f"re-export it with `labrun export RUN_DIR --format torchscript`"
                          ) from None

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = module(torch.from_numpy(batch).to(device))
        return logits.float().cpu().numpy()

    run.device = device
    return run


# ---------------------------------------------------------------------------------------------
# The predictor


class Predictor:
    """An exported model with the preprocessing it was trained with."""

    def __init__(self, model_path: str | Path, threads: int | None = None):
        self.model_path = Path(model_path)
        self.threads = threads  # the runtime's intra-op threads (None: its own default)
        self.metadata = read_metadata(self.model_path)
        meta = self.metadata
        self.class_names: list[str] = list(meta["class_names"])
        self.transform = ValTransform(int(meta["image_size"]), float(meta["val_resize_ratio"]))
        self.mean = torch.tensor(meta["mean"], dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(meta["std"], dtype=torch.float32).view(1, -1, 1, 1)
        self.dtype = torch.float16 if meta.get("dtype") == "float16" else torch.float32
        self.decoder = data_decode.resolve(meta.get("decoder", "turbojpeg"))
        make_runtime = onnx_runtime if meta["format"] == "onnx" else torchscript_runtime
        self.runtime = make_runtime(self.model_path, threads)
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
        return _decoding(self.transform, open_image(data, self.decoder))

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


# An export's "task" picks the code that serves it; an export without one is an image
# classifier's, as every export was before labrun exported language models (labrun.deploy.lm).
CLASSIFICATION = "classification"
REQUIRED_KEYS = {CLASSIFICATION: ("class_names", "image_size", "val_resize_ratio", "mean", "std"),
                 "lm": ("vocab_size", "block_size", "tokenizer"),
                 "segmentation": ("class_names", "image_size", "eval_size", "mean", "std")}


def task_of(meta: dict[str, Any]) -> str:
    return str(meta.get("task", CLASSIFICATION))


def read_metadata(model_path: Path, task: str | None = CLASSIFICATION) -> dict[str, Any]:
    """The metadata JSON beside an exported model, checked: an export of `task` (None: of any
    task) that has the keys its task is served with."""
    if not model_path.is_file():
        raise LabrunError(f"{model_path}: no such model file")
    path = metadata_path(model_path)
    if not path.is_file():
        raise LabrunError(f"{model_path} has no metadata file {path.name} beside it; export "
                          f"models with `labrun export`, which writes it")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise LabrunError(f"{path}: unreadable metadata ({one_line(error)}); "
                          f"export the model again") from None
    if not isinstance(meta, dict):
        raise LabrunError(f"{path}: metadata is not a JSON object; export the model again")
    kind = task_of(meta)
    if kind not in REQUIRED_KEYS:
        raise LabrunError(f"{path}: unknown task {kind!r} (this labrun serves "
                          f"{', '.join(REQUIRED_KEYS)}); export the model again")
    if task is not None and kind != task:
        raise LabrunError(f"{model_path} is an export of a task={kind} run, not task={task}: "
                          f"image classifiers answer `labrun predict` and POST /predict, "
                          f"language models (lm) POST /generate of `labrun serve`")
    missing = [key for key in ("format", *REQUIRED_KEYS[kind]) if key not in meta]
    if missing:
        raise LabrunError(f"{path}: metadata lacks {', '.join(missing)}; export the model again")
    if meta["format"] not in ("onnx", "torchscript"):
        raise LabrunError(f"{path}: unknown format {meta['format']!r}; export the model again")
    return meta


def default_threads(workers: int = 1) -> int:
    """Intra-op threads per process so that N server workers share the cores, not fight."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))
