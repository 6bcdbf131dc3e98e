"""Segmentation data: formats whose labels are masks (shapes, segfolder, seg_hdf5), and SegData,
which the Trainer gets for them (labrun.data.build):

    SegData.info              class names, the mean and std images are normalised by, and the
                              mask value not scored (ignore_index)
    SegData.loader(split...)  a DataLoader of uint8 NCHW images and uint8 NHW masks; with
                              dataset.decode=cpu|cuda, the workers crop the masks and read the
                              JPEGs, which this process decodes a batch at a time with the same
                              boxes (data/image/batched.py), as for classification

A format's loader returns {split: source}, each source with `dense = True` (what tells it from
an image classification format's), and:
    name, class_names, __len__(), describe(i)   as an ImageSource's (data/image/sources.py)
    open(i) -> (image, mask)   uint8 HxWx3 pixels or a JpegImage; uint8 HxW class indices
                               or a PngMask (masks.py: a mask decoded when it is cropped)
    holds_jpeg, read(i), mask(i)   optional: the image file's bytes and the mask apart, for
                                   dataset.decode=cpu|cuda

Images and masks are transformed together (transforms.py), with each sample's randomness from
(seed, epoch, index), as for classification. A mask that does not fit its image, or holds a
value that is neither a class nor ignore_index, is refused naming the file: a sample of pairs
(whole masks) when the data is built, before training, and every item as it is read (its size
from the headers, its values on the pixels it gives: a training crop decodes no mask row below
it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from labrun.core.errors import ConfigError, DataError
from labrun.data.image import batched, images_loader
from labrun.data.image.transforms import Box
from labrun.data.segmentation.masks import mask_pixels
from labrun.data.segmentation.transforms import JointEval, JointTrain, PadCollate, mask_box

CHECKED_AT_START = 16  # pairs read when the data is built, spread over each split


def holds_masks(splits: dict[str, Any]) -> bool:
    return all(getattr(source, "dense", False) for source in splits.values())


def size_problem(image_size: tuple[int, int], mask_size: tuple[int, int]) -> str | None:
    """Why an image of `image_size` (height, width) cannot take a mask of `mask_size`, or None."""
    if tuple(image_size) != tuple(mask_size):
        return (f"its mask is {mask_size[1]}x{mask_size[0]} (width x height), the image "
                f"{image_size[1]}x{image_size[0]}; masks must match their image's size")
    return None


def value_problem(values: np.ndarray, num_classes: int, ignore_index: int) -> str | None:
    """Why these mask pixels cannot train, or None."""
    wrong = (values >= num_classes) & (values != ignore_index)
    if wrong.any():
        return (f"its mask holds value {int(values[wrong].max())}, but there are {num_classes} "
                f"classes (0..{num_classes - 1}) and dataset.ignore_index={ignore_index}")
    return None


class Subset:
    """Some samples of another source: a held-out val split, or folds."""

    dense = True

    def __init__(self, source: Any, indices: np.ndarray, name: str):
        self.source, self.indices, self.name = source, np.sort(indices), name
        self.class_names = source.class_names

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def holds_jpeg(self) -> bool:
        return getattr(self.source, "holds_jpeg", False)

    def read(self, index: int) -> bytes:
        return self.source.read(int(self.indices[index]))

    def mask(self, index: int) -> np.ndarray:
        return self.source.mask(int(self.indices[index]))

    def open(self, index: int) -> tuple[Any, np.ndarray]:
        return self.source.open(int(self.indices[index]))

    def describe(self, index: int) -> str:
        return self.source.describe(int(self.indices[index]))


def split_off(train: Any, cfg: DictConfig) -> tuple[Subset, Subset]:
    """(train, val) out of a format's train split: fold dataset.fold of dataset.num_folds
    (scikit-learn's KFold: masks have no one label to stratify by), or a seeded
    dataset.val_fraction."""
    seed = cfg.get("split_seed", 0)
    if cfg.get("num_folds"):
        from sklearn.model_selection import KFold

        kept, held = list(KFold(cfg.num_folds, shuffle=True, random_state=seed)
                          .split(np.zeros(len(train))))[cfg.fold]
        return (Subset(train, kept, f"{train.name}[folds except {cfg.fold}]"),
                Subset(train, held, f"{train.name}[fold {cfg.fold} of {cfg.num_folds}]"))
    if cfg.val_fraction <= 0:
        raise DataError(f"{train.name} has no val split; set dataset.val_fraction (for "
                        f"example 0.1) to hold out part of train")
    order = np.random.default_rng(seed).permutation(len(train))
    n_val = round(len(train) * cfg.val_fraction)
    return (Subset(train, order[n_val:], f"{train.name}[train part]"),
            Subset(train, order[:n_val], f"{train.name}[val part]"))


@dataclass
class SegData:
    splits: dict[str, Any]
    cfg: DictConfig

    @classmethod
    def build(cls, splits: dict[str, Any], cfg: DictConfig) -> SegData:
        """The format's splits, val split off train where the format has none, each checked
        not empty, and a sample of each split's pairs checked."""
        decode = cfg.get("decode", "workers")
        if decode != "workers" and cfg.eval_size == "full":
            raise ConfigError(f"dataset.decode={decode} decodes batches of one size, and "
                              f"dataset.eval_size=full scores images at their own sizes; use "
                              f"dataset.eval_size=fixed or dataset.decode=workers")
        if cfg.get("num_folds") and "val" in splits:
            raise DataError(f"dataset.num_folds={cfg.num_folds}: {splits['val'].name} is a val "
                            f"split of the format's own; folds split a dataset without one")
        if cfg.get("num_folds") or "val" not in splits:
            splits["train"], splits["val"] = split_off(splits["train"], cfg)
        data = cls(splits, cfg)
        for split, source in splits.items():
            if len(source) == 0:
                raise DataError(f"{source.name}: the {split} split is empty; add images to it")
            for index in np.linspace(0, len(source) - 1, CHECKED_AT_START).astype(int):
                image, mask = source.open(int(index))
                data.check_size(source, int(index), image.shape[:2], mask.shape)
                data.check_values(source, int(index), mask_pixels(mask))
        if decode != "workers":
            batched.check(decode, splits)
        return data

    def check_size(self, source: Any, index: int, image_size: tuple[int, int],
                   mask_size: tuple[int, int]) -> None:
        self.refuse(source, index, size_problem(image_size, mask_size))

    def check_values(self, source: Any, index: int, values: np.ndarray | torch.Tensor) -> None:
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        self.refuse(source, index,
                    value_problem(values, len(self.class_names), self.cfg.ignore_index))

    @staticmethod
    def refuse(source: Any, index: int, problem: str | None) -> None:
        if problem:
            raise DataError(f"{source.describe(index)}: {problem}")

    @property
    def class_names(self) -> list[str]:
        return self.splits["train"].class_names

    @property
    def info(self) -> dict[str, Any]:
        return {"class_names": self.class_names, "mean": list(self.cfg.mean),
                "std": list(self.cfg.std), "ignore_index": int(self.cfg.ignore_index)}

    def transform(self, split: str) -> Callable:
        if split == "train":
            aug = self.cfg.augment
            return JointTrain(self.cfg.image_size, tuple(aug.crop_scale), tuple(aug.crop_ratio),
                              aug.hflip)
        return JointEval(self.cfg.image_size if self.cfg.eval_size == "fixed" else None)

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False
               ) -> Any:
        pairs = SegDataset(self, self.splits[split], self.transform(split), seed, split)
        full_size = split != "train" and self.cfg.eval_size == "full"
        return images_loader(pairs, self.cfg, micro_batch_size=micro_batch_size, seed=seed,
                             rank=rank, world_size=world_size,
                             samples_per_step=samples_per_step, pin_memory=pin_memory,
                             collate_fn=PadCollate(self.cfg.ignore_index) if full_size else None)


