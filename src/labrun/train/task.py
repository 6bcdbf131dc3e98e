"""The built-in task: image classification (loss and metrics), chosen by conf/task/.

A task is any class with the three methods, `num_sums` and `metric_names` of Classification; a
lab adding another task writes one like it and a conf/task/NAME.yaml naming it with `_target_`
(docs/plugins.md). The evaluation adds up per-batch sums (summed, so they reduce across ranks by
a plain all-reduce) and turns the totals into metrics once at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where a method needs it, not here: config validation imports this module
# for metric_names alone (labrun.config.validation), in processes that never train (a sweep's
# launcher, `labrun configs check` and `review`), and torch's import costs them 3 s.


class Classification:
    """Cross-entropy training; val/loss, val/acc (top-1) and val/acc5 (top-5)."""

    # The length of eval_sums' vector: a rank that gets no evaluation batch still all-reduces a
    # vector of this shape with the others (zeros), and an empty split still gives metrics.
    num_sums = 4
    # What eval_metrics reports for a split, each as SPLIT/NAME (val/acc). A class attribute:
    # labrun.config.validation checks checkpoint.monitor against it before any data loads,
    # without building the task.
    metric_names = ("loss", "acc", "acc5")

    def training_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F  # noqa: N812 - torch's own name for it

        return F.cross_entropy(logits, labels)

    def eval_sums(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[summed loss, top-1 correct, top-5 correct, count] of one batch, as float32 (MPS
        has no float64); the caller adds them up in float64 on the CPU."""
        import torch
        import torch.nn.functional as F  # noqa: N812

        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels[:, None])
        return torch.stack([
            F.cross_entropy(logits.float(), labels, reduction="sum"),
            hits[:, 0].sum().float(),
            hits.any(dim=1).sum().float(),
            torch.tensor(float(len(labels)), device=logits.device),
        ])

    def eval_metrics(self, sums: torch.Tensor, split: str) -> dict[str, float]:
        loss, top1, top5, count = sums.tolist()
        count = max(count, 1.0)
        # Keyed by metric_names, so that what is declared is what is reported.
        values = (loss / count, top1 / count, top5 / count)
        return {f"{split}/{name}": value
                for name, value in zip(self.metric_names, values, strict=True)}
