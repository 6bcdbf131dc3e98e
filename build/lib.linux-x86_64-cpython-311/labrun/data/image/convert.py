"""An image folder -> one HDF5 file (layout: data/image/hdf5.py); the command is labrun.cli.convert.

    labrun convert data/raw/imagenet data/processed/imagenet.h5 --max-side 512 --workers 16
    labrun convert data/raw/cifar data/processed/cifar.h5 --storage raw
    labrun convert --verify data/processed/imagenet.h5

jpeg storage keeps JPEG files byte for byte; other formats, CMYK JPEGs (which TurboJPEG cannot
decode to RGB) and, with --max-side, larger images are re-encoded. raw storage keeps decoded
pixels of one fixed size. Every file is decoded once here, in parallel, so a corrupt one is found
now (named, skipped and counted; an error with --strict) rather than in the middle of a run.

Each split's bytes are spooled to a temporary file first and then copied into one contiguous
HDF5 dataset of the exact size: contiguous storage reads a sample in ~10 us, where a resizable
(chunked) dataset costs 40-500 us per sample. The output is written under a temporary name and
renamed at the end, so an interrupted conversion never leaves a half-written OUT.h5.
"""

from __future__ import annotations

import functools
import io
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import h5py
import numpy as np
from PIL import Image
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from labrun.core.errors import DataError, LabrunError, one_line
from labrun.core.files import atomic_path
from labrun.data.image import hdf5, imagefolder
from labrun.data.image.decode import decode, encode_jpeg, is_jpeg, resolve
from labrun.data.image.transforms import ValTransform

COPY_BLOCK = 64 << 20  # bytes per write when copying a spool into the HDF5 file
MAX_LISTED = 20  # verify: failing samples listed before "and N more"


# ---------------------------------------------------------------------------------------------
# Encoding one file (runs in the worker processes)


@dataclass(frozen=True)
class Options:
    storage: str = "jpeg"
    max_side: int | None = None
    quality: int = 90
    size: int | None = None


@dataclass
class Encoded:
    payload: bytes | None  # what goes into the file; None when the file is unreadable
    shape: tuple[int, ...] | None = None  # decoded size (raw storage)
    error: str | None = None
    reencoded: bool = False


def encode_file(path: str, options: Options, decoder: str) -> Encoded:
    """Read, check (by decoding) and encode one image file for storage."""
    try:
        data = Path(path).read_bytes()
        image = decode(data, decoder)  # raises for a corrupt, truncated or non-image file
        if options.storage == "raw":
            if options.size:
                image = ValTransform(options.size, 1.0)(image).permute(1, 2, 0).numpy()
            return Encoded(np.ascontiguousarray(image).tobytes(), image.shape)
        too_big = options.max_side is not None and max(image.shape[:2]) > options.max_side
        if is_jpeg(data) and not too_big and _jpeg_mode(data) in ("RGB", "L"):
            return Encoded(data)
        if too_big:
            image = _shrink(image, options.max_side)
        return Encoded(encode_jpeg(image, options.quality), reencoded=True)
    except Exception as error:  # any failure means the same thing here: skip or stop
        return Encoded(None, error=one_line(error))


def _jpeg_mode(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as image:  # reads the header only
        return image.mode


def _shrink(image: np.ndarray, max_side: int) -> np.ndarray:
    import cv2

    height, width = image.shape[:2]
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)  # offline: quality over speed


# ---------------------------------------------------------------------------------------------
# Converting a folder


@dataclass
class SplitReport:
    images: int = 0
    skipped: int = 0
    reencoded: int = 0
    bytes: int = 0


