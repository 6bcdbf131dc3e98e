"""The hdf5 and imagefolder datasets: start-up checks, lazy per-process file handles, loaders
with workers, errors that name the sample, and one epoch of real training from each."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil

import h5py
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console
from test_data_convert import write_image_folder

from conftest import read_summary, run_train
from labrun import data
from labrun.config.dataset_schema import HDF5Config, ImageFolderConfig
from labrun.core.errors import DataError
from labrun.data.image import ImageData, ImageDataset, convert, hdf5


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A folder without bad files and its HDF5 twin: the same images in the same order."""
    root = write_image_folder(tmp_path_factory.mktemp("clean") / "src", train=16, val=4,
                              extras=False)
    out = root.parent / "clean.h5"
    convert.convert(str(root), str(out), console=Console(quiet=True))
    return root, out


def build(name: str, location: str, **overrides) -> ImageData:
    schema, key = (HDF5Config, "path") if name == "hdf5" else (ImageFolderConfig, "root")
    cfg = OmegaConf.merge(OmegaConf.structured(schema), {
        "_target_": f"labrun.data.image.{name}.load", "name": name, key: location, "image_size": 32, "num_workers": 2, **overrides})
    return data.build(cfg)


def open_hdf5_files() -> int:
    return h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE)


def test_hdf5_and_folder_loaders_with_workers_give_identical_batches(clean):
    root, out = clean
    before = open_hdf5_files()
    from_file, from_folder = build("hdf5", str(out)), build("imagefolder", str(root))
    assert open_hdf5_files() == before  # checked at start-up, then closed: nothing to fork
    assert from_file.class_names == from_folder.class_names == ["bird", "cat", "dog"]
    for split in ("train", "val"):
        loaders = [d.loader(split, micro_batch_size=8, seed=3) for d in (from_file, from_folder)]
        for loader in loaders:
            loader.sampler.set_epoch(1)
        batches = [list(loader) for loader in loaders]
        assert len(batches[0]) == len(batches[1]) == (6 if split == "train" else 2)
        for (xa, ya), (xb, yb) in zip(*batches, strict=True):
            assert xa.dtype == torch.uint8 and xa.shape[1:] == (3, 32, 32)
            assert torch.equal(ya, yb) and torch.equal(xa, xb)  # same bytes, same randomness


def test_hdf5_source_opens_the_file_lazily_once_per_process(clean):
    _, out = clean
    source = hdf5.load(str(out), "turbojpeg")["train"]
    assert source._file is None
    first = source.load(0)
    assert source._pid == os.getpid() and source._file is not None

    clone = pickle.loads(pickle.dumps(source))  # what a spawned worker receives
    assert clone._file is None and clone._data is None and np.array_equal(clone.load(5),
                                                                          source.load(5))

    inherited = source._file

    def child() -> None:  # a forked worker must not use the parent's handle
        assert source._pid != os.getpid()
        assert np.array_equal(source.load(0), first)
        os._exit(0 if source._pid == os.getpid() and source._file is not inherited else 1)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0


@pytest.mark.parametrize("case", ["missing", "truncated", "not_hdf5", "not_labrun",
                                  "future_format", "incomplete"])
def test_bad_hdf5_files_fail_at_start_up_in_one_line(clean, tmp_path, case):
    _, out = clean
    path = tmp_path / "bad.h5"
    if case == "truncated":
        path.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    elif case == "not_hdf5":
        path.write_text("id,label\n1,cat\n")
    elif case == "not_labrun":
        with h5py.File(path, "w") as file:
            file["images"] = np.zeros((2, 8, 8, 3), np.uint8)
    elif case != "missing":
        shutil.copy(out, path)
        with h5py.File(path, "r+") as file:
            if case == "future_format":
                file.attrs["labrun_format"] = 2
            elif case == "incomplete":
                del file["val/offsets"]
    expected = {"missing": "no such file; create it with `labrun convert SRC_DIR",
                "truncated": f"is truncated: {out.stat().st_size // 2} of its "
                             f"{out.stat().st_size} bytes are there; copy it again",
                "not_hdf5": "is not a readable HDF5 file (file signature not found)",
                "not_labrun": "not a labrun dataset (no labrun_format attribute)",
                "future_format": "has labrun_format=2 but this labrun reads format 1",
                "incomplete": "/val/offsets is missing"}[case]
    with pytest.raises(DataError) as error:
        build("hdf5", str(path))
    message = str(error.value)
    assert str(path) in message and expected in message and "\n" not in message, message
    if case not in ("missing", "future_format", "truncated"):
        assert "was it written by `labrun convert`?" in message


def test_a_sample_that_fails_to_decode_names_split_index_and_file(clean, tmp_path):
    root, out = clean
    damaged = tmp_path / "damaged.h5"
    shutil.copy(out, damaged)
    with h5py.File(damaged, "r+") as file:
        start, end = file["val/offsets"][2:4]
        file["val/data"][start:end] = np.frombuffer(b"\xff\xd8\xff" + b"\x00" * (end - start - 3),
                                                    np.uint8)
    dataset = ImageDataset(build("hdf5", str(damaged)).splits["val"], lambda x, rng: x, 0,
                                "val")
    with pytest.raises(DataError, match=r"damaged.h5: val sample 2 could not be decoded .*"
                                        r"labrun convert --verify"):
        dataset[(0, 2)]

    folder = tmp_path / "folder"
    shutil.copytree(root, folder)
    (folder / "train" / "cat" / "01.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    source = build("imagefolder", str(folder)).splits["train"]
    index = next(i for i in range(len(source)) if source.describe(i).endswith("cat/01.jpg"))
    dataset = ImageDataset(source, lambda x, rng: x, 0, "train")
    with pytest.raises(DataError, match=rf"train sample {index} \(.*cat/01.jpg\) could not be"):
        dataset[(0, index)]


def test_folder_with_class_subfolders_only_is_train_with_a_held_out_val(clean, tmp_path):
    root, _ = clean
    shutil.copytree(root / "train", tmp_path / "flat")
    built = build("imagefolder", str(tmp_path / "flat"), val_fraction=0.25)
    assert set(built.splits) == {"train", "val"}
    assert len(built.splits["train"]) == 36 and len(built.splits["val"]) == 12


def test_one_epoch_trains_from_the_hdf5_file_and_from_the_folder(clean, tmp_path):
    root, out = clean
    common = ["dataset.image_size=32", "dataset.num_workers=2", "trainer.max_epochs=1",
              "trainer.batch_size=16", "model=simple_cnn", "logger=csv"]
    for name, dataset in (("hdf5", [f"dataset.path={out}"]),
                          ("imagefolder", [f"dataset.root={root}"])):
        run_dir = tmp_path / name
        run_train(f"dataset={name}", *dataset, *common, run_dir=run_dir)
        summary = read_summary(run_dir)
        assert summary["status"] == "completed" and summary["epoch"] == 1, summary
        assert summary["step"] == 3  # 48 train images / 16


def test_train_py_reports_a_truncated_hdf5_file_in_one_line(clean, tmp_path):
    _, out = clean
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(out.read_bytes()[:4096])
    result = run_train("dataset=hdf5", f"dataset.path={truncated}", "trainer.max_epochs=1",
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {truncated} is truncated: 4096 of its"), result.stderr
