"""Whether a run's config asks for fine-tuning (pretrained or given starting weights, frozen
parameters, learning rates per parameter group), without importing torch: a sweep's submitter
asks it of every job (launch/sweep.plan, through the task's check_config), and importing torch
there for a sweep that fine-tunes nothing cost 650 MB of its resident memory
(train/fine_tuning.py checks the keys of a run that does)."""

from __future__ import annotations

from omegaconf import DictConfig


def asked(cfg: DictConfig) -> bool:
    model, optimizer = cfg.model, cfg.optimizer
    # model.pretrained as models/pretrained.asked_for reads it (that module imports torch).
    return bool(model.get("pretrained", False) or model.get("weights_backbone", False)
                or model.get("init_from") or model.get("freeze")
                or optimizer.get("groups") or optimizer.get("backbone_lr_mult") is not None)
