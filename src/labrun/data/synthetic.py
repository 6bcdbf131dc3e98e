"""Random images whose colour depends on the class: learnable, instant, any size."""

from __future__ import annotations

import numpy as np

from labrun.data.sources import ArraySource


def load(image_size: int, num_classes: int, num_train: int, num_val: int, num_test: int = 0
         ) -> dict[str, ArraySource]:
    rng = np.random.default_rng(0)
    class_colours = rng.integers(40, 216, size=(num_classes, 3))

    def make(n: int, name: str) -> ArraySource:
        labels = rng.integers(0, num_classes, size=n)
        noise = rng.normal(0, 40, size=(n, image_size, image_size, 3))
        images = np.clip(class_colours[labels][:, None, None, :] + noise, 0, 255)
        return ArraySource(images.astype(np.uint8), labels.astype(np.int64), f"synthetic/{name}")

    splits = {"train": make(num_train, "train"), "val": make(num_val, "val")}
    if num_test:
        splits["test"] = make(num_test, "test")
    return splits
