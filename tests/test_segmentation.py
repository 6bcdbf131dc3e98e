"""task=segmentation: the mask follows every augmentation; mean IoU from the summed confusion
matrix; the data's refusals; experiment=seg_shapes against the majority-class baseline; and
the guarantees classification has, on this task: kill -9 then a bit-identical resume, two
processes equal to one (the confusion matrix's sums exactly), compare and the dashboard."""

from __future__ import annotations

import contextlib
import json
import math
import re
import signal
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own name for it
from PIL import Image

from conftest import (
    DDP_LOSS_TOLERANCE,
    DDP_WEIGHT_TOLERANCE,
    assert_identical,
    final_weights,
    max_difference,
    rank_records,
    read_metrics,
    read_summary,
    run_labrun,
    run_train,
    start_dashboard,
    start_train,
    stop_dashboard,
    wait_for,
)
from labrun.core.errors import ConfigError, DataError
from labrun.data.segmentation import masks as mask_files
from labrun.data.segmentation import shapes
from labrun.data.segmentation.masks import PngMask, encode_mask, open_mask
from labrun.data.segmentation.transforms import JointEval, JointTrain
from labrun.train.evaluation import evaluation_sums
from labrun.train.task import Segmentation, mean_iou

# A U-Net small enough for a step in a few milliseconds: the guarantees, not the accuracy.
SEG_TINY = ["experiment=seg_shapes", "model.width=4", "model.depth=2", "dataset.num_train=64",
            "dataset.num_val=16", "trainer.batch_size=8", "trainer.max_epochs=4",
            "checkpoint.every_n_steps=5", "optimizer=sgd"]


# ---------------------------------------------------------------------------------------------
# The mask follows the image


