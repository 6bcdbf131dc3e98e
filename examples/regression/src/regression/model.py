"""The project's model (conf/model/mlp.yaml builds it): one hidden layer, one output.

labrun calls it with what the data declares: `features`, the number of input columns."""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    def __init__(self, features: int, width: int = 64):
        super().__init__(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, 1))
