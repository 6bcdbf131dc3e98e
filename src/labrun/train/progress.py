"""What a person watching a run sees: a rich progress bar on a terminal, plain periodic log
lines elsewhere (SLURM output files, CI logs).

Everything but the bar goes through `logging`, so Hydra's train.log in the run folder keeps it
too; the console handler (track/console.py) writes it with rich on a terminal.
"""

from __future__ import annotations

import logging
import sys
import time

import rich
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

log = logging.getLogger(__name__)


class StepWindow:
    """What happened since the last logged point: for loss, samples/s and data-wait fraction."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.wait = 0.0
        self.steps = 0
        self.samples = 0
        self.loss = torch.zeros((), device=self.device)
        # The parts of the loss a task reports (detection's: loss_classifier, ...), summed
        # like `loss`: tensors on the device, read at the log point only.
        self.parts: dict[str, torch.Tensor] = {}
        # What the task counts in its batches (text's tokens and padding: task.tally), host
        # numbers summed over the window.
        self.tally: dict[str, float] = {}

    def add_parts(self, parts: dict[str, torch.Tensor]) -> None:
        for name, value in parts.items():
            self.parts[name] = self.parts.get(name, 0) + value

    def add_tally(self, counted: dict[str, float]) -> None:
        for name, value in counted.items():
            self.tally[name] = self.tally.get(name, 0) + value

    def metrics(self, lr: float, units: dict[str, int]) -> dict[str, float]:
        """`units`: what a sample holds (the task's: {"tokens": 256}), each a perf/UNIT_per_s.
        What the task tallied per batch ({"tokens": 3100, "padding": 740}) gives a
        perf/NAME_per_s each and, of two or more, each one's share of their sum
        (perf/padding_frac)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        samples_per_s = self.samples / elapsed
        # Each step's loss is already the mean over ranks (Trainer.train_step).
        steps = max(self.steps, 1)
        parts = {f"train/loss_{name.removeprefix('loss_')}": value.item() / steps
                 for name, value in self.parts.items()}
        return {"train/loss": self.loss.item() / steps, **parts, "train/lr": lr,
                "perf/samples_per_s": samples_per_s,
                **{f"perf/{unit}_per_s": samples_per_s * n for unit, n in units.items()},
                **{f"perf/{name}_per_s": value / elapsed for name, value in self.tally.items()},
                **self._shares(),
                "perf/data_wait_frac": self.wait / elapsed}

    def _shares(self) -> dict[str, float]:
        total = sum(self.tally.values())
        if len(self.tally) < 2 or total <= 0:
            return {}
        return {f"perf/{name}_frac": value / total for name, value in self.tally.items()}


def _format(metrics: dict[str, float]) -> str:
    parts = []
    for key, value in metrics.items():
        name = key.split("/")[-1]
        if key == "perf/images_per_s":
            parts.append(f"{value:.0f} img/s")
        elif key == "perf/tokens_per_s":
            parts.append(f"{value:.0f} tok/s")
        elif key == "train/lr":
            parts.append(f"lr {value:.3g}")
        elif key == "perf/gpu_util":
            parts.append(f"gpu {value:.0%}")
        elif key.startswith("perf/"):
            continue
        else:
            parts.append(f"{key if '/' in key and not key.startswith('train/') else name} "
                         f"{value:.4f}")
    return "  ".join(parts)


class ProgressReporter:
    """mode: bar (rich), log (one line per logged point), none; auto picks bar on a TTY."""

    def __init__(self, mode: str = "auto", enabled: bool = True):
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "log"
        self.mode = mode if enabled else "none"
        # The console rich's log handler writes to: log lines print above the bar.
        self.console = rich.get_console()
        self.bar: Progress | None = None
        self.task = None
        self.started = time.time()

    def start_epoch(self, epoch: int, max_epochs: int | None, steps: int, done: int = 0,
                    step: int = 0, max_steps: int | None = None) -> None:
        """An epoch of `steps` steps, `done` of them already; with a step budget the bar ends
        where the budget does."""
        self.close()
        if max_steps:
            self.epoch_label = f"epoch {epoch + 1}"
            steps = min(steps, done + max_steps - step)
        else:
            self.epoch_label = f"epoch {epoch + 1}/{max_epochs}"
        if self.mode == "bar":
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeRemainingColumn(),
                                TextColumn("{task.fields[metrics]}"), console=self.console,
                                transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.epoch_label, total=steps, completed=done,
                                          metrics="")

    def update(self, done: int, step: int, metrics: dict[str, float] | None = None) -> None:
        if self.mode == "bar" and self.bar is not None:
            fields = {"metrics": _format(metrics)} if metrics else {}
            self.bar.update(self.task, completed=done, **fields)
        elif self.mode == "log" and metrics:
            log.info(f"{self.epoch_label} step {step}  {_format(metrics)}")

    def validated(self, metrics: dict[str, float], best: float | None, monitor: str,
                  step: int) -> None:
        """A validation's line, printed above the bar (which goes on mid-epoch)."""
        if self.mode != "none":
            best_text = f"  (best {monitor} {best:.4f})" if best is not None else ""
            log.info(f"{self.epoch_label} step {step}: {_format(metrics)}{best_text}")

    def message(self, text: str) -> None:
        if self.mode != "none":
            log.info(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
