"""CIFAR-10 through torchvision, downloaded once into `dataset.root`."""

from __future__ import annotations

import numpy as np

from labrun.core.errors import DataError
from labrun.data.image.sources import ArraySource


def load(root: str, download: bool, val_fraction: float, split_seed: int = 0
         ) -> dict[str, ArraySource]:
    from torchvision.datasets import CIFAR10

    try:
        train = CIFAR10(root, train=True, download=download)
        test = CIFAR10(root, train=False, download=download)
    except (RuntimeError, OSError) as error:
        raise DataError(f"dataset.root={root}: CIFAR-10 is not there and could not be "
                        f"downloaded ({error}); download it or fix the path") from error
    labels = np.asarray(train.targets, dtype=np.int64)
    order = np.random.default_rng(split_seed).permutation(len(labels))
    n_val = round(len(labels) * val_fraction)
    val, keep = order[:n_val], order[n_val:]
    splits = {"train": ArraySource(train.data[keep], labels[keep], "cifar10/train", train.classes),
              "test": ArraySource(test.data, np.asarray(test.targets, dtype=np.int64),
                                  "cifar10/test", train.classes)}
    if n_val:
        splits["val"] = ArraySource(train.data[val], labels[val], "cifar10/val", train.classes)
    else:
        splits["val"] = splits.pop("test")
    return splits
