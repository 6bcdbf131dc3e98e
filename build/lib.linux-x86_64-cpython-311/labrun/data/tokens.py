"""Token folders: text turned into token ids, as nanoGPT lays them out, for language modelling.

    OUT_DIR/train.bin     every train token id, flat, uint16 (vocabulary <= 65,536) or uint32
    OUT_DIR/val.bin       the same for val
    OUT_DIR/tokens.json   format, dtype, vocab_size, token counts per split, the tokenizer (its
                          kind and the sha256 of its file) and the source files
    OUT_DIR/tokenizer.json  the Hugging Face `tokenizers` file (absent for the bytes tokenizer)

`labrun convert text FILES_OR_DIRS OUT_DIR --tokenizer SPEC` writes one (convert_text); a run
reads a split with read_split, memory-mapped: the file is never loaded whole. This module is the
one owner of the layout.

Tokenizers (SPEC): `bytes`, each UTF-8 byte a token (vocabulary 256, nothing to train or
ship); `PATH/tokenizer.json`, a lab's own `tokenizers` file, copied into the folder; or
`train:VOCAB`, a byte-level BPE with VOCAB entries trained on the sources with the `tokenizers`
library (GPT-2's scheme: every string encodes, nothing is unknown).

Each source file's text goes to train up to `1 - val_fraction` of its characters (at a line
break where there is one) and the rest to val, so both splits hold text of every file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from labrun.core.errors import DataError

FORMAT = 1
SPLITS = ("train", "val")
META = "tokens.json"
TOKENIZER_FILE = "tokenizer.json"
# A directory given as a source contributes its text files, found by these suffixes (a file
# named on the command line is read whatever its name).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


@dataclass(frozen=True)
class Tokenizer:
    """What turns text into ids (`encode`: the ids of a text in pieces, each with the bytes of
    text it covers, so that a large file is never held as one list and its progress shows),
    its vocabulary size, and its file (None: bytes)."""
    kind: str  # bytes | file | trained
    vocab_size: int
    encode: Callable[[str], Iterator[tuple[np.ndarray, int]]]
    file: Path | None = None


def convert_text(sources: list[str | Path], out_dir: str | Path, tokenizer_spec: str, *,
                 val_fraction: float = 0.1, force: bool = False,
                 progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write the token folder `out_dir` from the text of `sources` (files, or folders of text
    files); returns what tokens.json records. `progress(n)` hears of each n bytes of text
    tokenized.
    The folder appears whole or not at all: it is written beside, under another name, and
    renamed into place (a convert that is killed leaves a `.NAME.partial-PID` folder, which no
    run reads and the next convert removes)."""
    out_dir = Path(out_dir)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction={val_fraction} must be between 0 and 1 (exclusive)")
    if out_dir.exists() and not force:
        raise DataError(f"{out_dir} exists; add --force to replace it")
    files = text_files(sources)
    # Every file checked before anything is written; each is read again, one at a time, to be
    # tokenized: a corpus is never held in memory whole.
    if not any([read_text(path) != "" for path in files]):
        raise DataError(f"no text in {', '.join(str(s) for s in sources)}: the files are empty")
    with _folder_in_place(out_dir) as partial:
        tokenizer = build_tokenizer(tokenizer_spec, files, partial)
        if tokenizer.vocab_size > 2 ** 32:
            raise DataError(f"the tokenizer's vocabulary ({tokenizer.vocab_size:,}) does not "
                            f"fit uint32 token files; use a smaller vocabulary")
        dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
        counts = {split: 0 for split in SPLITS}
        with open(partial / "train.bin", "wb") as train, open(partial / "val.bin", "wb") as val:
            for path in files:
                text = read_text(path)
                for split, part in zip(SPLITS, split_text(text, val_fraction), strict=True):
                    for ids, covered in tokenizer.encode(part):
                        (train if split == "train" else val).write(ids.astype(dtype).tobytes())
                        counts[split] += len(ids)
                        if progress is not None:
                            progress(covered)
        for split in SPLITS:
            if counts[split] == 0:
                raise DataError(f"the {split} split would hold no token: the text is too short "
                                f"for --val-fraction={val_fraction}")
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name,
                "vocab_size": tokenizer.vocab_size, "tokens": counts,
                "tokenizer": {"kind": tokenizer.kind,
                              "sha256": _sha256(tokenizer.file) if tokenizer.file else None,
                              "spec": tokenizer_spec},
                "sources": [str(path) for path in files]}
        (partial / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_meta(folder: str | Path) -> dict[str, Any]:
    """tokens.json of a token folder, checked against the split files it describes."""
    folder = Path(folder)
    path = folder / META
    if not path.is_file():
        raise DataError(f"{folder} is not a token folder (no {META}); write one with: labrun "
                        f"convert text FILES {folder} --tokenizer bytes")
    meta = json.loads(path.read_text())
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        data = folder / f"{split}.bin"
        expected = meta["tokens"][split] * itemsize
        size = data.stat().st_size if data.is_file() else None
        if size != expected:
            found = "missing" if size is None else f"{size:,} bytes"
            raise DataError(f"{data} is {found}, not the {expected:,} bytes {META} records "
                            f"(a copy cut short?); convert again: labrun convert text ... "
                            f"{folder} --force")
    return meta


def read_split(folder: str | Path, split: str) -> np.memmap:
    """The split's token ids, memory-mapped (read-only)."""
    meta = read_meta(folder)
    return np.memmap(Path(folder) / f"{split}.bin", dtype=meta["dtype"], mode="r")


def text_files(sources: list[str | Path]) -> list[Path]:
    """The files to read: each file named, and the text files (TEXT_SUFFIXES) under each folder
    named, in sorted order."""
    files: list[Path] = []
    for source in map(Path, sources):
        if source.is_file():
            files.append(source)
        elif source.is_dir():
            found = sorted(p for p in source.rglob("*")
                           if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not found:
                raise DataError(f"no text file ({', '.join(TEXT_SUFFIXES)}) under {source}")
            files.extend(found)
        else:
            raise DataError(f"{source} does not exist")
    return files


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if b"\0" in data[:65536]:
        raise DataError(f"{path} is a binary file, not text; leave it out")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); "
                        f"convert it to UTF-8 or leave it out") from None


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """(train part, val part): the cut at the line break nearest to 1 - val_fraction of the
    text, or at that character when the text has no line break near it."""
    cut = int(len(text) * (1 - val_fraction))
    line_break = text.rfind("\n", 0, cut)
    if line_break > cut - 1000 and line_break > 0:
        cut = line_break + 1
    return text[:cut], text[cut:]


