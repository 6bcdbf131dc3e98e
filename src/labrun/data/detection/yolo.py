"""dataset=yolo: ultralytics' layout, read as ultralytics reads it.

    data.yaml    path: ROOT (absolute, or relative to data.yaml's folder; default: that folder)
                 train: images/train        a folder of images (searched recursively), a .txt
                 val: images/val            list of image paths (a line starting with ./ is
                                            relative to the list's folder), or a list of those;
                                            relative to ROOT
                 names: [circle, square]    or {0: circle, 1: square}; nc, if given, must agree
    ROOT/labels/train/NAME.txt   for ROOT/images/train/NAME.jpg: the last /images/ of an image's
                                 path replaced by /labels/, its suffix by .txt

A label line is `class cx cy w h`, normalised to the image's width and height, or `class x1 y1
x2 y2 x3 y3 ...`, a polygon (ultralytics' segments), which becomes its bounding box. An image
without a label file, or with an empty one, has no objects.

Refused in one line (DataError), naming the file and the line: a line that is neither, a class
beyond the names, a box well outside its image (boxes.checked), a label file whose image is
missing; and a data.yaml without names or a split, naming the key.

load(data, decoder) is dataset=yolo's loader: train and val, and test where data.yaml names
one, as detection sources (sources.SplitSource).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from labrun.core.errors import DataError
from labrun.data.detection import DetectionItem, DetectionSplit
from labrun.data.detection.boxes import Cleaned, Objects, checked, corners_from_center
from labrun.data.detection.sources import SplitSource
from labrun.data.image.decode import IMAGE_SUFFIXES, resolve


def read_data_yaml(path: str | os.PathLike) -> tuple[dict, Path, list[str]]:
    """data.yaml's keys, its ROOT and its class names (module docstring)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise DataError(f"{path}: not a readable data.yaml ({error})") from None
    if not isinstance(data, dict) or "names" not in data:
        raise DataError(f"{path}: no `names:` (the class names, a list or {{index: name}}); "
                        f"add them as ultralytics' data.yaml has them")
    names = data["names"]
    if isinstance(names, dict):
        if sorted(names) != list(range(len(names))):
            raise DataError(f"{path}: names' keys are {sorted(names)}; they must be "
                            f"0..{len(names) - 1}")
        names = [names[index] for index in range(len(names))]
    names = [str(name) for name in names]
    if "nc" in data and data["nc"] != len(names):
        raise DataError(f"{path}: nc: {data['nc']}, but names lists {len(names)} classes; "
                        f"drop nc or fix it")
    root = Path(data.get("path") or path.parent)
    return data, root if root.is_absolute() else path.parent / root, names


def split_images(data: dict, root: Path, split: str, yaml_path: Path) -> list[Path]:
    """The split's image files, sorted, from its folders and .txt lists."""
    if not data.get(split):
        raise DataError(f"{yaml_path}: no `{split}:` (a folder of images or a .txt list of "
                        f"them, relative to {root})")
    sources = data[split] if isinstance(data[split], list) else [data[split]]
    images: list[Path] = []
    for source in sources:
        source = root / source
        if source.is_dir():
            images += [p for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES]
        elif source.suffix == ".txt" and source.is_file():
            for line in source.read_text().splitlines():
                line = line.strip()
                if line:
                    image = Path(line)
                    images.append(image if image.is_absolute() else source.parent / image)
        else:
            raise DataError(f"{yaml_path}: {split}: {source} is neither a folder nor a .txt "
                            f"list of images")
    return sorted(images)


def swap_last(path: Path, folder: str, by: str) -> Path:
    """`path` with its last folder named `folder` named `by` instead (unchanged without one)."""
    text, marker = f"{path}{os.sep}", f"{os.sep}{folder}{os.sep}"
    if marker in text:
        head, tail = text.rsplit(marker, 1)
        text = f"{head}{os.sep}{by}{os.sep}{tail}"
    return Path(text.rstrip(os.sep))