def convert(src: str, out: str, options: Options = Options(), *, workers: int = 1,
            force: bool = False, strict: bool = False, console: Console | None = None
            ) -> dict[str, SplitReport]:
    """Write `src`'s images to `out`; returns what was written per split."""
    console = console or Console(soft_wrap=True)
    out_path = Path(out)
    if out_path.exists() and not force:
        raise LabrunError(f"{out} already exists; pass --force to overwrite it")
    if out_path.is_dir():
        raise LabrunError(f"{out} is a folder; give the path of the .h5 file to write")
    splits, class_names = imagefolder.scan(src)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    decoder = resolve("turbojpeg")
    encode = partial(encode_file, options=options, decoder=decoder)
    start = time.perf_counter()
    reports: dict[str, SplitReport] = {}
    with atomic_path(out_path, unique=True) as temporary:
        with _mapper(workers) as mapper, h5py.File(temporary, "w") as file, \
                _progress(console) as progress:
            file.attrs["labrun_format"] = hdf5.FORMAT
            file.attrs["storage"] = options.storage
            file.attrs["classes"] = np.array(class_names, dtype=h5py.string_dtype())
            file.attrs["source"] = str(Path(src).resolve())
            file.attrs["convert_options"] = (f"storage={options.storage} "
                                             f"max_side={options.max_side} "
                                             f"quality={options.quality} size={options.size}")
            shape: tuple[int, ...] | None = None  # raw storage: the first image's, for all
            for split, found in splits.items():
                with tempfile.TemporaryFile(dir=out_path.parent) as spool:
                    offsets, labels, reports[split], shape = _encode_split(
                        found, mapper(encode, found.paths()), spool, options, shape, strict,
                        progress)
                    _write_split(file.create_group(split), spool, offsets, labels)
            if shape is not None:
                file.attrs["shape"] = np.array(shape, dtype=np.int64)
    _print_summary(console, src, out, options, reports, class_names, time.perf_counter() - start)
    return reports


def _encode_split(found: imagefolder.SplitFiles, results: Iterator[Encoded], spool,
                  options: Options, shape: tuple[int, ...] | None, strict: bool,
                  progress: Progress
                  ) -> tuple[list[int], list[int], SplitReport, tuple[int, ...] | None]:
    """Spool one split's encoded images in order; (offsets, labels, report, raw shape)."""
    paths = found.paths()
    task = progress.add_task(found.split, total=len(paths))
    report, offsets, labels = SplitReport(), [0], []
    for path, label, result in zip(paths, found.labels, results, strict=True):
        progress.advance(task)
        if result.error is not None:
            if strict:
                raise DataError(f"{path} is not a readable image ({result.error}); "
                                f"remove it, or drop --strict to skip it")
            progress.console.print(f"skipped {path}: {result.error}", highlight=False,
                                   markup=False)
            report.skipped += 1
            continue
        if options.storage == "raw":
            shape = shape or result.shape
            if result.shape != shape:
                raise DataError(f"{path} is {_size(result.shape)} but earlier images are "
                                f"{_size(shape)}; raw storage needs one size: pass --size N")
        spool.write(result.payload)
        offsets.append(offsets[-1] + len(result.payload))
        labels.append(label)
        report.reencoded += result.reencoded
    if not labels:
        raise DataError(f"{found.folder} has no readable images; {report.skipped} files were "
                        f"skipped")
    report.images, report.bytes = len(labels), offsets[-1]
    return offsets, labels, report, shape


def _write_split(group: h5py.Group, spool, offsets: list[int], labels: list[int]) -> None:
    data = group.create_dataset("data", shape=(offsets[-1],), dtype=np.uint8)  # contiguous
    spool.seek(0)
    position = 0
    while block := spool.read(COPY_BLOCK):
        data[position:position + len(block)] = np.frombuffer(block, dtype=np.uint8)
        position += len(block)
    group.create_dataset("offsets", data=np.array(offsets, dtype=np.int64))
    group.create_dataset("labels", data=np.array(labels, dtype=np.int64))


def _size(shape: tuple[int, ...] | None) -> str:
    return "x".join(str(s) for s in shape[:2]) if shape else "?"


