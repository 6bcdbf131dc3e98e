"""Bad data through the real `python train.py`: each ends in one line naming the file or the
sample and the fix, exit code 2, nothing trained on garbage."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from test_data_convert import write_image_folder

from conftest import run_labrun, run_train

COMMON = ["trainer.max_epochs=1", "dataset.image_size=32", "trainer.batch_size=8",
          "dataset.num_workers=2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data") / "images", train=6, val=2,
                              extras=False)


def one_line_error(*overrides: str, run_dir) -> str:
    result = run_train(*COMMON, *overrides, run_dir=run_dir, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr
    return lines[-1]


def test_corrupt_jpeg_in_a_folder_names_the_file(folder, tmp_path, fault):
    record = fault("data: corrupt JPEG in a folder")
    root = tmp_path / "images"
    shutil.copytree(folder, root)
    victim = root / "train" / "cat" / "03.jpg"
    victim.write_bytes(victim.read_bytes()[:200])  # cut short
    line = one_line_error("dataset=imagefolder", f"dataset.root={root}", run_dir=tmp_path / "r")
    named = str(victim) in line and "train" in line
    record.trial(named, note=line)
    assert named


def test_truncated_and_foreign_hdf5_files(folder, tmp_path, fault):
    record = fault("data: truncated / foreign HDF5 file")
    good = tmp_path / "good.h5"
    run_labrun("convert", str(folder), str(good), "--workers", "1")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["images"] = np.zeros((4, 8, 8), dtype=np.uint8)
    for path in (truncated, foreign):
        line = one_line_error("dataset=hdf5", f"dataset.path={path}", run_dir=tmp_path / path.stem)
        record.trial(str(path) in line, note=line)
        assert str(path) in line


def test_empty_class_folder_is_named(folder, tmp_path, fault):
    record = fault("data: empty class folder")
    root = tmp_path / "images"
    shutil.copytree(folder, root)
    for image in (root / "train" / "dog").iterdir():
        image.unlink()
    line = one_line_error("dataset=imagefolder", f"dataset.root={root}", run_dir=tmp_path / "r")
    record.trial("dog" in line, note=line)
    assert "dog" in line


def test_dataset_smaller_than_one_batch(folder, tmp_path, fault):
    record = fault("data: fewer samples than one batch")
    line = one_line_error("dataset=imagefolder", f"dataset.root={folder}",
                          "trainer.batch_size=64", run_dir=tmp_path / "r")
    clear = "fewer than one optimizer step" in line and "trainer.batch_size" in line
    record.trial(clear, note=line)
    assert clear
