"""scikit-learn's bundled 8x8 digits, upscaled: real data that needs no download.

The CSV is read from scikit-learn's package folder without importing scikit-learn, which would
add about a second to every start-up.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import cv2
import numpy as np

from labrun.core.errors import DataError
from labrun.data.image.sources import ArraySource

CLASS_NAMES = [str(d) for d in range(10)]


def _digits_csv() -> Path:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("dataset=digits needs scikit-learn's bundled data: pip install scikit-learn")
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"


def load(image_size: int, val_fraction: float, split_seed: int = 0,
         num_folds: int | None = None) -> dict[str, ArraySource]:
    """Train and a held-out val split of `val_fraction` (seeded by split_seed); with
    num_folds, every image as train, for ImageData to fold."""
    with gzip.open(_digits_csv(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    pixels, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    gray = (pixels * (255 / 16)).round().astype(np.uint8)
    big = np.stack([cv2.resize(im, (image_size, image_size), interpolation=cv2.INTER_LINEAR)
                    for im in gray])
    images = np.repeat(big[..., None], 3, axis=3)  # RGB, so every model takes it
    if num_folds:
        return {"train": ArraySource(images, labels, "digits/train")}
    order = np.random.default_rng(split_seed).permutation(len(images))
    n_val = round(len(images) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return {"train": ArraySource(images[train], labels[train], "digits/train"),
            "val": ArraySource(images[val], labels[val], "digits/val")}
