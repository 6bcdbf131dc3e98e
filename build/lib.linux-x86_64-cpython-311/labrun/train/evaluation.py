"""The evaluation loop every evaluation shares: the Trainer's validation and test, and
`labrun eval` (train/evaluate.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labrun.train.distributed import all_reduce_sum


@torch.inference_mode()
def evaluation_sums(model: nn.Module, task: Any, loader: Any, device: torch.device, autocast,
                    limit: int | None = None, distributed: bool = False) -> torch.Tensor:
    """The task's eval_sums over a split's batches (the first `limit`), added up in float64
    and across ranks: what task.eval_metrics turns into SPLIT/NAME values."""
    model.eval()
    sums = torch.zeros(task.num_sums, dtype=torch.float64)
    for index, batch in enumerate(loader):
        if limit and index >= limit:
            break
        batch = task.prepare(batch, device)
        with autocast():
            batch_sums = task.eval_sums(model, batch)
        sums = sums + batch_sums.cpu().double()
    return all_reduce_sum(sums.to(device) if distributed else sums).cpu()
