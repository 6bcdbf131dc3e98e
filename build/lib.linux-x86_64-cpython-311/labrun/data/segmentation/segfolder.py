"""dataset=segfolder: ROOT/images/ and ROOT/masks/ with matching file stems, optionally under
ROOT/train/, ROOT/val/ and ROOT/test/ (the layout of Pascal VOC's and most labs' sets).

Images are JPEG or PNG (any format Pillow reads); a mask is a PNG of class indices (mode L or P:
a palette PNG's indices, as Pascal VOC stores them), `ignore_index` (VOC's 255) marking void
pixels. Class names are ROOT/classes.txt's lines, or 0..dataset.num_classes-1 without it.

A stem without its mask is refused when the folder is scanned; a mask of another size than its
image, or holding a value that is no class, when a sample of pairs is checked at start and on
every item as it is read (labrun.data.segmentation), naming the file. Masks are read by
masks.py.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from labrun.core.errors import DataError
from labrun.data.image.decode import IMAGE_SUFFIXES, JpegImage, open_image, resolve
from labrun.data.image.imagefolder import JPEG_SUFFIXES
from labrun.data.segmentation.masks import PngMask, open_mask

SPLITS = ("train", "val", "test")


def class_names(root: str | os.PathLike, num_classes: int | None) -> list[str]:
    """ROOT/classes.txt's non-empty lines, else "0".."num_classes-1"; DataError without both."""
    listed = Path(root) / "classes.txt"
    if listed.is_file():
        names = [line.strip() for line in listed.read_text().splitlines() if line.strip()]
        if num_classes is not None and num_classes != len(names):
            raise DataError(f"dataset.num_classes={num_classes}, but {listed} names "
                            f"{len(names)} classes; drop dataset.num_classes or fix the file")
        return names
    if num_classes is None:
        raise DataError(f"{root} has no classes.txt; set dataset.num_classes (mask values "
                        f"0..num_classes-1), or write one class name per line into {listed}")
    return [str(c) for c in range(num_classes)]


def scan(root: str | os.PathLike) -> dict[str, list[tuple[Path, Path]]]:
    """Every split's (image, mask) paths, by stem; DataError for a folder that cannot work."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the segmentation folder "
                        f"(ROOT/images/ and ROOT/masks/, or ROOT/train/images/ ...)")
    split_dirs = {s: root / s for s in SPLITS if (root / s / "images").is_dir()}
    if not split_dirs:
        split_dirs = {"train": root}
    elif "train" not in split_dirs:
        raise DataError(f"{root} has {', '.join(split_dirs)}/ but no train/images/; add the "
                        f"training pairs there")
    return {split: _pairs(folder) for split, folder in split_dirs.items()}


def _pairs(folder: Path) -> list[tuple[Path, Path]]:
    images, masks = folder / "images", folder / "masks"
    for needed in (images, masks):
        if not needed.is_dir():
            raise DataError(f"{needed}: no such folder; a segmentation folder holds images/ and "
                            f"masks/ side by side, with matching file stems")
    masks_by_stem = {p.stem: p for p in _files(masks) if p.suffix.lower() == ".png"}
    pairs = []
    for image in sorted(_files(images)):
        if image.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        mask = masks_by_stem.get(image.stem)
        if mask is None:
            raise DataError(f"{image} has no mask: expected {masks / (image.stem + '.png')}; "
                            f"add it or remove the image")
        pairs.append((image, mask))
    if not pairs:
        raise DataError(f"{images} has no images; add JPEG or PNG files with their PNG masks "
                        f"in {masks}")
    return pairs


def _files(folder: Path) -> list[Path]:
    return [Path(e.path) for e in os.scandir(folder) if e.is_file() and not e.name.startswith(".")]


class SegFolderSource:
    """One split of a segmentation folder, read on demand."""

    dense = True  # its labels are masks (labrun.data.segmentation)

    def __init__(self, pairs: list[tuple[Path, Path]], class_names: list[str], decoder: str,
                 name: str):
        self.images = np.array([os.fsencode(i) for i, _ in pairs], dtype=np.bytes_)
        self.masks = np.array([os.fsencode(m) for _, m in pairs], dtype=np.bytes_)
        self.class_names, self.decoder, self.name = class_names, decoder, name

    def __len__(self) -> int:
        return len(self.images)

    @functools.cached_property
    def holds_jpeg(self) -> bool:
        """Whether any image is a JPEG file: only asked by dataset.decode=cpu|cuda."""
        return any(os.path.splitext(f)[1].lower() in JPEG_SUFFIXES for f in self.images)

    def read(self, index: int) -> bytes:
        return Path(os.fsdecode(self.images[index])).read_bytes()

    def mask(self, index: int) -> np.ndarray | PngMask:
        path = os.fsdecode(self.masks[index])
        return open_mask(Path(path).read_bytes(), path)

    def open(self, index: int) -> tuple[np.ndarray | JpegImage, np.ndarray | PngMask]:
        return open_image(self.read(index), self.decoder), self.mask(index)

    def describe(self, index: int) -> str:
        return os.fsdecode(self.images[index])


def load(root: str, decoder: str, num_classes: int | None = None
         ) -> dict[str, SegFolderSource]:
    decoder = resolve(decoder)
    names = class_names(root, num_classes)
    return {split: SegFolderSource(pairs, names, decoder, str(Path(root) / split))
            for split, pairs in scan(root).items()}