def l_shape(height: int = 60, width: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """An L (no mirror symmetry) of class 1 and a bar of class 2 on class 0, the image's
    colour a function of the class, so that each pixel of a transformed image says which
    class the mask must hold there."""
    mask = np.zeros((height, width), np.uint8)
    mask[10:50, 8:20] = 1
    mask[38:50, 8:45] = 1
    mask[5:15, 55:75] = 2
    colours = np.array([[0, 0, 0], [250, 0, 0], [0, 0, 250]], np.uint8)
    return colours[mask], mask


def class_from_colour(image: torch.Tensor) -> torch.Tensor:
    red, blue = image[0].int(), image[2].int()
    return torch.where(red > 125, 1, torch.where(blue > 125, 2, 0))


def interior(mask: torch.Tensor) -> torch.Tensor:
    """Pixels whose 3x3 neighbourhood is one class: away from the edges that resizing blends."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")
    low = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0]
    high = torch.nn.functional.max_pool2d(padded, 3, stride=1)[0, 0]
    return low == high


@pytest.mark.parametrize("transform", [JointTrain(24, scale=(0.08, 1.0)), JointTrain(96),
                                       JointEval(32), JointEval(None)],
                         ids=["crop-small", "crop-upscale", "eval-fixed", "eval-full"])
@pytest.mark.parametrize("stored", ["array", "png"])
def test_the_mask_follows_every_crop_flip_and_resize(transform, stored):
    image, mask = l_shape()
    if stored == "png":  # a PngMask, as files give: decoded by rows when the crop is known
        if mask_files._decode_rows is None:
            pytest.skip("the _png_rows extension is not built (no C compiler or libpng headers "
                        "at install): masks are arrays, the case above")
        mask = open_mask(encode_mask(mask), "l.png")
        assert isinstance(mask, PngMask)
    flips = set()
    for seed in range(40):
        rng = np.random.default_rng(seed)
        out_image, out_mask = transform(image, mask, rng)
        assert out_image.dtype == torch.uint8 and out_mask.dtype == torch.uint8
        assert out_image.shape[1:] == out_mask.shape
        inside = interior(out_mask)
        assert inside.float().mean() > 0.5  # most pixels are checked
        agree = class_from_colour(out_image)[inside] == out_mask[inside].int()
        assert agree.all(), f"seed {seed}: {int((~agree).sum())} interior pixels disagree"
        assert set(out_mask.unique().tolist()) <= {0, 1, 2}  # nearest: no blended class
        if isinstance(transform, JointTrain):
            # Mirrored or not, told by where the L's foot points: the pixels decide, not the box.
            flips.add(_foot_points_left(out_mask))
    if isinstance(transform, JointTrain):
        assert flips >= {True, False}  # both happened, and the checks above held for both


def _foot_points_left(mask: torch.Tensor) -> bool:
    ys, xs = torch.nonzero(mask == 1, as_tuple=True)
    if len(xs) == 0:
        return False
    bottom = ys >= ys.max() - 1
    column = torch.bincount(xs).argmax()  # the L's upright
    return bool(xs[bottom].float().mean() < column)


# ---------------------------------------------------------------------------------------------
# The metric


# Two tiny masks (3 x 4 pixels, 255 void) and what a model predicted for them, over five
# classes: class 3 is only predicted, class 4 neither in truth nor predicted.
VOID = 255
TRUTHS = [[[0, 0, 1, 1],
           [0, 0, 1, 1],
           [2, 2, 2, VOID]],
          [[1, 1, 1, 1],
           [0, 0, 2, 2],
           [0, 0, 2, 2]]]
PREDICTIONS = [[[0, 0, 1, 3],
                [0, 1, 1, 1],
                [2, 2, 0, 2]],  # the last pixel is void in truth: not scored
               [[1, 1, 3, 3],
                [0, 0, 2, 2],
                [0, 2, 2, 2]]]
# Counted by hand, rows true and columns predicted: truth 0 (8 pixels) predicted 0 six times,
# 1 once, 2 once; truth 1 (8) predicted 1 five times, 3 three times; truth 2 (7) predicted 0
# once, 2 six times. 23 pixels scored, 6 + 5 + 6 = 17 right.
CONFUSION_BY_HAND = [[6, 1, 1, 0, 0],
                     [0, 5, 0, 3, 0],
                     [1, 0, 6, 0, 0],
                     [0, 0, 0, 0, 0],
                     [0, 0, 0, 0, 0]]
# IoU = right / (true + predicted - right), per class present in truth or prediction:
# class 0: 6 / (8 + 7 - 6) = 2/3; class 1: 5 / (8 + 6 - 5) = 5/9; class 2: 6 / (7 + 7 - 6)
# = 3/4; class 3, only predicted: 0 / (0 + 3 - 0) = 0, and it counts; class 4: absent, left
# out. Without class 3 the mean would be 71/108, with class 4 as a zero 71/180.
IOU_BY_HAND = [2 / 3, 5 / 9, 3 / 4, 0.0]
MEAN_IOU_BY_HAND = 71 / 144
PIXEL_ACC_BY_HAND = 17 / 23


class Predicts(torch.nn.Module):
    """A model whose answers are the fixture's predictions, one batch after the other: the
    logits 10 for the predicted class, 0 for the others."""

    def __init__(self, predictions: list[torch.Tensor], classes: int):
        super().__init__()
        self.answers, self.classes = list(predictions), classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        predicted = self.answers.pop(0)
        return 10.0 * F.one_hot(predicted, self.classes).permute(0, 3, 1, 2).float()


def test_mean_iou_equals_a_confusion_matrix_counted_by_hand():
    """The fixture's two masks, one batch each, through the evaluation loop: the confusion
    matrix, mean IoU, pixel accuracy and loss equal what was counted by hand above; a class
    only predicted scores 0 and counts, a class nowhere does not."""
    task = Segmentation()
    task.setup({"class_names": list("abcde"), "mean": [0.5] * 3, "std": [0.25] * 3,
                "ignore_index": VOID}, torch.device("cpu"), torch.contiguous_format)
    masks = [torch.tensor([truth], dtype=torch.uint8) for truth in TRUTHS]
    loader = [(torch.zeros(1, 3, 3, 4, dtype=torch.uint8), mask) for mask in masks]
    model = Predicts([torch.tensor([p]) for p in PREDICTIONS], classes=5)
    sums = evaluation_sums(model, task, loader, torch.device("cpu"), contextlib.nullcontext)
    assert sums[2:].view(5, 5).long().tolist() == CONFUSION_BY_HAND
    assert sums[1] == 23
    metrics = task.eval_metrics(sums, "val")
    assert metrics["val/miou"] == pytest.approx(MEAN_IOU_BY_HAND, abs=1e-12)
    assert MEAN_IOU_BY_HAND == pytest.approx(sum(IOU_BY_HAND) / 4)
    assert metrics["val/pixel_acc"] == pytest.approx(PIXEL_ACC_BY_HAND, abs=1e-12)
    # Cross-entropy of logits 10 against 0 for the four other classes: log(1 + 4e-10) a pixel
    # predicted right, log(e10 + 4) a pixel predicted wrong.
    loss = (17 * math.log(1 + 4 * math.exp(-10)) + 6 * math.log(math.exp(10) + 4)) / 23
    assert metrics["val/loss"] == pytest.approx(loss, rel=1e-6)


def test_eval_sums_of_two_halves_add_up_to_the_whole_batchs_exactly():
    """Mean IoU of the whole is not the mean of the halves'; the sums are what add up."""
    task = Segmentation()
    task.setup({"class_names": ["a", "b", "c"], "mean": [0.5] * 3, "std": [0.25] * 3,
                "ignore_index": 255}, torch.device("cpu"), torch.contiguous_format)
    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 3, 3, padding=1)
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    masks = torch.randint(0, 3, (4, 16, 16), dtype=torch.uint8)
    masks[0, :4] = 255  # void: not scored
    whole = task.eval_sums(model, task.prepare((images, masks), torch.device("cpu")))
    halves = sum(task.eval_sums(model, task.prepare((images[i:i + 2], masks[i:i + 2]),
                                                     torch.device("cpu"))) for i in (0, 2))
    assert torch.equal(whole[1:], halves[1:])  # counts and confusion matrix: exactly
    assert whole[1] == 4 * 16 * 16 - 4 * 16
    assert whole[2:].sum() == whole[1]  # every scored pixel once in the matrix
    assert task.count((images, masks)) == whole[1]
    metrics = task.eval_metrics(whole, "val")
    assert set(metrics) == {"val/loss", "val/miou", "val/pixel_acc"}
    # The halves' mean IoUs averaged are another figure (what it should be: the test above).
    halves_miou = np.mean([task.eval_metrics(task.eval_sums(
        model, task.prepare((images[i:i + 2], masks[i:i + 2]), torch.device("cpu"))),
        "val")["val/miou"] for i in (0, 2)])
    assert metrics["val/miou"] != halves_miou


