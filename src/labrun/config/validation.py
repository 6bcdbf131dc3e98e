"""Validation of what the schemas' types cannot say: ranges, choices, paths that must exist,
and how keys fit together. `validate(cfg)` raises a ConfigError naming the first key that
cannot work and its fix; Hydra has already checked names and types while composing against
config/schema.py.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from labrun.config.fields import collect
from labrun.config.keys import check_keys
from labrun.config.schema import SCHEMAS
from labrun.core.errors import ConfigError

CHOICES = {
    "trainer.accelerator": ("auto", "cpu", "cuda", "mps"),
    "trainer.nan_policy": ("stop", "skip"),
    "trainer.progress": ("auto", "bar", "log", "none"),
    "checkpoint.mode": ("max", "min"),
    "precision.name": ("fp32", "bf16", "fp16"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "dataset.decode": ("workers", "cpu", "cuda"),
}
POSITIVE = ("distributed.bucket_cap_mb", "distributed.timeout_s", "trainer.max_epochs", "trainer.batch_size", "trainer.devices", "trainer.num_nodes",
            "dataset.image_size", "optimizer.lr", "trainer.log_every_n_steps")
NON_NEGATIVE = ("optimizer.weight_decay", "trainer.grad_clip", "checkpoint.keep_last",
                "checkpoint.every_n_steps", "dataset.num_workers", "schedule.warmup_epochs")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first key that cannot work, and how to fix it."""
    check_keys(cfg)
    for dotted, choices in CHOICES.items():
        value = OmegaConf.select(cfg, dotted)
        if value is not None and value not in choices:
            raise ConfigError(f"{dotted}={value} is not one of: {', '.join(choices)}")
    for dotted in POSITIVE:
        value = OmegaConf.select(cfg, dotted)
        if value is not None and not value > 0:
            raise ConfigError(f"{dotted}={value} must be greater than 0")
    for dotted in NON_NEGATIVE:
        value = OmegaConf.select(cfg, dotted)
        if value is not None and value < 0:
            raise ConfigError(f"{dotted}={value} must be 0 or more")
    if cfg.dataset.get("decode") == "cuda" and cfg.trainer.accelerator in ("cpu", "mps"):
        raise ConfigError(f"dataset.decode=cuda puts batches on the GPU, but "
                          f"trainer.accelerator={cfg.trainer.accelerator}; use "
                          f"dataset.decode=cpu or workers")
    fraction = cfg.dataset.val_fraction
    if not 0 <= fraction < 1:
        raise ConfigError(f"dataset.val_fraction={fraction} must be in [0, 1)")
    world_size = cfg.trainer.devices * cfg.trainer.num_nodes
    micro = cfg.trainer.micro_batch_size
    if micro != "auto":
        if not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0:
            raise ConfigError(
                f"trainer.micro_batch_size={micro} must be a positive integer or auto")
        if cfg.trainer.batch_size % (micro * world_size):
            raise ConfigError(
                f"trainer.batch_size={cfg.trainer.batch_size} is not divisible by "
                f"trainer.micro_batch_size x world size = {micro} x {world_size}; "
                f"pick a batch_size that is a multiple of {micro * world_size}")
    elif cfg.trainer.batch_size % world_size:
        raise ConfigError(
            f"trainer.batch_size={cfg.trainer.batch_size} is not divisible by the world size "
            f"{world_size} (trainer.devices x trainer.num_nodes)")
    for dotted, facts in collect(SCHEMAS).items():
        if facts.must_exist:
            _check_exists(cfg, dotted)
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).is_file():
        raise ConfigError(
            f"checkpoint.resume={resume}: no such file; give a checkpoint path, auto or never")
    _validate_monitor(cfg)


def _validate_monitor(cfg: DictConfig) -> None:
    monitor = cfg.get("monitor")
    if monitor is None:
        return
    if not 0 <= monitor.port <= 65535:
        raise ConfigError(f"monitor.port={monitor.port} must be in 0..65535 (0: a free port)")
    if monitor.bind != "node":
        try:
            ipaddress.ip_address(monitor.bind)
        except ValueError:
            # A host name would be looked up in DNS on every node; an address says where.
            raise ConfigError(
                f"monitor.bind={monitor.bind} is not an IP address; use 127.0.0.1 (this "
                f"machine only), node (this node's address towards the SLURM controller) or "
                f"an address of this machine") from None
    if not monitor.gpu_poll_s > 0:
        raise ConfigError(f"monitor.gpu_poll_s={monitor.gpu_poll_s} must be greater than 0")
    for name in ("data_bound_wait_frac", "gpu_idle_util"):
        value = monitor[name]
        if not 0 < value < 1:
            raise ConfigError(f"monitor.{name}={value} must be a fraction in (0, 1), "
                              f"e.g. 0.3")


def _check_exists(cfg: DictConfig, key: str) -> None:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent)
    if not isinstance(node, DictConfig) or leaf not in node.keys():
        return
    if OmegaConf.is_missing(node, leaf):
        raise ConfigError(f"{key} is required with {parent}={_option_name(cfg, parent)}; "
                          f"add {key}=...")
    value = node[leaf]
    if value is None or (key == "dataset.root" and node.get("download")):
        return  # unset, or downloaded on first use
    if not Path(value).exists():
        raise ConfigError(f"{key}={value}: no such file or folder; check the path")


def _option_name(cfg: DictConfig, group: str) -> str:
    node = OmegaConf.select(cfg, group)
    return node.get("name", "...") if isinstance(node, DictConfig) else "..."
