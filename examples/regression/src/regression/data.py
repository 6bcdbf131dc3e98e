"""Regression on scikit-learn's diabetes data (442 patients, 10 features, bundled with
scikit-learn: nothing downloaded): the project's dataset, `load` in conf/dataset/diabetes.yaml.

What labrun asks of it: its splits, what it declares to the task, and loaders in labrun's
sample order (labrun.data.epoch_loader gives exact resume and DDP sharding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from labrun.data import epoch_loader

# load_diabetes' own names: age, sex, body mass index, blood pressure, six blood serum readings.
FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


class Rows(Dataset):
    """(epoch, index) -> (features, target): the keys labrun's sampler gives."""

    def __init__(self, features: np.ndarray, targets: np.ndarray):
        self.features = torch.as_tensor(features, dtype=torch.float32)
        self.targets = torch.as_tensor(targets, dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        _, index = key
        return self.features[index], self.targets[index]


class Diabetes:
    """The patients in a fixed random order: test, then val, then train. The target (disease
    progression after a year) is standardised by train's mean and spread."""

    def __init__(self, val_fraction: float, test_fraction: float, num_workers: int):
        from sklearn.datasets import load_diabetes

        features, targets = load_diabetes(return_X_y=True)
        order = np.random.default_rng(0).permutation(len(targets))
        n_test, n_val = round(test_fraction * len(order)), round(val_fraction * len(order))
        parts = {"test": order[:n_test], "val": order[n_test:n_test + n_val],
                 "train": order[n_test + n_val:]}
        mean, std = targets[parts["train"]].mean(), targets[parts["train"]].std()
        self.rows = {split: Rows(features[rows], (targets[rows] - mean) / std)
                     for split, rows in parts.items()}
        self.target_mean, self.target_std = float(mean), float(std)
        self.num_workers = num_workers

    @property
    def splits(self) -> dict[str, int]:
        return {split: len(rows) for split, rows in self.rows.items()}

    @property
    def info(self) -> dict[str, Any]:
        return {"features": self.rows["train"].features.shape[1], "feature_names": FEATURES,
                "target_mean": self.target_mean, "target_std": self.target_std}

    def loader(self, split: str, **sizes: Any) -> torch.utils.data.DataLoader:
        return epoch_loader(self.rows[split], train=split == "train", name="diabetes",
                            num_workers=self.num_workers, **sizes)


def load(val_fraction: float = 0.15, test_fraction: float = 0.15, num_workers: int = 0
         ) -> Diabetes:
    """The dataset's `_target_`: labrun calls it with the dataset keys it names."""
    return Diabetes(val_fraction, test_fraction, num_workers)
