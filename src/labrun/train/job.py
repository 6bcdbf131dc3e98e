"""One training run, from a composed config to the objective a sweeper optimises.

    cfg -> validate -> distributed.setup -> data.build -> task.build_model
        -> Trainer(...).fit() -> best value of checkpoint.monitor
"""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from labrun import data
from labrun.config import facts, validation
from labrun.core import environment, hub_cache
from labrun.core.errors import ConfigError, LabrunError, RunInterrupted, one_line
from labrun.core.project import project_dir
from labrun.monitoring import metrics_endpoint
from labrun.runs import lock as run_lock
from labrun.runs import provenance
from labrun.runs.rundir import RunDir
from labrun.track import console
from labrun.track import loggers as tracking
from labrun.train import distributed, initial_weights
from labrun.train.checkpoint import CheckpointManager
from labrun.train.checkpoint import load as load_checkpoint
from labrun.train.trainer import Trainer

log = logging.getLogger(__name__)

# A checkpoint written by an older labrun names a few targets by their old module.
MOVED_TARGETS = {"labrun.schedules.": "labrun.train.schedules."}


def train(cfg: DictConfig) -> float | None:
    if not cfg.model.get("download", False):  # model.download=true: this run may fetch weights
        hub_cache.hub_offline()  # before validation, which may import huggingface_hub
    validation.validate(cfg)
    # Rank 0 holds the run folder (runs/lock.py): taken already by the Hydra callback or the
    # launcher before Hydra wrote in it; taken here on any other way in (a Hydra launcher not
    # labrun's, a call from Python). The processes started below inherit the right.
    taken = run_lock.claim(RunDir(cfg.paths.run_dir).lock_path)
    try:
        return _train_run(cfg)
    finally:
        if taken is not None:
            taken.release()


def _train_run(cfg: DictConfig) -> float | None:
    launch = {"overrides": hydra_overrides(), "sweep": sweep_info(),
              "composed": composed_from()}
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
    console.log_like_a_job(RunDir(cfg.paths.run_dir).log_path)
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
    task = instantiate(cfg.task)  # what a batch is, the model it needs, its loss and metrics
    model = task.build_model(cfg.model, dataset.info)
    start = initial_weights.source(cfg)  # model.pretrained or model.init_from
    if start is not None:
        initial_weights.load(model, cfg.model, start,
                             len(dataset.info.get("class_names") or []) or None)

    folder = RunDir(run_dir, writer=dist.is_main)
    checkpoints = CheckpointManager(folder.checkpoints_dir, cfg.checkpoint.monitor,
                                    cfg.checkpoint.mode, cfg.checkpoint.keep_last)
    resume = find_resume_state(cfg, checkpoints)
    # metrics.jsonl keeps what happened up to the step this run starts from: a resumed run logs
    # the later steps again, and a run from scratch (checkpoint.resume=never, or an earlier
    # attempt that ended before its first checkpoint) logs every step again.
    folder.truncate_metrics_after(resume["step"] if resume is not None else 0)
    recorded = {}
    if dist.is_main:
        recorded = provenance.write(folder.provenance_dir, launch["overrides"],
                                    project_dir() or Path.cwd(),
                                    *started_by(),
                                    weights=start.record() if start is not None else None,
                                    split=split_record(cfg.dataset),
                                    composed=launch.get("composed"))
    trainer = Trainer(cfg, dataset, model, folder=folder, checkpoints=checkpoints, dist=dist,
                      task=task)
    monitoring = start_monitoring(cfg, dist, folder, trainer, launch)
    try:
        # Built last, right before fit(), whose `finally` always closes it (wandb.finish()).
        tracker = tracking.build(cfg, run_dir, is_main=dist.is_main,
                                 resume_id=resume.get("wandb_run_id") if resume else None,
                                 provenance=recorded, sweep=launch["sweep"])
        return trainer.fit(tracker, resume)
    finally:
        monitoring.stop()


@dataclass
class Monitoring:
    """What watches this process's share of a run: the metrics endpoint and the NVML poller."""

    endpoint: metrics_endpoint.Endpoint | None = None
    gpus: metrics_endpoint.GpuPoller | None = None

    def stop(self) -> None:
        if self.endpoint is not None:
            self.endpoint.stop()
        if self.gpus is not None:
            self.gpus.stop()


