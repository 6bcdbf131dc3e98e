"""The detection data pipeline (issue 55): sources over COCO and YOLO folders and the drawn
shapes_boxes set, the transforms that move boxes (each checked against the pixels it moved),
the mosaic switch as run state, DetectionData's batches, and the dataset schemas. In process,
no training."""

from __future__ import annotations

import copy
import functools
import json

import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from labrun import data as labrun_data
from labrun.cli.hydra_app import user_error_message
from labrun.config import schema, validation
from labrun.core.errors import ConfigError, DataError
from labrun.core.project import LABRUN_CONF
from labrun.data.detection import coco, shapes, transforms, yolo
from labrun.data.detection.boxes import Cleaned, Objects
from labrun.data.detection.data import DetectionData, DetectionDataset, collate


def objects(boxes, labels=None, crowd=None) -> Objects:
    boxes = np.array(boxes, np.float32).reshape(-1, 4)
    labels = np.arange(len(boxes)) if labels is None else labels
    return Objects(boxes, np.array(labels, np.int64),
                   None if crowd is None else np.array(crowd, bool))


def painted(height: int, width: int, box, value: int = 255) -> np.ndarray:
    """A black image with `box` (integer corners) filled with `value`."""
    image = np.zeros((height, width, 3), np.uint8)
    x1, y1, x2, y2 = box
    image[y1:y2, x1:x2] = value
    return image


def composed(*overrides: str):
    """A detection run's config (task=detection), validated as a run's is."""
    schema.register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(LABRUN_CONF), version_base="1.3"):
        cfg = compose("train", overrides=["paths.run_dir=/tmp/x", "task=detection",
                                          *overrides])
    validation.validate(cfg)
    return cfg


@functools.cache
def small_shapes() -> DictConfig:
    """dataset=shapes_boxes as composed, made small; composed once (Hydra takes 0.5 s)."""
    return composed("dataset=shapes_boxes", "dataset.num_train=24", "dataset.num_val=8",
                    "dataset.image_size=64").dataset


def shapes_data(**changes) -> DetectionData:
    """DetectionData of small_shapes() with `changes` (dotted keys under dataset)."""
    cfg = copy.deepcopy(small_shapes())
    for dotted, value in changes.items():
        OmegaConf.update(cfg, dotted, value)
    return labrun_data.build(cfg)


# -- transforms ------------------------------------------------------------------------------

def test_hflip_mirrors_pixels_and_boxes_and_twice_gives_both_back():
    pixels = torch.from_numpy(painted(20, 30, (2, 4, 10, 12))).permute(2, 0, 1).contiguous()
    start = objects([[2, 4, 10, 12]])
    flipped, moved = transforms.hflip(pixels, start)
    assert moved.boxes.tolist() == [[20, 4, 28, 12]]
    assert (flipped[:, 4:12, 20:28] == 255).all() and flipped.sum() == pixels.sum()
    back, again = transforms.hflip(flipped, moved)
    assert torch.equal(back, pixels) and again.boxes.tolist() == start.boxes.tolist()


def test_letterbox_keeps_the_aspect_pads_with_gray_and_maps_a_known_box():
    # 200 wide, 100 high into 100 x 100: scale 0.5, 50 rows, 25 rows of gray above and below.
    image = painted(100, 200, (20, 10, 60, 50))
    pixels, moved = transforms.letterbox(image, objects([[20, 10, 60, 50]], crowd=[True]), 100)
    assert pixels.shape == (3, 100, 100) and pixels.dtype == torch.uint8
    assert moved.boxes.tolist() == [[10, 30, 30, 50]] and moved.crowd.tolist() == [True]
    assert (pixels[:, :25] == 114).all() and (pixels[:, 75:] == 114).all()
    assert (pixels[:, 31:49, 11:29] == 255).all()  # inside the box: the painted pixels
    assert (pixels[:, 25:75, 35:] == 0).all()  # beside it: the image's black


