"""dataset=det_hdf5 and `labrun convert det` (data/detection/hdf5.py) on small real COCO and
YOLO folders (tests/test_detection_data.py's, with JPEG and PNG files): the file holds each
image's own bytes and exactly the objects the folder's reader gives; a bad label, an
interruption or a source of neither layout leaves no file. In process, no training."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from test_detection_data import coco_folder, yolo_folder

from labrun.cli import main
from labrun.core.errors import DataError
from labrun.data.detection import coco, hdf5, yolo
from labrun.data.image import hdf5 as image_hdf5
from labrun.data.image.decode import JpegImage
from labrun.data.segmentation import hdf5 as seg_hdf5


def jpeg(path: Path, width: int = 40, height: int = 30) -> None:
    """A JPEG with content (a gradient), in place of the folder's PNG of the same name."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[..., 0] = np.arange(width, dtype=np.uint8)[None] * 6
    Image.fromarray(pixels).save(path.with_suffix(".jpg"), quality=90)
    path.unlink()


def coco_source(root: Path) -> Path:
    """coco_folder with b.png a JPEG: both kinds of file, kept as they are."""
    coco_folder(root)
    jpeg(root / "val2017" / "b.png")
    annotations = root / "annotations" / "instances_val2017.json"
    data = json.loads(annotations.read_text())
    data["images"][1]["file_name"] = "b.jpg"
    annotations.write_text(json.dumps(data))
    return root


