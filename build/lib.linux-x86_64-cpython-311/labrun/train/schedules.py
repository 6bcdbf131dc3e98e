"""Learning-rate schedules, stepped once per optimizer step, each with an optional linear warm-up.

The Trainer hands each the run's budget in optimizer steps (`total_steps`: trainer.max_steps,
or steps per epoch x trainer.max_epochs) and the steps of an epoch, so a schedule's keys may
count in either: `warmup_epochs` or `warmup_steps` (which wins when set), `step_epochs` or
`step_every_n_steps`. Built on torch's LambdaLR so the scheduler's state dict holds plain
numbers only.
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


def _in_steps(steps: int | None, epochs: float, steps_per_epoch: int) -> int:
    return steps if steps is not None else round(epochs * steps_per_epoch)


def cosine(optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int,
           warmup_epochs: float = 0.0, warmup_steps: int | None = None,
           min_lr_ratio: float = 0.0) -> LambdaLR:
    warmup = _in_steps(warmup_steps, warmup_epochs, steps_per_epoch)
    return LambdaLR(optimizer, partial(_cosine_factor, warmup_steps=warmup,
                                       total_steps=total_steps, min_lr_ratio=min_lr_ratio))


def step(optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int,
         warmup_epochs: float = 0.0, warmup_steps: int | None = None, step_epochs: int = 30,
         step_every_n_steps: int | None = None, gamma: float = 0.1) -> LambdaLR:
    warmup = _in_steps(warmup_steps, warmup_epochs, steps_per_epoch)
    every = _in_steps(step_every_n_steps, step_epochs, steps_per_epoch)
    return LambdaLR(optimizer, partial(_step_factor, warmup_steps=warmup, every_steps=every,
                                       gamma=gamma))


def constant(optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int,
             warmup_epochs: float = 0.0, warmup_steps: int | None = None) -> LambdaLR:
    warmup = _in_steps(warmup_steps, warmup_epochs, steps_per_epoch)
    return LambdaLR(optimizer, partial(_warmup, warmup_steps=warmup))
