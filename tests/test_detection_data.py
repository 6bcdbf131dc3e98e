"""Detection data read as the field's tools write it (issue 55, item 1): COCO's layout and
ultralytics' YOLO layout, on small real folders of PNG images made here; what real labels get
wrong fixed within a tolerance and refused beyond it, in one line naming the file and the line
or annotation. In process, no training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from labrun.core.errors import DataError
from labrun.data.detection import boxes, coco, yolo


def image(path: Path, width: int = 40, height: int = 30) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (width, height), (90, 120, 30)).save(path)
    return path


# -- boxes ------------------------------------------------------------------------------------

def where(i: int) -> str:
    return f"labels.txt:{i + 1}"


def test_a_corner_a_hair_outside_is_clipped_and_a_box_without_area_dropped_both_counted():
    cleaned = boxes.Cleaned()
    objects = boxes.checked([[0, 0, 40.001, 30], [-0.2, 5, 10, 12], [7, 7, 7, 20],
                             [1, 2, 3, 4]], [0, 1, 1, 0], 40, 30, 2, where, cleaned)
    assert objects.boxes.tolist() == [[0, 0, 40, 30], [0, 5, 10, 12], [1, 2, 3, 4]]
    assert objects.labels.tolist() == [0, 1, 0] and not objects.crowd.any()
    assert (cleaned.clipped, cleaned.dropped) == (2, 1)
    assert cleaned.line("train") == ("train: 2 box(es) clipped to their image (corners at most "
                                     "1% outside it), 1 without width or height dropped")
    assert boxes.Cleaned().line("val") is None


@pytest.mark.parametrize("box, label, line", [
    ([0, 0, 45, 30], 0, "labels.txt:1: box (0, 0, 45, 30): it lies outside the 40x30 image by "
                        "more than 1% of its side; fix the label (corners x1 y1 x2 y2 in the "
                        "image's pixels)"),
    ([10, 5, 4, 20], 0, "labels.txt:1: box (10, 5, 4, 20): its corners are reversed (x2 < x1 or "
                        "y2 < y1); fix the label (corners x1 y1 x2 y2 in the image's pixels)"),
    ([1, 2, 3, 4], 2, "labels.txt:1: class 2, but the data names 2 classes (0-1); fix the label "
                      "or the class names"),
])
def test_a_label_beyond_the_tolerance_is_one_line_naming_where(box, label, line):
    with pytest.raises(DataError) as refused:
        boxes.checked([box], [label], 40, 30, 2, where, boxes.Cleaned())
    assert str(refused.value) == line


def test_yolo_and_coco_boxes_become_corners_in_pixels():
    assert boxes.corners_from_center([0.5, 0.5, 0.5, 1.0], 40, 30).tolist() == [[10, 0, 30, 30]]
    assert boxes.corners_from_corner_size([3, 4, 10, 5]).tolist() == [[3, 4, 13, 9]]


# -- COCO ---------------------------------------------------------------------------------------

def coco_folder(root: Path, annotations: list[dict] | None = None, **changes) -> Path:
    """ROOT/annotations/instances_val2017.json and ROOT/val2017/: three images, categories 1, 3
    and 7 (not contiguous, as COCO's), one crowd region, one image without annotations."""
    for name in ("a.png", "b.png", "c.png"):
        image(root / "val2017" / name)
    data = {"images": [{"id": 10 + i, "file_name": name, "width": 40, "height": 30}
                       for i, name in enumerate(("a.png", "b.png", "c.png"))],
            "categories": [{"id": 7, "name": "triangle"}, {"id": 1, "name": "circle"},
                           {"id": 3, "name": "square"}],
            "annotations": annotations if annotations is not None else [
                {"id": 1, "image_id": 10, "category_id": 7, "bbox": [2, 3, 10, 8], "iscrowd": 0},
                {"id": 2, "image_id": 10, "category_id": 1, "bbox": [20, 10, 19.9999, 20.00001],
                 "iscrowd": 0},
                {"id": 3, "image_id": 11, "category_id": 3, "bbox": [0, 0, 40, 30], "iscrowd": 1},
            ], **changes}
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    return root


def test_coco_categories_map_to_classes_and_back_crowds_marked_empty_images_kept(tmp_path):
    split = coco.read_split(coco_folder(tmp_path), "val")
    assert split.class_names == ["circle", "square", "triangle"]  # sorted by category id
    assert split.category_ids == [1, 3, 7]
    first, second, third = split.items
    assert first.path == tmp_path / "val2017" / "a.png" and first.image_id == 10
    assert first.objects.labels.tolist() == [2, 0]  # triangle (7), circle (1)
    np.testing.assert_allclose(first.objects.boxes, [[2, 3, 12, 11], [20, 10, 39.9999, 30]])
    assert second.objects.crowd.tolist() == [True]
    assert len(third.objects) == 0  # no annotations: a background image
    assert (split.cleaned.clipped, split.cleaned.dropped) == (1, 0)


@pytest.mark.parametrize("annotation, line", [
    ({"id": 5, "image_id": 10, "category_id": 2, "bbox": [1, 1, 2, 2]},
     "annotation 5: category_id 2 is none of the file's categories ([1, 3, 7])"),
    ({"id": 6, "image_id": 99, "category_id": 1, "bbox": [1, 1, 2, 2]},
     "annotation 6: image_id 99 is none of the file's images"),
    ({"id": 8, "image_id": 12, "category_id": 1, "bbox": [30, 1, 30, 2]},
     "annotation 8: box (30, 1, 60, 3): it lies outside the 40x30 image"),
    ({"id": 9, "image_id": 12, "category_id": 1, "segmentation": [[1, 1, 5, 1, 5, 5]]},
     "annotation 9: bbox None is not [x, y, width, height] in pixels"),
])
def test_a_wrong_coco_annotation_is_one_line_naming_the_file_and_its_id(tmp_path, annotation,
                                                                       line):
    root = coco_folder(tmp_path, [annotation])
    with pytest.raises(DataError) as refused:
        coco.read_split(root, "val")
    assert str(refused.value).startswith(
        f"{root / 'annotations' / 'instances_val2017.json'}: {line}")


def test_unreadable_coco_json_a_missing_image_or_file_is_one_line(tmp_path):
    root = coco_folder(tmp_path)
    (root / "val2017" / "b.png").unlink()
    with pytest.raises(DataError, match=r"instances_val2017.json: image 11 \(b.png\) is not in "):
        coco.read_split(root, "val")
    # A file name with a folder in it is looked up there.
    image(root / "val2017" / "more" / "b.png")
    data = json.loads((root / "annotations" / "instances_val2017.json").read_text())
    data["images"][1]["file_name"] = "more/b.png"
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    assert coco.read_split(root, "val").items[1].path == root / "val2017" / "more" / "b.png"
    del data["images"][1]["width"]
    (root / "annotations" / "instances_val2017.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=r"image 11 lacks \['width'\]; COCO's images name"):
        coco.read_split(root, "val")
    (root / "annotations" / "instances_val2017.json").write_text('{"images": [')
    with pytest.raises(DataError, match="not a readable COCO annotation file"):
        coco.read_split(root, "val")
    with pytest.raises(DataError, match=r"no instances_train\*.json for the train split "
                                        r"\(found: instances_val2017.json\)"):
        coco.read_split(root, "train")


# -- YOLO ---------------------------------------------------------------------------------------

def yolo_folder(root: Path, names="[circle, square]") -> Path:
    """ultralytics' layout: images/{train,val}, labels/{train,val}, data.yaml with a relative
    path; val as a .txt list."""
    for split, stems in (("train", ("t1", "t2", "t3")), ("val", ("v1",))):
        for stem in stems:
            image(root / "images" / split / f"{stem}.png")
    labels = root / "labels"
    (labels / "train").mkdir(parents=True)
    (labels / "val").mkdir(parents=True)
    # t1: a box and a polygon (its bounding box); a corner a hair past the right edge
    (labels / "train" / "t1.txt").write_text("0 0.5 0.5 0.5 0.5\n"
                                             "1 0.1 0.1 0.3 0.1 0.3 0.4 0.1 0.4\n"
                                             "1 0.875 0.5 0.2500001 0.2\n")
    (labels / "train" / "t2.txt").write_text("")  # no objects; t3 has no label file at all
    (labels / "val" / "v1.txt").write_text("1 0.5 0.5 1 1\n")
    (root / "val.txt").write_text("./images/val/v1.png\n")
    (root / "data.yaml").write_text(f"path: .\ntrain: images/train\nval: val.txt\n"
                                    f"names: {names}\n")
    return root / "data.yaml"


def test_yolo_boxes_polygons_and_images_without_labels_read_as_ultralytics_reads_them(tmp_path):
    data_yaml = yolo_folder(tmp_path)
    train = yolo.read_split(data_yaml, "train")
    assert train.class_names == ["circle", "square"] and train.category_ids is None
    assert [item.path.name for item in train.items] == ["t1.png", "t2.png", "t3.png"]
    t1, t2, t3 = (item.objects for item in train.items)
    np.testing.assert_allclose(t1.boxes, [[10, 7.5, 30, 22.5], [4, 3, 12, 12], [30, 12, 40, 18]],
                               atol=1e-4)
    assert t1.labels.tolist() == [0, 1, 1]
    assert len(t2) == 0 and len(t3) == 0
    assert train.cleaned.clipped == 1
    val = yolo.read_split(data_yaml, "val")  # a .txt list, ./ relative to its folder
    assert [item.path for item in val.items] == [tmp_path / "images" / "val" / "v1.png"]
    assert val.items[0].objects.boxes.tolist() == [[0, 0, 40, 30]]


def test_yolo_names_as_a_dict_and_an_absolute_or_default_root(tmp_path):
    data_yaml = yolo_folder(tmp_path, names="{0: circle, 1: square}")
    assert yolo.read_split(data_yaml, "train").class_names == ["circle", "square"]
    data_yaml.write_text(data_yaml.read_text().replace("path: .", f"path: {tmp_path}"))
    assert len(yolo.read_split(data_yaml, "train").items) == 3
    data_yaml.write_text(data_yaml.read_text().replace(f"path: {tmp_path}\n", ""))
    assert len(yolo.read_split(data_yaml, "train").items) == 3


def test_labels_of_another_split_in_a_shared_folder_are_no_orphans(tmp_path):
    """One image folder split by .txt lists, as some exports do: val's labels sit beside
    train's, and belong to images that exist."""
    data_yaml = yolo_folder(tmp_path)
    (tmp_path / "train.txt").write_text("./images/train/t1.png\n./images/train/t2.png\n")
    (tmp_path / "val.txt").write_text("./images/train/t3.png\n")
    data_yaml.write_text(data_yaml.read_text().replace("train: images/train", "train: train.txt"))
    assert [i.path.name for i in yolo.read_split(data_yaml, "train").items] == ["t1.png", "t2.png"]


@pytest.mark.parametrize("label, line", [
    ("2 0.5 0.5 0.1 0.1\n", "t2.txt:1: class 2, but the data names 2 classes (0-1)"),
    ("0 0.5 0.5 0.1 0.1\n1 1.4 0.5 0.2 0.2\n",
     "t2.txt:2: box (52, 12, 60, 18): it lies outside the 40x30 image"),
    ("0 0.5 0.5 0.1\n", "t2.txt:1: 4 numbers; a label line is `class cx cy w h` (5)"),
    ("0 a 0.5 0.1 0.1\n", "t2.txt:1: '0 a 0.5 0.1 0.1' is not numbers"),
])
def test_a_wrong_yolo_label_is_one_line_naming_its_file_and_line(tmp_path, label, line):
    data_yaml = yolo_folder(tmp_path)
    (tmp_path / "labels" / "train" / "t2.txt").write_text(label)
    with pytest.raises(DataError) as refused:
        yolo.read_split(data_yaml, "train")
    assert str(refused.value).startswith(f"{tmp_path / 'labels' / 'train'}/{line}")


def test_a_label_without_its_image_and_a_data_yaml_without_names_are_refused(tmp_path):
    data_yaml = yolo_folder(tmp_path)
    orphan = tmp_path / "labels" / "train" / "gone.txt"
    orphan.write_text("0 0.5 0.5 0.1 0.1\n")
    with pytest.raises(DataError) as refused:
        yolo.read_split(data_yaml, "train")
    assert str(refused.value) == (f"{orphan}: a label file without its image (no image named "
                                  f"gone.* in train); add the image or remove the label")
    data_yaml.write_text("path: .\ntrain: images/train\n")
    with pytest.raises(DataError, match=r"data.yaml: no `names:`"):
        yolo.read_split(data_yaml, "train")
    data_yaml.write_text("path: .\nnames: [a]\n")
    with pytest.raises(DataError, match=r"data.yaml: no `val:`"):
        yolo.read_split(data_yaml, "val")
