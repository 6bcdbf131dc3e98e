"""One training run, from a composed config to the objective a sweeper optimises.

    cfg -> validate -> distributed.setup -> data.build -> models.build
        -> TrainingSession(...).fit() -> best value of checkpoint.monitor
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from labrun import data, models
from labrun.config import schema as config
from labrun.core.errors import ConfigError, LabrunError, one_line
from labrun.core.project import PROJECT_DIR
from labrun.runs import provenance
from labrun.runs.rundir import RunDir
from labrun.track import loggers as tracking
from labrun.train import distributed
from labrun.train.checkpoint import CheckpointManager
from labrun.train.checkpoint import load as load_checkpoint
from labrun.train.trainer import RunInterrupted, TrainingSession

# Keys that may differ between a run and its resumption without changing the result.
RESUME_SAFE_KEYS = ("trainer.max_epochs", "trainer.progress", "trainer.log_every_n_steps",
                    "trainer.limit_val_batches", "trainer.micro_batch_size", "dataset.num_workers",
                    "checkpoint.resume", "checkpoint.every_n_steps", "checkpoint.keep_last",
                    "logger", "paths", "cluster", "dataset.path", "dataset.root")


def train(cfg: DictConfig) -> float | None:
    config.validate(cfg)
    launch = {"overrides": hydra_overrides(), "sweep": sweep_info()}
    if distributed.launched_as_one_process(cfg.trainer):
        # trainer.devices=N on one machine: N processes, started the way torchrun does.
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        outcome = distributed.run_processes(cfg.trainer.devices, train_worker, resolved, launch)
        if "interrupted" in outcome:
            raise RunInterrupted(outcome["interrupted"])
        if "error" in outcome:
            raise LabrunError(outcome["error"])
        return outcome["objective"]
    return train_process(cfg, launch)


def train_worker(cfg: DictConfig, launch: dict[str, Any]) -> dict[str, Any]:
    """One of the processes that `trainer.devices=N` starts. A stop or a user error comes back
    as a value, so that the parent prints it in one line (a raised one would reach the parent
    as the launcher's multi-line ChildFailedError)."""
    try:
        return {"objective": train_process(cfg, launch)}
    except RunInterrupted as error:
        return {"interrupted": str(error)}
    except LabrunError as error:
        return {"error": one_line(error)}


def train_process(cfg: DictConfig, launch: dict[str, Any]) -> float | None:
    """One rank's share of a run (the only one, without distributed training)."""
    dist = distributed.setup(cfg.trainer, cfg.distributed)
    run_dir = RunDir(cfg.paths.run_dir)
    if dist.is_main:  # failures of an earlier attempt do not describe this one
        run_dir.clear_rank_errors()
    try:
        return _train(cfg, dist, launch)
    except Exception as error:
        # Rank 0 records its own failure in summary.json; a stop signal is no failure. The
        # others write errors/rank-N.txt, so a launcher can report it even when the scheduler
        # saw the job end well.
        if not dist.is_main and not isinstance(error, RunInterrupted):
            run_dir.write_rank_error(dist.rank, f"rank {dist.rank}: {type(error).__name__}: "
                                                f"{one_line(error)}")
        raise
    finally:
        distributed.cleanup()


def _train(cfg: DictConfig, dist: distributed.Distributed, launch: dict[str, Any]
           ) -> float | None:
    seed_everything(cfg.seed, cfg.trainer.deterministic, dist.device)
    run_dir = Path(cfg.paths.run_dir)
    dataset = data.build(cfg.dataset)
    model = models.build(cfg.model, dataset.num_classes)
    if cfg.model.init_from:
        load_weights(model, cfg.model.init_from)

    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.monitor,
                                    cfg.checkpoint.mode, cfg.checkpoint.keep_last)
    resume = find_resume_state(cfg, checkpoints)
    folder = RunDir(run_dir, writer=dist.is_main)
    # metrics.jsonl keeps what happened up to the step this run starts from: a resumed run logs
    # the later steps again, and a run from scratch (checkpoint.resume=never, or an earlier
    # attempt that ended before its first checkpoint) logs every step again.
    folder.truncate_metrics_after(resume["step"] if resume is not None else 0)
    recorded = {}
    if dist.is_main:
        recorded = provenance.write(run_dir / "provenance", launch["overrides"], PROJECT_DIR)
    session = TrainingSession(cfg, dataset, model, folder=folder, checkpoints=checkpoints,
                              dist=dist)
    # Built last, right before fit(), whose `finally` always closes it (wandb.finish()).
    tracker = tracking.build(cfg, run_dir, is_main=dist.is_main,
                             resume_id=resume.get("wandb_run_id") if resume else None,
                             provenance=recorded, sweep=launch["sweep"])
    return session.fit(tracker, resume)


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input sizes: pick the fastest kernels
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def load_weights(model: torch.nn.Module, path: str) -> None:
    """model.init_from: take every tensor whose name and shape match (a new head is skipped)."""
    weights = load_checkpoint(path)["model"]
    own = model.state_dict()
    usable = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise ConfigError(f"model.init_from={path}: no weight matches this model's layers; "
                          f"is it a checkpoint of the same architecture?")
    model.load_state_dict(usable, strict=False)
    skipped = sorted(set(own) - set(usable))
    if skipped:
        print(f"model.init_from: {len(usable)} tensors loaded, {len(skipped)} left as "
              f"initialised ({', '.join(skipped[:4])}{'...' if len(skipped) > 4 else ''})")


def find_resume_state(cfg: DictConfig, checkpoints: CheckpointManager) -> dict[str, Any] | None:
    choice = cfg.checkpoint.resume
    if choice == "never":
        return None
    if choice == "auto":
        found = checkpoints.load_latest_valid()
        if found is None:
            return None
        path, state = found
    else:
        path, state = Path(choice), load_checkpoint(choice)
    changed = changed_keys(state.get("config", {}), OmegaConf.to_container(cfg, resolve=True))
    if changed:
        raise ConfigError(
            f"cannot resume from {path}: the config differs in {', '.join(changed[:8])}; "
            f"use the same settings, or checkpoint.resume=never in a new folder")
    print(f"resuming from {path} (step {state['step']})")
    return state


def changed_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, ignoring RESUME_SAFE_KEYS."""
    changed = []
    for key in sorted(set(old) | set(new)):
        dotted = f"{prefix}{key}"
        if any(dotted == safe or dotted.startswith(safe + ".") for safe in RESUME_SAFE_KEYS):
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += changed_keys(a, b, dotted + ".")
        elif a != b:
            changed.append(dotted)
    return changed


def hydra_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def sweep_info() -> dict[str, Any]:
    """What the logger needs to know about the sweep this run belongs to (if any)."""
    if not HydraConfig.initialized():
        return {}
    hydra = HydraConfig.get()
    # A job of labrun's local launcher is a single run inside a sweep folder.
    sweep_dir = os.environ.get("LABRUN_SWEEP_DIR")
    return {"dir": sweep_dir or (hydra.sweep.dir if hydra.mode == RunMode.MULTIRUN else None),
            "overrides": list(hydra.overrides.task),
            "experiment": hydra.runtime.choices.get("experiment")}
