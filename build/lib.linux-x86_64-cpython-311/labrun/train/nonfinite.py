"""Non-finite losses, noted on the device without waiting for it.

Asking after every step whether the loss is finite (`.item()`) makes the host wait for the
GPU's whole queue of kernels, every step. Instead each step adds a few tensor operations to the
queue that keep a count and the first bad step, and the trainer reads them (one wait) where it
waits anyway: at its log points and before every checkpoint write. So with
trainer.nan_policy=stop a run goes on for at most log_every_n_steps (or every_n_steps) steps
past the first non-finite loss, and then stops naming that step, with no checkpoint written
after it. nan_policy=skip must decide before each optimizer step whether to take it, so it
reads the loss every step (trainer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FirstNonFinite:
    step: int  # the 1-based optimizer step whose loss was not finite
    loss: float
    count: int  # steps with a non-finite loss since the watch started


class NonFiniteWatch:
    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.first_loss = torch.zeros((), device=device)

    def note(self, loss: torch.Tensor, step: int) -> None:
        """Record the loss of optimizer step `step` (1-based); queues work, never waits."""
        bad = ~torch.isfinite(loss)
        first = bad & (self.first_step < 0)
        self.first_step = torch.where(first, step, self.first_step)
        self.first_loss = torch.where(first, loss.to(self.first_loss.dtype), self.first_loss)
        self.count += bad

    def read(self) -> FirstNonFinite | None:
        """The first non-finite step noted, or None: one wait for the device."""
        step, count, loss = torch.stack(
            [self.first_step.double(), self.count.double(), self.first_loss.double()]).tolist()
        return None if step < 0 else FirstNonFinite(int(step), loss, int(count))
