"""The built-in task: image classification (loss and metrics).

A lab adding another task writes a module like this one: a training loss, and the sums an
evaluation adds up over batches (summed, so they reduce across ranks by a plain all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def training_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def eval_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed loss, top-1 correct, top-5 correct, count] of one batch, as float32 (MPS has
    no float64); the caller adds them up in float64 on the CPU."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hits = top.eq(labels[:, None])
    return torch.stack([
        F.cross_entropy(logits.float(), labels, reduction="sum"),
        hits[:, 0].sum().float(),
        hits.any(dim=1).sum().float(),
        torch.tensor(float(len(labels)), device=logits.device),
    ])


def eval_metrics(sums: torch.Tensor, split: str) -> dict[str, float]:
    loss, top1, top5, count = sums.tolist()
    count = max(count, 1.0)
    return {f"{split}/loss": loss / count, f"{split}/acc": top1 / count,
            f"{split}/acc5": top5 / count}
