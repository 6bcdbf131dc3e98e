"""The token cache of `dataset=text`: every split read, checked and tokenized once by the
model's tokenizer, under CACHE_DIR/NAME-KEY/ (KEY the sha256 of the tokenizer file, of each data
file and of the settings that change a token).

Per split: the ids of every example end to end (ids.npy, uint32), its token types (types.npy,
uint8: which text of a pair), where each example starts (starts.npy) and the labels
(labels.npy); meta.json with the class names, the split sizes and how many examples were
truncated at max_length. Jobs starting together each write a folder of their own and rename it
into place; the first rename wins and every job reads the same bytes (as dataset=python_docs
does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labrun.core.errors import DataError
from labrun.data.text.formats import Columns, Example, class_names_of, label_ids, read_examples

FORMAT = 1
META = "meta.json"


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



def tokenizer_record(path: Path) -> dict[str, Any]:
    """What a run carries of its tokenizer (Data.info, then every checkpoint and export): the
    file's JSON text and its sha256, so that a checkpoint tokenizes alone."""
    text = path.read_text(encoding="utf-8")
    return {"kind": "file", "sha256": hashlib.sha256(text.encode()).hexdigest(), "json": text}



def settings_of(text_column: str, text_pair_column: str | None, label_column: str,
                class_names: list[str] | None, val_fraction: float, max_length: int
                ) -> Settings:
    if max_length < 8:
        raise DataError(f"dataset.max_length={max_length}: a text needs room for its tokens and "
                        f"the special ones; use 8 or more (BERT's own limit is 512)")
    return Settings(Columns(text_column, text_pair_column, label_column),
                    list(class_names) if class_names else None, val_fraction, max_length)
