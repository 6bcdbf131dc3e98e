"""Fine-tuning knobs: frozen parameters (`model.freeze`) and learning rates per parameter group
(`optimizer.groups`, `optimizer.backbone_lr_mult`), and validation's check of them and of the
starting weights (train/initial_weights.py), before any data loads.

Patterns are fnmatch patterns on parameter names (`layer1.*`, `fc.*`), as `model.named_
parameters()` gives them. A frozen parameter gets no gradient, so it is left out of the
optimizer and of DDP's gradient reduction (DDP reduces only parameters that require one); a
BatchNorm whose parameters are all frozen stays in eval mode (Trainer.train_mode), so its
running statistics stay the pretrained ones too. The schedule multiplies every group's own
learning rate (LambdaLR), so a group at a tenth of the rate stays at a tenth throughout.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from labrun.core.errors import ConfigError
from labrun.train import eager, initial_weights
from labrun.train.fine_tune_keys import asked

log = logging.getLogger(__name__)

# Keys of the optimizer's config that labrun reads itself, not the optimizer's arguments.
OPTIMIZER_KEYS = ("groups", "backbone_lr_mult")


def check(cfg: DictConfig, build: Callable[[], nn.Module], num_classes: int | None) -> None:
    """Refuse, in one line, fine-tuning keys that cannot work: starting weights that cannot be
    had or do not fit, a pattern that matches no parameter, both ways of grouping set, a
    backbone multiplier on a model with no class head. `build` gives the run's model
    (built here on the meta device: no memory, no initialisation)."""
    if not asked(cfg):
        return
    optimizer = cfg.optimizer
    if optimizer.get("groups") and optimizer.get("backbone_lr_mult") is not None:
        raise ConfigError("optimizer.groups and optimizer.backbone_lr_mult both set learning "
                          "rates per parameter; keep one")
    with torch.device("meta"):
        model = build()
    initial_weights.check(cfg, model, num_classes)
    names = [name for name, _ in model.named_parameters()]
    for pattern in cfg.model.get("freeze") or []:
        _must_match(names, pattern, "model.freeze")
    for group in _groups(optimizer):
        _must_match(names, group["params"], "optimizer.groups")
    if optimizer.get("backbone_lr_mult") is not None:
        if optimizer.backbone_lr_mult <= 0:
            raise ConfigError(f"optimizer.backbone_lr_mult={optimizer.backbone_lr_mult} must be "
                              f"greater than 0 (freeze the backbone with model.freeze instead)")
        if not initial_weights.head_keys(cfg.model, model, num_classes):
            raise ConfigError("optimizer.backbone_lr_mult: this model has no class head to "
                              "set apart; use optimizer.groups=[{params: PATTERN, lr_mult: X}]")


def _groups(optimizer: DictConfig) -> list[dict[str, Any]]:
    groups = optimizer.get("groups") or []
    if OmegaConf.is_config(groups):
        groups = OmegaConf.to_container(groups, resolve=True)
    for group in groups:
        if not (isinstance(group, dict) and isinstance(group.get("params"), str)
                and set(group) <= {"params", "lr_mult"}):
            raise ConfigError(f"optimizer.groups: {group} is not {{params: PATTERN, "
                              f"lr_mult: X}}, as in optimizer.groups=[{{params: 'fc.*', "
                              f"lr_mult: 10}}]")
        if not group.get("lr_mult", 1.0) > 0:
            raise ConfigError(f"optimizer.groups: lr_mult={group['lr_mult']} of {group['params']} "
                              f"must be greater than 0 (freeze it with model.freeze instead)")
    return groups


def _must_match(names: list[str], pattern: str, key: str) -> None:
    if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
        raise ConfigError(f"{key}: {pattern!r} matches no parameter of this model; names look "
                          f"like {', '.join(names[:3])} (fnmatch patterns: 'layer1.*')")


def freeze(model: nn.Module, patterns: Iterable[str]) -> list[nn.Module]:
    """Stop the gradient of every parameter a pattern matches (one log line says which);
    returns the BatchNorm layers to keep in eval mode (frozen_norms)."""
    frozen = []
    for name, parameter in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            parameter.requires_grad_(False)
            frozen.append(name)
    if frozen:
        log.info(f"model.freeze: {len(frozen)} parameters frozen ({frozen[0]} ... {frozen[-1]})")
    return frozen_norms(model)


def frozen_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers whose parameters are all frozen: kept in eval mode in training."""
    return [module for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            and any(True for _ in module.parameters())
            and not any(p.requires_grad for p in module.parameters())]


def build_optimizer(cfg: DictConfig, model: nn.Module, info: dict[str, Any]
                    ) -> torch.optim.Optimizer:
    """The configured optimizer over the parameters that train, in their groups (`info`:
    what the data declares; its class names tell the head apart)."""
    from hydra.utils import instantiate

    num_classes = len(info.get("class_names") or []) or None
    head = lambda: initial_weights.head_keys(cfg.model, model, num_classes)  # noqa: E731
    make = instantiate(optimizer_factory(cfg.optimizer))  # a partial: the class, its settings
    optimizer_class = getattr(make, "func", None)
    if (not cfg.trainer.compile and isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        eager.without_the_compiler(optimizer_class)
    return make(parameters(model, cfg.optimizer, head))


def optimizer_factory(optimizer: DictConfig) -> dict[str, Any]:
    """The optimizer's own config: labrun's keys taken out."""
    factory = OmegaConf.to_container(optimizer, resolve=True)
    for name in OPTIMIZER_KEYS:
        factory.pop(name, None)
    return factory


def parameters(model: nn.Module, optimizer: DictConfig, head: Callable[[], set[str]]
               ) -> Iterable[torch.nn.Parameter] | list[dict[str, Any]]:
    """What the optimizer is built on: every parameter that trains, in one group at
    optimizer.lr; or groups, each parameter in the first group whose pattern matches its name
    (`optimizer.groups`), or in the backbone at optimizer.lr x backbone_lr_mult where it is
    not part of the class head (`head()`: its state-dict keys), the rest at optimizer.lr."""
    training = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = _groups(optimizer)
    multiplier = optimizer.get("backbone_lr_mult")
    if not groups and multiplier is None:
        if len(training) == len(list(model.parameters())):
            return model.parameters()  # what every run without fine-tuning keys gets
        return [p for _, p in training]
    base = optimizer.lr
    if multiplier is not None:
        in_head = head()
        chosen: list[list[torch.nn.Parameter]] = [[], []]  # head at lr, backbone at lr x mult
        for name, parameter in training:
            chosen[0 if name in in_head else 1].append(parameter)
        return [group for group in ({"params": chosen[0], "lr": base},
                                    {"params": chosen[1], "lr": base * multiplier})
                if group["params"]]
    members: list[list[torch.nn.Parameter]] = [[] for _ in groups]
    rest = []
    for name, parameter in training:
        index = next((i for i, g in enumerate(groups)
                      if fnmatch.fnmatchcase(name, g["params"])), None)
        (rest if index is None else members[index]).append(parameter)
    built = [{"params": rest, "lr": base}] if rest else []
    built += [{"params": found, "lr": base * group.get("lr_mult", 1.0)}
              for group, found in zip(groups, members, strict=True) if found]
    return built