def test_scale_crop_moves_the_pixels_with_the_boxes_clipping_and_dropping_by_min_visible():
    seed = 3
    replay = np.random.default_rng(seed)  # the draws scale_crop makes: scale, top, left
    assert replay.uniform(2, 2) == 2
    top, left = int(replay.integers(0, 101)), int(replay.integers(0, 101))
    assert top >= 0 and 20 <= left <= 80, "pick a seed whose window leaves room for the boxes"
    image = np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)
    start = objects([[left + 10, top + 10, left + 30, top + 30],  # inside: kept as it is
                     [left - 10, top + 10, left + 10, top + 30],  # half inside: kept, clipped
                     [left - 14, top + 40, left + 6, top + 60]])  # 30% inside: dropped
    # Scale 2 of the letterbox scale (0.5) is 1: the window is the image's own pixels.
    pixels, kept = transforms.scale_crop(image, start, 100, (2, 2), 0.4,
                                         np.random.default_rng(seed))
    assert torch.equal(pixels, torch.from_numpy(image[top:top + 100, left:left + 100])
                       .permute(2, 0, 1))
    assert kept.boxes.tolist() == [[10, 10, 30, 30], [0, 10, 10, 30]]
    assert kept.labels.tolist() == [0, 1]
    _, stricter = transforms.scale_crop(image, start, 100, (2, 2), 0.6,
                                        np.random.default_rng(seed))
    assert stricter.labels.tolist() == [0]


def test_clipping_drops_boxes_thinner_than_min_side():
    kept = transforms.clipped(objects([[0, 0, 10, 10], [8.5, 0, 20, 10], [2, 2, 3, 9]]),
                              0, 0, 10, 10, 0.0)
    assert kept.boxes.tolist() == [[0, 0, 10, 10]]  # 1.5 px and 1 px wide: dropped


@pytest.mark.parametrize("seed", range(6))
def test_mosaic_boxes_land_on_the_pixels_of_their_own_image(seed):
    # Image k: its box painted 60 * (k + 1), label k; everything else black.
    samples = [(painted(100, 120, (20, 20, 90, 80), 60 * (k + 1)), objects([[20, 20, 90, 80]],
                                                                           [k]))
               for k in range(4)]
    pixels, placed = transforms.mosaic(samples, 128, (0.8, 1.2), 0.0,
                                       np.random.default_rng(seed))
    assert pixels.shape == (3, 128, 128) and len(placed) >= 1
    covered = torch.zeros(128, 128, dtype=torch.bool)
    for (x1, y1, x2, y2), label in zip(placed.boxes.tolist(), placed.labels.tolist(),
                                       strict=True):
        assert 0 <= x1 < x2 <= 128 and 0 <= y1 < y2 <= 128
        inner = pixels[:, int(np.ceil(y1)) + 1:int(y2) - 1, int(np.ceil(x1)) + 1:int(x2) - 1]
        assert inner.numel() and (inner.int() - 60 * (label + 1)).abs().max() <= 1
        covered[max(0, int(y1) - 1):int(np.ceil(y2)) + 1, max(0, int(x1) - 1):int(np.ceil(x2)) + 1] = True
    painted_pixels = (pixels[0] != 0) & (pixels[0] != 114)
    assert not (painted_pixels & ~covered).any()  # no painted region left without its box
    # Quadrants in order: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right.
    where = {label: box for box, label in zip(placed.boxes.tolist(), placed.labels.tolist(),
                                              strict=True)}
    for left, right in ((0, 1), (2, 3)):
        if left in where and right in where:
            assert where[left][2] <= where[right][0]
    for top, bottom in ((0, 2), (1, 3)):
        if top in where and bottom in where:
            assert where[top][3] <= where[bottom][1]


def test_a_region_resized_to_another_aspect_moves_each_axis_by_its_own_ratio():
    image = painted(40, 80, (20, 10, 60, 30))  # 80 wide, 40 high
    pixels, moved = transforms.resized(image, objects([[20, 10, 60, 30]]), 0, 20, 40, 40, 20, 10)
    assert pixels.shape == (3, 20, 10)
    assert moved.boxes.tolist() == [[0, 5, 10, 15]]  # x by 10/40, y by 20/40
    assert (pixels[:, 6:14, :] == 255).all() and (pixels[:, :4] == 0).all()


