"""The project's task (conf/task/regression.yaml): it owns the batch (labrun.train.task's
protocol) and names its deploy module, which exports, serves and predicts the trained model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own name for it
from torch import nn

from labrun import models


class Regression:
    """Mean squared error; val/loss (its mean) and val/mae, of the standardised target."""

    num_sums = 3  # squared errors, absolute errors, count
    metric_names = ("loss", "mae")
    deploy = "regression.deploy"  # export, serving and `labrun predict` (deploy.py)

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}

    def build_model(self, model_cfg, info: dict[str, Any]) -> nn.Module:
        return models.build(model_cfg, features=info["features"])

    def setup(self, info: dict[str, Any], device: torch.device, memory_format: Any) -> None:
        self.meta = dict(info)  # the features' names, the target's scale: what serving needs

    def prepare(self, batch, device: torch.device):
        return tuple(t.to(device) for t in batch)

    def count(self, batch) -> int:
        return len(batch[1])

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        features, targets = batch
        return F.mse_loss(model(features).squeeze(1), targets, reduction="sum")

    def eval_sums(self, model: nn.Module, batch) -> torch.Tensor:
        features, targets = batch
        error = model(features).squeeze(1).float() - targets
        return torch.stack([error.square().sum(), error.abs().sum(),
                            torch.tensor(float(len(targets)), device=error.device)])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        squared, absolute, count = sums.tolist()
        count = max(count, 1.0)
        return {f"{split}/loss": squared / count, f"{split}/mae": absolute / count}

    def checkpoint_meta(self) -> dict[str, Any]:
        return self.meta