# ---------------------------------------------------------------------------------------------
# The data's refusals


def seg_folder(root: Path, count: int = 4, size: tuple[int, int] = (40, 30),
               classes: bool = True) -> Path:
    for split in ("train", "val"):
        (root / split / "images").mkdir(parents=True)
        (root / split / "masks").mkdir(parents=True)
        for k in range(count):
            image, mask = shapes.draw(np.random.default_rng(k), max(size))
            image, mask = image[:size[1], :size[0]], mask[:size[1], :size[0]]
            Image.fromarray(image).save(root / split / "images" / f"{k:03d}.jpg")
            Image.fromarray(mask, mode="L").save(root / split / "masks" / f"{k:03d}.png")
    if classes:
        (root / "classes.txt").write_text("\n".join(shapes.CLASS_NAMES) + "\n")
    return root


def build_data(composed, root: Path, *overrides: str):
    from labrun import data

    cfg = composed("experiment=seg_shapes", "dataset=segfolder", f"dataset.root={root}",
                   *overrides)
    return data.build(cfg.dataset)


def test_a_segmentation_folder_trains_at_fixed_size_and_scores_at_full_size(composed,
                                                                           tmp_path):
    root = seg_folder(tmp_path / "seg")
    Image.fromarray(np.zeros((20, 36, 3), np.uint8)).save(root / "val" / "images" / "big.png")
    Image.fromarray(np.full((20, 36), 255, np.uint8), mode="L").save(
        root / "val" / "masks" / "big.png")
    data = build_data(composed, root, "dataset.image_size=16", "dataset.eval_size=full")
    assert data.info["class_names"] == shapes.CLASS_NAMES and data.info["ignore_index"] == 255
    images, masks = next(iter(data.loader("train", micro_batch_size=4, seed=0)))
    assert images.shape == (4, 3, 16, 16) and masks.shape == (4, 16, 16)
    images, masks = next(iter(data.loader("val", micro_batch_size=5, seed=0)))
    # Full size: padded to the batch's largest, the padding void (never scored).
    assert images.shape == (5, 3, 30, 40) and masks.shape == (5, 30, 40)
    scored = (masks != 255).sum().item()
    assert scored == 4 * 30 * 40  # the four 40x30 pairs' pixels; the padding and big.png: void