def build_tokenizer(spec: str, files: list[Path], folder: Path) -> Tokenizer:
    """The tokenizer SPEC names (train: learnt from `files`); a file-based one is written to
    folder/tokenizer.json."""
    if spec == "bytes":
        def encode_bytes(text: str) -> Iterator[tuple[np.ndarray, int]]:
            data = text.encode("utf-8")
            yield np.frombuffer(data, dtype=np.uint8), len(data)
        return Tokenizer("bytes", 256, encode_bytes)
    if spec.startswith("train:"):
        size = spec.removeprefix("train:")
        if not size.isdigit() or int(size) < 257:
            raise DataError(f"--tokenizer {spec}: give the vocabulary size after train:, a "
                            f"number above 256 (the bytes it starts from), e.g. train:4096")
        return _trained_bpe(int(size), files, folder / TOKENIZER_FILE)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"--tokenizer {spec}: no such file; give bytes, a tokenizer.json "
                        f"file or train:VOCAB")
    return _from_file(path, folder / TOKENIZER_FILE)


def _from_file(path: Path, copy: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        loaded = HFTokenizer.from_file(str(path))
    except Exception as error:  # the library raises a plain Exception for a bad file
        raise DataError(f"--tokenizer {path}: not a tokenizers file "
                        f"({str(error).splitlines()[0][:120]})") from None
    shutil.copyfile(path, copy)
    return Tokenizer("file", loaded.get_vocab_size(), _encoder(loaded), copy)


def _trained_bpe(vocab_size: int, files: list[Path], path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(file) for file in files], trainer=trainer)  # streamed from the files
    tokenizer.save(str(path))
    return Tokenizer("trained", tokenizer.get_vocab_size(), _encoder(tokenizer), path)


