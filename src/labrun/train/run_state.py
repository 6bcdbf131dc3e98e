"""What a checkpoint holds of a run, and how a run takes it back: the one place a checkpoint's
contents are put together (their format: checkpoint.CheckpointState) and read into a Trainer.

Everything needed to continue exactly is here: weights, optimizer, schedule, scaler, RNG
states, the position in the epoch's sample order, the log window, the callbacks' state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

import labrun
from labrun.models import unwrap
from labrun.runs.rundir import best_key
from labrun.train import checkpoint as ckpt
from labrun.train.checkpoint import CheckpointState
from labrun.train.progress import StepWindow

if TYPE_CHECKING:
    from labrun.train.trainer import Trainer


def capture(trainer: Trainer) -> CheckpointState:
    return {
        "model": unwrap(trainer.model).state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict(),
        "epoch": trainer.epoch,
        "step": trainer.step,
        "rng": ckpt.rng_state(),
        "data": {"epoch": trainer.epoch, "position": trainer.position,
                 "micro_batch_size": trainer.micro,
                 # A schedule the data keeps (detection's mosaic switch: data/detection).
                 **({"schedule": trainer.data.state_dict()}
                    if hasattr(trainer.data, "state_dict") else {})},
        "best": trainer.best,
        # The steps since the last logged point (see Trainer.train_epoch).
        "log_window": {"loss": trainer.window.loss.detach().cpu(),
                       "steps": trainer.window.steps,
                       # The loss's parts a task reports (detection's), where it has any.
                       **({"parts": {name: value.detach().cpu()
                                     for name, value in trainer.window.parts.items()}}
                          if trainer.window.parts else {})},
        "wandb_run_id": trainer.tracker.run_id,
        "config": OmegaConf.to_container(trainer.cfg, resolve=True),
        **trainer.task.checkpoint_meta(),  # class_names for classification
        # The task's deploy module, which export and serving import (labrun.deploy.hooks).
        "deploy": getattr(trainer.task, "deploy", None),
        "labrun_version": labrun.__version__,
        "callbacks": {name: cb.state_dict() for name, cb in trainer.callbacks.items()},
        # trainer.ema: the average and its count, and the name of the weights evaluation and
        # deployment read (checkpoint.inference_weights); "model" stays the trained weights.
        **({} if trainer.ema is None else {"ema": trainer.ema.state_dict_for_checkpoint(),
                                           "inference_weights": "ema"}),
    }


def restore(trainer: Trainer, state: CheckpointState) -> None:
    unwrap(trainer.model).load_state_dict(state["model"])
    if trainer.ema is not None:  # job.find_resume_state refuses a checkpoint without one
        trainer.ema.load_from_checkpoint(state["ema"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.scaler.load_state_dict(state["scaler"])
    trainer.step, trainer.best = state["step"], state["best"]
    trainer.epoch, trainer.position = state["data"]["epoch"], state["data"]["position"]
    if "schedule" in state["data"]:  # the run's own, made again into its train loader
        trainer.data.load_state_dict(state["data"]["schedule"])
        trainer.train_loader = trainer._train_loader()
    if trainer.auto_micro and state["data"]["micro_batch_size"] != trainer.micro:
        trainer.micro = state["data"]["micro_batch_size"]  # keep what fitted in memory
        trainer.train_loader = trainer._train_loader()
    if "log_window" in state:  # absent from checkpoints written before labrun kept it
        window = StepWindow(trainer.device)
        window.loss += state["log_window"]["loss"].to(trainer.device)
        window.steps = state["log_window"]["steps"]
        window.add_parts({name: value.to(trainer.device)
                          for name, value in state["log_window"].get("parts", {}).items()})
        trainer._resumed_window = window
    for name, callback_state in state.get("callbacks", {}).items():
        if name in trainer.callbacks:  # a callback added on resume starts fresh
            trainer.callbacks[name].load_state_dict(callback_state)
    ckpt.set_rng_state(state["rng"])  # job.py has cut metrics.jsonl back to this step already
    trainer.folder.summary.update({best_key(trainer.cfg.checkpoint.monitor): trainer.best})
