"""Labelled text (`dataset=text`), tokenized once by the model's tokenizer into a token cache,
batched with dynamic padding: the one owner of the text formats and of the cache's layout.

    path = FILE              the train split (.csv, .jsonl, .parquet); val held out of it
    path = FOLDER            train.EXT, and val.EXT (or validation.EXT) and test.EXT if there;
                             or a folder `datasets`' save_to_disk wrote (its splits by name)

A row holds `text_column`, `label_column` and, for pairs, `text_pair_column`. Labels are names
(strings) or ids (integers): names are mapped to ids by `class_names` (null: the train split's
labels, sorted). Every row is checked before anything is tokenized; a missing column, a label
outside the names, an empty text or a file that is not UTF-8 is refused in one line naming the
file and the row.

The token cache (CACHE_DIR/NAME-KEY/, KEY the sha256 of the tokenizer file, of each data file
and of the settings that change a token): per split, the ids of every example end to end
(ids.npy, uint32), its token types (types.npy, uint8: which text of a pair), where each example
starts (starts.npy) and the labels (labels.npy); meta.json with the class names, the split
sizes and how many examples were truncated at max_length. Jobs starting together each write a
folder of their own and rename it into place; the first rename wins and every job reads the
same bytes (as dataset=python_docs does).

Batches are (input_ids, attention_mask, token_type_ids, labels), padded to the batch's longest
example rounded up to `pad_to_multiple_of`. For training the sampler groups examples of
similar length (LengthGroupedSampler: Hugging Face's "group_by_length", drawn from (seed,
epoch) so that a resumed run continues mid-epoch with exactly the same batches).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from labrun.core import hub_cache
from labrun.core.errors import DataError
from labrun.data import EpochSampler, epoch_loader

log = logging.getLogger(__name__)

FORMAT = 1
SUFFIXES = (".csv", ".jsonl", ".parquet")
SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation"), "test": ("test",)}
META = "meta.json"
# Examples per "mega-batch" sorted by length (Hugging Face's LengthGroupedSampler takes 50
# batches): wide enough to find similar lengths, narrow enough that order stays random.
GROUP_BATCHES = 50


@dataclass
class Example:
    text: str
    pair: str | None
    label: Any
    where: str  # "FILE, row N": what a refusal names


# -- reading ------------------------------------------------------------------------------------


def split_sources(path: Path) -> dict[str, Path | tuple[Path, str]]:
    """The files of each split under `path`: a file is the train split; a folder holds
    SPLIT.EXT files or a `datasets` folder ((folder, split) for each of its splits)."""
    if path.is_file():
        return {"train": path}
    if not path.is_dir():
        raise DataError(f"dataset.path={path} does not exist")
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _datasets_splits(path)
    found: dict[str, Path | tuple[Path, str]] = {}
    for split, names in SPLIT_NAMES.items():
        for name in names:
            files = [path / f"{name}{suffix}" for suffix in SUFFIXES
                     if (path / f"{name}{suffix}").is_file()]
            if files:
                found[split] = files[0]
                break
    if "train" not in found:
        raise DataError(f"dataset.path={path} holds no train file (train.csv, train.jsonl or "
                        f"train.parquet) and is no folder saved by datasets' save_to_disk")
    return found


def _datasets_splits(path: Path) -> dict[str, Path | tuple[Path, str]]:
    if (path / "state.json").is_file():  # one Dataset: the train split
        return {"train": (path, "")}
    names = json.loads((path / "dataset_dict.json").read_text())["splits"]
    found = {split: (path, name) for split, options in SPLIT_NAMES.items()
             for name in options if name in names}
    if "train" not in found:
        raise DataError(f"dataset.path={path}: its splits ({', '.join(names)}) have no train")
    return {split: found[split] for split in SPLIT_NAMES if split in found}


def read_rows(source: Path | tuple[Path, str]) -> tuple[str, Iterator[dict[str, Any]]]:
    """(what a refusal calls the source, its rows as dicts)."""
    if isinstance(source, tuple):
        folder, split = source
        return f"{folder}{f' [{split}]' if split else ''}", _datasets_rows(folder, split)
    if source.suffix == ".csv":
        return str(source), _csv_rows(source)
    if source.suffix == ".jsonl":
        return str(source), _jsonl_rows(source)
    if source.suffix == ".parquet":
        return str(source), _parquet_rows(source)
    raise DataError(f"{source}: labrun reads text from {', '.join(SUFFIXES)} files; convert it "
                    f"to one of them")


def _text_of(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not UTF-8 (byte {error.start}: {error.reason}); "
                        f"convert the file to UTF-8") from None


def _csv_rows(path: Path) -> Iterator[dict[str, Any]]:
    yield from csv.DictReader(io.StringIO(_text_of(path), newline=""))  # quoted line breaks kept


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    for number, line in enumerate(_text_of(path).splitlines(), start=1):
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}, row {number}: not JSON ({error.msg}); each line of a "
                                f".jsonl file is one object") from None


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'labrun[nlp]'"
                        ) from None
    yield from pq.read_table(path).to_pylist()


def _datasets_rows(folder: Path, split: str) -> Iterator[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{folder}: a folder saved by Hugging Face datasets needs it: pip "
                        f"install 'labrun[nlp]'") from None
    loaded = datasets.load_from_disk(str(folder))
    yield from (loaded[split] if split else loaded)


@dataclass(frozen=True)
class Columns:
    text: str
    pair: str | None
    label: str


def read_examples(source: Path | tuple[Path, str], columns: Columns) -> list[Example]:
    """Every example of a source, each text checked (present, a non-empty string)."""
    name, rows = read_rows(source)
    examples = []
    for number, row in enumerate(rows, start=1):
        where = f"{name}, row {number}"
        needed = [c for c in (columns.text, columns.pair, columns.label) if c is not None]
        missing = [c for c in needed if c not in row]
        if missing:
            raise DataError(f"{where}: no column {missing[0]!r} (it has {', '.join(row)}); "
                            f"name the column with dataset.{_key(columns, missing[0])}=NAME")
        texts = [row[columns.text]] + ([row[columns.pair]] if columns.pair else [])
        for column, text in zip(needed, texts, strict=False):
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{where}: the {column!r} text is empty; remove the row or "
                                f"give it text")
        examples.append(Example(texts[0], texts[1] if columns.pair else None,
                                row[columns.label], where))
    if not examples:
        raise DataError(f"{name} holds no row")
    return examples


def _key(columns: Columns, column: str) -> str:
    return {columns.text: "text_column", columns.pair: "text_pair_column",
            columns.label: "label_column"}[column]


def as_id(label: Any) -> int | None:
    """An integer label (JSON's 3, a CSV's "3"): a class id; None for a name."""
    if isinstance(label, int) and not isinstance(label, bool):
        return label
    if isinstance(label, str) and label.strip().isdigit():
        return int(label)
    return None


def label_ids(examples: list[Example], names: list[str]) -> np.ndarray:
    """Each example's label id: a name's place in `names` (names may be digits), else an
    integer label within them."""
    index = {name: i for i, name in enumerate(names)}
    ids = np.empty(len(examples), dtype=np.int64)
    for i, example in enumerate(examples):
        label = example.label
        found = index.get(label) if isinstance(label, str) else None
        if found is None and (number := as_id(label)) is not None and number < len(names):
            found = number
        if found is None:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise DataError(f"{example.where}: label {label!r} is not one of the class names "
                            f"({shown}); fix the row, or list every name in "
                            f"dataset.class_names")
        ids[i] = found
    return ids


def class_names_of(examples: list[Example]) -> list[str]:
    """The train split's labels as names: ids 0 to the largest when every label is an integer
    (a class absent from train keeps its id), else the names sorted."""
    labels = [example.label for example in examples]
    numbers = [as_id(label) for label in labels]
    if all(number is not None for number in numbers):
        return [str(number) for number in range(max(numbers) + 1)]
    return sorted({str(label) for label in labels})


# -- the token cache ---------------------------------------------------------------------------


@dataclass
class Settings:
    """What the token cache depends on, besides the data and the tokenizer file."""
    columns: Columns
    class_names: list[str] | None
    val_fraction: float
    max_length: int

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, "columns": vars(self.columns), "class_names": self.class_names,
                "val_fraction": self.val_fraction, "max_length": self.max_length}


def sha256_file(path: Path) -> str:
    with open(path, "rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def cache_key(sources: dict[str, Path | tuple[Path, str]], tokenizer: Path,
              settings: Settings) -> str:
    digest = hashlib.sha256(json.dumps(settings.record(), sort_keys=True).encode())
    digest.update(sha256_file(tokenizer).encode())
    for split, source in sources.items():
        folder = source[0] if isinstance(source, tuple) else None
        files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder else [source]
        for file in files:
            digest.update(f"{split}:{file.name}:{sha256_file(file)}".encode())
    return digest.hexdigest()


def tokenize(examples: list[Example], tokenizer: Any, max_length: int
             ) -> tuple[dict[str, np.ndarray], int]:
    """The examples' token ids, token types and starts, end to end; and how many were cut
    at max_length."""
    pairs = examples[0].pair is not None
    inputs = [(e.text, e.pair) for e in examples] if pairs else [e.text for e in examples]
    encodings = tokenizer.encode_batch(inputs)
    lengths = np.array([len(e.ids) for e in encodings], dtype=np.int64)
    truncated = sum(1 for e in encodings if e.overflowing)
    starts = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    return {"ids": np.fromiter((i for e in encodings for i in e.ids), dtype=np.uint32,
                               count=int(starts[-1])),
            "types": np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.uint8,
                                 count=int(starts[-1])),
            "starts": starts}, truncated


def load_tokenizer(path: Path, max_length: int) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()  # padding is the batch's, not the example's
    tokenizer.enable_truncation(max_length)
    return tokenizer


def build_cache(folder: Path, sources: dict[str, Path | tuple[Path, str]], tokenizer_file: Path,
                settings: Settings) -> None:
    """Read, check, split and tokenize the data into `folder` (renamed into place whole)."""
    examples = {split: read_examples(source, settings.columns)
                for split, source in sources.items()}
    names = list(settings.class_names or class_names_of(examples["train"]))
    labels = {split: label_ids(found, names) for split, found in examples.items()}
    if "val" not in examples:
        if not 0.0 < settings.val_fraction < 1.0:
            raise DataError(f"dataset.val_fraction={settings.val_fraction}: with no val split "
                            f"of its own, hold one out with a fraction between 0 and 1")
        # A fixed draw: every run of this data holds out the same examples (and shares a cache).
        order = np.random.default_rng(0).permutation(len(examples["train"]))
        cut = max(1, round(len(order) * settings.val_fraction))
        held, kept = np.sort(order[:cut]), np.sort(order[cut:])
        examples["val"] = [examples["train"][i] for i in held]
        labels["val"] = labels["train"][held]
        examples["train"] = [examples["train"][i] for i in kept]
        labels["train"] = labels["train"][kept]
    tokenizer = load_tokenizer(tokenizer_file, settings.max_length)
    folder.parent.mkdir(parents=True, exist_ok=True)
    mine = folder.with_name(f".{folder.name}.{os.getpid()}-{os.urandom(4).hex()}")
    mine.mkdir()
    try:
        meta = {**settings.record(), "class_names": names, "sizes": {}, "truncated": {},
                "tokenizer_sha256": sha256_file(tokenizer_file)}
        for split, found in examples.items():
            arrays, truncated = tokenize(found, tokenizer, settings.max_length)
            (mine / split).mkdir()
            for name, array in {**arrays, "labels": labels[split]}.items():
                np.save(mine / split / f"{name}.npy", array)
            meta["sizes"][split] = len(found)
            meta["truncated"][split] = truncated
        (mine / META).write_text(json.dumps(meta, indent=2) + "\n")
        try:
            mine.rename(folder)
        except OSError:  # another job's folder is in place: the same bytes
            pass
    finally:
        shutil.rmtree(mine, ignore_errors=True)


# -- batches -------------------------------------------------------------------------------------


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


def tokenizer_record(path: Path) -> dict[str, Any]:
    """What a run carries of its tokenizer (Data.info, then every checkpoint and export): the
    file's JSON text and its sha256, so that a checkpoint tokenizes alone."""
    text = path.read_text(encoding="utf-8")
    return {"kind": "file", "sha256": hashlib.sha256(text.encode()).hexdigest(), "json": text}


def pad_id_of(tokenizer: Any) -> int:
    """The tokenizer's padding id: its [PAD] (or <pad>) token, else 0."""
    for token in ("[PAD]", "<pad>", "<|padding|>"):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def settings_of(text_column: str, text_pair_column: str | None, label_column: str,
                class_names: list[str] | None, val_fraction: float, max_length: int
                ) -> Settings:
    if max_length < 8:
        raise DataError(f"dataset.max_length={max_length}: a text needs room for its tokens and "
                        f"the special ones; use 8 or more (BERT's own limit is 512)")
    return Settings(Columns(text_column, text_pair_column, label_column),
                    list(class_names) if class_names else None, val_fraction, max_length)


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
