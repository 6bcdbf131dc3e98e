"""k-fold cross-validation (dataset.num_folds, dataset.fold) and dataset.split_seed: the fold
indices, the refusals before data loads, and a real 3-fold sweep aggregated over its folds."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import numpy as np
import pytest

from conftest import FAST, PROJECT, PYTHON, read_summary
from labrun.data.image import digits
from labrun.data.image.sources import ArraySource, folds

SPREAD_OVER_WORKERS = True  # no fixture is shared


def labelled(count: int = 103, classes: int = 4) -> ArraySource:
    labels = np.random.default_rng(7).integers(0, classes, count)
    return ArraySource(np.zeros((count, 2, 2, 3), np.uint8), labels, "toy")


@pytest.mark.parametrize("num_folds", [3, 5])
def test_folds_are_disjoint_cover_the_data_once_and_keep_the_class_shares(num_folds):
    source = labelled()
    held = []
    for fold in range(num_folds):
        train, val = folds(source, num_folds, fold, seed=0)
        train_ids, val_ids = set(train.indices.tolist()), set(val.indices.tolist())
        assert not train_ids & val_ids
        assert train_ids | val_ids == set(range(len(source)))
        held.append(val_ids)
    assert sum(len(ids) for ids in held) == len(source)  # each sample validated exactly once
    assert set().union(*held) == set(range(len(source)))
    everywhere = Counter(source.labels.tolist())
    for ids in held:  # stratified: each fold holds each class's share, to one sample
        here = Counter(source.labels[sorted(ids)].tolist())
        for label, total in everywhere.items():
            assert abs(here[label] - total / num_folds) <= 1, (label, here[label], total)


def test_split_seed_draws_other_folds_and_the_same_again():
    source = labelled()
    first = folds(source, 5, 0, seed=0)[1].indices
    assert np.array_equal(first, folds(source, 5, 0, seed=0)[1].indices)
    assert not np.array_equal(first, folds(source, 5, 0, seed=1)[1].indices)


def test_split_seed_zero_keeps_digits_val_split_and_another_seed_moves_it():
    labels_of = {seed: digits.load(8, 0.2, split_seed=seed)["val"].labels for seed in (0, 1)}
    # The split every earlier run used: the first 20% of a permutation seeded with 0.
    order = np.random.default_rng(0).permutation(1797)
    whole = digits.load(8, 0.2, num_folds=3)["train"]
    assert len(whole) == 1797  # folded later, by ImageData
    assert np.array_equal(labels_of[0], whole.labels[order[:359]])
    assert not np.array_equal(labels_of[0], labels_of[1])


REFUSALS = {
    "a fold without K": (["dataset.fold=1"], "dataset.fold=1 needs dataset.num_folds"),
    "a fold out of range": (["dataset.num_folds=3", "dataset.fold=3"],
                            "dataset.fold=3 must be one of 0..2 (dataset.num_folds=3)"),
    "no fold given": (["dataset.num_folds=3"], "dataset.fold=None must be one of 0..2"),
    "one fold": (["dataset.num_folds=1", "dataset.fold=0"], "dataset.num_folds=1 must be 2"),
    "a format with its own val": (
        ["dataset=synthetic", "dataset.num_folds=3", "dataset.fold=0"],
        "dataset synthetic has a val split of its own (it draws dataset.num_val images"),
    "an image folder with val/": (
        ["dataset=imagefolder", "dataset.root={root}", "dataset.num_folds=3", "dataset.fold=0"],
        "/val is its val split"),
}


@pytest.mark.parametrize("refusal", REFUSALS, ids=list(REFUSALS))
def test_a_fold_mistake_is_one_line_before_data_loads(refusal, composed, tmp_path):
    from labrun.config import validation
    from labrun.core.errors import ConfigError

    (tmp_path / "images" / "val").mkdir(parents=True)
    overrides, expected = REFUSALS[refusal]
    cfg = composed(*[o.format(root=tmp_path / "images") for o in overrides])
    with pytest.raises(ConfigError) as caught:
        validation.validate(cfg)
    message = str(caught.value)
    assert "\n" not in message and expected in message, message


def test_a_three_fold_sweep_aggregated_over_its_folds(tmp_path, capsys):
    from labrun import cli

    sweep = tmp_path / "cv"
    result = subprocess.run(
        [PYTHON, "train.py", "-m", *FAST, "dataset.num_folds=3", "dataset.fold=range(0,3)",
         "trainer.max_epochs=1", "trainer.limit_train_batches=6", "optimizer.lr=0.01",
         f"hydra.sweep.dir={sweep}"], cwd=PROJECT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for fold in range(3):
        record = json.loads((sweep / str(fold) / "provenance" / "split.json").read_text())
        assert record == {"split_seed": 0, "num_folds": 3, "fold": fold, "val_fraction": 0.2}
    losses = [read_summary(sweep / str(fold))["val/loss"] for fold in range(3)]
    assert len(set(losses)) == 3  # three different val folds
    assert cli.main(["compare", str(sweep), "--over", "dataset.fold",
                     "--csv", str(tmp_path / "cv.csv")]) == 0
    import csv

    with open(tmp_path / "cv.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["n"] == "3"
    assert float(row["final val/loss mean"]) == pytest.approx(sum(losses) / 3)
    capsys.readouterr()
