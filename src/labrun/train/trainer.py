"""TrainingSession: the training and evaluation loop, readable top to bottom.

    fit()          epochs of train_epoch() + evaluate("val"), a checkpoint after each, then the
                   best checkpoint on the test split when there is one
    train_epoch()  optimizer steps until the epoch's end (or a stop signal)
    train_step()   `accumulation` micro-batches forward/backward, then one optimizer step

A step counts optimizer steps. Batches arrive as uint8 and are turned into normalised floats
on the device. Everything needed to continue exactly (weights, optimizer, schedule, scaler,
RNG states, position in the epoch's sample order) is in the checkpoint.

One concern, the loop, in one file of about 460 lines: its parts (AMP, accumulation, DDP, stop
signals, the log window) share the session's state step by step, and split apart they would be
read side by side anyway. The checkpoint format (checkpoint.py) and the run folder's files
(tracking.py) live with their owners.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import warnings
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import labrun
from labrun.core.errors import LabrunError, one_line
from labrun.data import Data
from labrun.data.transforms import BatchNormalizer
from labrun.models import unwrap
from labrun.runs.rundir import RunDir
from labrun.track.loggers import NoTracker, Tracker
from labrun.train import checkpoint as ckpt
from labrun.train.checkpoint import CheckpointManager
from labrun.train.distributed import Distributed, all_reduce_sum
from labrun.train.progress import ProgressReporter
from labrun.train.task import eval_metrics, eval_sums, training_loss


class RunInterrupted(LabrunError):
    """A stop signal arrived; a checkpoint was saved at the step boundary that followed."""


class NonFiniteLoss(LabrunError):
    """The loss became NaN or infinite and trainer.nan_policy=stop."""


AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Window:
    """What happened since the last logged point: for loss, images/s and data-wait fraction."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.wait = 0.0
        self.steps = 0
        self.samples = 0
        self.loss = torch.zeros((), device=self.device)