def label_path(image: Path) -> Path:
    """ultralytics' img2label_paths: the last /images/ replaced by /labels/, suffix .txt."""
    return swap_last(image, "images", "labels").with_suffix(".txt")


def read_labels(path: Path, width: int, height: int, num_classes: int,
                cleaned: Cleaned) -> Objects:
    """One label file's objects in the image's pixels (module docstring)."""
    if not path.is_file():
        return Objects.none()
    rows, lines = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        try:
            values = [float(field) for field in fields]
        except ValueError:
            raise DataError(f"{path}:{number}: {line.strip()!r} is not numbers; a label line "
                            f"is `class cx cy w h` (normalised) or `class x1 y1 x2 y2 ...`"
                            ) from None
        if len(values) == 5:
            box = corners_from_center(values[1:], width, height)[0]
        elif len(values) >= 7 and len(values) % 2 == 1:  # a polygon of 3 points or more
            xs, ys = np.array(values[1::2]) * width, np.array(values[2::2]) * height
            box = np.array([xs.min(), ys.min(), xs.max(), ys.max()], np.float32)
        else:
            raise DataError(f"{path}:{number}: {len(values)} numbers; a label line is `class cx "
                            f"cy w h` (5) or `class x1 y1 x2 y2 x3 y3 ...` (a polygon)")
        if values[0] != int(values[0]):
            raise DataError(f"{path}:{number}: class {values[0]:g} is not a whole number")
        rows.append((int(values[0]), box))
        lines.append(number)
    if not rows:
        return Objects.none()
    return checked(np.stack([box for _, box in rows]), [cls for cls, _ in rows], width, height,
                   num_classes, lambda i: f"{path}:{lines[i]}", cleaned)


def orphan_labels(images: list[Path]) -> list[Path]:
    """Label files in the split's label folders with no image of their stem beside the images
    (another split's labels may share the folder, where .txt lists split one image folder)."""
    orphans = []
    for folder in sorted({label_path(image).parent for image in images}):
        if not folder.is_dir():
            continue
        image_folder = swap_last(folder, "labels", "images")
        stems = {p.stem for p in image_folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES} \
            if image_folder.is_dir() else set()
        orphans += [label for label in sorted(folder.glob("*.txt")) if label.stem not in stems]
    return orphans


def read_split(data_yaml: str | os.PathLike, split: str) -> DetectionSplit:
    """The split's images and their objects (module docstring)."""
    data_yaml = Path(data_yaml)
    data, root, names = read_data_yaml(data_yaml)
    images = split_images(data, root, split, data_yaml)
    if not images:
        raise DataError(f"{data_yaml}: {split}: no images in {data[split]} (under {root})")
    orphans = orphan_labels(images)
    if orphans:
        raise DataError(f"{orphans[0]}: a label file without its image (no image named "
                        f"{orphans[0].stem}.* in {split}); add the image or remove the label"
                        + (f" ({len(orphans) - 1} more)" if len(orphans) > 1 else ""))
    cleaned = Cleaned()
    items = []
    for image in images:
        try:
            with Image.open(image) as opened:
                width, height = opened.size
        except OSError as error:
            raise DataError(f"{image}: not a readable image ({error})") from None
        items.append(DetectionItem(image, width, height,
                                   read_labels(label_path(image), width, height, len(names),
                                               cleaned)))
    return DetectionSplit(split, items, names, None, cleaned)


def load(data: str, decoder: str = "turbojpeg") -> dict[str, SplitSource]:
    """dataset=yolo: {split: source} for train, val and (where data.yaml names one) test."""
    decoder = resolve(decoder)
    keys, _, _ = read_data_yaml(data)
    splits = ["train", "val"] + (["test"] if keys.get("test") else [])
    return {split: SplitSource(read_split(data, split), decoder, f"{data} ({split})")
            for split in splits}