def test_colour_jitter_off_changes_nothing_and_on_is_drawn_from_the_rng():
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 16, 16),
                                                                dtype=np.uint8))
    assert transforms.jitter(pixels, np.random.default_rng(1)) is pixels
    one = transforms.jitter(pixels, np.random.default_rng(1), 0.4, 0.4, 0.5, 0.1)
    assert torch.equal(one, transforms.jitter(pixels, np.random.default_rng(1), 0.4, 0.4, 0.5,
                                              0.1))
    assert not torch.equal(one, pixels) and one.dtype == torch.uint8
    gray = torch.full((3, 4, 4), 100, dtype=torch.uint8)  # no colour: hue and saturation keep it
    assert (transforms.jitter(gray, np.random.default_rng(2), saturation=0.9, hue=0.5)
            .int() - 100).abs().max() <= 1


# -- shapes_boxes ----------------------------------------------------------------------------

def test_shapes_boxes_are_tight_apart_and_the_same_every_time():
    source = shapes.load(64, num_train=20, num_val=4)["train"]
    counts = set()
    for index in range(20):
        image, found = source.open(index)
        again_image, again = source.open(index)
        assert np.array_equal(image, again_image) and np.array_equal(found.boxes, again.boxes)
        assert image.shape == (64, 64, 3) and 1 <= len(found) <= 4
        assert set(found.labels.tolist()) <= {0, 1, 2}
        counts.add(len(found))
        b = found.boxes
        assert (b[:, :2] >= 0).all() and (b[:, 2:] <= 64).all()
        sides = np.minimum(b[:, 2] - b[:, 0], b[:, 3] - b[:, 1])
        assert (sides >= 0.08 * 64).all()  # a radius of 0.08 of the side at least
        for i in range(len(b)):  # apart: no two boxes overlap (distinct grid cells)
            for j in range(i + 1, len(b)):
                assert (min(b[i, 2], b[j, 2]) <= max(b[i, 0], b[j, 0])
                        or min(b[i, 3], b[j, 3]) <= max(b[i, 1], b[j, 1]))
    assert len(counts) >= 3  # the number of shapes varies


# -- DetectionData -----------------------------------------------------------------------------

def first_batches(loader, count: int = 2):
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


def test_samples_come_from_seed_epoch_and_index_with_0_or_2_workers():
    data = shapes_data(num_workers=0)
    data.start(10)
    quiet = first_batches(data.loader("train", micro_batch_size=4, seed=5))
    data.cfg.num_workers = 2
    workers = first_batches(data.loader("train", micro_batch_size=4, seed=5))
    for (images, targets), (images2, targets2) in zip(quiet, workers, strict=True):
        assert torch.equal(images, images2)
        for a, b in zip(targets, targets2, strict=True):
            assert a["image_id"] == b["image_id"] and torch.equal(a["boxes"], b["boxes"])
    samples = DetectionDataset(data.splits["train"], "train", data.cfg, 5, data.mosaic_off_from)
    image_a, _ = samples[(0, 3)]
    assert torch.equal(image_a, samples[(0, 3)][0])
    assert not torch.equal(image_a, samples[(1, 3)][0])  # another epoch, other draws


def test_mosaic_is_on_before_mosaic_off_from_and_off_from_it(monkeypatch):
    made = []
    real = transforms.mosaic
    monkeypatch.setattr(transforms, "mosaic", lambda *a, **k: made.append(1) or real(*a, **k))
    data = shapes_data(**{"augment.mosaic": 1.0, "augment.close_mosaic": 3})
    data.start(10)
    assert data.mosaic_off_from == 7
    samples = DetectionDataset(data.splits["train"], "train", data.cfg, 0, data.mosaic_off_from)
    for epoch in (0, 6):
        samples[(epoch, 2)]
    assert len(made) == 2
    for epoch in (7, 9):
        samples[(epoch, 2)]
    assert len(made) == 2
    # Neither start() nor load_state_dict(): mosaic in every epoch, however late.
    untouched = shapes_data(**{"augment.mosaic": 1.0, "augment.close_mosaic": 3})
    loader = untouched.loader("train", micro_batch_size=4, seed=0)
    assert loader.dataset.mosaic_off_from is None and loader.dataset.mosaic_on(10_000)
    loader.dataset[(10_000, 1)]
    assert len(made) == 3