def _encoder(tokenizer: Any) -> Callable[[str], Iterator[tuple[np.ndarray, int]]]:
    def encode(text: str) -> Iterator[tuple[np.ndarray, int]]:
        # Lines in batches: one call per line is slow, one call for a whole file holds every
        # token's offsets in memory at once.
        lines = text.splitlines(keepends=True)
        for start in range(0, len(lines), 4096):
            batch = lines[start:start + 4096]
            encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
            yield (np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64),
                   sum(len(line.encode("utf-8")) for line in batch))
    return encode


def tokenizer_info(folder: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What a run carries of its folder's tokenizer (Data.info, then every checkpoint):
    tokens.json's record of it plus, for a `tokenizers` file, the file's JSON text, so that a
    checkpoint turns text into ids and back alone (export, serving) once the folder is gone."""
    info = dict(meta["tokenizer"])
    if info.get("kind") != "bytes":
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"{path} is missing: {META} records a {info.get('kind')} tokenizer; "
                            f"convert again: labrun convert text ... {folder} --force")
        info["json"] = path.read_text(encoding="utf-8")
    return info


@dataclass(frozen=True)
class Codec:
    """Text to token ids and back, for a served model's prompt and continuation."""
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def codec(tokenizer: dict[str, Any]) -> Codec:
    """The Codec of what a checkpoint carries of its tokenizer (tokenizer_info); nothing else is
    read. Decoding never fails: a continuation that is not valid UTF-8 (sampling may stop, or
    wander, inside a character's bytes) decodes with U+FFFD in place of the bad bytes."""
    kind = tokenizer.get("kind")
    if kind == "bytes":
        return Codec(256, lambda text: list(text.encode("utf-8")),
                     lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    if not tokenizer.get("json"):
        raise DataError(f"the model's {kind or 'unknown'} tokenizer comes without its "
                        f"tokenizer.json text (a checkpoint written before labrun kept it); "
                        f"train the run again (labrun rerun RUN_DIR --exec) to write one with it")
    from tokenizers import Tokenizer as HFTokenizer

    loaded = HFTokenizer.from_str(tokenizer["json"])
    # A byte-level BPE's decoder (convert's train:VOCAB) already replaces bytes that are not
    # UTF-8; so do the other `tokenizers` decoders, which build text from string pieces.
    return Codec(loaded.get_vocab_size(),
                 lambda text: loaded.encode(text, add_special_tokens=False).ids,
                 lambda ids: loaded.decode(list(ids)))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextmanager
def _folder_in_place(out_dir: Path) -> Iterator[Path]:
    """A partial folder beside out_dir, renamed to out_dir when the block ends well and removed
    when it raises; an existing out_dir (--force) is replaced only then."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
            shutil.rmtree(stale, ignore_errors=True)  # left by a convert that was killed
    partial = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)
    partial.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


# -- reading, for training (dataset=tokens) ------------------------------------------------------


class TokenWindows:
    """(epoch, index) -> (inputs, targets): a window of block_size tokens and the same shifted
    by one. Train windows start at an offset drawn from (seed, epoch, index), as nanoGPT draws
    them, so any worker gives the same window and a resumed run continues exactly; val windows
    lie one after another. The token file is opened in each worker, memory-mapped."""

    def __init__(self, folder: Path, split: str, block_size: int, seed: int, shuffle: bool):
        self.folder, self.split, self.block_size = folder, split, block_size
        self.seed, self.shuffle = seed, shuffle
        self.size = read_meta(folder)["tokens"][split]
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return max(0, (self.size - 1) // self.block_size)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Any, Any]:
        import torch

        epoch, index = key
        if self._tokens is None:
            self._tokens = read_split(self.folder, self.split)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, index])
            start = int(rng.integers(0, self.size - self.block_size))
        else:
            start = index * self.block_size
        window = np.asarray(self._tokens[start:start + self.block_size + 1], dtype=np.int64)
        return torch.from_numpy(window[:-1].copy()), torch.from_numpy(window[1:].copy())

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}  # each worker maps the file itself


@dataclass
class TokenData:
    """What `dataset=tokens` gives the Trainer: the splits, what the task is told (`info`),
    and loaders of (inputs, targets) batches in the sampler's (epoch, index) order."""
    folder: Path
    block_size: int
    num_workers: int
    meta: dict[str, Any]

    @property
    def splits(self) -> dict[str, int]:
        return dict(self.meta["tokens"])

    @property
    def class_names(self) -> list[str]:
        return []

    @property
    def info(self) -> dict[str, Any]:
        return {"vocab_size": self.meta["vocab_size"], "block_size": self.block_size,
                "tokenizer": tokenizer_info(self.folder, self.meta)}

    def loader(self, split: str, *, micro_batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1, samples_per_step: int = 1, pin_memory: bool = False) -> Any:
        from labrun.data import epoch_loader

        windows = TokenWindows(self.folder, split, self.block_size, seed, shuffle=split == "train")
        return epoch_loader(windows, train=split == "train", micro_batch_size=micro_batch_size,
                            seed=seed, rank=rank, world_size=world_size,
                            samples_per_step=samples_per_step, pin_memory=pin_memory,
                            num_workers=self.num_workers,
                            name=f"{self.folder} (windows of {self.block_size + 1} tokens)")


def load(path: str, block_size: int, num_workers: int = 0) -> TokenData:
    """dataset=tokens: the token folder at `path` (checked whole: tokens.json and both files),
    in windows of `block_size` tokens."""
    folder = Path(path)
    return TokenData(folder, block_size, num_workers, read_windowed(folder, block_size))


def read_windowed(folder: Path, block_size: int) -> dict[str, Any]:
    """read_meta, and each split longer than one window."""
    meta = read_meta(folder)
    for split in SPLITS:
        if meta["tokens"][split] <= block_size:
            raise DataError(f"{folder}: the {split} split holds {meta['tokens'][split]:,} "
                            f"tokens, not more than dataset.block_size={block_size}; lower "
                            f"it or convert more text")
    return meta


def python_docs(folder: str, block_size: int, num_workers: int = 0) -> TokenData:
    """dataset=python_docs: the documentation text inside every CPython (`pydoc_data.topics`,
    about 465,000 characters), one byte a token, so that a language model trains with nothing
    downloaded. Converted on first use into the token folder `folder`; jobs starting together
    each convert into a folder of their own and rename it into place, and the first rename
    wins (a rename onto a folder that exists fails): no job reads a half-written folder."""
    folder = Path(folder)
    if not (folder / META).is_file():
        from pydoc_data.topics import topics

        folder.parent.mkdir(parents=True, exist_ok=True)
        mine = folder.with_name(f".{folder.name}.{os.getpid()}-{os.urandom(4).hex()}")
        text = folder.with_name(f"{mine.name}.txt")
        try:
            text.write_text("".join(topics.values()), encoding="utf-8")
            convert_text([text], mine, "bytes")
            try:
                mine.rename(folder)
            except OSError:  # another job's folder is in place: the same bytes
                pass
        finally:
            text.unlink(missing_ok=True)
            shutil.rmtree(mine, ignore_errors=True)
    return load(str(folder), block_size, num_workers)


def declared(dataset: Any) -> dict[str, Any] | None:
    """What the dataset config `dataset` will load, if it is this module's (dataset=tokens or
    python_docs): its tokens.json, read and checked against its files without loading them, for
    validation before any data loads. None for any other dataset. python_docs, converted on
    first use, is the bytes tokenizer's until then."""
    target = dataset.get("_target_")
    if target == f"{__name__}.load":
        folder = Path(dataset.path)
    elif target == f"{__name__}.python_docs":
        folder = Path(dataset.folder)
        if not (folder / META).is_file():
            return {"vocab_size": 256, "tokenizer": {"kind": "bytes", "sha256": None}}
    else:
        return None
    return read_windowed(folder, dataset.block_size)
