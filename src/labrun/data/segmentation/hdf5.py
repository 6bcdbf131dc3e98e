"""dataset=seg_hdf5: a segmentation folder (segfolder.py) in one HDF5 file, written by
`labrun convert seg SRC_DIR OUT.h5` (labrun.cli.convert_seg) and read by load().

    /{split}/images         uint8, flat: every image file's bytes end to end, as the file holds
                            them (a JPEG stays a JPEG)
    /{split}/image_offsets  int64, n + 1: image i is images[image_offsets[i]:image_offsets[i + 1]]
    /{split}/masks          uint8, flat: every mask as a PNG (masks.encode_mask), end to end
    /{split}/mask_offsets   int64, n + 1
    /{split}/names          each image's path in the folder, for errors that name a sample
    root attributes         labrun_format=1, kind=segmentation, classes, source

Flat arrays plus offsets, as the image classification file (data/image/hdf5.py): a slice of a
contiguous array reads in microseconds. Images are kept as their files' bytes, so a JPEG's
training crop decodes only its region (decode.open_image -> JpegImage), as from the folder.
Masks are kept as PNGs, for size: a 1024x768 mask of a few regions is ~10 KB as a PNG against
786 KB raw, so a file of raw masks would be mostly masks. Each is stored re-encoded as a palette
PNG of the same values (masks.encode_mask), whose unfiltered rows decode in ~0.45 ms where a
grey PNG's filtered ones took ~1.35 ms (the bench's masks, here); the folder's masks and the
file's give exactly the same values. Nothing of a run's settings is stored (ignore_index,
sizes): one file serves any.

Every pair is decoded once while converting, in parallel (where masks are re-encoded), so a
corrupt file or a mask of another size than its image is refused now, naming it, rather than
mid-run. The file is written under a temporary name and renamed when complete (core.files.
atomic_path): an interrupted or refused conversion leaves no OUT.h5 that a run could read.

As for classification, each process opens the file on its first read and keeps it open (an
HDF5 handle must not be used across a fork into the DataLoader workers); offsets are read once,
at start-up, and shared with the workers. A source reads a pair whole (open) or its image bytes
and mask apart (read, mask: for dataset.decode=cpu|cuda), as segfolder's does.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import h5py
import numpy as np
from rich.console import Console

from labrun.core.errors import DataError, LabrunError, one_line
from labrun.core.files import atomic_path
from labrun.data.image.convert import _human, _mapper, _progress  # one progress bar, one pool
from labrun.data.image.decode import JpegImage, decode, open_image, resolve
from labrun.data.image.hdf5 import open_file
from labrun.data.image.imagefolder import JPEG_SUFFIXES
from labrun.data.segmentation import segfolder
from labrun.data.segmentation.masks import PngMask, encode_mask, open_mask, read_mask

FORMAT = 1
KIND = "segmentation"  # tells this file from a classification one (data/image/hdf5.py)
SPLIT_ORDER = ("train", "val", "test")
DATASETS = ("images", "image_offsets", "masks", "mask_offsets")
COPY_BLOCK = 64 << 20  # bytes of masks copied into the file at a time


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class SplitReport:
    pairs: int = 0
    image_bytes: int = 0
    mask_bytes: int = 0


def convert(src: str, out: str, *, num_classes: int | None = None, workers: int = 1,
            force: bool = False, console: Console | None = None) -> dict[str, SplitReport]:
    """Write segmentation folder `src` to `out`; returns what was written per split."""
    console = console or Console(soft_wrap=True)
    out_path = Path(out)
    if out_path.is_dir():
        raise LabrunError(f"{out} is a folder; give the path of the .h5 file to write")
    if out_path.exists() and not force:
        raise LabrunError(f"{out} already exists; pass --force to overwrite it")
    splits = segfolder.scan(src)
    names = class_names(src, num_classes)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    prepare = partial(prepare_pair, decoder=resolve("turbojpeg"))
    start = time.perf_counter()
    reports: dict[str, SplitReport] = {}
    with atomic_path(out_path, unique=True) as temporary:
        with _mapper(workers) as mapper, h5py.File(temporary, "w") as file, \
                _progress(console) as progress:
            file.attrs["labrun_format"] = FORMAT
            file.attrs["kind"] = KIND
            file.attrs["classes"] = np.array(names, dtype=h5py.string_dtype())
            file.attrs["source"] = str(Path(src).resolve())
            for split, pairs in splits.items():
                task = progress.add_task(split, total=len(pairs))
                reports[split] = write_split(file.create_group(split), Path(src), pairs,
                                             mapper(prepare, pairs),
                                             partial(progress.advance, task))
    seconds = time.perf_counter() - start
    console.print(f"{src} -> {out}: {len(names)} classes ({', '.join(names[:8])}"
                  f"{', ...' if len(names) > 8 else ''})", highlight=False, markup=False)
    for split, r in reports.items():
        console.print(f"  {split}: {r.pairs} pairs, images {_human(r.image_bytes)}, masks "
                      f"{_human(r.mask_bytes)}", highlight=False)
    total = sum(r.pairs for r in reports.values())
    console.print(f"time: {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} pairs/s)",
                  highlight=False)
    return reports


def class_names(src: str, num_classes: int | None) -> list[str]:
    """segfolder's class names, with the command's own option named in the errors."""
    listed = Path(src) / "classes.txt"
    if not listed.is_file() and num_classes is None:
        raise DataError(f"{src} has no classes.txt; pass --num-classes N (mask values "
                        f"0..N-1), or write one class name per line into {listed}")
    names = segfolder.class_names(src, None if listed.is_file() else num_classes)
    if num_classes is not None and num_classes != len(names):
        raise DataError(f"--num-classes={num_classes}, but {listed} names {len(names)} "
                        f"classes; drop --num-classes or fix the file")
    return names


def prepare_pair(pair: tuple[Path, Path], decoder: str) -> tuple[str | None, bytes]:
    """(why this image and mask cannot be stored, or None; the mask's PNG to store). Runs in
    the worker processes."""
    image_path, mask_path = pair
    try:
        image = decode(image_path.read_bytes(), decoder)
    except Exception as error:  # corrupt, truncated or not an image: the same answer
        return (f"{image_path} is not a readable image ({one_line(error)}); replace it, or "
                f"remove it and its mask"), b""
    try:
        mask = read_mask(mask_path)
    except DataError as error:
        return str(error), b""
    except OSError as error:
        return (f"{mask_path} could not be read ({one_line(error)}); replace it, or remove it "
                f"and its image"), b""
    if image.shape[:2] != mask.shape:
        return (f"{mask_path} is {mask.shape[1]}x{mask.shape[0]} (width x height) but its "
                f"image {image_path.name} is {image.shape[1]}x{image.shape[0]}; masks must "
                f"match their image's size"), b""
    return None, encode_mask(mask)


def write_split(group: h5py.Group, root: Path, pairs: list[tuple[Path, Path]], prepared,
                advance) -> SplitReport:
    """Store one split's pairs in order; `prepared` yields prepare_pair's answer for each."""
    # The image files' sizes give their offsets up front: the dataset is created at its exact
    # size (contiguous storage, which reads fastest) and every file is written straight into
    # it. The masks' sizes are known once they are encoded: they wait in a scratch file beside
    # the output (a split's masks may not fit in memory) and are copied in at the end.
    image_offsets = _offsets(image for image, _ in pairs)
    images = group.create_dataset("images", shape=(image_offsets[-1],), dtype=np.uint8)
    mask_sizes = []
    with tempfile.TemporaryFile(dir=Path(group.file.filename).parent) as spilled:
        for i, ((image, _), (problem, mask)) in enumerate(zip(pairs, prepared, strict=True)):
            if problem is not None:
                raise DataError(problem)
            _put(images, image_offsets, i, image)
            spilled.write(mask)
            mask_sizes.append(len(mask))
            advance()
        mask_offsets = np.concatenate([[0], np.cumsum(mask_sizes)]).astype(np.int64)
        masks = group.create_dataset("masks", shape=(mask_offsets[-1],), dtype=np.uint8)
        spilled.seek(0)
        for start in range(0, int(mask_offsets[-1]), COPY_BLOCK):
            block = np.frombuffer(spilled.read(COPY_BLOCK), dtype=np.uint8)
            masks[start:start + len(block)] = block
    group.create_dataset("image_offsets", data=image_offsets)
    group.create_dataset("mask_offsets", data=mask_offsets)
    group.create_dataset("names", data=np.array([str(image.relative_to(root))
                                                 for image, _ in pairs],
                                                dtype=h5py.string_dtype()))
    return SplitReport(len(pairs), int(image_offsets[-1]), int(mask_offsets[-1]))


def _offsets(paths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([path.stat().st_size for path in paths])]
                          ).astype(np.int64)


def _put(dataset: h5py.Dataset, offsets: np.ndarray, index: int, path: Path) -> None:
    data = path.read_bytes()
    if len(data) != offsets[index + 1] - offsets[index]:
        raise DataError(f"{path} changed while it was being converted; convert again once "
                        f"nothing writes to the folder")
    dataset[offsets[index]:offsets[index + 1]] = np.frombuffer(data, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class SplitIndex:
    image_offsets: np.ndarray  # int64, n + 1
    mask_offsets: np.ndarray  # int64, n + 1
    names: list[str]


@dataclass
class FileIndex:
    """What read_index found in a valid file: everything except the pairs themselves."""

    path: str
    class_names: list[str]
    source: str
    splits: dict[str, SplitIndex] = field(default_factory=dict)


def read_index(path: str | os.PathLike) -> FileIndex:
    """Open, check the layout, read the offsets and names, close. DataError for any problem."""
    path = str(path)
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file; create it with `labrun convert seg SRC_DIR "
                        f"{path}`")
    try:
        file = open_file(path)
    except OSError as error:
        raise DataError(f"{path} is not a readable HDF5 file ({one_line(error)}); copy it "
                        f"again, or convert again: labrun convert seg SRC_DIR {path} --force"
                        ) from error
    with file:
        return _check(path, file)


def _check(path: str, file: h5py.File) -> FileIndex:
    def fail(problem: str) -> DataError:
        return DataError(f"{path}: {problem}; was it written by `labrun convert seg`? "
                         f"Convert again: labrun convert seg SRC_DIR {path} --force")

    attrs = file.attrs
    if "labrun_format" not in attrs:
        raise fail("not a labrun dataset (no labrun_format attribute)")
    if _text(attrs.get("kind", "")) == "detection":  # data/detection/hdf5.py's
        raise DataError(f"{path} holds images and boxes (labrun convert det); read it with "
                        f"dataset=det_hdf5")
    if _text(attrs.get("kind", "")) != KIND:
        raise DataError(f"{path} is an image classification file (one label per image); read "
                        f"it with dataset=hdf5, or convert a segmentation folder for "
                        f"dataset=seg_hdf5: labrun convert seg SRC_DIR OUT.h5")
    if int(attrs["labrun_format"]) != FORMAT:
        raise DataError(f"{path} has labrun_format={attrs['labrun_format']} but this labrun "
                        f"reads format {FORMAT}; convert the folder again with this labrun")
    names = [_text(c) for c in np.atleast_1d(attrs.get("classes", []))]
    if not names:
        raise fail("no classes attribute")
    index = FileIndex(path, names, _text(attrs.get("source", "")))
    if "train" not in file:
        raise fail("no /train group")
    for split in sorted(file, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 3, s)):
        group = file[split]
        for name in (*DATASETS, "names"):
            if not isinstance(group.get(name), h5py.Dataset) or group[name].ndim != 1:
                raise fail(f"/{split}/{name} is missing or not a 1-D array")
        offsets = {}
        for data, dtype in (("images", np.uint8), ("masks", np.uint8)):
            found = group[f"{data[:-1]}_offsets"]
            if group[data].dtype != dtype or found.dtype != np.int64:
                raise fail(f"/{split}/{data} or its offsets have the wrong type")
            offsets[data] = found[:]
            ends = offsets[data]
            if ends[0] != 0 or ends[-1] != group[data].shape[0] or np.any(np.diff(ends) < 0):
                raise fail(f"/{split}/{data[:-1]}_offsets do not cover /{split}/{data} in order")
        if not len(offsets["images"]) == len(offsets["masks"]) == len(group["names"]) + 1:
            raise fail(f"/{split} holds different numbers of images, masks and names")
        index.splits[split] = SplitIndex(offsets["images"], offsets["masks"],
                                         [_text(n) for n in group["names"][:]])
    return index


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SegHDF5Source:
    """One split of a seg_hdf5 file; the file is opened lazily, once per process."""

    dense = True  # its labels are masks (labrun.data.segmentation)

    def __init__(self, index: FileIndex, split: str, decoder: str):
        self.path, self.split, self.decoder = index.path, split, decoder
        self.image_offsets = index.splits[split].image_offsets
        self.mask_offsets = index.splits[split].mask_offsets
        self.names = np.array(index.splits[split].names, dtype=np.str_)  # one object to pickle
        self.class_names = index.class_names
        self.name = f"{self.path}:/{split}"
        self._file = self._images = self._masks = self._pid = None

    def __len__(self) -> int:
        return len(self.names)

    def __getstate__(self) -> dict:
        # Never pickle a handle (spawned workers): the receiver opens its own.
        return {**self.__dict__, "_file": None, "_images": None, "_masks": None, "_pid": None}

    @functools.cached_property
    def holds_jpeg(self) -> bool:
        """Whether any image is a JPEG file (by its name, as segfolder's): only asked by
        dataset.decode=cpu|cuda."""
        return any(os.path.splitext(name)[1].lower().encode() in JPEG_SUFFIXES
                   for name in self.names)

    def _open_here(self) -> None:
        if self._pid != os.getpid():  # first read in this process, or a forked copy of a handle
            self._file = open_file(self.path)
            group = self._file[self.split]
            self._images, self._masks, self._pid = group["images"], group["masks"], os.getpid()

    def read(self, index: int) -> np.ndarray:
        """Image `index`'s file bytes, as stored."""
        self._open_here()
        return self._images[self.image_offsets[index]:self.image_offsets[index + 1]]

    def mask(self, index: int) -> np.ndarray | PngMask:
        """Mask `index`'s PNG, as stored (masks.open_mask)."""
        self._open_here()
        stored = self._masks[self.mask_offsets[index]:self.mask_offsets[index + 1]]
        return open_mask(stored, f"{self.describe(index)}'s mask")

    def open(self, index: int) -> tuple[np.ndarray | JpegImage, np.ndarray | PngMask]:
        try:
            image = open_image(self.read(index), self.decoder)
        except Exception as error:
            raise DataError(f"{self.describe(index)} could not be decoded ({one_line(error)}); "
                            f"convert the folder again: labrun convert seg SRC_DIR {self.path} "
                            f"--force") from error
        return image, self.mask(index)

    def describe(self, index: int) -> str:
        return f"{self.path}: {self.split} sample {index} ({self.names[index]})"


def load(path: str, decoder: str) -> dict[str, SegHDF5Source]:
    index = read_index(path)
    decoder = resolve(decoder)
    return {split: SegHDF5Source(index, split, decoder) for split in index.splits}
