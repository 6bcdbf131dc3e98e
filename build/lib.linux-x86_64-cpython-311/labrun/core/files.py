"""Writing files so that a crash never leaves half of one: the one atomic-write helper.

A reader sees the old content or the new, never a mix: the data goes to a temporary file in the
same folder, which then replaces the target (rename is atomic on one file system, NFS included).
`durable=True` also fsyncs the file and its folder, so the new content survives a power cut or
a node crash; use it for what a run cannot be rebuilt without (checkpoints, summary.json, the
run-folder lock). Caches and reports that a re-run rewrites skip the fsync: it costs
milliseconds per call on a shared file system.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path, *, durable: bool = False, unique: bool = False
                ) -> Iterator[Path]:
    """Write to the yielded temporary path (`.NAME.tmp` beside `path`); on success it replaces
    `path`, on an exception it is removed and `path` is untouched. For writers that want a
    path of their own (torch.save, h5py, an exporter). `unique` adds the PID to the temporary
    name, for writers that two processes may run at once on one target."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp" + (f"-{os.getpid()}" if unique else ""))
    tmp.unlink(missing_ok=True)  # left by a writer that was killed
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, data: bytes, *, durable: bool = False) -> None:
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | Path, text: str, *, durable: bool = False) -> None:
    write_bytes_atomic(path, text.encode(), durable=durable)


def write_json_atomic(path: str | Path, data: Any, *, durable: bool = False) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", durable=durable)


def fsync_folder(folder: str | Path) -> None:
    """Make a rename in `folder` durable (POSIX: the folder entry is data of the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file (a line cut short by a crash is dropped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    try:
        # One parse for the whole file (`labrun compare` reads a sweep's every metrics.jsonl);
        # line by line only when a line is damaged.
        return json.loads("[" + ",".join(line for line in lines if line.strip()) + "]")
    except json.JSONDecodeError:
        pass
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