def test_the_batched_decode_crops_masks_and_images_as_the_workers_do(composed, tmp_path):
    """dataset.decode=cpu: the workers read bytes and crop the masks, this process decodes the
    batch's JPEGs and crops them with the same boxes: masks equal to the workers path's, images
    within the batched decode's tolerance (tests/test_data_decode_batched.py)."""
    from test_data_decode_batched import TOLERANCE

    root = seg_folder(tmp_path / "seg", count=12, size=(64, 48))
    by_decode = {}
    for decode in ("workers", "cpu"):
        data = build_data(composed, root, "dataset.image_size=24", f"dataset.decode={decode}")
        by_decode[decode] = [next(iter(data.loader(split, micro_batch_size=12, seed=3)))
                             for split in ("train", "val")]
    for (images, masks), (cpu_images, cpu_masks) in zip(*by_decode.values(), strict=True):
        assert torch.equal(masks, cpu_masks.cpu())
        # Drawn shapes' hard edges blur differently at a reduced DCT scale (the workers path)
        # than decoded whole and resized in float (this one): twice the photos' tolerance,
        # still well below a mirrored image's distance.
        difference = (images.float() - cpu_images.float()).abs().mean(dim=(1, 2, 3))
        mirrored = (images.float() - cpu_images.flip(3).float()).abs().mean(dim=(1, 2, 3))
        assert difference.max() <= 2 * TOLERANCE, difference
        assert (difference < mirrored / 2).all(), (difference, mirrored)
    # And the masks moved with their images: not every sample kept the same crop.
    assert not torch.equal(by_decode["cpu"][0][1], by_decode["cpu"][1][1])


MASK_REFUSALS = {
    "a stem without its mask": ("no_mask", "has no mask: expected"),
    "a mask of another size": ("wrong_size", "its mask is 20x10 (width x height), the image 40x30"),
    "a value that is no class": ("bad_value", "its mask holds value 7, but there are 4 classes"),
    "no classes.txt nor num_classes": ("no_classes", "has no classes.txt; set dataset.num_classes"),
    "a mask in colours": ("rgb", "has 3 channels; a mask holds one class index per pixel"),
}


def spoil(root: Path, how: str) -> Path:
    masks = root / "train" / "masks"
    if how == "no_mask":
        (masks / "002.png").unlink()
    elif how == "wrong_size":
        Image.fromarray(np.zeros((10, 20), np.uint8), mode="L").save(masks / "002.png")
    elif how == "bad_value":
        Image.fromarray(np.full((30, 40), 7, np.uint8), mode="L").save(masks / "002.png")
    elif how == "rgb":
        Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(masks / "002.png")
    elif how == "no_classes":
        (root / "classes.txt").unlink()
    return root / "train" / "images" / "002.jpg"


@pytest.mark.parametrize("refusal", MASK_REFUSALS, ids=list(MASK_REFUSALS))
def test_a_bad_pair_is_one_line_naming_the_file_before_training(refusal, composed, tmp_path):
    how, expected = MASK_REFUSALS[refusal]
    root = seg_folder(tmp_path / "seg")
    named = spoil(root, how)
    with pytest.raises(DataError) as caught:
        build_data(composed, root)
    message = str(caught.value)
    assert "\n" not in message and expected in message, message
    if how == "rgb":
        assert str(named.parent.parent / "masks" / "002.png") in message, message
    elif how != "no_classes":
        assert str(named) in message, message