def _print_summary(console: Console, src: str, out: str, options: Options,
                   reports: dict[str, SplitReport], class_names: list[str], seconds: float
                   ) -> None:
    console.print(f"{src} -> {out} ({options.storage} storage)", highlight=False, markup=False)
    table = Table()
    for column in ("split", "images", "skipped", "re-encoded", "bytes"):
        table.add_column(column, justify="left" if column == "split" else "right")
    for split, r in reports.items():
        table.add_row(split, str(r.images), str(r.skipped), str(r.reencoded), _human(r.bytes))
    total = sum(r.images for r in reports.values())
    skipped = sum(r.skipped for r in reports.values())
    table.add_row("total", str(total), str(skipped),
                  str(sum(r.reencoded for r in reports.values())),
                  _human(sum(r.bytes for r in reports.values())), style="bold")
    console.print(table)
    shown = ", ".join(class_names[:8]) + (", ..." if len(class_names) > 8 else "")
    console.print(f"classes: {len(class_names)} ({shown})", highlight=False, markup=False)
    console.print(f"time: {seconds:.1f} s ({(total + skipped) / max(seconds, 1e-9):.0f} images/s)",
                  highlight=False)
    if skipped:
        console.print(f"{skipped} unreadable file(s) skipped (listed above); "
                      f"--strict makes them an error", highlight=False)


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


# ---------------------------------------------------------------------------------------------
# Verifying a file


def verify(path: str, workers: int = 1, console: Console | None = None) -> int:
    """Check structure and counts (hdf5.read_index) and decode every sample; DataError if any
    fails. Returns the number of samples checked."""
    console = console or Console(soft_wrap=True)
    index = hdf5.read_index(path)
    decoder = resolve("turbojpeg")
    failures: list[str] = []
    with _mapper(workers) as mapper, _progress(console) as progress:
        for split, split_index in index.splits.items():
            size = len(split_index.labels)
            chunks = [range(i, min(i + 256, size)) for i in range(0, size, 256)]
            task = progress.add_task(f"verify {split}", total=size)
            check = partial(_check_samples, path, split, decoder)
            for chunk, errors in zip(chunks, mapper(check, chunks), strict=True):
                progress.advance(task, len(chunk))
                failures += [f"{split} sample {i}: {error}" for i, error in errors]
            console.print(f"{split}: {size} samples", highlight=False)
    total = sum(len(s.labels) for s in index.splits.values())
    if failures:
        for line in failures[:MAX_LISTED]:
            console.print(line, highlight=False, markup=False)
        if len(failures) > MAX_LISTED:
            console.print(f"... and {len(failures) - MAX_LISTED} more", highlight=False)
        raise DataError(f"{path}: {len(failures)} of {total} samples do not decode (first: "
                        f"{failures[0]}); convert the image folder again")
    console.print(f"OK: {path}: {total} samples in {len(index.splits)} split(s), "
                  f"{len(index.class_names)} classes, {index.storage} storage", highlight=False)
    return total


def _check_samples(path: str, split: str, decoder: str, indices: range
                   ) -> list[tuple[int, str]]:
    source = _verify_source(path, split, decoder)
    errors = []
    for i in indices:
        try:
            stored = source.read(i)
            if source.shape is None:
                decode(stored, source.decoder)
        except Exception as error:
            errors.append((i, one_line(error)))
    return errors


@functools.cache  # once per worker process, rather than pickling offsets into every task
def _verify_source(path: str, split: str, decoder: str) -> hdf5.HDF5Source:
    return hdf5.HDF5Source(hdf5.read_index(path), split, decoder)


# ---------------------------------------------------------------------------------------------
# Plumbing


class _mapper:
    """An ordered, lazy map over `workers` processes (in-process for workers <= 1)."""

    def __init__(self, workers: int):
        self.pool = ProcessPoolExecutor(workers) if workers > 1 else None

    def __enter__(self) -> Callable[[Callable, Iterable], Iterator]:
        if self.pool is None:
            return map
        # Start the workers now, before the caller opens an HDF5 file: a forked process must not
        # inherit an open handle. (With fork, the first task starts all workers at once.)
        self.pool.submit(int).result()
        return lambda fn, items: self.pool.map(fn, items, chunksize=16)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            # On an error (--strict, Ctrl-C) drop the queued work instead of finishing it.
            self.pool.shutdown(wait=True, cancel_futures=True)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    disable=not console.is_terminal)


def cpu_count() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
