"""The evaluation loop every evaluation shares: the Trainer's validation and test, and
`labrun eval` (train/evaluate.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labrun.train.distributed import all_reduce_sum


@torch.inference_mode()
def evaluation_sums(model: nn.Module, task: Any, loader: Any, device: torch.device, autocast,
                    limit: int | None = None, distributed: bool = False) -> Any:
    """The task's eval_sums over a split's batches (the first `limit`), added up in float64
    and across ranks: what task.eval_metrics turns into SPLIT/NAME values.

    A task whose metric is no sum (`gathers = True`: detection's mAP ranks every detection of
    the split) gives eval_records instead: each rank's, gathered on every rank and put in the
    order of their keys, so that N processes hand eval_metrics what one process would."""
    model.eval()
    if getattr(task, "gathers", False):
        return _gathered_records(model, task, loader, device, autocast, limit, distributed)
    sums = torch.zeros(task.num_sums, dtype=torch.float64)
    for index, batch in enumerate(loader):
        if limit and index >= limit:
            break
        batch = task.prepare(batch, device)
        with autocast():
            batch_sums = task.eval_sums(model, batch)
        sums = sums + batch_sums.cpu().double()
    return all_reduce_sum(sums.to(device) if distributed else sums).cpu()


def _gathered_records(model: nn.Module, task: Any, loader: Any, device: torch.device,
                      autocast, limit: int | None, distributed: bool) -> list[Any]:
    """[(key, record)] of the whole split, sorted by key (a sample's index in its split)."""
    records: list[Any] = []
    for index, batch in enumerate(loader):
        if limit and index >= limit:
            break
        batch = task.prepare(batch, device)
        with autocast():
            records.extend(task.eval_records(model, batch))
    if distributed:
        shards: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shards, records)
        records = [record for shard in shards for record in shard]
    return sorted(records, key=lambda record: record[0])
