"""Bad data through the real `python train.py`: each ends in one line naming the file or the
sample and the fix, exit code 2, nothing trained on garbage (no checkpoint written). Data lost:
whether the run changed any of its input files (hashed before and after)."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from test_data_convert import write_image_folder

from conftest import run_labrun, run_train
from faults.conftest import hash_inputs, inputs_changed

COMMON = ["trainer.max_epochs=1", "dataset.image_size=32", "trainer.batch_size=8",
          "dataset.num_workers=2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data") / "images", train=6, val=2,
                              extras=False)


def one_line_error(*overrides: str, run_dir, inputs: list) -> tuple[str, list[str], list[str]]:
    """Run on bad data; returns the error line, the input files the run changed and the
    checkpoints it wrote (both must stay empty)."""
    hashes = hash_inputs(inputs)
    result = run_train(*COMMON, *overrides, run_dir=run_dir, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr
    trained = sorted(p.name for p in run_dir.glob("checkpoints/*.pt"))
    return lines[-1], inputs_changed(hashes, inputs), trained


def outcome(line: str, changed: list[str], trained: list[str]) -> str:
    return (f"{line} | checkpoints written: {trained or 'none'}; input files changed: "
            f"{changed or 'none'}")


def test_corrupt_jpeg_in_a_folder_names_the_file(folder, tmp_path, fault):
    record = fault("data: corrupt JPEG in a folder")
    root = tmp_path / "images"
    shutil.copytree(folder, root)
    victim = root / "train" / "cat" / "03.jpg"
    victim.write_bytes(victim.read_bytes()[:200])  # cut short
    line, changed, trained = one_line_error("dataset=imagefolder", f"dataset.root={root}",
                                            run_dir=tmp_path / "r", inputs=[root])
    named = str(victim) in line and "train" in line
    record.trial(named and not trained, lost=bool(changed), note=outcome(line, changed, trained))
    assert named and not trained and not changed


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
        line, changed, trained = one_line_error("dataset=hdf5", f"dataset.path={path}",
                                                run_dir=tmp_path / path.stem, inputs=[path])
        named = str(path) in line
        record.trial(named and not trained, lost=bool(changed),
                     note=outcome(line, changed, trained))
        assert named and not trained and not changed


def test_empty_class_folder_is_named(folder, tmp_path, fault):
    record = fault("data: empty class folder")
    root = tmp_path / "images"
    shutil.copytree(folder, root)
    for image in (root / "train" / "dog").iterdir():
        image.unlink()
    line, changed, trained = one_line_error("dataset=imagefolder", f"dataset.root={root}",
                                            run_dir=tmp_path / "r", inputs=[root])
    record.trial("dog" in line and not trained, lost=bool(changed),
                 note=outcome(line, changed, trained))
    assert "dog" in line and not trained and not changed


def test_dataset_smaller_than_one_batch(folder, tmp_path, fault):
    record = fault("data: fewer samples than one batch")
    line, changed, trained = one_line_error("dataset=imagefolder", f"dataset.root={folder}",
                                            "trainer.batch_size=64", run_dir=tmp_path / "r",
                                            inputs=[folder])
    clear = "fewer than one optimizer step" in line and "trainer.batch_size" in line
    record.trial(clear and not trained, lost=bool(changed), note=outcome(line, changed, trained))
    assert clear and not trained and not changed
