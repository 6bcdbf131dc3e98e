"""Model registry: torchvision and timm classification models by name, plus small built-ins
(SimpleCNN here, the GPT of task=lm in gpt.py).

Model configs name a factory with `_target_` and `_partial_: true`; `build()` adds what the data
declares (the number of classes; a vocabulary and window for a language model).
"""

from __future__ import annotations

import inspect

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from labrun.core.errors import ConfigError

# Keys of the model's config that labrun reads itself (the starting weights, frozen layers),
# not constructor arguments (train/initial_weights.py, train/fine_tuning.py); a factory that
# takes `pretrained` gets it all the same: torchvision's are built as their weights' builder
# builds them.
LABRUN_KEYS = ("init_from", "pretrained", "weights_backbone", "download", "freeze")
# torchvision's classifiers with auxiliary classifiers (GoogLeNet's aux1 and aux2, Inception
# v3's AuxLogits): in training they return those logits beside the main ones, a namedtuple the
# classification loss cannot take. labrun builds them without, as torchvision's googlenet
# builder leaves them out of its pretrained model.
AUX_LOGITS = ("googlenet", "inception_v3")


class SimpleCNN(nn.Module):
    """Three conv blocks and a linear head; no batch norm, so it trains on the CPU in seconds
    and gradient accumulation is exactly equivalent to a bigger batch."""

    def __init__(self, num_classes: int, width: int = 32, dropout: float = 0.0, in_chans: int = 3):
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(inplace=True),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(block(in_chans, width), block(width, 2 * width),
                                      block(2 * width, 4 * width), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten())
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def torchvision_model(num_classes: int, name: str, pretrained: bool | str = False
                      ) -> nn.Module:
    """Any torchvision classification model, randomly initialised, with the constructor
    arguments torchvision's builder gives it for the weights `model.pretrained` names
    (pretrained.torchvision_arguments): they are loaded after it is built
    (train/initial_weights.py), from a file found offline, and `labrun export` rebuilds the
    same model from the run's config."""
    # Imported on use: torchvision's package imports all of it, torch._dynamo included (a
    # second or two per process), which a run of a built-in model does not need.
    import torchvision

    from labrun.models.pretrained import torchvision_arguments

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        close = [m for m in available if m.startswith(name[:4])][:6]
        raise ConfigError(f"model.name={name} is not a torchvision classification model; "
                          f"try one of: {', '.join(close or available[:6])}")
    arguments = torchvision_arguments(name, pretrained)
    if name in AUX_LOGITS:
        arguments["aux_logits"] = False
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                        **arguments)


def timm_model(num_classes: int, name: str, drop_rate: float = 0.0) -> nn.Module:
    """Any timm model (`timm.list_models()`), randomly initialised: nothing is downloaded
    (pretrained weights are loaded after it is built, train/initial_weights.py)."""
    import timm  # imported on use: timm imports slowly and most runs do not need it

    if not timm.is_model(name):
        close = timm.list_models(f"{name[:4]}*")[:6]
        raise ConfigError(f"model.name={name} is not a timm model; try one of: "
                          f"{', '.join(close or timm.list_models()[:6])}")
    return timm.create_model(name, pretrained=False, num_classes=num_classes,
                             drop_rate=drop_rate)


def build(model_cfg: DictConfig, num_classes: int | None = None, **sizes: int) -> nn.Module:
    """Instantiate the configured model with what the data declares: `num_classes` outputs
    for a classifier, or the sizes another task passes (vocab_size and block_size for
    task=lm). A size the model's config sets itself wins over the data's: validation has
    checked that the data fits it (train/task.py, LanguageModelling.check_config)."""
    factory_cfg = OmegaConf.to_container(model_cfg, resolve=True)
    for name in LABRUN_KEYS:
        factory_cfg.pop(name, None)
    if num_classes is not None:
        sizes["num_classes"] = num_classes
    for name in list(sizes):
        if factory_cfg.get(name) is None:
            factory_cfg.pop(name, None)  # left to the data
        else:
            del sizes[name]  # the model's config fixes it (model.block_size=1024)
    factory = instantiate(factory_cfg)
    # Built for the weights it loads (models/pretrained.py): the keys the factory takes.
    parameters = inspect.signature(factory).parameters
    asked = {key: model_cfg.get(key, False) for key in ("pretrained", "weights_backbone")
             if key in parameters}
    return factory(**sizes, **asked)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers, whose state dict has clean keys."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return getattr(model, "_orig_mod", model)  # torch.compile
