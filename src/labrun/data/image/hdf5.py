"""HDF5 datasets written by `labrun convert` (layout in docs/ARCHITECTURE.md).

    /{split}/data     uint8, flat: every sample's bytes end to end
    /{split}/offsets  int64, n + 1: sample i is data[offsets[i]:offsets[i + 1]]
    /{split}/labels   int64, n
    root attributes   labrun_format=1, storage (jpeg | raw), classes, source, and shape for raw

One flat array plus offsets, not a variable-length entry per image: a slice of a contiguous
array reads in about 8 us, a variable-length entry in about 52 us.

The file is checked at start-up, in the main process, and closed again: an HDF5 handle must not
cross a fork into the DataLoader workers. Each process then opens the file on its first load()
and keeps it open; offsets and labels are read once, at start-up, and shared with the workers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from labrun.core.errors import DataError
from labrun.data.image.decode import JpegImage, decode, open_image, resolve

FORMAT = 1
STORAGES = ("jpeg", "raw")
SPLIT_ORDER = ("train", "val", "test")


@dataclass
class SplitIndex:
    offsets: np.ndarray  # int64, n + 1
    labels: np.ndarray  # int64, n


@dataclass
class FileIndex:
    """What `read_index` found in a valid file: everything except the samples themselves."""

    path: str
    storage: str
    class_names: list[str]
    source: str
    shape: tuple[int, ...] | None  # raw storage: every sample's HxWxC
    splits: dict[str, SplitIndex] = field(default_factory=dict)


def read_index(path: str | os.PathLike) -> FileIndex:
    """Open, check the layout, read offsets and labels, close. DataError for any problem."""
    path = str(path)
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file; create it with `labrun convert SRC_DIR {path}`")
    try:
        file = open_file(path)
    except OSError as error:
        reason = str(error).splitlines()[0].removeprefix("Unable to synchronously open file ")
        cut = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", reason)
        if cut:  # usually a copy or download that did not finish
            raise DataError(f"{path} is truncated: {cut[1]} of its {cut[2]} bytes are there; "
                            f"copy it again, or convert again: labrun convert SRC_DIR {path} "
                            f"--force") from error
        raise DataError(f"{path} is not a readable HDF5 file {reason}; was it written by "
                        f"`labrun convert`? Convert again: labrun convert SRC_DIR {path} --force"
                        ) from error
    with file:
        return _check(path, file)


def open_file(path: str) -> h5py.File:
    # No HDF5 file locking: readers only, of a file `labrun convert` renames into place once
    # complete, and locks fail on the NFS/Lustre mounts where lab datasets often live.
    return h5py.File(path, "r", locking=False)


def _check(path: str, file: h5py.File) -> FileIndex:
    def fail(problem: str) -> DataError:
        return DataError(f"{path}: {problem}; was it written by `labrun convert`? "
                         f"Convert again: labrun convert SRC_DIR {path} --force")

    attrs = file.attrs
    if "labrun_format" not in attrs:
        raise fail("not a labrun dataset (no labrun_format attribute)")
    if _text(attrs.get("kind", "")) == "segmentation":  # data/segmentation/hdf5.py's
        raise DataError(f"{path} holds images and masks (labrun convert seg); read it with "
                        f"dataset=seg_hdf5 task=segmentation")
    if _text(attrs.get("kind", "")) == "detection":  # data/detection/hdf5.py's
        raise DataError(f"{path} holds images and boxes (labrun convert det); read it with "
                        f"dataset=det_hdf5")
    if int(attrs["labrun_format"]) != FORMAT:
        raise DataError(f"{path} has labrun_format={attrs['labrun_format']} but this labrun "
                        f"reads format {FORMAT}; convert the images again with this labrun")
    storage = _text(attrs.get("storage"))
    if storage not in STORAGES:
        raise fail(f"storage attribute is {storage!r}, not one of {', '.join(STORAGES)}")
    shape = None
    if storage == "raw":
        shape = tuple(int(s) for s in np.atleast_1d(attrs.get("shape", [])))
        if len(shape) != 3 or min(shape) <= 0:
            raise fail("raw storage without a valid shape attribute (height, width, channels)")
    class_names = [_text(c) for c in np.atleast_1d(attrs.get("classes", []))]
    if not class_names:
        raise fail("no classes attribute")
    index = FileIndex(path, storage, class_names, _text(attrs.get("source", "")), shape)
    names = sorted(file, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 3, s))
    if "train" not in names:
        raise fail("no /train group")
    for split in names:
        group = file[split]
        for name, dtype in (("data", np.uint8), ("offsets", np.int64), ("labels", np.int64)):
            if not isinstance(group.get(name), h5py.Dataset):
                raise fail(f"/{split}/{name} is missing")
            if group[name].dtype != dtype or group[name].ndim != 1:
                raise fail(f"/{split}/{name} is {group[name].dtype} {group[name].shape}, not a "
                           f"1-D {np.dtype(dtype)} array")
        offsets, labels = group["offsets"][:], group["labels"][:]
        if len(offsets) != len(labels) + 1:
            raise fail(f"/{split} has {len(labels)} labels but {len(offsets)} offsets "
                       f"(should be {len(labels) + 1})")
        if offsets[0] != 0 or offsets[-1] != group["data"].shape[0] or np.any(np.diff(offsets) < 0):
            raise fail(f"/{split}/offsets do not cover /{split}/data in order")
        if shape is not None and np.any(np.diff(offsets) != np.prod(shape)):
            raise fail(f"/{split} has samples whose size is not {shape}")
        if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
            raise fail(f"/{split}/labels has values outside 0..{len(class_names) - 1}")
        index.splits[split] = SplitIndex(offsets, labels)
    return index


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class HDF5Source:
    """One split of a labrun HDF5 file; the file is opened lazily, once per process."""

    def __init__(self, index: FileIndex, split: str, decoder: str):
        self.path, self.split, self.decoder = index.path, split, decoder
        self.storage, self.shape = index.storage, index.shape
        self.holds_jpeg = self.storage == "jpeg"  # convert stores every image as a JPEG
        self.offsets, self.labels = index.splits[split].offsets, index.splits[split].labels
        self.class_names = index.class_names
        self.name = f"{self.path}:/{split}"
        # Said with any error about a sample, also one that a transform meets when it decodes.
        self.hint = f"check the file with `labrun convert --verify {self.path}`"
        self._file = self._data = self._pid = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self) -> dict:
        # Never pickle a handle (spawned workers): the receiver opens its own.
        return {**self.__dict__, "_file": None, "_data": None, "_pid": None}

    def read(self, index: int) -> np.ndarray:
        """Sample `index` as stored: encoded bytes (jpeg) or the flat pixels (raw)."""
        if self._pid != os.getpid():  # first read in this process, or a forked copy of a handle
            self._file = open_file(self.path)
            self._data, self._pid = self._file[self.split]["data"], os.getpid()
        return self._data[self.offsets[index]:self.offsets[index + 1]]

    def load(self, index: int, min_size: int | None = None) -> np.ndarray:
        return self._decoded(index, lambda stored: decode(stored, self.decoder, min_size))

    def open(self, index: int) -> np.ndarray | JpegImage:
        return self._decoded(index, lambda stored: open_image(stored, self.decoder))

    def _decoded(self, index: int, decode_stored: Callable) -> np.ndarray | JpegImage:
        stored = self.read(index)
        if self.shape is not None:
            return stored.reshape(self.shape)
        try:
            return decode_stored(stored)
        except Exception as error:
            raise DataError(f"{self.describe(index)} could not be decoded ({error}); "
                            f"{self.hint}") from error

    def describe(self, index: int) -> str:
        return f"{self.path}: {self.split} sample {index}"


def load(path: str, decoder: str) -> dict[str, HDF5Source]:
    index = read_index(path)
    decoder = resolve(decoder) if index.storage == "jpeg" else decoder
    return {split: HDF5Source(index, split, decoder) for split in index.splits}
