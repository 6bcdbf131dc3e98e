"""Data: what `dataset._target_` makes, and the sampling every format shares.

    build(cfg.dataset) -> an object with
        info                     what the data declares to the task (train/task.py): class
                                 names, a vocabulary...
        splits                   its splits (train, val, maybe test), by name
        loader(split, ...)       a DataLoader of the split's batches, as the task's prepare()
                                 takes them

A format is a function named by `dataset._target_`, called with the dataset keys it names as
parameters (call_target). An image format returns {"train": ImageSource, "val": ..., ...},
which labrun.data.image makes into ImageData (transforms, decoding, held-out val); a format of
masks returns sources that say `dense = True` (SegData, labrun.data.segmentation), one of boxes
sources that say `boxes = True` (DetectionData, labrun.data.detection); a format of another
kind returns its own object (dataset=tokens: labrun.data.tokens.TokenData).

Samples are addressed as (epoch, index) by EpochSampler, whatever the format: the sampler,
which lives in the main process, hands the epoch to the workers with every index, so each
sample's randomness derives from (seed, epoch, index). That keeps runs reproducible with any
number of workers, persistent or not, lets a resumed run continue mid-epoch with exactly the
same batches, and shards a step's samples across DDP ranks (epoch_loader).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, Sampler

from labrun.config import keys
from labrun.core.errors import DataError


class Data(Protocol):
    """What the Trainer reads of a run's data, whatever its kind."""

    @property
    def info(self) -> dict[str, Any]: ...

    @property
    def splits(self) -> Mapping[str, Any]: ...

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False
               ) -> Any: ...


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


def epoch_loader(samples: Dataset, *, train: bool, micro_batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, samples_per_step: int = 1,
                 pin_memory: bool = False, num_workers: int = 0, name: str = "the data",
                 collate_fn: Callable | None = None, sampler: EpochSampler | None = None
                 ) -> DataLoader:
    """A loader of `samples` (a Dataset indexed by (epoch, index) keys, len() the number of
    samples) in EpochSampler's order, with exact resume and DDP sharding: the image formats',
    and that of a format making its own loaders (data/tokens.py, a lab's own). `sampler`: an
    EpochSampler of another order for the same keys (data/text/ groups by length)."""
    if sampler is None:
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
    """The data `cfg` (the dataset section) names, ready for the Trainer."""
    from labrun.data import image  # the image formats' loaders return their splits

    image.check_decode(cfg)  # before any data is read
    image.check_folds(cfg)
    made = call_target(cfg)
    if isinstance(made, dict):
        from labrun.data import detection, segmentation

        if detection.holds_boxes(made):
            from labrun.data.detection.data import DetectionData

            return DetectionData.build(made, cfg)
        if segmentation.holds_masks(made):
            return segmentation.SegData.build(made, cfg)
        return image.ImageData.build(made, cfg)
    return made  # a format that makes its own loaders (dataset=tokens: data/tokens.py)


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

    def order(self) -> list[int]:
        """Every sample of the epoch, in the order all ranks share (before sharding)."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def indices(self) -> list[int]:
        order = self.order()
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
