"""Image folders: ROOT/train/<class>/*, ROOT/val/<class>/*, optional ROOT/test/<class>/*.

A folder whose subfolders are the classes themselves is the train split alone (data.build then
holds out dataset.val_fraction of it as val). Class names are train's subfolders, sorted; val
and test use the same mapping. `scan` is shared with `labrun convert`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labrun.core.errors import DataError
from labrun.data.image.decode import IMAGE_SUFFIXES, JpegImage, decode, open_image, resolve

SPLITS = ("train", "val", "test")
JPEG_SUFFIXES = frozenset({b".jpg", b".jpeg", b".jpe"})


@dataclass
class SplitFiles:
    """One split's images: paths relative to `folder`, and their labels."""

    split: str
    folder: Path
    files: np.ndarray  # bytes paths in one array: cheap to share with forked workers
    labels: np.ndarray  # int64

    def paths(self) -> list[str]:
        return [str(self.folder / os.fsdecode(f)) for f in self.files]


def scan(root: str | os.PathLike) -> tuple[dict[str, SplitFiles], list[str]]:
    """Find every split's images and the class names; DataError for a folder that cannot work."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such folder; give the image folder (ROOT/train/<class>/*) "
                        f"or check the path")
    split_dirs = {s: root / s for s in SPLITS if (root / s).is_dir()}
    if not split_dirs:
        split_dirs = {"train": root}  # ROOT/<class>/*
    elif "train" not in split_dirs:
        raise DataError(f"{root} has {', '.join(split_dirs)}/ but no train/ folder; add "
                        f"{root}/train/<class>/ with the training images")
    class_names = _class_folders(split_dirs["train"])
    if not class_names:
        raise DataError(f"{split_dirs['train']} has no class folders; put each class's images "
                        f"in a subfolder named after it (train/<class>/*.jpg)")
    label_of = {name: i for i, name in enumerate(class_names)}
    splits = {}
    for split, folder in split_dirs.items():
        classes = _class_folders(folder)
        unknown = sorted(set(classes) - set(label_of))
        if unknown:
            raise DataError(f"{folder}/{unknown[0]} is a class that train/ does not have; "
                            f"add it to train/ or remove it")
        files, labels = [], []
        for name in classes:
            found = sorted(_images_under(folder / name, folder))
            if not found:
                raise DataError(f"{folder / name} is an empty class folder (no image files); "
                                f"add images or remove the folder")
            files += found
            labels += [label_of[name]] * len(found)
        if not files:
            raise DataError(f"{folder} has no images; add them under {folder}/<class>/")
        splits[split] = SplitFiles(split, folder, np.array(files, dtype=np.bytes_),
                                   np.array(labels, dtype=np.int64))
    return splits, class_names


def _class_folders(folder: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.is_dir() and not entry.name.startswith("."))


def _images_under(folder: Path, relative_to: Path) -> list[bytes]:
    """Image files below `folder` (nested folders too, as torchvision's ImageFolder), skipping
    hidden files such as macOS's ._name.jpg, which only look like images."""
    found = []
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in names:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
                found.append(os.fsencode(os.path.relpath(os.path.join(directory, name),
                                                         relative_to)))
    return found


class FolderSource:
    """One split of an image folder, decoded on demand."""

    def __init__(self, split: SplitFiles, class_names: list[str], decoder: str, name: str):
        self.folder, self.files, self.labels = split.folder, split.files, split.labels
        self.class_names, self.decoder, self.name = class_names, decoder, name

    def __len__(self) -> int:
        return len(self.labels)

    def path(self, index: int) -> Path:
        return self.folder / os.fsdecode(self.files[index])

    @functools.cached_property
    def holds_jpeg(self) -> bool:
        """Whether any image is a JPEG file (by its name): only asked by dataset.decode=cpu|cuda."""
        return any(os.path.splitext(f)[1].lower() in JPEG_SUFFIXES for f in self.files)

    def read(self, index: int) -> bytes:
        return self.path(index).read_bytes()

    def load(self, index: int, min_size: int | None = None) -> np.ndarray:
        return decode(self.path(index).read_bytes(), self.decoder, min_size)

    def open(self, index: int) -> np.ndarray | JpegImage:
        return open_image(self.path(index).read_bytes(), self.decoder)

    def describe(self, index: int) -> str:
        return str(self.path(index))


def load(root: str, decoder: str) -> dict[str, FolderSource]:
    decoder = resolve(decoder)
    splits, class_names = scan(root)
    return {split: FolderSource(files, class_names, decoder, str(files.folder))
            for split, files in splits.items()}