class SegDataset(Dataset):
    """(epoch, index) -> (uint8 CxHxW image, uint8 HxW mask), transformed together."""

    def __init__(self, data: SegData, source: Any, transform: Callable, seed: int, split: str):
        self.data, self.source, self.transform = data, source, transform
        self.seed, self.split = seed, split

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = key
        rng = np.random.default_rng([self.seed, epoch, index])
        try:
            image, mask = self.source.open(index)
        except DataError:
            raise
        except Exception as error:
            raise self.error(index, error) from error
        self.data.check_size(self.source, index, image.shape[:2], mask.shape)
        image, mask = self.transform(image, mask, rng)
        self.data.check_values(self.source, index, mask)
        return image, mask

    def target(self, index: int, size: tuple[int, int], box: Box) -> torch.Tensor:
        """The mask of sample `index`, whose image is `size`, through `box`: for the batched
        decode (data/image/batched.py), which crops the image with the same box."""
        try:
            mask = self.source.mask(index)
        except DataError:
            raise
        except Exception as error:
            raise self.error(index, error) from error
        self.data.check_size(self.source, index, size, mask.shape)
        out = self.transform.size
        mask = mask_box(mask, box, out, out)
        self.data.check_values(self.source, index, mask)
        return mask

    def error(self, index: int, error: BaseException | str) -> DataError:
        return DataError(f"{self.split} sample {index} ({self.source.describe(index)}) could "
                         f"not be loaded: {error}")
