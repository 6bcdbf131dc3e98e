"""Trainer: the training and evaluation loop, readable top to bottom.

    fit()          train_epoch() until the budget (trainer.max_epochs, or trainer.max_steps)
                   is spent, then the best checkpoint on the test split when there is one
    train_epoch()  optimizer steps until the epoch's end, the budget's, or a stop
    validate()     evaluate("val"), the callbacks that judge by it, then a checkpoint (the best
                   one when it improved): at each epoch's end, or every
                   trainer.val_every_n_steps steps, and when the budget ends mid-epoch
    train_step()   `accumulation` micro-batches forward/backward, then one optimizer step

A step counts optimizer steps. The task (train/task.py) owns the batch: it moves it to the
device and prepares it, and computes the loss summed over the batch's items; the Trainer
divides by the items of the whole optimizer step, over every micro-batch and rank. Everything
needed to continue exactly is in the checkpoint (run_state.py puts it together and back).

The loop's parts live with their owners: mixed precision (precision.py), stop signals
(stop_signals.py), the checkpoint format (checkpoint.py), the run folder (runs/rundir.py), the
loss and metrics (the `task` config group) and the callbacks (the `callbacks` group).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from labrun.core import environment
from labrun.core.errors import LabrunError, RunInterrupted, one_line
from labrun.data import Data
from labrun.models import unwrap
from labrun.monitoring.metrics_endpoint import GpuPoller, TrainingStats
from labrun.runs.rundir import RunDir, best_key
from labrun.track.loggers import NoTracker, Tracker
from labrun.train import callbacks as callback_registry
from labrun.train import checkpoint as ckpt
from labrun.train import ema, fine_tuning, run_state
from labrun.train.checkpoint import CheckpointManager
from labrun.train.distributed import Distributed, all_reduce_sum
from labrun.train.evaluation import evaluation_sums
from labrun.train.nonfinite import NonFiniteWatch
from labrun.train.precision import Precision
from labrun.train.progress import ProgressReporter, StepWindow
from labrun.train.stop_signals import StopSignals


class NonFiniteLoss(LabrunError):
    """The loss became NaN or infinite and trainer.nan_policy=stop."""


class Trainer:
    def __init__(self, cfg: DictConfig, data: Data, model: nn.Module, *, folder: RunDir,
                 checkpoints: CheckpointManager, dist: Distributed, task: Any = None):
        trainer = cfg.trainer
        self.cfg, self.data, self.folder = cfg, data, folder
        self.tracker: Tracker = NoTracker()
        self.window = StepWindow(torch.device("cpu"))  # the current epoch's, once training
        self._resumed_window: StepWindow | None = None
        self.checkpoints, self.dist, self.device = checkpoints, dist, dist.device
        self.progress = ProgressReporter(trainer.progress, enabled=dist.is_main)
        # What a batch is, its loss and metrics; job.py passes the one that built the model.
        self.task = task if task is not None else instantiate(cfg.task)
        self.callbacks = callback_registry.build(cfg.get("callbacks"))

        # Batch sizes: batch_size is global; each process takes micro-batches and accumulates.
        self.per_rank_batch = trainer.batch_size // dist.world_size
        self.auto_micro = trainer.micro_batch_size == "auto"
        self.micro = self.per_rank_batch if self.auto_micro else int(trainer.micro_batch_size)

        # Model, possibly channels_last, DDP-wrapped and compiled. self.model stays the plain one.
        self.model = model.to(self.device)
        self.memory_format = torch.channels_last if trainer.channels_last else torch.contiguous_format
        self.model = self.model.to(memory_format=self.memory_format)
        # Before DDP wraps it: DDP reduces the gradients of the parameters that train only.
        self.frozen_norms = fine_tuning.freeze(self.model, cfg.model.get("freeze") or [])
        self.net: nn.Module = self.model
        if dist.enabled:
            self.net = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=cfg.distributed.bucket_cap_mb)
        if trainer.compile:
            self.net = torch.compile(self.net)

        self.optimizer = fine_tuning.build_optimizer(cfg, self.model, data.info)
        # trainer.ema: the average of the weights (train/ema.py), which evaluation uses. Updated
        # by the optimizer's step hook, so after each step really taken and only then: fp16's
        # GradScaler skips optimizer.step() on an overflow, nan_policy=skip never calls it.
        self.ema = ema.build(trainer, self.model)
        if self.ema is not None:
            self.optimizer.register_step_post_hook(lambda *_: self.ema.update(self.model))
        self.train_loader = self._train_loader()
        self.steps_per_epoch = self.train_loader.sampler.steps_per_epoch()
        if trainer.limit_train_batches:
            self.steps_per_epoch = min(self.steps_per_epoch, trainer.limit_train_batches)
        # The budget in optimizer steps, whichever way it was given (validation allows one).
        self.max_steps = trainer.max_steps or self.steps_per_epoch * trainer.max_epochs
        self.val_every = trainer.val_every_n_steps
        self.scheduler = instantiate(cfg.schedule)(
            self.optimizer, steps_per_epoch=self.steps_per_epoch, total_steps=self.max_steps)

        self.precision = Precision(cfg.precision.name, self.device, cfg.precision.init_scale)
        self.scaler, self.autocast = self.precision.scaler, self.precision.autocast

        self.task.setup(data.info, self.device, self.memory_format)
        self.tally = getattr(self.task, "tally", None)  # what the task counts in a batch

        self.epoch = 0  # the epoch in progress (0-based)
        self.position = 0  # samples of this epoch's order already trained on, on this rank
        self.step = 0  # optimizer steps so far
        self.best: float | None = None
        self.signals = StopSignals()
        self.nonfinite = NonFiniteWatch(self.device)  # read at log points and checkpoint writes
        self.stop_reason: str | None = None  # a callback ended training early (request_stop)
        self.stop_status = "completed"  # ... and how the run then ends: completed or pruned
        self._eval_loaders: dict[str, Any] = {}
        # What the metrics endpoint shows: plain numbers, a few attribute updates per step.
        self.stats = TrainingStats()
        self.gpus: GpuPoller | None = None  # set by job.py where NVML reports the run's GPUs

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, tracker: Tracker, resume: dict[str, Any] | None = None) -> float | None:
        """Train to the budget; return the best monitored value. `tracker` is finished
        whatever happens (completed, failed, interrupted)."""
        monitor = self.cfg.checkpoint.monitor
        self.tracker = tracker
        if resume is not None:
            run_state.restore(self, resume)
            self.progress.message(f"resumed at epoch {self.epoch + 1}, step {self.step}")
        elif hasattr(self.data, "start"):
            # Data with a schedule of its own (detection's mosaic, off for the last epochs)
            # fixes it when a run starts; a resumed run takes the checkpoint's back, whatever
            # its budget is now. The loader is made again: its samples take the schedule.
            self.data.start(-(-self.max_steps // self.steps_per_epoch))
            self.train_loader = self._train_loader()
        self._call("on_fit_start")
        resumed_from = self.step
        # From here a stop signal checkpoints: summary.json saying "running" is what a
        # supervisor (or a test) sees first.
        restore_signals = self.signals.catch()
        self.folder.summary.pop("stopped_early", None)  # set again below if it still holds
        self.folder.update_summary(status="running", error=None, epoch=self.epoch, step=self.step,
                                   monitor=monitor, mode=self.cfg.checkpoint.mode, ended_at=None,
                                   started_at=self.folder.summary.get("started_at") or time.time(),
                                   # The scheduler's count of this job's requeues
                                   # (preemption, node failure), for `labrun status`.
                                   requeued=environment.read().restart_count)
        status, error = "failed", None
        try:
            while self.step < self.max_steps and self.stop_reason is None:
                epoch_ended = self.train_epoch()
                if epoch_ended:
                    self.epoch, self.position = self.epoch + 1, 0
                if ((epoch_ended and not self.val_every)
                        or (self.step == self.max_steps and not self._validation_due())):
                    self.validate()
                if self.signals.agreed(self.dist.enabled, self.device):
                    self._stop_if_signalled()
            if self.stop_reason is not None:
                self.progress.message(f"stopped early: {self.stop_reason}")
                self.folder.update_summary(stopped_early=self.stop_reason)
            if "test" in self.data.splits and self.stop_status != "pruned":
                self.test_best()
            status = self.stop_status if self.stop_reason is not None else "completed"
            best = "none" if self.best is None else f"{self.best:.4f}"
            self.progress.message(f"{status}: best {monitor} {best}; results in {self.folder.path}")
            return self.best
        except (RunInterrupted, SystemExit):
            status = "interrupted"  # SystemExit: submitit requeued the job
            raise
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            error = f"{type(exc).__name__}: {one_line(exc)}"[:500]
            raise
        finally:
            restore_signals()
            self.progress.close()
            self._call("on_fit_end", status)
            self.folder.update_summary(status=status, error=error, epoch=self.epoch,
                                       step=self.step, ended_at=time.time())
            if status in ("completed", "pruned") and self.dist.is_main:
                # After summary.json says so: a kill in between leaves at most what
                # `labrun gc` removes later. An unfinished run keeps what it resumes from.
                self.checkpoints.keep_on_finish(self.cfg.checkpoint.on_finish)
            self.tracker.finish(status, self.folder.summary)
            self.write_rank_record(status, resumed_from)

    def train_epoch(self) -> bool:
        """Train from the epoch's position on, to its end, the budget's, or a stop asked for at
        a validation; True when the epoch's steps are done."""
        self.train_mode()
        sampler = self.train_loader.sampler
        sampler.set_epoch(self.epoch, start=self.position)
        batches = iter(self.train_loader)
        done = self.position // self.per_rank_batch
        self.progress.start_epoch(self.epoch, self.cfg.trainer.max_epochs, self.steps_per_epoch,
                                  done, self.step, self.cfg.trainer.max_steps)
        # A run resumed mid-window carries on the checkpoint's window, so that its next logged
        # train/loss averages the same steps as an uninterrupted run's.
        window = self.window = self._resumed_window or StepWindow(self.device)
        self._resumed_window = None
        every_n = self.cfg.checkpoint.every_n_steps
        while done < self.steps_per_epoch and self.step < self.max_steps:
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
            if (self.step % self.cfg.trainer.log_every_n_steps == 0
                    or done == self.steps_per_epoch or self.step == self.max_steps):
                self.check_finite()
                metrics = window.metrics(self.optimizer.param_groups[0]["lr"],
                                         getattr(self.task, "units", {}))
                if self.gpus is not None:  # a float the NVML thread keeps: no wait here
                    util = self.gpus.take_utilization()
                    if util is not None:
                        metrics["perf/gpu_util"] = util
                self.log(metrics)
                self.progress.update(done, self.step, metrics)
                window.reset()
            else:
                self.progress.update(done, self.step)
            self._call("on_step_end")
            if self._validation_due():
                started = time.perf_counter()
                self.validate()
                if self.stop_reason is not None:  # a callback stopped the run at it
                    break
                self.train_mode()
                window.start += time.perf_counter() - started  # not training time
            elif every_n and self.step % every_n == 0 and done < self.steps_per_epoch:
                self.save_checkpoint()
            if self._signals_due() and self.signals.agreed(self.dist.enabled, self.device):
                self.save_checkpoint()
                self._stop_if_signalled()
        return done == self.steps_per_epoch

    def train_step(self, batches, window: StepWindow) -> None:
        accumulation = self.per_rank_batch // self.micro
        # The step's micro-batches first, as the loader gives them: the loss is divided by the
        # items of the whole step (samples, tokens, pixels), known once every one is counted.
        # Each is prepared on the device only when its turn comes (an image task reuses one
        # buffer for the normalised batch).
        wait_start = time.perf_counter()
        micro_batches = [next(batches) for _ in range(accumulation)]
        waited = time.perf_counter() - wait_start
        window.wait += waited
        if self.tally is not None:  # counted on the loader's batches, on the host: no wait
            for batch in micro_batches:
                window.add_tally({name: value * self.dist.world_size  # every rank's, as samples
                                  for name, value in self.tally(batch).items()})
        self.stats.data_wait_s += waited
        step_loss, loss_parts = self.backward(micro_batches)
        # fp16's GradScaler skips non-finite steps itself. Otherwise nan_policy=stop notes the
        # loss on the device and check_finite() stops the run at its next read; skip has to
        # know now whether to take this step, so it waits for the loss every step.
        if not self.scaler.is_enabled():
            if self.cfg.trainer.nan_policy == "skip" and not torch.isfinite(step_loss).item():
                self.optimizer.zero_grad(set_to_none=True)
                self.stats.nonfinite_steps += 1
                self.progress.message(f"loss is {step_loss.item()} at step {self.step + 1}: "
                                      f"step skipped")
                return
            self.nonfinite.note(step_loss, self.step + 1)
        if self.cfg.trainer.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        window.steps += 1
        window.samples += self.per_rank_batch * self.dist.world_size
        window.loss += step_loss
        window.add_parts(loss_parts)
        # Steps and images counted together: a scrape never sees one without the other.
        self.stats.count_step(self.per_rank_batch * self.dist.world_size, time.time())

    def train_mode(self) -> None:
        self.net.train()
        for norm in self.frozen_norms:  # frozen layers keep their running statistics
            norm.eval()

    @property
    def eval_model(self) -> nn.Module:
        """What validation and test evaluate: the EMA's module with trainer.ema, else the
        trained model."""
        return self.model if self.ema is None else self.ema.module

    def evaluate(self, split: str) -> dict[str, float]:
        self._sync_ema()  # every rank evaluates the EMA the checkpoint keeps
        sums = evaluation_sums(self.eval_model, self.task, self._eval_loader(split), self.device,
                               self.autocast, self.cfg.trainer.limit_val_batches,
                               self.dist.enabled)
        return self.task.eval_metrics(sums, split)

    def validate(self) -> None:
        """Validation, the callbacks that judge by it (before the checkpoint, which keeps their
        state), then the checkpoint: best.pt too when checkpoint.monitor improved."""
        val = self.evaluate("val")
        self._call("on_validation_end", val)
        monitor = self.cfg.checkpoint.monitor
        value = val.get(monitor, self.folder.summary.get(monitor))
        improved = self.checkpoints.is_better(value, self.best)
        if improved:
            self.best = value
        point = {**val, best_key(monitor): self.best}
        self.log(point)
        self.folder.update_summary(epoch=self.epoch, step=self.step, **point)
        self.save_checkpoint(is_best=improved)
        self.progress.validated(val, self.best, monitor, self.step)

    def test_best(self) -> None:
        if self.dist.enabled:
            torch.distributed.barrier()  # rank 0 may still be writing best.pt
        best = self.checkpoints.best_path
        if best.exists():  # its EMA's weights with trainer.ema (what eval and export use)
            unwrap(self.eval_model).load_state_dict(ckpt.inference_weights(ckpt.load(best)))
        test = self.evaluate("test")
        self.log(test)
        self.folder.update_summary(**test)
        self.progress.message("test (best checkpoint): " + "  ".join(
            f"{k} {v:.4f}" for k, v in test.items()))

    def write_rank_record(self, status: str, resumed_from: int) -> None:
        self.folder.write_rank_record(
            rank=self.dist.rank, local_rank=self.dist.local_rank,
            world_size=self.dist.world_size, status=status, resumed_from_step=resumed_from,
            step=self.step, optimizer_steps=self.stats.steps)

    # -- helpers -------------------------------------------------------------------------------

    def backward(self, micro_batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Leave the gradient of one big batch holding the step's micro-batches of every rank:
        each one's summed loss divided by the items of the whole step, whatever number each
        micro-batch holds. Returns the step's loss, the same on every rank, and the parts of it
        a task reports (detection's losses; the task's loss_parts after each loss()), alike."""
        per_rank_items = self.per_rank_items(micro_batches)
        step_loss = torch.zeros((), device=self.device)
        parts: dict[str, torch.Tensor] = {}  # a task's loss parts (detection's), summed alike
        for micro_step, batch in enumerate(micro_batches):
            batch = self.task.prepare(batch, self.device)
            last = micro_step == len(micro_batches) - 1
            # Only the last micro-batch of a step all-reduces gradients across ranks.
            sync = contextlib.nullcontext() if last or not self.dist.enabled else self.net.no_sync()
            with sync, self.autocast():
                loss = self.task.loss(self.net, batch) / per_rank_items
            self.scaler.scale(loss).backward()
            step_loss += loss.detach()
            for name, value in getattr(self.task, "loss_parts", {}).items():
                parts[name] = parts.get(name, 0) + value.float() / per_rank_items
        if self.dist.enabled and parts:  # the parts ride on the loss's all-reduce
            summed = all_reduce_sum(torch.stack([step_loss, *parts.values()])) / self.dist.world_size
            step_loss, parts = summed[0], dict(zip(parts, summed[1:], strict=True))
        elif self.dist.enabled:  # every rank must take the same decision after the step
            step_loss = all_reduce_sum(step_loss) / self.dist.world_size
        return step_loss, parts

    def per_rank_items(self, micro_batches: list[Any]) -> float | torch.Tensor:
        """The step's items over all ranks, divided by the ranks: each rank divides its summed
        loss by it, so DDP's mean of the gradients is the gradient of the mean over all items.
        An int count is the same on every rank (the sampler gives each the same samples per
        step): no collective. A tensor count may differ: summed across ranks on the device."""
        items = sum(self.task.count(batch) for batch in micro_batches)
        if not isinstance(items, torch.Tensor):
            return float(items)
        if not self.dist.enabled:
            return items  # on the host, a 0-d tensor divides as a plain number: no wait
        if items.device.type == "cpu":
            # Counted on the host: onto the device by a fill, which waits for nothing (a copy
            # from pageable memory would wait for the device's queue).
            items = torch.full((), float(items), device=self.device)
        return all_reduce_sum(items.float()) / self.dist.world_size

    def request_stop(self, reason: str, status: str = "completed") -> None:
        """For callbacks: end training at this validation, saying why. The run ends "completed"
        (early stopping), or "pruned" (a hyper-parameter search gave up on it: no test split
        evaluation, and its sweeper records the trial as pruned)."""
        if status not in ("completed", "pruned"):
            raise ValueError(f"request_stop: status must be completed or pruned, not {status}")
        self.stop_reason, self.stop_status = reason, status

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks.values():
            getattr(callback, hook)(self, *args)

    def log(self, metrics: dict[str, float]) -> None:
        self.stats.record(metrics, self.epoch, self.cfg.checkpoint.monitor)
        self.folder.log_metrics(metrics, self.step, self.epoch)
        if self.dist.is_main:
            self.folder.summary.update(metrics)
        self.tracker.log(metrics, self.step)

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

    def check_finite(self) -> None:
        """Raise NonFiniteLoss if a step's loss was not finite since the run started (one
        wait for the device; every rank reads the same all-reduced losses at the same step)."""
        first = self.nonfinite.read()
        if first is None:
            return
        self.stats.nonfinite_steps = first.count
        last = self.checkpoints.latest_path()
        kept = f"; the last good checkpoint is {last}" if last else ""
        epoch = (first.step - 1) // self.steps_per_epoch + 1
        raise NonFiniteLoss(f"loss became {first.loss} at step {first.step} (epoch "
                            f"{epoch}){kept}; lower optimizer.lr, use precision=fp32 "
                            f"or trainer.grad_clip, or trainer.nan_policy=skip")

    def _validation_due(self) -> bool:
        """Whether trainer.val_every_n_steps asks for a validation after this step."""
        return bool(self.val_every) and self.step % self.val_every == 0

    @property
    def point(self) -> tuple[str, int]:
        """Where training stands in the unit its validations come at: ("epoch", epochs done)
        when they come at epochs' ends of an epoch budget, else ("step", steps done). Pruning
        reports by it and early stopping names it."""
        if self.val_every or self.cfg.trainer.max_steps:
            return "step", self.step
        return "epoch", self.epoch

    def _signals_due(self) -> bool:
        """Whether the ranks agree on stop signals after this step. Alone, a process reads its
        own flag for free, every step; under DDP agreeing is an all-reduce and a wait for the
        device, so the ranks do it every trainer.stop_check_every_n_steps steps, all at the
        same steps."""
        return not self.dist.enabled or self.step % self.cfg.trainer.stop_check_every_n_steps == 0

    def _stop_if_signalled(self) -> None:
        """Called once the ranks have agreed on a stop signal (StopSignals.agreed)."""
        name = self.signals.name
        if self.signals.requeues():
            self.progress.message(f"{name} at step {self.step}: checkpoint saved, requeueing")
            self.folder.update_summary(status="interrupted", ended_at=time.time())
            self.signals.requeue()  # submitit: requeue, exit
        raise RunInterrupted(f"{name} at step {self.step}: checkpoint saved; resume with: "
                             f"labrun resume {self.folder.path}")

    # -- checkpoints (their contents: run_state.py) ----------------------------------------------

    def save_checkpoint(self, is_best: bool = False) -> None:
        self.check_finite()  # on every rank: a checkpoint of non-finite weights is never written
        self._sync_ema()  # on every rank, as a resumed run's ranks all take rank 0's
        if self.dist.is_main:
            self.checkpoints.save(run_state.capture(self), self.step, is_best=is_best)

    def _sync_ema(self) -> None:
        """Under DDP, rank 0's EMA buffers on every rank (WeightEma.broadcast_buffers): called
        at validations and checkpoints, which every rank reaches at the same step."""
        if self.ema is not None and self.dist.enabled:
            self.ema.broadcast_buffers()
