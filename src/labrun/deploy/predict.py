"""`labrun predict MODEL INPUT... [OPTIONS]`: what `labrun serve` would answer, offline, through
the same served model. The inputs and options are the model's task's (its deploy module's
predict_arguments and predict, labrun.deploy.hooks):

    image classifier   IMAGE_OR_DIR... [--k 5] [--csv FILE]: a line per image, or CSV rows
    segmentation       IMAGE_OR_DIR... --out DIR: a mask PNG and an overlay per image
    a lab's task       whatever its module declares (examples/regression: a CSV of rows)

`labrun predict MODEL --help` lists the options of MODEL's task. The arguments are checked
before the model loads; a mistake is one line and exit 2, with nothing written. Here too are
the pieces every task's predict shares: image files from files and folders, an input read or
skipped with a line saying why, a CSV written whole.
"""

from __future__ import annotations

import argparse
import csv
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from labrun.core.errors import LabrunError
from labrun.data.image.decode import IMAGE_SUFFIXES
from labrun.deploy import hooks, load
from labrun.deploy.runtime import ImageError

log = logging.getLogger(__name__)


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose mistakes are one line (a LabrunError) instead of usage and exit."""

    def error(self, message: str):
        raise LabrunError(f"{self.prog}: {message} (`{self.prog} --help` lists the options)")


def predict(model: str | Path, argv: Sequence[str]) -> int:
    deploy = load.deploy_of(model)  # from the metadata or the checkpoint: nothing loads yet
    if not hooks.can_predict(deploy):
        raise LabrunError(f"{model} is a task={deploy.TASK} model, whose deploy module "
                          f"({deploy.__name__}) has no predict hooks; serve it with `labrun "
                          f"serve {model}`: {deploy.USAGE}")
    parser = OneLineParser(prog=f"labrun predict {model}",
                           description=f"predict with a task={deploy.TASK} model "
                                       f"({deploy.__name__})")
    deploy.predict_arguments(parser)
    args = parser.parse_args(list(argv))
    folder: Path | None = None

    def open_model() -> Any:
        nonlocal folder
        served, folder = load.load(model)
        return served

    try:
        return int(deploy.predict(args, open_model) or 0)
    finally:
        load.remove_folder(folder)


def image_files(inputs: list[Path]) -> list[Path]:
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


def read_input(path: Path, prepare: Callable[[bytes], Any]) -> Any | None:
    """prepare(the file's bytes), or None, said on stderr, when it is no usable input."""
    try:
        return prepare(path.read_bytes())
    except (ImageError, OSError) as error:
        log.warning("skipped %s: %s", path, error)
        return None


def check_out(out: Path, inputs: list[Path], paths: list[Path], written: Callable[[str], list[str]],
              what: str) -> None:
    """Refuse, before a model loads, an --out that is a folder of the input images (or a folder
    given), a file, or one where two inputs would write one file (the same stem in two
    folders). `written(stem)`: the names an image's answers take; `what`: what they are."""
    folders = {path.parent.resolve() for path in paths}
    folders |= {item.resolve() for item in inputs if item.is_dir()}
    if out.resolve() in folders:
        raise LabrunError(f"--out {out} is a folder of the input images; {what} never go among "
                          f"them: give another folder, such as {out.parent / (out.name + '-out')}")
    if out.exists() and not out.is_dir():
        raise LabrunError(f"--out {out} is a file; give a folder (it is made if missing)")
    writers: dict[str, Path] = {}
    for path in paths:
        for name in written(path.stem):
            if name in writers:
                raise LabrunError(f"{writers[name]} and {path} would both write {out / name}; "
                                  f"predict them into separate --out folders")
            writers[name] = path


def batches(paths: list[Path], size: int, prepare: Callable[[bytes], Any]
            ) -> Iterator[tuple[list[tuple[Path, Any]], int]]:
    """The inputs `size` at a time: each batch's (path, prepare(its bytes)) of the usable ones,
    and how many were skipped (read_input says why)."""
    for start in range(0, len(paths), size):
        prepared = [(path, read_input(path, prepare)) for path in paths[start:start + size]]
        usable = [(path, image) for path, image in prepared if image is not None]
        yield usable, len(prepared) - len(usable)


def write_csv(path: Path, header: list[str], rows: list[Sequence[Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