def start_monitoring(cfg: DictConfig, dist: distributed.Distributed, folder: RunDir,
                     trainer: Trainer, launch: dict[str, Any]) -> Monitoring:
    """Rank 0 serves the run's metrics and its node's GPUs (monitor/node-0.json); on a
    multi-node run each other node's local rank 0 serves that node's GPUs, where it has any;
    the other ranks serve nothing. Rank 0 reads its node's GPUs for perf/gpu_util even with
    monitor.enabled=false: metrics.jsonl keeps it for `labrun status`."""
    monitor = cfg.monitor
    node = node_rank(dist, cfg.trainer.devices)
    if not (dist.is_main or (dist.local_rank == 0 and node > 0)):
        return Monitoring()
    watch = Monitoring()
    if dist.device.type == "cuda" and (dist.is_main or monitor.enabled):
        watch.gpus = metrics_endpoint.GpuPoller.open(cuda_uuids(cfg.trainer.devices),
                                                     monitor.gpu_poll_s)
    if dist.is_main:
        trainer.gpus = watch.gpus
    exports = ("run", "gpus") if dist.is_main else ("gpus",)
    if not monitor.enabled or (not dist.is_main and watch.gpus is None):
        return watch
    sweep = launch.get("sweep") or {}
    labels = metrics_endpoint.run_labels(folder.path, sweep_dir=sweep.get("dir"),
                                         experiment=sweep.get("experiment"))
    try:
        watch.endpoint = metrics_endpoint.Endpoint.start(
            folder, node_rank=node, exports=exports, labels=labels, bind=monitor.bind,
            port=monitor.port, stats=trainer.stats if dist.is_main else None, gpus=watch.gpus)
    except BaseException:
        watch.stop()
        raise
    return watch


def node_rank(dist: distributed.Distributed, devices: int) -> int:
    """Which node of the run this process is on: as torchrun or the scheduler says
    (core.environment), else the rank over the processes per node (ranks are numbered node
    by node)."""
    if dist.world_size == 1:
        return 0
    said = environment.read().node_rank
    return said if said is not None else dist.rank // max(1, devices)


def cuda_uuids(devices: int) -> list[str]:
    """NVML's names ("GPU-...") of this node's GPUs of the run, cuda:0 first. By UUID, not by
    index: CUDA numbers GPUs fastest first and NVML by PCI bus, and CUDA_VISIBLE_DEVICES may
    name any subset."""
    uuids = []
    for index in range(min(devices, torch.cuda.device_count())):
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuids.append(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    return uuids


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


def split_record(dataset: DictConfig) -> dict[str, Any] | None:
    """provenance/split.json: how an image dataset's val split was drawn (None for a format
    without these keys, such as token folders, whose files hold their splits)."""
    if "split_seed" not in dataset:
        return None
    return {key: dataset.get(key) for key in ("split_seed", "num_folds", "fold", "val_fraction")}


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
    saved = with_newer_keys(state.get("config", {}), OmegaConf.to_container(cfg, resolve=True))
    changed = facts.changed_keys(saved, OmegaConf.to_container(cfg, resolve=True),
                                 ignore_resume_safe=True)
    if changed:
        raise ConfigError(
            f"cannot resume from {path}: the config differs in {', '.join(changed[:8])}; "
            f"use the same settings, or checkpoint.resume=never in a new folder")
    if cfg.trainer.ema and "ema" not in state:  # written before labrun had trainer.ema
        raise ConfigError(f"cannot resume from {path} with trainer.ema=true: it holds no EMA of "
                          f"the weights; resume with trainer.ema=false, or "
                          f"checkpoint.resume=never in a new folder")
    log.info(f"resuming from {path} (step {state['step']})")
    return state


def with_newer_keys(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The saved config as this labrun reads it: a key it lacks was added by a later labrun
    (the task and callbacks groups, `_target_` of dataset and logger), with the value that
    reproduces what the older code did, which is the current one; moved targets are renamed."""
    upgraded = dict(saved)
    for name, value in current.items():
        if name not in saved:
            upgraded[name] = value
        elif isinstance(saved[name], dict) and isinstance(value, dict):
            upgraded[name] = with_newer_keys(saved[name], value)
        elif name == "_target_" and isinstance(saved[name], str):
            for old, new in MOVED_TARGETS.items():
                if saved[name].startswith(old):
                    upgraded[name] = new + saved[name][len(old):]
    return upgraded


def hydra_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def composed_from() -> dict[str, Any]:
    """The config sources (the search path) and the option of each group that composed this
    run's config, as plain data: provenance names the lab's files among them."""
    if not HydraConfig.initialized():
        return {}
    runtime = HydraConfig.get().runtime
    return {"sources": [{"provider": source.provider, "path": source.path}
                        for source in runtime.config_sources],
            "choices": {group: option for group, option in runtime.choices.items()}}


def started_by() -> tuple[list[str], str]:
    """The command line that started this run, and the folder it started in. A sweep's job,
    and a run sent to the cluster without -m, runs in a worker process of its launcher
    (submitit's), whose own command line says nothing of the run: the job's is the script
    (Hydra's job name) with the job's overrides, in the folder it was launched from."""
    if HydraConfig.initialized() and (HydraConfig.get().mode == RunMode.MULTIRUN
                                      or environment.read().submitted_by_labrun):
        hydra = HydraConfig.get()
        return [f"{hydra.job.name}.py", *hydra.overrides.task], hydra.runtime.cwd
    return list(sys.argv), os.getcwd()


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