def test_a_bad_mask_outside_the_checked_sample_is_named_when_read(composed, tmp_path):
    root = seg_folder(tmp_path / "seg", count=40)  # more pairs than the start checks
    data = build_data(composed, root)
    source = data.splits["train"]
    checked = {int(i) for i in np.linspace(0, len(source) - 1, 16).astype(int)}
    unchecked = next(i for i in range(len(source)) if i not in checked)
    Image.fromarray(np.full((30, 40), 9, np.uint8), mode="L").save(
        Path(source.masks[unchecked].decode()))
    with pytest.raises(DataError) as caught:
        list(data.loader("train", micro_batch_size=40, seed=0))
    assert source.describe(unchecked) in str(caught.value)
    assert "holds value 9" in str(caught.value)


def test_a_bad_pair_through_train_py_exits_2_with_one_line(tmp_path):
    root = seg_folder(tmp_path / "seg")
    spoil(root, "wrong_size")
    result = run_train("experiment=seg_shapes", "dataset=segfolder", f"dataset.root={root}",
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "its mask is 20x10" in errors[0], result.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before training


TASK_REFUSALS = {
    "masks under classification": (["dataset=shapes"], "holds masks, a label per pixel; "
                                                       "train it with task=segmentation"),
    "labels under segmentation": (["task=segmentation"], "task=segmentation needs a dataset "
                                                         "of masks"),
    "an ignore index beyond a byte": (["experiment=seg_shapes", "dataset.ignore_index=300"],
                                      "dataset.ignore_index=300: masks hold values 0..255"),
}


@pytest.mark.parametrize("refusal", TASK_REFUSALS, ids=list(TASK_REFUSALS))
def test_a_task_and_dataset_that_do_not_fit_are_one_line_before_data_loads(refusal, composed):
    from labrun.config import validation

    overrides, expected = TASK_REFUSALS[refusal]
    with pytest.raises(ConfigError) as caught:
        validation.validate(composed(*overrides))
    assert "\n" not in str(caught.value) and expected in str(caught.value), caught.value


# ---------------------------------------------------------------------------------------------
# The preset, and what reads a finished run


def majority_baseline(count: int = 128) -> tuple[float, float]:
    """Mean IoU and pixel accuracy of predicting the commonest class (background) everywhere,
    on the preset's val split."""
    confusion = torch.zeros(4, 4, dtype=torch.long)
    for index in range(count):
        _, mask = shapes.ShapesSource("val", count, 32).open(index)
        truth = torch.from_numpy(mask).long().flatten()
        confusion += torch.bincount(truth * 4, minlength=16).view(4, 4)
    return mean_iou(confusion)


def test_seg_shapes_reaches_half_a_mean_iou_well_above_the_majority_class(seg_run):
    summary = read_summary(seg_run)
    baseline_miou, baseline_acc = majority_baseline()
    print(f"experiment=seg_shapes: val/miou {summary['best/val/miou']:.3f}, pixel_acc "
          f"{summary['val/pixel_acc']:.3f}; background everywhere: miou {baseline_miou:.3f}, "
          f"pixel_acc {baseline_acc:.3f}")
    assert summary["status"] == "completed"
    assert (summary["monitor"], summary["mode"]) == ("val/miou", "max")  # the task's default
    assert summary["best/val/miou"] >= 0.5
    assert baseline_miou < 0.3 and summary["best/val/miou"] > baseline_miou + 0.2
    best = torch.load(seg_run / "checkpoints" / "best.pt", weights_only=True)
    assert best["task"] == "segmentation" and best["class_names"] == shapes.CLASS_NAMES


def test_eval_in_two_processes_gives_the_same_confusion_matrix_as_one(seg_run):
    """The confusion matrix's sums reduce across ranks exactly: best.pt on val, one image a
    forward pass (so that both see the same logits), in one process and in two, gives the
    same mean IoU and pixel accuracy to the last bit."""
    written = seg_run / "eval" / "shapes-val-best.json"
    run_labrun("eval", str(seg_run), "--split", "val", "trainer.batch_size=1")
    one_record = json.loads(written.read_text())
    run_labrun("eval", str(seg_run), "--split", "val", "trainer.devices=2",
               "trainer.batch_size=2")
    two_record = json.loads(written.read_text())
    # Two processes' confusion matrices were added up, not one process's whole split: with
    # trainer.devices=2 ignored, the figures below can match all the same.
    assert (one_record["world_size"], two_record["world_size"]) == (1, 2)
    one, two = one_record["metrics"], two_record["metrics"]
    assert (two["val/miou"], two["val/pixel_acc"]) == (one["val/miou"], one["val/pixel_acc"])
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-12)
    # And what training measured of best.pt, in batches of 16: the same, up to the ties of
    # logits that other batch sizes may round differently.
    assert one["val/miou"] == pytest.approx(read_summary(seg_run)["best/val/miou"], abs=1e-3)


