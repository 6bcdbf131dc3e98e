"""The project's dataset loader (conf/dataset/{{package}}.yaml names it): data/processed/ as
preprocess.py wrote it, as labrun's image sources. labrun does the rest: the held-out val
split, augmentation, normalisation, sampling that resumes exactly.

labrun calls `load` with the dataset keys it names as parameters."""

from __future__ import annotations

import numpy as np

from labrun.data.image.sources import ArraySource


def load(path: str, val_fraction: float, split_seed: int = 0) -> dict[str, ArraySource]:
    with np.load(path) as arrays:
        images, labels = arrays["images"], arrays["labels"]
        class_names = [str(name) for name in arrays["class_names"]]
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_val = round(len(labels) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return {"train": ArraySource(images[train], labels[train], "{{package}}/train", class_names),
            "val": ArraySource(images[val], labels[val], "{{package}}/val", class_names)}