def test_the_mosaic_switch_travels_in_the_state_dict_into_the_loaders():
    data = shapes_data(**{"augment.close_mosaic": 2})
    data.start(5)
    state = data.state_dict()
    assert state == {"mosaic_off_from": 3}
    restored = shapes_data(**{"augment.close_mosaic": 2})
    restored.load_state_dict(state)
    loader = restored.loader("train", micro_batch_size=4, seed=0)
    assert loader.dataset.mosaic_off_from == 3
    assert not loader.dataset.mosaic_on(3) and loader.dataset.mosaic_on(2)
    data.start(1)  # a budget shorter than close_mosaic: no mosaic at all
    assert data.mosaic_off_from == 0


class CrowdSource:
    """Two 40 x 20 images: one with a box and a crowd region, one without objects."""

    boxes = True
    name, class_names, category_ids = "crowds", ["a", "b"], [3, 9]

    def __init__(self):
        self.cleaned = Cleaned(clipped=2)

    def __len__(self) -> int:
        return 2

    def open(self, index: int):
        if index == 1:
            return np.zeros((20, 40, 3), np.uint8), Objects.none()
        return np.zeros((20, 40), np.uint8), objects([[0, 0, 20, 10], [20, 0, 40, 20]], [1, 0],
                                                    [False, True])

    def image_id(self, index: int) -> int:
        return 100 + index

    def describe(self, index: int) -> str:
        return f"crowds[{index}]"


def test_batches_are_uint8_images_and_target_dicts_crowds_kept_for_eval_only(caplog):
    cfg = copy.deepcopy(small_shapes())
    cfg.image_size, cfg.num_workers, cfg.augment.mosaic = 40, 0, 0.0
    with caplog.at_level("WARNING"):
        data = DetectionData.build({"train": CrowdSource(), "val": CrowdSource()}, cfg)
    assert "crowds: 2 box(es) clipped" in caplog.text
    assert data.info == {"class_names": ["a", "b"], "category_ids": [3, 9], "image_size": 40}
    images, targets = next(iter(data.loader("val", micro_batch_size=2, seed=0)))
    assert images.shape == (2, 3, 40, 40) and images.dtype == torch.uint8
    first, second = targets
    assert first["boxes"].dtype == torch.float32 and first["labels"].dtype == torch.int64
    assert first["crowd"].dtype == torch.bool and first["image_id"] == 100
    assert first["boxes"].tolist() == [[0, 10, 20, 20], [20, 10, 40, 30]]  # 10 rows of gray
    assert first["crowd"].tolist() == [False, True] and first["labels"].tolist() == [1, 0]
    assert second["boxes"].shape == (0, 4) and second["image_id"] == 101
    _, train_targets = next(iter(data.loader("train", micro_batch_size=2, seed=0)))
    for target in train_targets:
        assert not target["crowd"].any() and 0 not in target["labels"].tolist()
    pair = collate([(torch.zeros(3, 4, 4, dtype=torch.uint8), {"image_id": 1})] * 3)
    assert pair[0].shape == (3, 3, 4, 4) and len(pair[1]) == 3


def test_a_format_without_val_holds_part_of_train_out():
    data = shapes_data(num_val=0, num_train=20, val_fraction=0.25)
    assert (len(data.splits["train"]), len(data.splits["val"])) == (15, 5)
    ids = {data.splits["val"].image_id(i) for i in range(5)}
    assert not ids & {data.splits["train"].image_id(i) for i in range(15)}


# -- files -----------------------------------------------------------------------------------

