"""dataset=det_hdf5: a detection dataset (COCO's layout or a YOLO data.yaml: coco.py, yolo.py)
in one HDF5 file, written by `labrun convert det SRC OUT.h5` (labrun.cli.convert_det) and read
by load(). This module owns the layout:

    /{split}/images         uint8, flat: every image file's bytes end to end, as the file holds
                            them (a JPEG stays a JPEG, a PNG a PNG: nothing is re-encoded)
    /{split}/image_offsets  int64, n + 1: image i is images[image_offsets[i]:image_offsets[i + 1]]
    /{split}/widths         int32, n: each image's size, in the pixels its boxes are in
    /{split}/heights        int32, n
    /{split}/image_ids      int64, n: COCO's image ids (evaluation names them); a YOLO image's
                            position in its split
    /{split}/names          each image's path under the source's root, for errors that name it
    /{split}/boxes          float32, [total, 4]: every image's boxes end to end, x1 y1 x2 y2 in
                            its pixels (boxes.Objects)
    /{split}/labels         int64, total: class indices
    /{split}/crowd          bool, total: COCO's crowd regions
    /{split}/box_offsets    int64, n + 1: image i's objects are boxes[box_offsets[i]:...[i + 1]]
    /{split} attributes     clipped, dropped: what boxes.checked fixed while converting
    root attributes         labrun_format=1, kind=detection, classes, category_ids (COCO only:
                            class index -> category id), source, source_format (coco | yolo)

Flat arrays plus offsets, as the other labrun files (data/image/hdf5.py, data/segmentation/
hdf5.py). Images are their files' bytes, so a JPEG's training crop decodes only its region
(decode.open_image -> JpegImage), as from the folder. The labels are checked while converting
exactly as the folder's readers check them (read_split: one line naming the file and the line
or annotation), and each image's header is read, so that an unreadable image, or one of
another size than its annotation says (its boxes would be in the wrong pixels), is refused now
rather than mid-run. The file is written under a temporary name and renamed when complete
(core.files.atomic_path): an interrupted or refused conversion leaves no OUT.h5.

Reading: the boxes of a split are a few bytes per object (COCO's train: 860k objects, ~25 MB),
so they are read once at start-up and shared with the DataLoader workers; the images are read
per sample from a handle each process opens on its first read (an HDF5 handle must not cross a
fork), as for segmentation.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import h5py
import numpy as np
from PIL import Image
from rich.console import Console

from labrun.core.errors import DataError, LabrunError, one_line
from labrun.core.files import atomic_path
from labrun.data.detection import DetectionSplit, coco, yolo
from labrun.data.detection.boxes import Cleaned, Objects
from labrun.data.image.convert import _human, _progress  # one progress bar for every converter
from labrun.data.image.decode import JpegImage, open_image, resolve
from labrun.data.image.hdf5 import open_file

FORMAT = 1
KIND = "detection"  # tells this file from a classification or segmentation one
SPLIT_ORDER = ("train", "val", "test")
CONVERT = "labrun convert det SRC"  # the command that writes this file, named in errors


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class SplitReport:
    images: int
    boxes: int
    image_bytes: int
    cleaned: Cleaned  # what boxes.checked fixed: printed, and kept in the file


def convert(src: str, out: str, *, force: bool = False, console: Console | None = None
            ) -> dict[str, SplitReport]:
    """Write COCO folder or YOLO data.yaml `src` to `out`; returns what was written per split."""
    console = console or Console(soft_wrap=True)
    out_path = Path(out)
    if out_path.is_dir():
        raise LabrunError(f"{out} is a folder; give the path of the .h5 file to write")
    if out_path.exists() and not force:
        raise LabrunError(f"{out} already exists; pass --force to overwrite it")
    source_format, root, splits = read_source(src)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    reports = write(splits, out_path, root=root, source_format=source_format, console=console)
    seconds = time.perf_counter() - start
    names = splits[0].class_names
    console.print(f"{src} -> {out}: {source_format}, {len(names)} classes ({', '.join(names[:8])}"
                  f"{', ...' if len(names) > 8 else ''})", highlight=False, markup=False)
    for split, r in reports.items():
        console.print(f"  {split}: {r.images} images, {r.boxes} boxes, images "
                      f"{_human(r.image_bytes)}", highlight=False, markup=False)
        fixed = r.cleaned.line(split)
        if fixed:
            console.print(f"  {fixed}", highlight=False, markup=False)
    total = sum(r.images for r in reports.values())
    console.print(f"time: {seconds:.1f} s ({total / max(seconds, 1e-9):.0f} images/s)",
                  highlight=False)
    return reports


def read_source(src: str | os.PathLike) -> tuple[str, Path, list[DetectionSplit]]:
    """(coco | yolo, the root the images' names are kept relative to, the splits found, each
    read and checked by its format's reader). DataError for a source that is neither layout."""
    path = Path(src)
    if path.is_dir() and not any((path / "annotations").glob("instances_*.json")) \
            and (path / "data.yaml").is_file():
        path = path / "data.yaml"  # a YOLO dataset's folder: its data.yaml
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        data, root, _ = yolo.read_data_yaml(path)
        found = [split for split in SPLIT_ORDER if data.get(split)]
        if not found:
            raise DataError(f"{path}: none of {', '.join(SPLIT_ORDER)} names images; a data.yaml "
                            f"has train: and val: (folders or .txt lists under {root})")
        return "yolo", root, [yolo.read_split(path, split) for split in found]
    if path.is_dir() and any((path / "annotations").glob("instances_*.json")):
        found = [split for split in SPLIT_ORDER
                 if any((path / "annotations").glob(f"instances_{split}*.json"))]
        if not found:
            there = sorted(p.name for p in (path / "annotations").glob("instances_*.json"))
            raise DataError(f"{path / 'annotations'}: {', '.join(there)} name no split; COCO's "
                            f"layout is instances_train2017.json, instances_val2017.json")
        return "coco", path, [coco.read_split(path, split) for split in found]
    what = ("no such file or folder" if not path.exists() else
            "neither a COCO folder nor a YOLO data.yaml")
    raise DataError(f"{src}: {what}; give a COCO folder (SRC/annotations/instances_*.json) "
                    f"or a YOLO data.yaml")


def write(splits: list[DetectionSplit], out: str | os.PathLike, *, root: str | os.PathLike,
          source_format: str, console: Console | None = None) -> dict[str, SplitReport]:
    """Write the splits (their class names must agree) to `out`, atomically; `root` is the
    folder the images' names are stored relative to. Returns what was written per split."""
    console = console or Console(soft_wrap=True)
    names, category_ids = splits[0].class_names, splits[0].category_ids
    for split in splits[1:]:
        if (split.class_names, split.category_ids) != (names, category_ids):
            raise DataError(f"the {split.name} split's classes ({', '.join(split.class_names)})"
                            f" differ from the {splits[0].name} split's ({', '.join(names)}); "
                            f"one file holds one set of classes: make the splits' agree")
    reports: dict[str, SplitReport] = {}
    with atomic_path(out, unique=True) as temporary:
        with h5py.File(temporary, "w") as file, _progress(console) as progress:
            file.attrs["labrun_format"] = FORMAT
            file.attrs["kind"] = KIND
            file.attrs["classes"] = np.array(names, dtype=h5py.string_dtype())
            if category_ids is not None:
                file.attrs["category_ids"] = np.array(category_ids, np.int64)
            file.attrs["source"] = str(Path(root).resolve())
            file.attrs["source_format"] = source_format
            for split in splits:
                task = progress.add_task(split.name, total=len(split.items))
                reports[split.name] = write_split(file.create_group(split.name), split,
                                                  Path(root), partial(progress.advance, task))
    return reports


def write_split(group: h5py.Group, split: DetectionSplit, root: Path, advance) -> SplitReport:
    """Store one split's images and objects in order."""
    items = split.items
    # The files' sizes give their offsets up front: the dataset is created at its exact size
    # (contiguous storage, which reads fastest) and every file is written straight into it.
    image_offsets = np.concatenate([[0], np.cumsum([i.path.stat().st_size for i in items])]
                                   ).astype(np.int64)
    images = group.create_dataset("images", shape=(image_offsets[-1],), dtype=np.uint8)
    for index, item in enumerate(items):
        data = item.path.read_bytes()
        if len(data) != image_offsets[index + 1] - image_offsets[index]:
            raise DataError(f"{item.path} changed while it was being converted; convert again "
                            f"once nothing writes to the folder")
        check_image(data, item.path, item.width, item.height)
        images[image_offsets[index]:image_offsets[index + 1]] = np.frombuffer(data, np.uint8)
        advance()
    objects = [item.objects for item in items]
    box_offsets = np.concatenate([[0], np.cumsum([len(o) for o in objects])]).astype(np.int64)
    group.create_dataset("image_offsets", data=image_offsets)
    group.create_dataset("widths", data=np.array([i.width for i in items], np.int32))
    group.create_dataset("heights", data=np.array([i.height for i in items], np.int32))
    group.create_dataset("image_ids", data=np.array(
        [index if item.image_id is None else item.image_id for index, item in enumerate(items)],
        np.int64))
    group.create_dataset("names", data=np.array([_relative(item.path, root) for item in items],
                                                dtype=h5py.string_dtype()))
    group.create_dataset("boxes", data=_joined([o.boxes for o in objects], np.float32, (0, 4)))
    group.create_dataset("labels", data=_joined([o.labels for o in objects], np.int64, (0,)))
    group.create_dataset("crowd", data=_joined([o.crowd for o in objects], bool, (0,)))
    group.create_dataset("box_offsets", data=box_offsets)
    group.attrs["clipped"], group.attrs["dropped"] = split.cleaned.clipped, split.cleaned.dropped
    return SplitReport(len(items), int(box_offsets[-1]), int(image_offsets[-1]), split.cleaned)


def check_image(data: bytes, path: Path, width: int, height: int) -> None:
    """Refuse a file that is no readable image, or one whose size is not its annotation's (its
    boxes would then be in other pixels). Pillow reads the header only: fast."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            size = image.size
    except Exception as error:  # truncated, corrupt or not an image: the same answer
        raise DataError(f"{path} is not a readable image ({one_line(error)}); replace it, or "
                        f"remove it and its labels") from None
    if size != (width, height):
        raise DataError(f"{path} is {size[0]}x{size[1]} (width x height), but its annotation "
                        f"says {width}x{height}; its boxes would be in other pixels: fix the "
                        f"annotation's width and height")


def _joined(arrays: list[np.ndarray], dtype, empty_shape: tuple[int, ...]) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(empty_shape, dtype)


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:  # a YOLO .txt list may name images outside data.yaml's root
        return str(path)


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class SplitIndex:
    """Everything of a split but its image bytes: small enough to hold in memory."""

    image_offsets: np.ndarray  # int64, n + 1
    widths: np.ndarray  # int32, n
    heights: np.ndarray  # int32, n
    image_ids: np.ndarray  # int64, n
    names: np.ndarray  # str, n
    boxes: np.ndarray  # float32, [total, 4]
    labels: np.ndarray  # int64, total
    crowd: np.ndarray  # bool, total
    box_offsets: np.ndarray  # int64, n + 1
    cleaned: Cleaned


@dataclass
class FileIndex:
    path: str
    class_names: list[str]
    category_ids: list[int] | None
    source: str
    splits: dict[str, SplitIndex]


def read_index(path: str | os.PathLike) -> FileIndex:
    """Open, check the layout and version, read everything but the images, close. DataError
    (one line) for any problem."""
    path = str(path)
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file; create it with `{CONVERT} {path}` (SRC: a COCO "
                        f"folder or a YOLO data.yaml)")
    try:
        file = open_file(path)
    except OSError as error:
        raise DataError(f"{path} is not a readable HDF5 file ({one_line(error)}); copy it "
                        f"again, or convert again: {CONVERT} {path} --force") from error
    with file:
        return _check(path, file)


# Each split's arrays: (name, dtype, shape after the first axis).
PER_IMAGE = (("widths", np.int32), ("heights", np.int32), ("image_ids", np.int64))
PER_BOX = (("boxes", np.float32, (4,)), ("labels", np.int64, ()), ("crowd", np.bool_, ()))


def _check(path: str, file: h5py.File) -> FileIndex:
    def fail(problem: str) -> DataError:
        return DataError(f"{path}: {problem}; was it written by `labrun convert det`? Convert "
                         f"again: {CONVERT} {path} --force")

    attrs = file.attrs
    if "labrun_format" not in attrs:
        raise fail("not a labrun dataset (no labrun_format attribute)")
    kind = _text(attrs.get("kind", ""))
    if kind != KIND:
        other = ("images and masks (labrun convert seg); read it with dataset=seg_hdf5"
                 if kind == "segmentation" else
                 "images with a label each (labrun convert); read it with dataset=hdf5")
        raise DataError(f"{path} holds {other}, not detection data; convert a COCO folder or "
                        f"a YOLO data.yaml for dataset=det_hdf5: {CONVERT} OUT.h5")
    if int(attrs["labrun_format"]) != FORMAT:
        raise DataError(f"{path} has labrun_format={attrs['labrun_format']} but this labrun "
                        f"reads detection format {FORMAT}; convert again with this labrun: "
                        f"{CONVERT} {path} --force")
    names = [_text(c) for c in np.atleast_1d(attrs.get("classes", []))]
    if not names:
        raise fail("no classes attribute")
    category_ids = ([int(c) for c in np.atleast_1d(attrs["category_ids"])]
                    if "category_ids" in attrs else None)
    if category_ids is not None and len(category_ids) != len(names):
        raise fail(f"{len(category_ids)} category_ids for {len(names)} classes")
    if not len(file):
        raise fail("no split groups")
    order = sorted(file, key=lambda s: (SPLIT_ORDER.index(s) if s in SPLIT_ORDER else 3, s))
    splits = {split: _check_split(file[split], f"/{split}", len(names), fail) for split in order}
    return FileIndex(path, names, category_ids, _text(attrs.get("source", "")), splits)


def _check_split(group: h5py.Group, where: str, num_classes: int, fail) -> SplitIndex:
    def read(name: str, dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
        found = group.get(name)
        if not isinstance(found, h5py.Dataset) or found.dtype != dtype or found.shape[1:] != tail:
            raise fail(f"{where}/{name} is missing or not {np.dtype(dtype)} "
                       f"[n{''.join(f', {t}' for t in tail)}]")
        return found[()]

    images = group.get("images")
    if not isinstance(images, h5py.Dataset) or images.dtype != np.uint8 or images.ndim != 1:
        raise fail(f"{where}/images is missing or not a 1-D uint8 array")
    image_offsets, box_offsets = read("image_offsets", np.int64), read("box_offsets", np.int64)
    per_image = {name: read(name, dtype) for name, dtype in PER_IMAGE}
    per_box = {name: read(name, dtype, tail) for name, dtype, tail in PER_BOX}
    text = read("names", h5py.string_dtype())
    for offsets, total, what in ((image_offsets, images.shape[0], "images"),
                                 (box_offsets, len(per_box["boxes"]), "boxes")):
        if (len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != total
                or np.any(np.diff(offsets) < 0)):
            raise fail(f"{where}'s offsets do not cover {where}/{what} in order")
    count = len(image_offsets) - 1
    if len(box_offsets) - 1 != count or any(len(a) != count
                                            for a in [*per_image.values(), text]):
        raise fail(f"{where} holds different numbers of images, names and box lists")
    if any(len(a) != box_offsets[-1] for a in per_box.values()):
        raise fail(f"{where}'s boxes, labels and crowd differ in length")
    labels = per_box["labels"]
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise fail(f"{where}/labels go beyond the {num_classes} classes")
    return SplitIndex(image_offsets, **per_image,
                      names=np.array([_text(n) for n in text], dtype=np.str_),
                      **per_box, box_offsets=box_offsets,
                      cleaned=Cleaned(int(group.attrs.get("clipped", 0)),
                                      int(group.attrs.get("dropped", 0))))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class DetHDF5Source:
    """One split of a det_hdf5 file, as every detection format's source (data/detection): its
    images decoded by labrun's decoders, its objects from memory; the file opened lazily, once
    per process."""

    boxes = True  # its labels are boxes (labrun.data.detection)

    def __init__(self, index: FileIndex, split: str, decoder: str):
        self.path, self.split, self.decoder = index.path, split, decoder
        self.index = index.splits[split]
        self.class_names, self.category_ids = index.class_names, index.category_ids
        self.cleaned = self.index.cleaned
        self.name = f"{self.path}:/{split}"
        self._images = self._pid = None

    def __len__(self) -> int:
        return len(self.index.names)

    def __getstate__(self) -> dict:
        # Never pickle a handle (spawned workers): the receiver opens its own.
        return {**self.__dict__, "_images": None, "_pid": None}

    def read(self, index: int) -> np.ndarray:
        """Image `index`'s file bytes, as stored."""
        if self._pid != os.getpid():  # first read in this process, or a forked copy of a handle
            self._images, self._pid = open_file(self.path)[self.split]["images"], os.getpid()
        offsets = self.index.image_offsets
        return self._images[offsets[index]:offsets[index + 1]]

    def objects(self, index: int) -> Objects:
        start, end = self.index.box_offsets[index], self.index.box_offsets[index + 1]
        return Objects(self.index.boxes[start:end], self.index.labels[start:end],
                       self.index.crowd[start:end])

    def size(self, index: int) -> tuple[int, int]:
        """(width, height) of image `index`, without reading it (aspect-ratio grouping)."""
        return int(self.index.widths[index]), int(self.index.heights[index])

    def open(self, index: int) -> tuple[np.ndarray | JpegImage, Objects]:
        try:
            image = open_image(self.read(index), self.decoder)
        except Exception as error:
            raise DataError(f"{self.describe(index)} could not be decoded ({one_line(error)}); "
                            f"convert again: {CONVERT} {self.path} --force") from error
        return image, self.objects(index)

    def image_id(self, index: int) -> int:
        return int(self.index.image_ids[index])

    def describe(self, index: int) -> str:
        return f"{self.path}: {self.split} image {index} ({self.index.names[index]})"


def load(path: str, decoder: str = "turbojpeg") -> dict[str, DetHDF5Source]:
    """dataset=det_hdf5: {split: source} of the file at `path`."""
    index = read_index(path)
    decoder = resolve(decoder)
    return {split: DetHDF5Source(index, split, decoder) for split in index.splits}
