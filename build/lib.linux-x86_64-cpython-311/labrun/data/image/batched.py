"""dataset.decode=cpu|cuda: the workers read bytes and draw crops; this process decodes batches.

    loader = batched_loader(dataset, sampler, ...)   # Data.loader's, for decode=cpu|cuda
    for images, labels in loader: ...                # uint8 NCHW and int64, both on the device

The DataLoader workers do what needs no pixels: read a sample's bytes (a file, an HDF5 slice),
read the JPEG header for its size, and draw the crop and flip with the transform's own box(),
from the same (seed, epoch, index) generator as the workers path (labrun.data.image.ImageDataset): both crop
and flip alike. Each batch crosses to this process as one flat byte tensor. Here torchvision's
decode_jpeg decodes the batch's JPEGs in one call (nvJPEG on the GPU, which is fastest given a
list; libjpeg-turbo on the CPU), and each image is cropped, resized and mirrored on that device.
cpu and cuda run the same code but for the device, so the CPU tests cover the logic.

Pixels differ a little from the workers path: it decodes at a reduced DCT scale when a crop is
at least twice the output size (data/image/decode.py), this path always at full size; nvJPEG rounds
its IDCT and chroma upsampling a little differently from libjpeg-turbo; and the resize runs in
float32 (CUDA's antialiased kernel takes no uint8), where the workers' CPU kernel is uint8 fixed
point. tests/test_data_decode_batched.py states the tolerance.

What decode_jpeg should not get (PNG and other formats, CMYK JPEGs, a file cut short or with an
unreadable header) the worker transforms as the workers path does, which decodes it or names the
file in one line; it joins the batch ready-made.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from labrun.config.facts import facts_of
from labrun.core.errors import ConfigError, DataError, one_line
from labrun.data.image.decode import encode_jpeg, jpeg_size

DECODES = facts_of("dataset.decode").choices  # as the schema field declares them

log = logging.getLogger(__name__)


def check(decode: str, splits: dict[str, Any]) -> None:
    """ConfigError unless every split holds JPEG files, which is what decode=cpu|cuda is for."""
    for source in splits.values():
        if not getattr(source, "holds_jpeg", False):
            raise ConfigError(f"dataset.decode={decode} decodes JPEG files in batches, but "
                              f"{source.name} holds no JPEG files; use dataset.decode=workers")


def check_device(decode: str) -> None:
    if decode not in DECODES:
        raise ConfigError(f"dataset.decode={decode} is not one of: {', '.join(DECODES)}")
    if decode == "cuda" and not torch.cuda.is_available():
        raise ConfigError("dataset.decode=cuda needs a CUDA GPU, and torch finds none here; "
                          "use dataset.decode=cpu or workers")


def decode_device(decode: str) -> torch.device:
    """Where decode=cpu|cuda decodes: the CPU, or this process's CUDA device (distributed
    setup has made it the current one), unless torchvision lacks nvJPEG: then the CPU."""
    if decode == "cpu":
        return torch.device("cpu")
    check_device(decode)
    device = torch.device("cuda", torch.cuda.current_device())
    reason = _nvjpeg_error(device)
    if reason is None:
        return device
    _warn_nvjpeg_missing(reason)
    return torch.device("cpu")


@functools.cache
def _nvjpeg_error(device: torch.device) -> str | None:
    """Why nvJPEG cannot decode on `device` (torchvision built without it, the library missing),
    or None when it can; any other failure is not a missing nvJPEG, and raises."""
    from torchvision.io import ImageReadMode, decode_jpeg

    tiny = torch.from_numpy(np.frombuffer(encode_jpeg(np.zeros((8, 8, 3), np.uint8), 90),
                                          dtype=np.uint8).copy())
    try:
        decode_jpeg([tiny], mode=ImageReadMode.RGB, device=device)
    except RuntimeError as error:
        if "nvjpeg" in str(error).lower():
            return _clean(error)
        raise
    return None


@functools.cache  # once per process
def _warn_nvjpeg_missing(reason: str) -> None:
    log.warning("dataset.decode=cuda: nvJPEG is unavailable (%s); decoding batches on the CPU "
                "instead (dataset.decode=cpu), which is slower", reason)


# ---------------------------------------------------------------------------------------------
# In the workers


class EncodedDataset(Dataset):
    """(epoch, index) -> (index, target, JPEG bytes, Box), or (index, target, uint8 CxSxS,
    None) for what the batched decode leaves to the workers path. `images`: an ImageDataset
    (the target a label) or a SegDataset (labrun.data.segmentation: its mask, which the
    worker crops and resizes itself with the same box, nearest-exact being cheap on the CPU)."""

    def __init__(self, images: Any):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: tuple[int, int]) -> tuple:
        epoch, index = key
        images = self.images
        try:
            data = images.source.read(index)
        except Exception as error:
            raise images.error(index, error) from error
        size = jpeg_size(data)
        if size is None:
            image, target = images[key]
            return index, target, image, None
        rng = np.random.default_rng([images.seed, epoch, index])  # as ImageDataset draws it
        box = images.transform.box(*size, rng)
        return index, images.target(index, size, box), data, box


@dataclass
class EncodedBatch:
    """A batch as the workers hand it over: few tensors, each one shared-memory transfer."""

    indices: torch.Tensor  # int64 N: the samples, for error messages
    labels: torch.Tensor  # int64 N, or uint8 N x S x S masks
    data: torch.Tensor  # uint8: the batch's JPEGs end to end
    offsets: torch.Tensor  # int64 K + 1: JPEG k is data[offsets[k]:offsets[k + 1]]
    boxes: torch.Tensor  # int64 K x 5: top, left, height, width, flip
    encoded_at: torch.Tensor  # int64 K: their places in the batch
    ready: torch.Tensor  # uint8 (N - K) x 3 x S x S: the samples the workers transformed
    ready_at: torch.Tensor  # int64 N - K


def collate(samples: list[tuple]) -> EncodedBatch:
    encoded = [i for i, sample in enumerate(samples) if sample[3] is not None]
    ready = [i for i, sample in enumerate(samples) if sample[3] is None]
    jpegs = [np.frombuffer(samples[i][2], dtype=np.uint8) for i in encoded]
    return EncodedBatch(
        indices=torch.tensor([sample[0] for sample in samples], dtype=torch.int64),
        labels=(torch.stack([sample[1] for sample in samples])
                if isinstance(samples[0][1], torch.Tensor)
                else torch.tensor([sample[1] for sample in samples], dtype=torch.int64)),
        data=torch.from_numpy(np.concatenate(jpegs) if jpegs else np.zeros(0, np.uint8)),
        offsets=torch.tensor(np.cumsum([0] + [len(jpeg) for jpeg in jpegs]), dtype=torch.int64),
        boxes=torch.tensor([samples[i][3] for i in encoded], dtype=torch.int64).view(-1, 5),
        encoded_at=torch.tensor(encoded, dtype=torch.int64),
        ready=(torch.stack([samples[i][2] for i in ready]) if ready
               else torch.zeros(0, dtype=torch.uint8)),
        ready_at=torch.tensor(ready, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# In the main process


class BatchDecoder:
    """EncodedBatch -> (uint8 N x 3 x S x S images, their labels or masks), both on `device`."""

    def __init__(self, images: Any, device: torch.device):
        self.images, self.device = images, device  # images: the ImageDataset, for errors
        self.size = images.transform.size

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        size, device = self.size, self.device
        out = torch.empty((len(batch.labels), 3, size, size), dtype=torch.uint8, device=device)
        if len(batch.ready_at):
            out[batch.ready_at.to(device)] = batch.ready.to(device)
        if len(batch.encoded_at):
            decoded = self.decode(batch)
            for image, box, at in zip(decoded, batch.boxes.tolist(), batch.encoded_at.tolist(),
                                      strict=True):
                out[at] = crop_resize(image, *box, size=size)
        return out, batch.labels.to(device)

    def decode(self, batch: EncodedBatch) -> list[torch.Tensor]:
        """Every JPEG of the batch as uint8 3xHxW on the device, in one call."""
        from torchvision.io import ImageReadMode, decode_jpeg

        bounds = batch.offsets.tolist()
        jpegs = [batch.data[a:b] for a, b in itertools.pairwise(bounds)]
        try:
            return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            pass  # the call says not which image failed: decode them one by one to name it
        for jpeg, at in zip(jpegs, batch.encoded_at.tolist(), strict=True):
            try:
                decode_jpeg([jpeg], mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError as error:
                raise self.images.error(int(batch.indices[at]), _clean(error)) from error
        raise DataError(f"{self.images.split}: a batch of JPEGs could not be decoded together "
                        f"on {self.device}, though each one alone can; use dataset.decode=workers")


def crop_resize(image: torch.Tensor, top: int, left: int, height: int, width: int, flip: int,
                *, size: int) -> torch.Tensor:
    """uint8 3xHxW -> the box's region, resized to uint8 3 x size x size (antialiased
    bilinear, as the workers path and torchvision's Resize) and mirrored if `flip`."""
    region = image[None, :, top:top + height, left:left + width]
    if (height, width) != (size, size):
        # Floats: CUDA's antialiased kernel takes no uint8; the CPU runs the same code.
        region = F.interpolate(region.float(), size=(size, size), mode="bilinear",
                               antialias=True, align_corners=False)
        region = region.round_().clamp_(0, 255).to(torch.uint8)
    return region[0].flip(2) if flip else region[0]


class DecodedLoader:
    """A DataLoader of EncodedBatches, decoded here: iterates like the workers path's loader
    (and has its sampler), but its images are already on the device."""

    def __init__(self, loader: torch.utils.data.DataLoader, decode: Callable):
        self.loader, self.decode = loader, decode
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            yield self.decode(batch)


def _clean(error: BaseException) -> str:
    """torchvision's message without its C++ source location ("decode_jpeg, FILE.cpp:171, ")."""
    return re.sub(r"^\w+, \S+:\d+, ", "", one_line(error))
