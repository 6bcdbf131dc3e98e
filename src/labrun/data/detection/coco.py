"""dataset=coco: COCO's own layout, which most labelling tools export (CVAT, Label Studio,
Roboflow):

    ROOT/annotations/instances_train2017.json   ROOT/train2017/*.jpg
    ROOT/annotations/instances_val2017.json     ROOT/val2017/*.jpg

A split is the annotation file instances_NAME.json whose NAME starts with the split's name
(train, val, test), its images in ROOT/NAME/ or ROOT/images/NAME/. Category ids need not be
contiguous (COCO's run 1..90 with gaps): classes are the categories sorted by id, and
`category_ids` maps a class back to its id (what COCO evaluation and exported predictions
name). `iscrowd` regions are kept and marked (boxes.Objects.crowd); images without annotations
are kept as background.

Refused in one line (DataError), naming the file and the annotation or image id: unreadable
JSON, an annotation of an unknown image or category, a box well outside its image
(boxes.checked), an image the file lists that its folder lacks.

load(root, decoder) is dataset=coco's loader: train and val, and test where its annotation
file is there, as detection sources (sources.SplitSource).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from labrun.core.errors import DataError
from labrun.data.detection import DetectionItem, DetectionSplit
from labrun.data.detection.boxes import Cleaned, Objects, checked, corners_from_corner_size
from labrun.data.detection.sources import SplitSource
from labrun.data.image.decode import resolve


def annotation_file(root: Path, split: str) -> Path:
    """ROOT/annotations/instances_SPLIT*.json, one of them; DataError naming what is there."""
    folder = root / "annotations"
    found = sorted(folder.glob(f"instances_{split}*.json")) if folder.is_dir() else []
    if len(found) != 1:
        there = sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []
        what = "several" if found else "no"
        raise DataError(f"{folder}: {what} instances_{split}*.json for the {split} split "
                        f"(found: {', '.join(there) or 'nothing'}); COCO's layout is "
                        f"annotations/instances_{split}2017.json beside {split}2017/")
    return found[0]


def images_folder(root: Path, annotations: Path) -> Path:
    name = annotations.stem.removeprefix("instances_")
    for folder in (root / name, root / "images" / name):
        if folder.is_dir():
            return folder
    raise DataError(f"{annotations}: no image folder {root / name} (nor {root / 'images' / name})"
                    f" for its images")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a readable COCO annotation file ({error})") from None
    if not isinstance(data, dict) or not {"images", "annotations", "categories"} <= data.keys():
        has = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise DataError(f"{path}: a COCO annotation file holds images, annotations and "
                        f"categories; this one has {has}")
    return data


def read_split(root: str | os.PathLike, split: str) -> DetectionSplit:
    """The split's images and their objects (module docstring)."""
    root = Path(root)
    path = annotation_file(root, split)
    folder = images_folder(root, path)
    data = read_json(path)
    categories = sorted(data["categories"], key=lambda c: c["id"])
    class_of = {c["id"]: index for index, c in enumerate(categories)}
    images = {image.get("id"): image for image in data["images"]}
    present = set(os.listdir(folder))  # one listing; a name with folders in it is looked up
    for image in data["images"]:
        if not {"id", "file_name", "width", "height"} <= image.keys():
            raise DataError(f"{path}: image {image.get('id', image.get('file_name'))} lacks "
                            f"{sorted({'id', 'file_name', 'width', 'height'} - image.keys())}; "
                            f"COCO's images name their id, file_name, width and height")
        name = image["file_name"]
        if name not in present and not (folder / name).is_file():
            raise DataError(f"{path}: image {image['id']} ({name}) is not in {folder}; add "
                            f"it, or remove it and its annotations from the file")
    per_image: dict[int, list[dict]] = {image_id: [] for image_id in images}
    for annotation in data["annotations"]:
        where = f"{path}: annotation {annotation.get('id')}"
        if annotation.get("image_id") not in images:
            raise DataError(f"{where}: image_id {annotation.get('image_id')} is none of the "
                            f"file's images")
        if annotation.get("category_id") not in class_of:
            raise DataError(f"{where}: category_id {annotation.get('category_id')} is none of "
                            f"the file's categories ({sorted(class_of)})")
        bbox = annotation.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4
                and all(isinstance(v, int | float) for v in bbox)):
            raise DataError(f"{where}: bbox {bbox!r} is not [x, y, width, height] in pixels")
        per_image[annotation["image_id"]].append(annotation)
    cleaned = Cleaned()
    items = []
    for image_id, image in images.items():
        annotations = per_image[image_id]
        if not annotations:
            objects = Objects.none()
        else:
            ids = [a.get("id") for a in annotations]
            objects = checked(
                corners_from_corner_size([a["bbox"] for a in annotations]),
                [class_of[a["category_id"]] for a in annotations],
                image["width"], image["height"], len(categories),
                lambda i, ids=ids: f"{path}: annotation {ids[i]}", cleaned,
                crowd=[bool(a.get("iscrowd", 0)) for a in annotations])
        items.append(DetectionItem(folder / image["file_name"], image["width"],
                                   image["height"], objects, image_id))
    return DetectionSplit(split, items, [c["name"] for c in categories],
                          [c["id"] for c in categories], cleaned)



def load(root: str, decoder: str = "turbojpeg") -> dict[str, SplitSource]:
    """dataset=coco: {split: source} for train, val and (where its file is there) test."""
    decoder, root_path = resolve(decoder), Path(root)
    splits = ["train", "val"]
    if list((root_path / "annotations").glob("instances_test*.json")):
        splits.append("test")  # COCO's own test-dev has no annotations: a lab's test split
    return {split: SplitSource(read_split(root_path, split), decoder, f"{root} ({split})")
            for split in splits}
