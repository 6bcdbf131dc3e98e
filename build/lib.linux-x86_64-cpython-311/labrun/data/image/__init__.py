"""Images: the formats that give one ImageSource per split (digits, cifar, imagefolder, hdf5,
synthetic, or a lab's own), their decoding (decode.py, batched.py) and augmentation
(transforms.py), and ImageData, which the Trainer gets for them (labrun.data.build):

    ImageData.info              class names, and the mean and std the image tasks normalise by
    ImageData.loader(split...)  a DataLoader of uint8 NCHW batches and int64 labels; with
                                dataset.decode=cpu|cuda, one whose batches the main process
                                decoded, already on that device (batched.py)

Each sample's augmentation randomness derives from (seed, epoch, index) (ImageDataset), as
labrun.data.EpochSampler hands them out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from labrun.core.errors import ConfigError, DataError
from labrun.data import epoch_loader
from labrun.data.image import batched
from labrun.data.image.sources import ImageSource, folds, hold_out
from labrun.data.image.transforms import TrainTransform, ValTransform

log = logging.getLogger(__name__)


# Formats whose files define a val split, which folds would contradict (refused before any
# data is read); an image folder with val/ and an HDF5 file with a val group are told by looking.
OWN_VAL_SPLIT = {"labrun.data.image.cifar.load": "CIFAR-10 holds its val split out itself",
                 "labrun.data.image.synthetic.load": "it draws dataset.num_val images of its own"}


def check_folds(cfg: DictConfig) -> None:
    """dataset.num_folds on a format with a val split of its own: refused in one line."""
    if not cfg.get("num_folds"):
        return
    target = cfg.get("_target_")
    reason = OWN_VAL_SPLIT.get(target)
    if target == "labrun.data.image.imagefolder.load" and (Path(cfg.root) / "val").is_dir():
        reason = f"{Path(cfg.root) / 'val'} is its val split"
    elif target == "labrun.data.image.hdf5.load" and Path(cfg.path).is_file():
        from labrun.data.image import hdf5

        if "val" in hdf5.read_index(cfg.path).splits:
            reason = f"{cfg.path} holds a val group"
    if reason:
        raise ConfigError(f"dataset.num_folds={cfg.num_folds}: dataset {cfg.name} has a val "
                          f"split of its own ({reason}); folds split data without one "
                          f"(dataset=digits, an image folder without val/)")


def check_decode(cfg: DictConfig) -> None:
    """dataset.decode=cpu|cuda: refused before any data is read where it cannot run."""
    decode = cfg.get("decode", "workers")
    if decode != "workers":
        batched.check_device(decode)


@dataclass
class ImageData:
    splits: dict[str, ImageSource]
    cfg: DictConfig

    @classmethod
    def build(cls, splits: dict[str, ImageSource], cfg: DictConfig) -> ImageData:
        """The format's splits, with val held out of train where the format has none, each
        checked not empty."""
        seed = cfg.get("split_seed", 0)
        if cfg.get("num_folds") and "val" in splits:  # a lab's format: known only now
            raise DataError(f"dataset.num_folds={cfg.num_folds}: {splits['val'].name} is a val "
                            f"split of the format's own; folds split a dataset without one")
        if cfg.get("num_folds"):
            log.info(f"dataset.fold={cfg.fold} of {cfg.num_folds} is the val split "
                     f"(dataset.val_fraction={cfg.val_fraction} is not used)")
            splits["train"], splits["val"] = folds(splits["train"], cfg.num_folds, cfg.fold,
                                                   seed)
        elif "val" not in splits:
            if cfg.val_fraction <= 0:
                raise DataError(f"{splits['train'].name} has no val split; set "
                                f"dataset.val_fraction (for example 0.1) to hold out part of "
                                f"train")
            splits["train"], splits["val"] = hold_out(splits["train"], cfg.val_fraction, seed)
        for split, source in splits.items():
            if len(source) == 0:
                raise DataError(f"{source.name}: the {split} split is empty; add images to it")
        decode = cfg.get("decode", "workers")
        if decode != "workers":
            batched.check(decode, splits)
        return cls(splits, cfg)

    @property
    def class_names(self) -> list[str]:
        return self.splits["train"].class_names

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def info(self) -> dict[str, Any]:
        """What the data declares to the task (train/task.py): its class names, and the mean
        and std its images are normalised by."""
        return {"class_names": self.class_names, "mean": list(self.cfg.mean),
                "std": list(self.cfg.std)}

    def transform(self, split: str) -> Callable:
        if split == "train":
            aug = self.cfg.augment
            return TrainTransform(self.cfg.image_size, tuple(aug.crop_scale),
                                  tuple(aug.crop_ratio), aug.hflip)
        return ValTransform(self.cfg.image_size, self.cfg.augment.val_resize_ratio)

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False
               ) -> DataLoader:
        """Train: shuffled per epoch, whole optimizer steps only. Eval: in order, every sample once."""
        images = ImageDataset(self.splits[split], self.transform(split), seed, split)
        return images_loader(images, self.cfg, micro_batch_size=micro_batch_size, seed=seed,
                             rank=rank, world_size=world_size,
                             samples_per_step=samples_per_step, pin_memory=pin_memory)


def images_loader(images: Dataset, cfg: DictConfig, *, micro_batch_size: int, seed: int,
                  rank: int, world_size: int, samples_per_step: int, pin_memory: bool,
                  collate_fn: Callable | None = None) -> DataLoader | batched.DecodedLoader:
    """The loader of an ImageDataset or a SegDataset (labrun.data.segmentation): its samples
    in EpochSampler's order, decoded in the workers, or with dataset.decode=cpu|cuda read there
    and decoded a batch at a time in this process (batched.py)."""
    batched_decode = cfg.get("decode", "workers") != "workers"
    loader = epoch_loader(batched.EncodedDataset(images) if batched_decode else images,
                          train=images.split == "train", micro_batch_size=micro_batch_size,
                          seed=seed, rank=rank, world_size=world_size,
                          samples_per_step=samples_per_step,
                          # batched: nvJPEG copies the bytes itself; nothing to pin
                          pin_memory=pin_memory and not batched_decode,
                          num_workers=cfg.num_workers, name=images.source.name,
                          collate_fn=batched.collate if batched_decode else collate_fn)
    if not batched_decode:
        return loader
    decoder = batched.BatchDecoder(images, batched.decode_device(cfg.decode))
    return batched.DecodedLoader(loader, decoder)


class ImageDataset(Dataset):
    """(epoch, index) -> (uint8 CxHxW tensor, label), augmented with per-sample randomness."""

    def __init__(self, source: ImageSource, transform: Callable, seed: int, split: str):
        self.source, self.transform, self.seed, self.split = source, transform, seed, split

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, index = key
        rng = np.random.default_rng([self.seed, epoch, index])
        try:
            image = self.source.open(index)  # a JPEG is decoded by the transform, when it crops
            return self.transform(image, rng), int(self.source.labels[index])
        except DataError:
            raise
        except Exception as error:
            raise self.error(index, error) from error

    def target(self, index: int, size: tuple[int, int], box: Any) -> int:
        """Sample `index`'s label, for the batched decode (batched.EncodedDataset)."""
        return int(self.source.labels[index])

    def error(self, index: int, error: BaseException | str) -> DataError:
        """The one line for sample `index` that could not be loaded: which file, and why."""
        hint = getattr(self.source, "hint", None)
        return DataError(f"{self.split} sample {index} ({self.source.describe(index)}) could "
                         f"not be loaded: {error}" + (f"; {hint}" if hint else ""))
