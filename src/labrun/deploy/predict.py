"""`labrun predict MODEL IMAGE_OR_DIR... [--k 5] [--csv FILE]`: what `labrun serve` would answer,
offline, through the same labrun.deploy.runtime code.

Prints one line per image (`path  class (prob)  class (prob) ...`), or writes a CSV with one row
per (image, rank). An unreadable image is named on stderr and skipped; the exit code is then 1.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator
from pathlib import Path

from labrun.core.errors import LabrunError
from labrun.data.image.decode import IMAGE_SUFFIXES
from labrun.deploy import load
from labrun.deploy import runtime as inference

log = logging.getLogger(__name__)






def predict(model: str | Path, inputs: list[Path], *, k: int = 5, csv_file: Path | None = None,
            batch_size: int = 32) -> int:
    """Print (or write as CSV) the top-k classes of each image; 1 when an image was skipped."""
    if k < 1 or batch_size < 1:
        raise LabrunError("--k and --batch-size must be 1 or more")
    paths = collect(inputs)
    predictor, tmp = load.load(model)
    try:
        rows, failed = [], 0
        for path, top in predict_files(predictor, paths, k, batch_size):
            if top is None:
                failed += 1
                continue
            if csv_file is None:
                print(f"{path}  " + "  ".join(f"{t['class']} ({t['prob']:.4f})" for t in top))
            rows += [(str(path), rank, t["class"], t["index"], t["prob"])
                     for rank, t in enumerate(top, start=1)]
    finally:
        load.remove_folder(tmp)
    if csv_file is not None:
        csv_file.parent.mkdir(parents=True, exist_ok=True)
        with open(csv_file, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "rank", "class", "index", "prob"])
            writer.writerows(rows)
        log.info("%d images predicted, %d skipped -> %s", len(paths) - failed, failed, csv_file)
    elif failed:
        log.warning("%d of %d images skipped", failed, len(paths))
    return 1 if failed else 0


def collect(inputs: list[Path]) -> list[Path]:
    """Files as given, folders searched recursively for image files, in a stable order."""
    paths: list[Path] = []
    for item in inputs:
        if item.is_dir():
            paths += sorted(p for p in item.rglob("*")
                            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        elif item.is_file():
            paths.append(item)
        else:
            raise LabrunError(f"{item}: no such file or folder")
    if not paths:
        raise LabrunError(f"no image files in {', '.join(map(str, inputs))} "
                          f"(looked for {', '.join(sorted(IMAGE_SUFFIXES))})")
    return paths


def predict_files(predictor: inference.Predictor, paths: list[Path], k: int, batch_size: int
                  ) -> Iterator[tuple[Path, list[dict] | None]]:
    """(path, top-k) per file, in order; top-k is None for a file that is not a usable image."""
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        images = []
        for path in chunk:
            try:
                images.append(predictor.prepare(path.read_bytes()))
            except (inference.ImageError, OSError) as error:
                log.warning("skipped %s: %s", path, error)
                images.append(None)
        good = [image for image in images if image is not None]
        tops = iter(predictor.predict(good, k) if good else [])
        for path, image in zip(chunk, images, strict=True):
            yield path, None if image is None else next(tops)
