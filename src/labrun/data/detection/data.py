"""DetectionData: what the Trainer gets for a detection format (labrun.data.build), and the
dataset and collate behind its loaders.

A batch is (images, targets):
    images    uint8 B x 3 x S x S (S = dataset.image_size), letterboxed (transforms.py)
    targets   one dict per image: "boxes" float32 [N, 4] x1 y1 x2 y2 in the S x S image's
              pixels, "labels" int64 [N] class indices 0..K-1, "crowd" bool [N], "image_id"
              int (source.image_id: COCO's id). Train targets leave crowd regions out (as
              torchvision's COCO reference trains); eval targets keep them, flagged, for the
              evaluation to ignore what matches them.

Mosaic is switched off for the last dataset.augment.close_mosaic epochs (as YOLO does), so
that training ends on images like those it is scored on. Which epoch that is belongs to the
run, not to the config: start(max_epochs) fixes `mosaic_off_from` when a run starts afresh,
and the checkpoint carries it (state_dict, load_state_dict), so a resumed run switches at the
same epoch even if its budget changed. Data on which neither was called keeps mosaic on in
every epoch (a copy that failed to take the state back is then visibly wrong, not subtly).
The value must be set before loader() is called: the workers get a pickled copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from labrun.core.errors import DataError
from labrun.data.detection import transforms
from labrun.data.detection.boxes import Objects
from labrun.data.detection.sources import hold_out
from labrun.data.image import images_loader

log = logging.getLogger(__name__)


@dataclass
class DetectionData:
    splits: dict[str, Any]
    cfg: DictConfig
    mosaic_off_from: int | None = None  # the first epoch without mosaic; None: none

    @classmethod
    def build(cls, splits: dict[str, Any], cfg: DictConfig) -> DetectionData:
        """The format's splits, val held out of train where the format has none, each checked
        not empty; what reading fixed of each split's labels logged once."""
        for source in splits.values():
            line = source.cleaned.line(source.name)
            if line:
                log.warning(line)
        if "val" not in splits:
            splits["train"], splits["val"] = hold_out(splits["train"], cfg.val_fraction,
                                                      cfg.get("split_seed", 0))
        for split, source in splits.items():
            if len(source) == 0:
                raise DataError(f"{source.name}: the {split} split is empty; add images to it")
        return cls(splits, cfg)

    @property
    def info(self) -> dict[str, Any]:
        """What the data declares to the task: class names, COCO category ids (None: the class
        index is the id), and the side of the square images."""
        train = self.splits["train"]
        return {"class_names": list(train.class_names),
                "category_ids": None if train.category_ids is None else list(train.category_ids),
                "image_size": int(self.cfg.image_size)}

    # -- the mosaic switch: run state ---------------------------------------------------------

    def start(self, max_epochs: int) -> None:
        """A run's fresh start: mosaic off from epoch max_epochs - close_mosaic on."""
        self.mosaic_off_from = max(0, int(max_epochs) - int(self.cfg.augment.close_mosaic))

    def state_dict(self) -> dict[str, Any]:
        return {"mosaic_off_from": self.mosaic_off_from}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mosaic_off_from = state["mosaic_off_from"]

    # -- loaders --------------------------------------------------------------------------------

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False
               ) -> Any:
        """Train: shuffled per epoch, augmented, whole optimizer steps only. Eval: in order,
        letterboxed, every sample once."""
        samples = DetectionDataset(self.splits[split], split, self.cfg, seed,
                                   self.mosaic_off_from)
        return images_loader(samples, self.cfg, micro_batch_size=micro_batch_size, seed=seed,
                             rank=rank, world_size=world_size,
                             samples_per_step=samples_per_step, pin_memory=pin_memory,
                             collate_fn=collate)


class DetectionDataset(Dataset):
    """(epoch, index) -> (uint8 3 x S x S image, target dict), transformed with randomness
    from (seed, epoch, index)."""

    def __init__(self, source: Any, split: str, cfg: DictConfig, seed: int,
                 mosaic_off_from: int | None):
        self.source, self.split, self.seed = source, split, seed
        self.size = int(cfg.image_size)
        aug = cfg.augment
        self.hflip, self.scale = bool(aug.hflip), tuple(aug.scale)
        self.min_visible, self.mosaic = float(aug.min_visible), float(aug.mosaic)
        self.colour = {k: float(aug[k]) for k in ("brightness", "contrast", "saturation", "hue")}
        self.mosaic_off_from = mosaic_off_from

    def __len__(self) -> int:
        return len(self.source)

    def mosaic_on(self, epoch: int) -> bool:
        return self.mosaic > 0 and (self.mosaic_off_from is None
                                    or epoch < self.mosaic_off_from)

    def open(self, index: int) -> tuple[Any, Objects]:
        """Image `index` and its objects; crowd regions left out for training."""
        image, objects = self.source.open(index)
        if self.split == "train" and objects.crowd.any():
            keep = ~objects.crowd
            objects = Objects(objects.boxes[keep], objects.labels[keep], objects.crowd[keep])
        return image, objects

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, dict[str, Any]]:
        epoch, index = key
        try:
            pixels, objects = self.transformed(epoch, index)
        except DataError:
            raise
        except Exception as error:
            raise DataError(f"{self.split} sample {index} ({self.source.describe(index)}) "
                            f"could not be loaded: {error}") from error
        return pixels, {"boxes": torch.from_numpy(objects.boxes),
                        "labels": torch.from_numpy(objects.labels),
                        "crowd": torch.from_numpy(objects.crowd),
                        "image_id": int(self.source.image_id(index))}

    def transformed(self, epoch: int, index: int) -> tuple[torch.Tensor, Objects]:
        if self.split != "train":
            return transforms.letterbox(*self.open(index), self.size)
        rng = np.random.default_rng([self.seed, epoch, index])
        if self.mosaic_on(epoch) and rng.random() < self.mosaic:
            others = rng.integers(0, len(self.source), size=3)
            samples = [self.open(int(i)) for i in (index, *others)]
            pixels, objects = transforms.mosaic(samples, self.size, self.scale,
                                                self.min_visible, rng)
        else:
            pixels, objects = transforms.scale_crop(*self.open(index), self.size, self.scale,
                                                    self.min_visible, rng)
            pixels, objects = transforms.pad(pixels, objects, self.size)
        if self.hflip and rng.random() < 0.5:
            pixels, objects = transforms.hflip(pixels, objects)
        return transforms.jitter(pixels, rng, **self.colour), objects


def collate(samples: list[tuple[torch.Tensor, dict[str, Any]]]
            ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """(uint8 B x 3 x S x S images, a list of B target dicts): targets hold different numbers
    of boxes, so they stay a list."""
    return torch.stack([image for image, _ in samples]), [target for _, target in samples]
