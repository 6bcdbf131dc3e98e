"""trainer.ema: an exponential moving average of the weights, which validation, the test split,
best.pt's choice, `labrun eval` and `labrun export` use instead of the trained weights (as
timm's and YOLO's recipes evaluate); the trained weights go on training, untouched.

    WeightEma(model, decay, warmup_steps)   torch's AveragedModel (use_buffers=True): a copy of
                                            the model on its device, parameters and buffers
    .update(model)                          after each optimizer step really taken (the Trainer
                                            calls it from the optimizer's step hook)
    .state_dict() / .load_state_dict()      what a checkpoint holds: {"model", "updates"}

The first update copies the weights (AveragedModel's and get_ema_multi_avg_fn's W_0); update n
after it moves each floating tensor towards the model's by 1 - d with YOLO's warm-up,
d = decay * (1 - exp(-n / warmup_steps)) (warmup_steps 0: d = decay), so that early weights, far
from where training goes, are forgotten fast. Integer buffers (BatchNorm's num_batches_tracked)
are the model's own, as timm's ModelEmaV3 keeps them: averaging a counter means nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel


def decay_at(update: int, decay: float, warmup_steps: int) -> float:
    """The weight of the old average at the `update`-th update (1-based)."""
    if warmup_steps <= 0:
        return decay
    return decay * (1.0 - math.exp(-update / warmup_steps))


def warmup_ema_multi_avg_fn(decay: float, warmup_steps: int):
    """torch's get_ema_multi_avg_fn with the warm-up: an AveragedModel multi_avg_fn whose third
    argument is the number of this update, a Python int (no tensor to read back)."""

    @torch.no_grad()
    def ema_update(ema_tensors: list[torch.Tensor], model_tensors: list[torch.Tensor],
                   update: int) -> None:
        if torch.is_floating_point(ema_tensors[0]) or torch.is_complex(ema_tensors[0]):
            torch._foreach_lerp_(ema_tensors, model_tensors, 1.0 - decay_at(update, decay,
                                                                             warmup_steps))
        else:
            torch._foreach_copy_(ema_tensors, model_tensors)

    return ema_update


class WeightEma(AveragedModel):
    """The EMA of a model's parameters and buffers, on the model's device."""

    def __init__(self, model: nn.Module, decay: float, warmup_steps: int):
        # device=None: the copy stays where the model is.
        super().__init__(model, multi_avg_fn=warmup_ema_multi_avg_fn(decay, warmup_steps),
                         use_buffers=True)
        self.module.requires_grad_(False)
        self.module.eval()
        # The count of updates, on the host. AveragedModel keeps its own (n_averaged) as a
        # tensor and reads it back every update (bool(n_averaged == 0), n_averaged > 0, then a
        # copy to the device per dtype group): each a wait for the device's queue on a GPU, every
        # optimizer step. So update_parameters is not called: update() below is its few lines
        # with the count here, grouping the tensors the same way and calling the same
        # multi_avg_fn; n_averaged is kept equal to the count, for anyone who reads it.
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One update from `model` (the plain module: under DDP its weights are every rank's)."""
        ours = [*self.module.parameters(), *self.module.buffers()]
        theirs = [*model.parameters(), *model.buffers()]
        if len(ours) != len(theirs):
            raise RuntimeError("trainer.ema: the model's tensors changed since the EMA copied it")
        self.updates += 1
        if self.updates == 1:
            torch._foreach_copy_(ours, theirs)
        else:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
            for mine, its in zip(ours, theirs, strict=True):
                pair = groups.setdefault((mine.device, mine.dtype), ([], []))
                pair[0].append(mine.detach())
                pair[1].append(its.detach())
            for ema_tensors, model_tensors in groups.values():
                self.multi_avg_fn(ema_tensors, model_tensors, self.updates)
        self.n_averaged.fill_(self.updates)  # a fill from a host number: no wait

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """What a checkpoint keeps: the averaged module's state dict (the model's own keys) and
        the number of updates, which the warm-up goes on from on resume."""
        return {"model": self.module.state_dict(), "updates": self.updates}

    def load_from_checkpoint(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.updates = int(state["updates"])
        self.n_averaged.fill_(self.updates)

    @torch.no_grad()
    def broadcast_buffers(self) -> None:
        """Under DDP: rank 0's buffers on every rank. The parameters are the same everywhere (the
        ranks take the same steps), but each rank's BatchNorm statistics saw its own batches;
        at a validation and a checkpoint every rank takes rank 0's, which the checkpoint keeps
        (as timm's distribute_bn does before it evaluates)."""
        for buffer in self.module.buffers():
            torch.distributed.broadcast(buffer, src=0)


def build(trainer_cfg: Any, model: nn.Module) -> WeightEma | None:
    """The run's EMA (trainer.ema), or None: a copy of `model` as it is now."""
    if not trainer_cfg.get("ema", False):
        return None
    return WeightEma(model, float(trainer_cfg.ema_decay), int(trainer_cfg.ema_warmup_steps))
