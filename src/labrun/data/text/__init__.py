"""Labelled text (`dataset=text`), tokenized once by the model's tokenizer into a token cache,
batched with dynamic padding.

    formats.py   the files of each split, their rows, each row's texts and label, checked
    cache.py     the token cache: tokenized once, memory-mapped by every worker

Batches are (input_ids, attention_mask, token_type_ids, labels), padded to the batch's longest
example rounded up to `pad_to_multiple_of`. For training the sampler groups examples of
similar length (LengthGroupedSampler: Hugging Face's "group_by_length", drawn from (seed,
epoch) so that a resumed run continues mid-epoch with exactly the same batches).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from labrun.core import hub_cache
from labrun.core.errors import DataError
from labrun.data import EpochSampler, epoch_loader
from labrun.data.text.cache import (
    META,
    build_cache,
    cache_key,
    load_tokenizer,
    settings_of,
    tokenizer_record,
)
from labrun.data.text.formats import split_sources

log = logging.getLogger(__name__)

# Examples per "mega-batch" sorted by length (Hugging Face's LengthGroupedSampler takes 50
# batches): wide enough to find similar lengths, narrow enough that order stays random.
GROUP_BATCHES = 50


class TextExamples:
    """(epoch, index) -> (ids, types, label) of a split of the token cache, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.starts = np.load(folder / "starts.npy")
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, int]:
        if self._arrays is None:
            self._arrays = {name: np.load(self.folder / f"{name}.npy", mmap_mode="r")
                            for name in ("ids", "types", "labels")}
        _, index = key
        start, end = self.starts[index], self.starts[index + 1]
        return (self._arrays["ids"][start:end], self._arrays["types"][start:end],
                int(self._arrays["labels"][index]))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}  # each worker maps the files itself


class PaddingCollate:
    """A batch of examples padded to its longest, rounded up to `multiple`: (input_ids,
    attention_mask, token_type_ids, labels), int64 but the mask."""

    def __init__(self, pad_id: int, multiple: int):
        self.pad_id, self.multiple = pad_id, multiple

    def __call__(self, examples: Sequence[tuple[np.ndarray, np.ndarray, int]]
                 ) -> tuple[torch.Tensor, ...]:
        longest = max(len(ids) for ids, _, _ in examples)
        width = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(examples), width), self.pad_id, dtype=torch.int64)
        types = torch.zeros((len(examples), width), dtype=torch.int64)
        mask = torch.zeros((len(examples), width), dtype=torch.int64)
        for row, (own_ids, own_types, _) in enumerate(examples):
            n = len(own_ids)
            ids[row, :n] = torch.from_numpy(own_ids.astype(np.int64))
            types[row, :n] = torch.from_numpy(own_types.astype(np.int64))
            mask[row, :n] = 1
        labels = torch.tensor([label for _, _, label in examples], dtype=torch.int64)
        return ids, mask, types, labels


class LengthGroupedSampler(EpochSampler):
    """EpochSampler's (seed, epoch) order with examples of similar length side by side: the
    shuffled order cut into mega-batches of GROUP_BATCHES steps, each sorted longest first
    (Hugging Face's group_by_length). The order is a function of (seed, epoch) alone, so a
    resumed run's `start` lands on the same batches; sharding and padding are EpochSampler's."""

    def __init__(self, lengths: np.ndarray, seed: int, rank: int = 0, world_size: int = 1,
                 multiple: int = 1, micro_batch_size: int = 1):
        super().__init__(len(lengths), seed, rank, world_size, shuffle=True, multiple=multiple,
                         pad=True)
        self.lengths = lengths
        self.group = GROUP_BATCHES * micro_batch_size * world_size

    def order(self) -> list[int]:
        shuffled = super().order()
        grouped = []
        for start in range(0, len(shuffled), self.group):
            chunk = shuffled[start:start + self.group]
            grouped += sorted(chunk, key=lambda i: -int(self.lengths[i]))  # stable: ties keep order
        return grouped


@dataclass
class TextData:
    """What `dataset=text` gives the Trainer: the splits, what the task is told (`info`: class
    names, the tokenizer, pairs or not) and loaders of padded batches."""

    folder: Path
    meta: dict[str, Any]
    tokenizer: dict[str, Any]
    pad_id: int
    pad_to_multiple_of: int
    length_grouped: bool
    num_workers: int

    @property
    def splits(self) -> dict[str, int]:
        return dict(self.meta["sizes"])

    @property
    def info(self) -> dict[str, Any]:
        return {"class_names": list(self.meta["class_names"]), "tokenizer": self.tokenizer,
                "max_length": self.meta["max_length"],
                "pairs": self.meta["columns"]["pair"] is not None,
                "pad_id": self.pad_id, "truncated": dict(self.meta["truncated"])}

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False) -> Any:
        examples = TextExamples(self.folder / split)
        train = split == "train"
        sampler = (LengthGroupedSampler(examples.lengths(), seed, rank, world_size,
                                        multiple=samples_per_step,
                                        micro_batch_size=micro_batch_size)
                   if train and self.length_grouped else None)
        return epoch_loader(examples, train=train, micro_batch_size=micro_batch_size, seed=seed,
                            rank=rank, world_size=world_size, samples_per_step=samples_per_step,
                            pin_memory=pin_memory, num_workers=self.num_workers,
                            name=f"{self.folder} ({split})", sampler=sampler,
                            collate_fn=PaddingCollate(self.pad_id, self.pad_to_multiple_of))



def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's padding id: its [PAD] (or <pad>) token, else 0."""
    for token in ("[PAD]", "<pad>", "<|padding|>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0



def load(path: str, tokenizer: str | None, cache_dir: str, text_column: str = "text",
         text_pair_column: str | None = None, label_column: str = "label",
         class_names: list[str] | None = None, val_fraction: float = 0.1, max_length: int = 128,
         revision: str | None = None, weights_cache: str | None = None,
         length_grouped: bool = True, pad_to_multiple_of: int = 1, num_workers: int = 0,
         name: str = "text") -> TextData:
    """dataset=text: the labelled text at `path`, tokenized by model `tokenizer`'s tokenizer
    (its snapshot in the weights cache) into the token cache under `cache_dir`."""
    if not tokenizer:
        raise DataError("dataset=text needs a tokenizer: the model's (model=hf model.name=ID), "
                        "or dataset.tokenizer=ID of another model in the weights cache")
    snapshot = hub_cache.locate(tokenizer, revision, weights_cache)
    settings = settings_of(text_column, text_pair_column, label_column, class_names,
                           val_fraction, max_length)
    sources = split_sources(Path(path))
    key = cache_key(sources, snapshot.tokenizer_file, settings)
    folder = Path(cache_dir) / f"{name}-{key[:16]}"
    if not (folder / META).is_file():
        build_cache(folder, sources, snapshot.tokenizer_file, settings)
    meta = json.loads((folder / META).read_text())
    sizes = ", ".join(f"{n:,} {split}" for split, n in meta["sizes"].items())
    cut = ", ".join(f"{n:,} {split}" for split, n in meta["truncated"].items() if n)
    log.info(f"dataset=text: {sizes} examples, {len(meta['class_names'])} classes; "
             f"{f'truncated at max_length={max_length}: {cut}' if cut else 'none truncated'}")
    loaded = load_tokenizer(snapshot.tokenizer_file, max_length)
    return TextData(folder, meta, tokenizer_record(snapshot.tokenizer_file), pad_id_of(loaded),
                    max(1, pad_to_multiple_of), length_grouped, num_workers)
