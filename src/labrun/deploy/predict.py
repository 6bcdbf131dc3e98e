"""`labrun predict MODEL IMAGE_OR_DIR... [--k 5] [--csv FILE]`: what `labrun serve` would answer,
offline, through the same labrun.deploy.runtime code.

Prints one line per image (`path  class (prob)  class (prob) ...`), or writes a CSV with one row
per (image, rank). An unreadable image is named on stderr and skipped; the exit code is then 1.

A segmentation model's (labrun.deploy.segmentation) writes, for each image, --out DIR/<stem>.png
(its mask: a palette PNG of class indices, at the image's size) and DIR/<stem>_overlay.png (the
image tinted by the classes' colours), and prints `path  class share  class share ...`. DIR must
be given, and be none of the images' own folders: masks never land among the images.
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
from labrun.deploy.segmentation import Segmenter

log = logging.getLogger(__name__)


def predict(model: str | Path, inputs: list[Path], *, k: int = 5, csv_file: Path | None = None,
            out: Path | None = None, batch_size: int = 32) -> int:
    """Print (or write as CSV) the top-k classes of each image, or write a segmentation model's
    masks into `out`; 1 when an image was skipped."""
    if k < 1 or batch_size < 1:
        raise LabrunError("--k and --batch-size must be 1 or more")
    paths = collect(inputs)
    if out is not None:
        check_out(out, inputs, paths)  # before the model loads and anything is written
    predictor, tmp = load.load(model, task=None)
    try:
        if isinstance(predictor, Segmenter):
            if csv_file is not None:
                raise LabrunError(f"--csv is for image classifiers; {model} is a segmentation "
                                  f"model, whose masks go into --out DIR: drop --csv")
            return predict_masks(predictor, paths, out, batch_size)
        if not isinstance(predictor, inference.Predictor):
            raise LabrunError(f"{model} is a language model's export (task=lm): `labrun predict` "
                              f"answers image models; language models answer POST /generate of "
                              f"`labrun serve`")
        if out is not None:
            raise LabrunError(f"--out DIR is where a segmentation model's masks go; {model} is "
                              f"an image classifier: print its answers, or --csv FILE")
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


def check_out(out: Path, inputs: list[Path], paths: list[Path]) -> None:
    """Refuse an --out that is an image's own folder (or a folder given), or that would get two
    files of one name (the same stem in two folders)."""
    folders = {path.parent.resolve() for path in paths}
    folders |= {item.resolve() for item in inputs if item.is_dir()}
    if out.resolve() in folders:
        raise LabrunError(f"--out {out} is a folder of the input images; masks never go among "
                          f"them: give another folder, such as {out.parent / (out.name + '-masks')}")
    if out.exists() and not out.is_dir():
        raise LabrunError(f"--out {out} is a file; give a folder (it is made if missing)")
    stems: dict[str, Path] = {}
    for path in paths:
        for name in (path.stem, f"{path.stem}_overlay"):
            if name in stems:
                raise LabrunError(f"{stems[name]} and {path} would both write {out / name}.png; "
                                  f"predict them into separate --out folders")
        stems[path.stem] = stems[f"{path.stem}_overlay"] = path


def predict_masks(segmenter: Segmenter, paths: list[Path], out: Path | None, batch_size: int
                  ) -> int:
    """OUT/<stem>.png and OUT/<stem>_overlay.png of each image, a line of its classes' shares
    printed; 1 when an image was skipped."""
    if out is None:
        raise LabrunError("a segmentation model writes mask PNGs: add --out DIR (a folder "
                          "other than the images' own)")
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for start in range(0, len(paths), batch_size):
        prepared = []
        for path in paths[start:start + batch_size]:
            try:
                prepared.append((path, segmenter.prepare(path.read_bytes())))
            except (inference.ImageError, OSError) as error:
                log.warning("skipped %s: %s", path, error)
                failed += 1
        masks = segmenter.masks([p.image for _, p in prepared]) if prepared else []
        for (path, image), mask in zip(prepared, masks, strict=True):
            mask = segmenter.restore(mask, image.size)
            (out / f"{path.stem}.png").write_bytes(segmenter.mask_png(mask))
            (out / f"{path.stem}_overlay.png").write_bytes(
                segmenter.overlay_png(image.picture, mask))
            print(f"{path}  " + "  ".join(f"{name} {share:.4f}" for name, share
                                          in segmenter.fractions(mask).items()))
    log.info("%d images segmented, %d skipped -> %s", len(paths) - failed, failed, out)
    return 1 if failed else 0
