"""The text formats of `dataset=text`: which files hold which split, their rows, and each
row's texts and label, checked; the one reader of CSV, JSONL, Parquet and `datasets` folders.

    path = FILE              the train split (.csv, .jsonl, .parquet); val held out of it
    path = FOLDER            train.EXT, and val.EXT (or validation.EXT) and test.EXT if there;
                             or a folder `datasets`' save_to_disk wrote (its splits by name)

A row holds `text_column`, `label_column` and, for pairs, `text_pair_column`. Labels are names
(strings) or ids (integers): names are mapped to ids by `class_names` (null: the train split's
labels, sorted). A missing column, a label outside the names, an empty text or a file that is
not UTF-8 is refused in one line naming the file and the row.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labrun.core.errors import DataError

SUFFIXES = (".csv", ".jsonl", ".parquet")
SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation"), "test": ("test",)}


@dataclass
class Example:
    text: str
    pair: str | None
    label: Any
    where: str  # "FILE, row N": what a refusal names


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
