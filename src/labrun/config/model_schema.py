"""The model/ group's schemas: what a model section holds, by kind of model (`_target_` names
the class or function that builds it). Their own module for length; config/schema.py registers
them with the others (SCHEMAS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from labrun.config.fields import NewKeys, key


@dataclass
class ModelConfig:
    new_keys: ClassVar[NewKeys] = NewKeys.TARGET

    _target_: str = MISSING
    _partial_: bool = True
    # The starting weights (train/initial_weights.py): a labrun checkpoint, a state dict (.pt,
    # .pth) or a .safetensors file; a class head of another size is re-initialised.
    init_from: str | None = key(None, must_exist=True)
    freeze: list[str] = field(default_factory=list)  # parameter name patterns: ["layer1.*"]


@dataclass
class PretrainedModelConfig(ModelConfig):
    # true: the library's default weights; or their name (torchvision's IMAGENET1K_V2, timm's
    # tag a1_in1k). Found offline (models/pretrained.py); `labrun weights fetch` fills the cache.
    pretrained: Any = False
    download: bool = key(False, resume_safe=True, affects_result=False)  # fetch if not cached


@dataclass
class SimpleCNNConfig(ModelConfig):
    width: int = 32
    dropout: float = 0.0


@dataclass
class TorchvisionModelConfig(PretrainedModelConfig):
    name: str = MISSING


@dataclass
class TimmModelConfig(PretrainedModelConfig):
    name: str = MISSING  # any name timm.list_models() gives
    drop_rate: float = 0.0  # dropout before the classifier


@dataclass
class UNetConfig(ModelConfig):
    width: int = 16  # channels of the first level, doubled at each level down
    depth: int = 3  # levels down (the input is padded to a multiple of 2**depth)


@dataclass
class TorchvisionSegModelConfig(PretrainedModelConfig):
    name: str = MISSING  # fcn_resnet50, deeplabv3_resnet50, lraspp_mobilenet_v3_large...
    aux_loss: bool = False  # torchvision's auxiliary head (FCN, DeepLabV3)


@dataclass
class TorchvisionDetModelConfig(PretrainedModelConfig):
    name: str = MISSING  # fcos_resnet50_fpn, retinanet_resnet50_fpn_v2, ssdlite320_mobilenet_v3_large...
    # Its backbone's weights alone (ImageNet's: true, or their name), the rest random; or the
    # whole detector's with `pretrained` (COCO's). Found offline as `pretrained` is.
    weights_backbone: Any = False
    score_threshold: float = 0.05  # what evaluation keeps of the detector's answers
    detections_per_image: int = 100


@dataclass
class FCOSModelConfig(ModelConfig):
    backbone: str = "resnet18"  # resnet18 | resnet34 | resnet50 (models/detection.py checks)
    fpn_channels: int = 64
    norm: str = "group"  # group | batch
    score_threshold: float = 0.05
    detections_per_image: int = 100


@dataclass
class GPTConfig(ModelConfig):
    # null: the token folder's vocabulary and dataset.block_size. Set, they are the model's own
    # (a vocabulary padded to a multiple of 64, positions for longer windows than this run's).
    vocab_size: int | None = None
    block_size: int | None = None
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128  # a multiple of n_head
    dropout: float = 0.0


@dataclass
class HFModelConfig(ModelConfig):
    """A Hugging Face transformers model for text classification (models/hf.py), its body
    pretrained, read from the hub cache's snapshot that `labrun weights fetch model=hf` left."""
    name: str = MISSING  # the hub's id: bert-base-uncased, org/model
    # A commit, branch or tag; null: the commit refs/main names in the cache, recorded in every
    # checkpoint.
    revision: str | None = None
    weights_cache: str | None = key(None, path=True, resume_safe=True, affects_result=False)
    dropout: float | None = None  # null: the model's own (BERT's hidden and attention dropout)