def convert(src: Path, out: Path, capsys) -> tuple[int, str]:
    code = main(["convert", "det", str(src), str(out)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_same(sources: dict, splits: dict) -> None:
    """The file's splits hold what the folder's reader gives, image for image."""
    assert list(sources) == list(splits)
    for name, split in splits.items():
        source = sources[name]
        assert len(source) == len(split.items)
        assert source.class_names == split.class_names
        assert source.category_ids == split.category_ids
        assert (source.cleaned.clipped, source.cleaned.dropped) == (split.cleaned.clipped,
                                                                    split.cleaned.dropped)
        for i, item in enumerate(split.items):
            assert source.read(i).tobytes() == item.path.read_bytes()
            assert source.image_id(i) == (i if item.image_id is None else item.image_id)
            assert source.size(i) == (item.width, item.height)
            objects = source.objects(i)
            assert objects.boxes.dtype == np.float32 and objects.labels.dtype == np.int64
            np.testing.assert_array_equal(objects.boxes, item.objects.boxes)
            np.testing.assert_array_equal(objects.labels, item.objects.labels)
            np.testing.assert_array_equal(objects.crowd, item.objects.crowd)
            assert item.path.name in source.describe(i)


def test_a_coco_folder_converts_to_its_own_bytes_boxes_crowds_ids_and_categories(tmp_path,
                                                                                capsys):
    root, out = coco_source(tmp_path / "coco"), tmp_path / "out" / "coco.h5"
    code, printed = convert(root, out, capsys)
    assert code == 0, printed
    assert "coco, 3 classes (circle, square, triangle)" in printed
    assert "val: 3 images, 3 boxes" in printed
    assert "val: 1 box(es) clipped to their image" in printed
    sources = hdf5.load(str(out), "turbojpeg")
    assert_same(sources, {"val": coco.read_split(root, "val")})
    val = sources["val"]
    assert val.boxes is True and val.category_ids == [1, 3, 7]
    assert [val.image_id(i) for i in range(3)] == [10, 11, 12]
    image, objects = val.open(0)  # a PNG: its pixels
    assert isinstance(image, np.ndarray) and image.shape == (30, 40, 3)
    assert objects.labels.tolist() == [2, 0]
    image, objects = val.open(1)  # a JPEG: known by its header until a transform crops it
    assert isinstance(image, JpegImage) and image.shape == (30, 40, 3)
    assert objects.crowd.tolist() == [True]
    assert len(val.open(2)[1]) == 0  # a background image


def test_a_yolo_data_yaml_converts_with_every_split_and_index_ids(tmp_path, capsys):
    data_yaml, out = yolo_folder(tmp_path / "yolo"), tmp_path / "yolo.h5"
    jpeg(tmp_path / "yolo" / "images" / "train" / "t2.png")
    code, printed = convert(data_yaml, out, capsys)
    assert code == 0, printed
    assert "yolo, 2 classes (circle, square)" in printed
    assert "train: 3 images, 3 boxes" in printed and "val: 1 images, 1 boxes" in printed
    sources = hdf5.load(str(out), "pil")
    assert_same(sources, {split: yolo.read_split(data_yaml, split) for split in ("train", "val")})
    assert sources["train"].category_ids is None
    with h5py.File(out, "r", locking=False) as file:  # the sources hold it open
        assert [n.decode() for n in file["train/names"][()]] == [
            "images/train/t1.png", "images/train/t2.jpg", "images/train/t3.png"]
        assert file["train/boxes"].shape == (3, 4) and file["train/box_offsets"][()].tolist() \
            == [0, 3, 3, 3]
    # The folder holding data.yaml is taken for it.
    code, printed = convert(tmp_path / "yolo", tmp_path / "again.h5", capsys)
    assert code == 0, printed


def test_a_bad_label_is_refused_in_one_line_and_no_file_is_left(tmp_path, capsys):
    data_yaml, out = yolo_folder(tmp_path / "yolo"), tmp_path / "yolo.h5"
    label = tmp_path / "yolo" / "labels" / "train" / "t2.txt"
    label.write_text("5 0.5 0.5 0.1 0.1\n")
    code, printed = convert(data_yaml, out, capsys)
    assert code == 2
    assert printed == (f"error: {label}:1: class 5, but the data names 2 classes (0-1); fix the "
                       f"label or the class names\n")
    assert list(tmp_path.glob("*.h5*")) == [] and list(tmp_path.glob(".*.h5*")) == []


def test_an_image_of_another_size_than_its_annotation_is_refused_with_no_file(tmp_path, capsys):
    root, out = coco_folder(tmp_path / "coco"), tmp_path / "coco.h5"
    Image.new("RGB", (41, 30)).save(root / "val2017" / "c.png")
    code, printed = convert(root, out, capsys)
    assert code == 2
    assert printed.startswith(f"error: {root / 'val2017' / 'c.png'} is 41x30 (width x height), "
                              f"but its annotation says 40x30")
    assert printed.count("\n") == 1 and not out.exists()
    assert list(tmp_path.glob(".coco.h5*")) == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_an_interruption_mid_write_leaves_no_file(tmp_path, monkeypatch, capsys, stop):
    data_yaml, out = yolo_folder(tmp_path / "yolo"), tmp_path / "yolo.h5"
    written = []

    def check_then_stop(data, path, width, height):
        written.append(path)
        if len(written) == 2:  # the first image is in the file already
            raise stop("stopped")

    monkeypatch.setattr(hdf5, "check_image", check_then_stop)
    if stop is KeyboardInterrupt:
        assert main(["convert", "det", str(data_yaml), str(out)]) == 130
    else:
        with pytest.raises(OSError):
            main(["convert", "det", str(data_yaml), str(out)])
    assert len(written) == 2
    assert not out.exists() and list(tmp_path.glob(".yolo.h5*")) == []


def test_a_source_of_neither_layout_is_one_line(tmp_path, capsys):
    (tmp_path / "folder").mkdir()
    code, printed = convert(tmp_path / "folder", tmp_path / "out.h5", capsys)
    assert code == 2
    assert printed == (f"error: {tmp_path / 'folder'}: neither a COCO folder nor a YOLO "
                       f"data.yaml; give a COCO folder (SRC/annotations/instances_*.json) or "
                       f"a YOLO data.yaml\n")
    code, printed = convert(tmp_path / "missing", tmp_path / "out.h5", capsys)
    assert code == 2 and printed.startswith(f"error: {tmp_path / 'missing'}: no such file")
    assert not (tmp_path / "out.h5").exists()


def test_an_existing_out_needs_force(tmp_path, capsys):
    root, out = coco_folder(tmp_path / "coco"), tmp_path / "coco.h5"
    out.write_text("kept")
    code, printed = convert(root, out, capsys)
    assert code == 2 and "already exists; pass --force" in printed
    assert out.read_text() == "kept"
    assert main(["convert", "det", str(root), str(out), "--force"]) == 0
    assert len(hdf5.load(str(out))["val"]) == 3


def test_a_file_of_another_kind_or_version_is_one_line_and_told_apart(tmp_path, capsys):
    root, out = coco_folder(tmp_path / "coco"), tmp_path / "coco.h5"
    assert main(["convert", "det", str(root), str(out)]) == 0
    for other in (image_hdf5, seg_hdf5):  # the other formats' readers name this one's
        with pytest.raises(DataError, match=r"holds images and boxes \(labrun convert det\); "
                                            r"read it with dataset=det_hdf5"):
            other.read_index(out)
    with h5py.File(out, "r+") as file:
        file.attrs["labrun_format"] = 2
    with pytest.raises(DataError) as refused:
        hdf5.load(str(out))
    assert str(refused.value) == (f"{out} has labrun_format=2 but this labrun reads detection "
                                  f"format 1; convert again with this labrun: labrun convert "
                                  f"det SRC {out} --force")
    with h5py.File(out, "r+") as file:
        file.attrs["labrun_format"] = 1
        file.attrs["kind"] = "segmentation"
    with pytest.raises(DataError, match=r"holds images and masks \(labrun convert seg\); "
                                             r"read it with dataset=seg_hdf5, not detection"):
        hdf5.load(str(out))
    with h5py.File(out, "r+") as file:
        file.attrs["kind"] = "detection"
        del file["val/crowd"]
    with pytest.raises(DataError, match=r"/val/crowd is missing or not bool \[n\]; was it "
                                             r"written by `labrun convert det`"):
        hdf5.load(str(out))
    (tmp_path / "plain.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="plain.h5 is not a readable HDF5 file"):
        hdf5.load(str(tmp_path / "plain.h5"))
    with h5py.File(tmp_path / "other.h5", "w"):
        pass
    with pytest.raises(DataError, match="not a labrun dataset"):
        hdf5.load(str(tmp_path / "other.h5"))
