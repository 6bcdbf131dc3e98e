"""Learning-rate schedules, stepped once per optimizer step, each with an optional linear warm-up.

Built on torch's LambdaLR so the scheduler's state dict holds plain numbers only.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _warmup(step: int, warmup_steps: int) -> float:
    return (step + 1) / (warmup_steps + 1) if step < warmup_steps else 1.0


def _cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _step_factor(step: int, warmup_steps: int, every_steps: int, gamma: float) -> float:
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    return gamma ** ((step - warmup_steps) // max(1, every_steps))


def cosine(optimizer: Optimizer, *, steps_per_epoch: int, max_epochs: int,
           warmup_epochs: float = 0.0, min_lr_ratio: float = 0.0) -> LambdaLR:
    warmup = round(warmup_epochs * steps_per_epoch)
    return LambdaLR(optimizer, partial(_cosine_factor, warmup_steps=warmup,
                                       total_steps=steps_per_epoch * max_epochs,
                                       min_lr_ratio=min_lr_ratio))


def step(optimizer: Optimizer, *, steps_per_epoch: int, max_epochs: int,
         warmup_epochs: float = 0.0, step_epochs: int = 30, gamma: float = 0.1) -> LambdaLR:
    warmup = round(warmup_epochs * steps_per_epoch)
    return LambdaLR(optimizer, partial(_step_factor, warmup_steps=warmup,
                                       every_steps=step_epochs * steps_per_epoch, gamma=gamma))


def constant(optimizer: Optimizer, *, steps_per_epoch: int, max_epochs: int,
             warmup_epochs: float = 0.0) -> LambdaLR:
    warmup = round(warmup_epochs * steps_per_epoch)
    return LambdaLR(optimizer, partial(_warmup, warmup_steps=warmup))
