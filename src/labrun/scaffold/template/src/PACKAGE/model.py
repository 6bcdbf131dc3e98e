"""The project's model: a small CNN to start from (conf/model/{{package}}.yaml builds it).

labrun calls it with what the data declares: `num_classes`, the dataset's class count."""

from __future__ import annotations

from torch import nn


class Net(nn.Sequential):
    def __init__(self, num_classes: int, width: int = 16):
        super().__init__(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))
