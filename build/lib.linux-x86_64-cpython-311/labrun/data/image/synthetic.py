"""Random images whose colour depends on the class: learnable, instant, any size.

Images are made when loaded, from (split, index), so a large synthetic set (benchmarks at
224 px) costs no memory and every worker makes the same image for the same index.
"""

from __future__ import annotations

import numpy as np

SPLIT_SEEDS = {"train": 1, "val": 2, "test": 3}


class SyntheticSource:
    def __init__(self, split: str, size: int, num_classes: int, image_size: int):
        self.name, self.split, self.image_size = f"synthetic/{split}", split, image_size
        self.holds_jpeg = False  # pixels made on demand
        self.class_names = [str(c) for c in range(num_classes)]
        self.colours = np.random.default_rng(0).integers(40, 216, size=(num_classes, 3))
        self.labels = np.random.default_rng(SPLIT_SEEDS[split]).integers(0, num_classes, size)

    def __len__(self) -> int:
        return len(self.labels)

    def load(self, index: int, min_size: int | None = None) -> np.ndarray:
        rng = np.random.default_rng([SPLIT_SEEDS[self.split], index])
        shape = (self.image_size, self.image_size, 3)
        noise = rng.normal(0, 40, size=shape).astype(np.float32)
        return np.clip(self.colours[self.labels[index]] + noise, 0, 255).astype(np.uint8)

    open = load

    def describe(self, index: int) -> str:
        return f"{self.name}[{index}]"


def load(image_size: int, num_classes: int, num_train: int, num_val: int, num_test: int = 0
         ) -> dict[str, SyntheticSource]:
    sizes = {"train": num_train, "val": num_val, "test": num_test}
    return {split: SyntheticSource(split, n, num_classes, image_size)
            for split, n in sizes.items() if n}