def test_compare_and_the_dashboard_show_mean_iou(seg_run, tmp_path):
    out = tmp_path / "runs.csv"
    run_labrun("compare", str(seg_run), "--csv", str(out))
    header, row = out.read_text().splitlines()[:2]
    assert "best val/miou" in header.split(","), header
    assert f"{read_summary(seg_run)['best/val/miou']:.4f}"[:5] in row
    proc, url, _ = start_dashboard(seg_run.parent)  # a folder of runs: the dashboard writes beside them
    try:
        experiment = httpx.post(f"{url}/data/plugin/hparams/experiment",
                                json={"experimentName": ""}, timeout=30).json()
        tags = [m["name"]["tag"] for m in experiment["metricInfos"]]
        assert "best/val/miou" in tags, tags
    finally:
        stop_dashboard(proc, url)


# ---------------------------------------------------------------------------------------------
# Every guarantee, on this task


@pytest.fixture(scope="module")
def whole_tiny_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("seg-whole") / "run"
    run_train(*SEG_TINY, run_dir=run_dir)
    return run_dir


def test_killed_with_sigkill_mid_epoch_it_resumes_bit_identical(whole_tiny_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(*SEG_TINY, run_dir=run_dir, output=subprocess.DEVNULL)
    try:
        wait_for(run_dir / "checkpoints" / "step-00000005.pt", proc)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = run_train(*SEG_TINY, run_dir=run_dir)
    resumed_at = re.search(r"resuming from .* \(step (\d+)\)", result.stdout)
    # Killed after step 5 of epoch 1's 8; resumed from the newest checkpoint, before the end.
    assert resumed_at and 5 <= int(resumed_at[1]) < 32, result.stdout[-2000:]
    assert read_summary(run_dir)["status"] == "completed"
    assert_identical(final_weights(run_dir), final_weights(whole_tiny_run))
    miou = [(m["step"], m["val/miou"]) for m in read_metrics(run_dir) if "val/miou" in m]
    assert miou == [(m["step"], m["val/miou"]) for m in read_metrics(whole_tiny_run)
                    if "val/miou" in m]


def test_two_processes_train_as_one(whole_tiny_run, tmp_path):
    """The U-Net's GroupNorm normalises each sample alone: two ranks of 4 images a step train
    as one process of 8, up to the order of float sums."""
    two = tmp_path / "two"
    run_train(*SEG_TINY, "trainer.devices=2", run_dir=two)
    assert [r["world_size"] for r in rank_records(two)] == [2, 2]
    difference = max_difference(final_weights(two), final_weights(whole_tiny_run))
    print(f"segmentation, devices=2 vs devices=1: weights differ by at most {difference:.2e}")
    assert difference <= DDP_WEIGHT_TOLERANCE
    loss_two, loss_one = (read_summary(r)["val/loss"] for r in (two, whole_tiny_run))
    assert abs(loss_two - loss_one) <= DDP_LOSS_TOLERANCE, (loss_two, loss_one)