class TrainingSession:
    def __init__(self, cfg: DictConfig, data: Data, model: nn.Module, *, folder: RunDir,
                 checkpoints: CheckpointManager, dist: Distributed):
        trainer = cfg.trainer
        self.cfg, self.data, self.folder = cfg, data, folder
        self.tracker: Tracker = NoTracker()
        self.window = _Window(torch.device("cpu"))  # the current epoch's, once training
        self._resumed_window: _Window | None = None
        self.checkpoints, self.dist, self.device = checkpoints, dist, dist.device
        self.progress = ProgressReporter(trainer.progress, enabled=dist.is_main)

        # Batch sizes: batch_size is global; each process takes micro-batches and accumulates.
        self.per_rank_batch = trainer.batch_size // dist.world_size
        self.auto_micro = trainer.micro_batch_size == "auto"
        self.micro = self.per_rank_batch if self.auto_micro else int(trainer.micro_batch_size)

        # Model, possibly channels_last, DDP-wrapped and compiled. self.model stays the plain one.
        self.model = model.to(self.device)
        self.memory_format = torch.channels_last if trainer.channels_last else torch.contiguous_format
        self.model = self.model.to(memory_format=self.memory_format)
        self.net: nn.Module = self.model
        if dist.enabled:
            self.net = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=cfg.distributed.bucket_cap_mb)
        if trainer.compile:
            self.net = torch.compile(self.net)

        self.optimizer = instantiate(cfg.optimizer)(self.model.parameters())
        self.train_loader = self._train_loader()
        self.steps_per_epoch = self.train_loader.sampler.steps_per_epoch()
        if trainer.limit_train_batches:
            self.steps_per_epoch = min(self.steps_per_epoch, trainer.limit_train_batches)
        self.scheduler = instantiate(cfg.schedule)(
            self.optimizer, steps_per_epoch=self.steps_per_epoch, max_epochs=trainer.max_epochs)

        # Mixed precision: autocast for bf16 and fp16, a GradScaler for fp16 only.
        self.autocast_dtype = AUTOCAST_DTYPES[cfg.precision.name]
        if self.autocast_dtype is torch.float16 and self.device.type == "cpu":
            if not _cpu_autocast_supports(torch.float16):
                warnings.warn("precision=fp16: CPU autocast does not support float16 here; "
                              "running bf16 instead", stacklevel=2)
                self.autocast_dtype = torch.bfloat16
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=cfg.precision.init_scale,
            enabled=self.autocast_dtype is torch.float16)

        shape = (1, -1, 1, 1)
        # Each step is done with its batch before the next arrives: the buffer can be reused.
        self.normalize = BatchNormalizer(
            torch.tensor(list(cfg.dataset.mean), device=self.device).view(shape),
            torch.tensor(list(cfg.dataset.std), device=self.device).view(shape))

        self.epoch = 0  # the epoch in progress (0-based)
        self.position = 0  # samples of this epoch's order already trained on, on this rank
        self.step = 0  # optimizer steps so far
        self.steps_taken = 0  # optimizer steps this process took itself (ranks/rank-N.json)
        self.best: float | None = None
        self.stop_signal: int | None = None
        self._requeue_handler = None
        self._eval_loaders: dict[str, Any] = {}

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, tracker: Tracker, resume: dict[str, Any] | None = None) -> float | None:
        """Train to trainer.max_epochs; return the best monitored value. `tracker` is finished
        whatever happens (completed, failed, interrupted)."""
        trainer, monitor = self.cfg.trainer, self.cfg.checkpoint.monitor
        self.tracker = tracker
        if resume is not None:
            self.load_state_dict(resume)
            self.progress.message(f"resumed at epoch {self.epoch + 1}, step {self.step}")
        resumed_from = self.step
        self.folder.update_summary(status="running", error=None, epoch=self.epoch, step=self.step,
                                   monitor=monitor, ended_at=None,
                                   started_at=self.folder.summary.get("started_at") or time.time(),
                                   # SLURM's count of this job's requeues (preemption, node
                                   # failure), for `labrun status`.
                                   requeued=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
        restore_signals = self._catch_stop_signals()
        status, error = "failed", None
        try:
            while self.epoch < trainer.max_epochs:
                self.train_epoch()
                val = self.evaluate("val")
                self.epoch, self.position = self.epoch + 1, 0
                self.end_epoch(val)
                if self._stop_requested():
                    self._stop_if_signalled()
            if "test" in self.data.splits:
                self.test_best()
            status = "completed"
            best = "none" if self.best is None else f"{self.best:.4f}"
            self.progress.message(f"completed: best {monitor} {best}; results in {self.folder.path}")
            return self.best
        except (RunInterrupted, SystemExit):
            status = "interrupted"  # SystemExit: submitit requeued the job
            raise
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            error = _one_line(exc)
            raise
        finally:
            restore_signals()
            self.progress.close()
            self.folder.update_summary(status=status, error=error, epoch=self.epoch,
                                       step=self.step, ended_at=time.time())
            self.tracker.finish(status, self.folder.summary)
            self.write_rank_record(status, resumed_from)

    def train_epoch(self) -> None:
        self.net.train()
        sampler = self.train_loader.sampler
        sampler.set_epoch(self.epoch, start=self.position)
        batches = iter(self.train_loader)
        done = self.position // self.per_rank_batch
        self.progress.start_epoch(self.epoch, self.cfg.trainer.max_epochs, self.steps_per_epoch,
                                  done)
        # A run resumed mid-window carries on the checkpoint's window, so that its next logged
        # train/loss averages the same steps as an uninterrupted run's.
        window = self.window = self._resumed_window or _Window(self.device)
        self._resumed_window = None
        every_n = self.cfg.checkpoint.every_n_steps
        while done < self.steps_per_epoch:
            try:
                self.train_step(batches, window)
            except torch.OutOfMemoryError:
                if not self.auto_micro or self.micro == 1:
                    raise
                batches = self._shrink_micro_batch()
                continue
            done += 1
            self.step += 1
            self.position += self.per_rank_batch
            if self.step % self.cfg.trainer.log_every_n_steps == 0 or done == self.steps_per_epoch:
                metrics = self._window_metrics(window)
                self.log(metrics)
                self.progress.update(done, self.step, metrics)
                window.reset()
            else:
                self.progress.update(done, self.step)
            if every_n and self.step % every_n == 0 and done < self.steps_per_epoch:
                self.save_checkpoint()
            if self._stop_requested():
                self.save_checkpoint()
                self._stop_if_signalled()

    def train_step(self, batches, window: _Window) -> None:
        accumulation = self.per_rank_batch // self.micro
        step_loss = torch.zeros((), device=self.device)
        for micro_step in range(accumulation):
            wait_start = time.perf_counter()
            images, labels = next(batches)
            window.wait += time.perf_counter() - wait_start
            images, labels = self.to_device(images, labels)
            last = micro_step == accumulation - 1
            # Only the last micro-batch of a step all-reduces gradients across ranks.
            sync = contextlib.nullcontext() if last or not self.dist.enabled else self.net.no_sync()
            with sync, self.autocast():
                # Dividing by the accumulation makes k micro-batches of b equal one batch of k*b.
                loss = training_loss(self.net(images), labels) / accumulation
            self.scaler.scale(loss).backward()
            step_loss += loss.detach()
        if self.dist.enabled:  # every rank must take the same decision below
            step_loss = all_reduce_sum(step_loss) / self.dist.world_size
        if not self.scaler.is_enabled() and not torch.isfinite(step_loss).item():
            self.optimizer.zero_grad(set_to_none=True)
            self._non_finite_loss(step_loss.item())
            return
        if self.cfg.trainer.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.scaler.step(self.optimizer)
        self.steps_taken += 1
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        window.steps += 1
        window.samples += self.per_rank_batch * self.dist.world_size
        window.loss += step_loss

    @torch.inference_mode()
    def evaluate(self, split: str) -> dict[str, float]:
        self.model.eval()
        loader = self._eval_loader(split)
        limit = self.cfg.trainer.limit_val_batches
        sums = torch.zeros(4, dtype=torch.float64)
        for index, (images, labels) in enumerate(loader):
            if limit and index >= limit:
                break
            images, labels = self.to_device(images, labels)
            with self.autocast():
                logits = self.model(images)
            sums += eval_sums(logits.float(), labels).cpu().double()
        sums = all_reduce_sum(sums.to(self.device) if self.dist.enabled else sums).cpu()
        return eval_metrics(sums, split)

    def end_epoch(self, val: dict[str, float]) -> None:
        monitor = self.cfg.checkpoint.monitor
        value = val.get(monitor, self.folder.summary.get(monitor))
        improved = self.checkpoints.is_better(value, self.best)
        if improved:
            self.best = value
        point = {**val, f"best/{monitor}": self.best}
        self.log(point)
        self.folder.update_summary(epoch=self.epoch, step=self.step, **point)
        self.save_checkpoint(is_best=improved)
        self.progress.end_epoch(val, self.best, monitor)

    def test_best(self) -> None:
        if self.dist.enabled:
            torch.distributed.barrier()  # rank 0 may still be writing best.pt
        best = self.checkpoints.folder / "best.pt"
        if best.exists():
            unwrap(self.model).load_state_dict(ckpt.load(best)["model"])
        test = self.evaluate("test")
        self.log(test)
        self.folder.update_summary(**test)
        self.progress.message("test (best checkpoint): " + "  ".join(
            f"{k} {v:.4f}" for k, v in test.items()))

    def write_rank_record(self, status: str, resumed_from: int) -> None:
        self.folder.write_rank_record(
            rank=self.dist.rank, local_rank=self.dist.local_rank,
            world_size=self.dist.world_size, status=status, resumed_from_step=resumed_from,
            step=self.step, optimizer_steps=self.steps_taken)

    # -- helpers -------------------------------------------------------------------------------

    def to_device(self, images: torch.Tensor, labels: torch.Tensor):
        non_blocking = self.device.type == "cuda"
        images = images.to(self.device, non_blocking=non_blocking)
        images = self.normalize(images)
        return (images.contiguous(memory_format=self.memory_format),
                labels.to(self.device, non_blocking=non_blocking))

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def log(self, metrics: dict[str, float]) -> None:
        self.folder.log_metrics(metrics, self.step, self.epoch)
        if self.dist.is_main:
            self.folder.summary.update(metrics)
        self.tracker.log(metrics, self.step)

    def _window_metrics(self, window: _Window) -> dict[str, float]:
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        # Each step's loss is already the mean over ranks (train_step), the same on every rank.
        return {"train/loss": window.loss.item() / max(window.steps, 1),
                "train/lr": self.optimizer.param_groups[0]["lr"],
                "perf/images_per_s": window.samples / elapsed,
                "perf/data_wait_frac": window.wait / elapsed}

    def _train_loader(self):
        return self.data.loader("train", micro_batch_size=self.micro, seed=self.cfg.seed,
                                rank=self.dist.rank, world_size=self.dist.world_size,
                                samples_per_step=self.per_rank_batch,
                                pin_memory=self.device.type == "cuda")

    def _eval_loader(self, split: str):
        if split not in self._eval_loaders:
            self._eval_loaders[split] = self.data.loader(
                split, micro_batch_size=self.micro, seed=self.cfg.seed, rank=self.dist.rank,
                world_size=self.dist.world_size, pin_memory=self.device.type == "cuda")
        return self._eval_loaders[split]

    def _shrink_micro_batch(self):
        """Out of memory: halve the micro-batch, double the accumulation, redo the step."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        # The largest size up to half that divides the per-process batch: whole steps only.
        self.micro = max(d for d in range(1, self.micro // 2 + 1) if self.per_rank_batch % d == 0)
        self.progress.message(f"out of memory: trainer.micro_batch_size -> {self.micro}, "
                              f"accumulation -> {self.per_rank_batch // self.micro}")
        self.train_loader = self._train_loader()
        self.train_loader.sampler.set_epoch(self.epoch, start=self.position)
        return iter(self.train_loader)

    def _non_finite_loss(self, value: float) -> None:
        if self.cfg.trainer.nan_policy == "skip":
            self.progress.message(f"loss is {value} at step {self.step + 1}: step skipped")
            return
        last = self.checkpoints.latest_path()
        kept = f"; the last good checkpoint is {last}" if last else ""
        raise NonFiniteLoss(f"loss became {value} at step {self.step + 1} (epoch "
                            f"{self.epoch + 1}){kept}; lower optimizer.lr, use precision=fp32 "
                            f"or trainer.grad_clip, or trainer.nan_policy=skip")

    # -- stop signals --------------------------------------------------------------------------

    def _catch_stop_signals(self):
        """SIGTERM, SIGINT and SIGUSR2 (SLURM's warning before a time limit or a preemption)
        ask for a checkpoint at the next step boundary; a second SIGINT aborts at once.

        A USR2 handler that was already there (submitit's: it requeues the job) runs after
        that checkpoint, so the requeued job resumes from it.
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT,
                                                     signal.SIGUSR2)}
        self._requeue_handler = previous[signal.SIGUSR2]

        def handler(signum, frame):
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.progress.message(f"{signal.Signals(signum).name}: stopping after this step "
                                  f"with a checkpoint")

        for s in previous:
            signal.signal(s, handler)
        return lambda: [signal.signal(s, h) for s, h in previous.items()]

    def _stop_requested(self) -> bool:
        """Whether any rank got a stop signal: every rank stops at the same step boundary."""
        signum = self.stop_signal or 0
        if self.dist.enabled:
            flag = torch.tensor(float(signum), device=self.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        if signum:
            self.stop_signal = signum
        return bool(signum)

    def _stop_if_signalled(self) -> None:
        """Called once _stop_requested() has agreed on a signal."""
        name = signal.Signals(self.stop_signal).name
        if self.stop_signal == signal.SIGUSR2 and callable(self._requeue_handler):
            self.progress.message(f"{name} at step {self.step}: checkpoint saved, requeueing")
            self.folder.update_summary(status="interrupted", ended_at=time.time())
            self._requeue_handler(self.stop_signal, None)  # submitit: requeue, then exit
        raise RunInterrupted(f"{name} at step {self.step}: checkpoint saved; resume with: "
                             f"labrun resume {self.folder.path}")

    # -- checkpoint state ----------------------------------------------------------------------

    def save_checkpoint(self, is_best: bool = False) -> None:
        if self.dist.is_main:
            self.checkpoints.save(self.state_dict(), self.step, is_best=is_best)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "rng": ckpt.rng_state(),
            "data": {"epoch": self.epoch, "position": self.position,
                     "micro_batch_size": self.micro},
            "best": self.best,
            # The steps since the last logged point (see train_epoch).
            "log_window": {"loss": self.window.loss.detach().cpu(), "steps": self.window.steps},
            "wandb_run_id": self.tracker.run_id,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "class_names": self.data.class_names,
            "labrun_version": labrun.__version__,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.step, self.best = state["step"], state["best"]
        self.epoch, self.position = state["data"]["epoch"], state["data"]["position"]
        if self.auto_micro and state["data"]["micro_batch_size"] != self.micro:
            self.micro = state["data"]["micro_batch_size"]  # keep what fitted in memory
            self.train_loader = self._train_loader()
        if "log_window" in state:  # absent from checkpoints written before labrun kept it
            self._resumed_window = _Window(self.device)
            self._resumed_window.loss += state["log_window"]["loss"].to(self.device)
            self._resumed_window.steps = state["log_window"]["steps"]
        ckpt.set_rng_state(state["rng"])  # run.py has cut metrics.jsonl back to this step already
        self.folder.summary.update({f"best/{self.cfg.checkpoint.monitor}": self.best})


def _cpu_autocast_supports(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except (RuntimeError, AssertionError):
        return False


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {one_line(exc)}"[:500]

