"""Image sources: indexable collections of (uint8 HxWx3 image, label) for one split.

A source only knows how to fetch image i; augmentation and batching live in
data/image/__init__.py.
Every source has:
    name         "digits/train", a file path... used in error messages
    labels       int64 array, one per image
    class_names  list of str
    __len__()
    load(i, min_size=None)   uint8 HxWx3 RGB; a decoder may return a smaller image (JPEG DCT
                             scaling) as long as both sides stay >= min_size
    open(i)      what the transforms take: the pixels, or a JpegImage that decodes only the
                 region a transform crops from it (labrun.data.image.decode)
    describe(i)  where image i comes from, for error messages ("digits/train[12]", a file path)
    hint         optional: what to do about a sample that cannot be read, added to the error
    holds_jpeg   optional (default False): its images are stored as JPEG files, whose bytes
    read(i)      gives; what dataset.decode=cpu|cuda (data/image/batched.py) needs
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from labrun.data.image.decode import JpegImage


class ImageSource(Protocol):
    name: str
    labels: np.ndarray
    class_names: list[str]

    def __len__(self) -> int: ...

    def load(self, index: int, min_size: int | None = None) -> np.ndarray: ...

    def open(self, index: int) -> np.ndarray | JpegImage: ...

    def describe(self, index: int) -> str: ...


class ArraySource:
    """Images already decoded in memory (digits, synthetic, CIFAR)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, name: str,
                 class_names: list[str] | None = None):
        self.images, self.labels, self.name = images, np.asarray(labels, dtype=np.int64), name
        self.class_names = list(class_names or [str(c) for c in range(int(self.labels.max()) + 1)])
        self.holds_jpeg = False  # decoded pixels

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int, min_size: int | None = None) -> np.ndarray:
        image = self.images[index]
        return image if image.ndim == 3 else np.repeat(image[..., None], 3, axis=2)

    open = load

    def describe(self, index: int) -> str:
        return f"{self.name}[{index}]"


class SubsetSource:
    """Some images of another source, for a val split held out of train."""

    def __init__(self, source: ImageSource, indices: np.ndarray, name: str):
        self.source, self.indices, self.name = source, np.asarray(indices), name
        self.labels = source.labels[self.indices]
        self.class_names = source.class_names
        self.hint = getattr(source, "hint", None)

    @property
    def holds_jpeg(self) -> bool:
        return getattr(self.source, "holds_jpeg", False)

    def read(self, index: int) -> bytes | np.ndarray:
        return self.source.read(int(self.indices[index]))

    def __len__(self) -> int:
        return len(self.indices)

    def load(self, index: int, min_size: int | None = None) -> np.ndarray:
        return self.source.load(int(self.indices[index]), min_size)

    def open(self, index: int) -> np.ndarray | JpegImage:
        return self.source.open(int(self.indices[index]))

    def describe(self, index: int) -> str:
        return self.source.describe(int(self.indices[index]))


def hold_out(train: ImageSource, fraction: float, seed: int = 0) -> tuple[SubsetSource, SubsetSource]:
    """Split a seeded `fraction` of `train` off as val: (train, val)."""
    order = np.random.default_rng(seed).permutation(len(train))
    n_val = round(len(train) * fraction)
    return (SubsetSource(train, np.sort(order[n_val:]), f"{train.name}[train part]"),
            SubsetSource(train, np.sort(order[:n_val]), f"{train.name}[val part]"))


def folds(train: ImageSource, num_folds: int, fold: int, seed: int = 0
          ) -> tuple[SubsetSource, SubsetSource]:
    """Fold `fold` of a seeded k-fold split of `train` as val, the other K-1 folds as train:
    stratified by class (scikit-learn's StratifiedKFold), so every fold keeps the classes'
    shares. The K folds are disjoint and cover `train` exactly once."""
    from sklearn.model_selection import StratifiedKFold

    labels = np.asarray(train.labels)
    splitter = StratifiedKFold(n_splits=num_folds, shuffle=True, random_state=seed)
    kept, held = list(splitter.split(np.zeros(len(labels)), labels))[fold]
    return (SubsetSource(train, np.sort(kept), f"{train.name}[folds except {fold}]"),
            SubsetSource(train, np.sort(held), f"{train.name}[fold {fold} of {num_folds}]"))
