"""What a person watching a run sees: a rich progress bar on a terminal, plain periodic log
lines elsewhere (SLURM output files, CI logs)."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _format(metrics: dict[str, float]) -> str:
    parts = []
    for key, value in metrics.items():
        name = key.split("/")[-1]
        if key == "perf/images_per_s":
            parts.append(f"{value:.0f} img/s")
        elif key == "train/lr":
            parts.append(f"lr {value:.3g}")
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
        self.console = Console()
        self.bar: Progress | None = None
        self.task = None
        self.started = time.time()

    def start_epoch(self, epoch: int, max_epochs: int, steps: int, done: int = 0) -> None:
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
            print(f"{self.epoch_label} step {step}  {_format(metrics)}", flush=True)

    def end_epoch(self, metrics: dict[str, float], best: float | None, monitor: str) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.mode != "none":
            best_text = f"  (best {monitor} {best:.4f})" if best is not None else ""
            self.console.print(f"{self.epoch_label}: {_format(metrics)}{best_text}",
                               highlight=False, soft_wrap=True)

    def message(self, text: str) -> None:
        if self.mode != "none":
            self.console.print(text, highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
