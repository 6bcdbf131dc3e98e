"""What every task's served model shares: an exported file in its runtime, its metadata,
and images decoded as the training data pipeline decodes them.

    run = open_runtime(MODEL, fmt)    MODEL: model.onnx | model.torchscript.pt; run(array) ->
                                      float32 array, on the GPU when the runtime has one
                                      (run(a, b, ...): a model of several inputs, in order)
    meta = read_metadata(MODEL)       the metadata JSON that `labrun export` wrote beside it,
                                      checked against the keys its task's deploy module reads
    open_image(bytes, decoder)        an upload's image, refused (ImageError) when it is no
                                      usable image, before memory is taken for it

Each task's deploy module (labrun.deploy.hooks) builds its served model on these: `labrun
serve`, `labrun predict`, the parity check of `labrun export` and the serving benchmark all run
an exported file through open_runtime, so a served answer and an offline answer cannot drift
apart.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from labrun.core.errors import LabrunError, one_line
from labrun.data.image import decode as data_decode
from labrun.deploy import hooks

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
    return decoding(data_decode.open_image, data, decoder)


def decoding(decode: Callable, *args: Any) -> Any:
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
    input_names = [i.name for i in session.get_inputs()]

    def run(*batch: np.ndarray) -> np.ndarray:
        feed = dict(zip(input_names, batch, strict=True))
        return session.run(None, feed)[0].astype(np.float32, copy=False)

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

    def run(*batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = module(*(torch.from_numpy(array).to(device) for array in batch))
        return logits.float().cpu().numpy()

    run.device = device
    return run


def open_runtime(path: Path, fmt: str, threads: int | None = None
                 ) -> Callable[[np.ndarray], np.ndarray]:
    """The exported file of `fmt` ("onnx", "torchscript") in its own runtime."""
    return (onnx_runtime if fmt == "onnx" else torchscript_runtime)(path, threads)


# ---------------------------------------------------------------------------------------------
# The metadata


def read_metadata(model_path: Path, task: str | None = None) -> dict[str, Any]:
    """The metadata JSON beside an exported model, checked: an export of `task` (None: of any
    task) that has the keys its task's deploy module serves it with."""
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
    deploy = hooks.of_metadata(meta, path)
    if task is not None and deploy.TASK != task:
        raise LabrunError(f"{model_path} is an export of a task={deploy.TASK} run, not "
                          f"task={task}; `labrun serve` and `labrun predict` take an export of "
                          f"any task")
    missing = [key for key in ("format", *deploy.REQUIRED_KEYS) if key not in meta]
    if missing:
        raise LabrunError(f"{path}: metadata lacks {', '.join(missing)}; export the model again")
    if meta["format"] not in ("onnx", "torchscript"):
        raise LabrunError(f"{path}: unknown format {meta['format']!r}; export the model again")
    return meta


def default_threads(workers: int = 1) -> int:
    """Intra-op threads per process so that N server workers share the cores, not fight."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))
