"""Datasets, samplers and loaders.

    build(cfg.dataset)  -> Data: one ImageSource per split (train, val, maybe test) + class names
    Data.loader(split, ...)  -> a DataLoader of uint8 NCHW batches and int64 labels; with
                                dataset.decode=cpu|cuda, one whose batches the main process
                                decoded, already on that device (data/batched.py)

A dataset format is a function named by `dataset._target_` (digits.load, hdf5.load, ... or a
lab's own): it takes some of the dataset keys as keyword arguments (`path`, `image_size`...)
and returns {"train": ImageSource, "val": ..., "test": ...}; val may be left out.

Samples are addressed as (epoch, index): the sampler, which lives in the main process, hands
the epoch to the workers with every index, so each sample's augmentation randomness derives from
(seed, epoch, index). That keeps runs reproducible with any number of workers, persistent or
not, and lets a resumed run continue mid-epoch with exactly the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, Sampler

from labrun.config import keys
from labrun.core.errors import DataError
from labrun.data import batched
from labrun.data.sources import ImageSource, hold_out
from labrun.data.transforms import TrainTransform, ValTransform


def call_target(node: DictConfig, **available: Any) -> Any:
    """Call `node._target_` with the keyword arguments it names, taken from the node's keys
    and `available` (values labrun computes, such as a run folder).

    Unlike hydra.utils.instantiate, which passes every key, a plug-in takes only what it needs
    from a section that also holds keys for labrun (a dataset's loader takes `path`, not
    `num_workers`); one that takes **kwargs gets everything.
    """
    target = get_object(node._target_)  # an error names the target
    accepted = keys.target_arguments(node._target_)  # None: it takes any
    values = {str(k): _plain(node[k]) for k in node if not str(k).startswith("_")}
    values.update(available)
    return target(**{k: v for k, v in values.items() if accepted is None or k in accepted})


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@dataclass
class Data:
    splits: dict[str, ImageSource]
    cfg: DictConfig

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
        source = self.splits[split]
        images = ImageDataset(source, self.transform(split), seed, split)
        batched_decode = self.cfg.get("decode", "workers") != "workers"
        loader = epoch_loader(batched.EncodedDataset(images) if batched_decode else images,
                              train=split == "train", micro_batch_size=micro_batch_size,
                              seed=seed, rank=rank, world_size=world_size,
                              samples_per_step=samples_per_step,
                              # batched: nvJPEG copies the bytes itself; nothing to pin
                              pin_memory=pin_memory and not batched_decode,
                              num_workers=self.cfg.num_workers, name=source.name,
                              collate_fn=batched.collate if batched_decode else None)
        if not batched_decode:
            return loader
        decoder = batched.BatchDecoder(images, batched.decode_device(self.cfg.decode))
        return batched.DecodedLoader(loader, decoder)


def epoch_loader(samples: Dataset, *, train: bool, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, samples_per_step: int = 1,
                 pin_memory: bool = False, num_workers: int = 0, name: str = "the data",
                 collate_fn: Callable | None = None) -> DataLoader:
    """A loader of `samples` (a Dataset indexed by (epoch, index) keys, len() the number of
    samples) in EpochSampler's order, with exact resume and DDP sharding: the image formats',
    and that of a format making its own loaders (data/tokens.py, a lab's own)."""
    sampler = EpochSampler(len(samples), seed, rank, world_size, shuffle=train,
                           multiple=samples_per_step if train else 1, pad=train)
    if train and len(sampler) == 0:
        raise DataError(f"{name} has {len(samples)} samples, fewer than one optimizer step "
                        f"({samples_per_step * world_size}); lower trainer.batch_size")
    # The loader's own generator: creating an iterator must not draw from the global RNG, or a
    # resumed run (which creates its iterators at other times) would drift.
    return DataLoader(samples, batch_size=micro_batch_size, sampler=sampler,
                      num_workers=num_workers, persistent_workers=num_workers > 0,
                      prefetch_factor=4 if num_workers > 0 else None, pin_memory=pin_memory,
                      collate_fn=collate_fn, generator=torch.Generator().manual_seed(seed))


def build(cfg: DictConfig) -> Data:
    decode = cfg.get("decode", "workers")
    if decode != "workers":
        batched.check_device(decode)  # before reading any data
    splits = call_target(cfg)
    if not isinstance(splits, dict):
        return splits  # a format that makes its own loaders (dataset=tokens: data/tokens.py)
    if "val" not in splits:
        if cfg.val_fraction <= 0:
            raise DataError(f"{splits['train'].name} has no val split; set dataset.val_fraction "
                            f"(for example 0.1) to hold out part of train")
        splits["train"], splits["val"] = hold_out(splits["train"], cfg.val_fraction)
    for split, source in splits.items():
        if len(source) == 0:
            raise DataError(f"{source.name}: the {split} split is empty; add images to it")
    if decode != "workers":
        batched.check(decode, splits)
    return Data(splits, cfg)


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

    def error(self, index: int, error: BaseException | str) -> DataError:
        """The one line for sample `index` that could not be loaded: which file, and why."""
        hint = getattr(self.source, "hint", None)
        return DataError(f"{self.split} sample {index} ({self.source.describe(index)}) could "
                         f"not be loaded: {error}" + (f"; {hint}" if hint else ""))


class EpochSampler(Sampler):
    """Yields (epoch, index) keys; shuffled with a seed per epoch, sharded across ranks.

    Like DistributedSampler, the shuffled order is padded by repetition so that every rank gets
    the same number of samples (pad=True, for training); eval shards are not padded, so every
    sample counts once. `multiple` trims each rank's share to whole optimizer steps, and
    `set_epoch(epoch, start)` starts mid-epoch when a run resumes.
    """

    def __init__(self, size: int, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, multiple: int = 1, pad: bool = True):
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self.shuffle, self.multiple, self.pad = shuffle, multiple, pad
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        if self.pad and self.size % self.world_size:
            total = math.ceil(self.size / self.world_size) * self.world_size
            order = (order * math.ceil(total / self.size))[:total]
        mine = order[self.rank::self.world_size]
        return mine[:len(mine) // self.multiple * self.multiple]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.indices()[self.start:]:
            yield self.epoch, index

    def __len__(self) -> int:
        return max(0, len(self.indices()) - self.start)

    def steps_per_epoch(self) -> int:
        return len(self.indices()) // self.multiple