def test_coco_and_yolo_folders_load_as_sources_and_a_broken_image_is_named(tmp_path):
    root = tmp_path / "coco"
    for split in ("train", "val"):
        (root / f"{split}2017").mkdir(parents=True)
        Image.fromarray(painted(30, 40, (4, 6, 20, 16))).save(root / f"{split}2017" / "a.png")
        (root / f"{split}2017" / "bad.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}2017.json").write_text(json.dumps({
            "images": [{"id": 7, "file_name": "a.png", "width": 40, "height": 30},
                       {"id": 8, "file_name": "bad.jpg", "width": 40, "height": 30}],
            "categories": [{"id": 5, "name": "thing"}],
            "annotations": [{"id": 1, "image_id": 7, "category_id": 5, "bbox": [4, 6, 16, 10]}]}))
    sources = coco.load(str(root), "pil")
    assert set(sources) == {"train", "val"} and sources["val"].boxes
    image, found = sources["val"].open(0)
    assert image.shape == (30, 40, 3) and found.boxes.tolist() == [[4, 6, 20, 16]]
    assert sources["val"].image_id(1) == 8 and sources["val"].category_ids == [5]
    with pytest.raises(DataError) as refused:
        sources["val"].open(1)
    assert str(refused.value).startswith(f"{root / 'val2017' / 'bad.jpg'}: not a readable image")
    assert "\n" not in str(refused.value)
    cfg = composed("dataset=coco", f"dataset.root={root}", "dataset.num_workers=0",
                   "dataset.decoder=pil", "dataset.image_size=32").dataset
    loader = labrun_data.build(cfg).loader("val", micro_batch_size=2, seed=0)
    with pytest.raises(DataError, match=r"bad.jpg: not a readable image"):
        next(iter(loader))

    (tmp_path / "y" / "images" / "train").mkdir(parents=True)
    (tmp_path / "y" / "labels" / "train").mkdir(parents=True)
    Image.fromarray(painted(30, 40, (0, 0, 1, 1))).save(tmp_path / "y/images/train/p.png")
    (tmp_path / "y/labels/train/p.txt").write_text("1 0.5 0.5 0.5 0.5\n")
    (tmp_path / "y/data.yaml").write_text("train: images/train\nval: images/train\n"
                                          "names: [a, b]\n")
    sources = yolo.load(str(tmp_path / "y/data.yaml"), "pil")
    assert set(sources) == {"train", "val"} and sources["train"].image_id(0) == 0
    assert sources["train"].open(0)[1].boxes.tolist() == [[10, 7.5, 30, 22.5]]


# -- config ----------------------------------------------------------------------------------

def test_each_detection_option_composes_and_a_misspelt_key_is_refused(tmp_path):
    cfg = composed("dataset=shapes_boxes")
    assert OmegaConf.to_container(cfg.dataset.augment) == {
        "hflip": True, "scale": [0.5, 1.5], "min_visible": 0.4, "brightness": 0.3,
        "contrast": 0.3, "saturation": 0.5, "hue": 0.015, "mosaic": 0.5, "close_mosaic": 2}
    assert cfg.dataset.image_size == 128
    (tmp_path / "data.yaml").write_text("")
    assert composed("dataset=yolo", f"dataset.data={tmp_path / 'data.yaml'}").dataset.decoder \
        == "turbojpeg"
    assert composed("dataset=coco", f"dataset.root={tmp_path}").dataset.image_size == 640
    for override, line in (
            ("dataset.augment.mosiac=0.5", "dataset.augment.mosiac: no such config key; did "
                                           "you mean dataset.augment.mosaic?"),
            ("dataset.min_visibel=0.3", "dataset.min_visibel: no such config key")):
        with pytest.raises(Exception) as refused:
            composed("dataset=shapes_boxes", override)
        assert user_error_message(refused.value) == line


@pytest.mark.parametrize("override, line", [
    ("dataset.augment.mosaic=1.5", "dataset.augment.mosaic=1.5 must be in [0, 1]"),
    ("dataset.augment.min_visible=-0.1", "dataset.augment.min_visible=-0.1 must be in [0, 1]"),
    ("dataset.augment.brightness=1.0", "dataset.augment.brightness=1.0 must be in [0, 1)"),
    ("dataset.augment.hue=0.7", "dataset.augment.hue=0.7 must be in [0, 0.5]"),
    ("dataset.augment.close_mosaic=-1", "dataset.augment.close_mosaic=-1 must be 0 or more"),
    ("dataset.augment.scale=[1.5,0.5]", "dataset.augment.scale=[1.5, 0.5] must be [low, high]"),
])
def test_an_augment_value_its_transform_cannot_take_is_one_line(override, line):
    cfg = copy.deepcopy(small_shapes())
    key, value = override.split("=")
    OmegaConf.update(cfg, key.removeprefix("dataset."), yaml.safe_load(value))
    with pytest.raises(ConfigError) as refused:
        validation.check_detection_augment(cfg)
    assert str(refused.value).startswith(line)
