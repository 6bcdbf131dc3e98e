"""dataset=seg_hdf5 and `labrun convert seg` (data/segmentation/hdf5.py) on a small
segmentation folder, and `labrun bench seg-data` shrunk to a smoke run (speed is never asserted
here)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from rich.console import Console
from test_seg_masks import png_chunks

from conftest import PROJECT, PYTHON, run_labrun, run_train
from labrun import cli
from labrun.bench.seg_data import PAIRS_VERSION, SEG_DATA_TARGETS
from labrun.core.errors import DataError
from labrun.data.image.decode import JpegImage, decode
from labrun.data.segmentation import hdf5, segfolder
from labrun.data.segmentation.masks import decode_mask, mask_pixels, read_mask
from labrun.data.segmentation.shapes import CLASS_NAMES, draw


def write_segfolder(root: Path, splits: dict[str, int] | None = None) -> Path:
    """root/{train,val}/images/NN.jpg|png and masks/NN.png, with classes.txt: even stems JPEG,
    odd ones PNG; one mask a palette PNG (as Pascal VOC's are), the others grey."""
    for split, count in (splits or {"train": 8, "val": 2}).items():
        for folder in ("images", "masks"):
            (root / split / folder).mkdir(parents=True, exist_ok=True)
        for k in range(count):
            image, mask = draw(np.random.default_rng(k + 100 * (split != "train")), 48)
            suffix = "png" if k % 2 else "jpg"
            Image.fromarray(image).save(root / split / "images" / f"{k:02d}.{suffix}")
            saved = Image.fromarray(mask, "L")
            if (split, k) == ("train", 3):
                saved = saved.convert("P")  # same indices, stored as a palette
            saved.save(root / split / "masks" / f"{k:02d}.png")
    (root / "classes.txt").write_text("\n".join(CLASS_NAMES) + "\n")
    return root


def convert_quietly(root: Path, out: Path, **options) -> None:
    hdf5.convert(str(root), str(out), console=Console(quiet=True), **options)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    root = write_segfolder(tmp_path_factory.mktemp("seg") / "src")
    out = root.parent / "seg.h5"
    run_labrun("convert", "seg", str(root), str(out))  # the real command, its worker processes
    return root, out


def labrun_in_process(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_file_gives_exactly_the_folder_pairs(converted):
    root, out = converted
    for decoder in ("turbojpeg", "pil"):
        folder, stored = segfolder.load(str(root), decoder), hdf5.load(str(out), decoder)
        assert list(stored) == list(folder) == ["train", "val"]
        for split, source in stored.items():
            assert source.dense and source.class_names == CLASS_NAMES
            assert len(source) == len(folder[split]) == (8 if split == "train" else 2)
            for i in range(len(source)):
                (image, mask), (want_image, want_mask) = source.open(i), folder[split].open(i)
                mask, want_mask = mask_pixels(mask), mask_pixels(want_mask)
                assert mask.dtype == np.uint8 and np.array_equal(mask, want_mask)
                assert type(image) is type(want_image)
                if isinstance(image, JpegImage):  # the crop decodes its region, as from files
                    assert bytes(image.data) == bytes(want_image.data)
                    assert np.array_equal(image.crop(5, 7, 30, 20), want_image.crop(5, 7, 30, 20))
                    assert np.array_equal(decode(image.data), decode(want_image.data))
                else:
                    assert np.array_equal(image, want_image)
    train = hdf5.load(str(out), "turbojpeg")["train"]
    assert isinstance(train.open(0)[0], JpegImage) and isinstance(train.open(1)[0], np.ndarray)
    assert train.describe(3) == f"{out}: train sample 3 (train/images/03.png)"
    # A source that has read holds an open file; its pickle (spawned workers) holds none.
    copy = pickle.loads(pickle.dumps(train))
    assert copy._file is None
    assert np.array_equal(mask_pixels(copy.open(2)[1]), mask_pixels(train.open(2)[1]))


@pytest.mark.parametrize("decode", ["workers", "cpu"])
def test_a_run_gets_the_same_batches_from_the_file_as_from_the_folder(converted, composed,
                                                                       decode):
    """The same crops, flips, pixels and masks: with the workers decoding (a JPEG's crop region
    only), and with this process decoding the batch's JPEGs (dataset.decode=cpu, which reads
    the image bytes and the masks apart)."""
    from labrun import data

    root, out = converted
    batches = []
    for dataset in (["dataset=segfolder", f"dataset.root={root}"],
                    ["dataset=seg_hdf5", f"dataset.path={out}"]):
        cfg = composed("experiment=seg_shapes", *dataset, "dataset.image_size=24",
                       f"dataset.decode={decode}", "dataset.num_workers=0")
        built = data.build(cfg.dataset)
        batches.append([next(iter(built.loader(split, micro_batch_size=8, seed=3)))
                        for split in ("train", "val")])
    for (images, masks), (stored_images, stored_masks) in zip(*batches, strict=True):
        assert images.shape[1:] == (3, 24, 24) and masks.shape[1:] == (24, 24)
        assert torch.equal(images, stored_images) and torch.equal(masks, stored_masks)


def test_masks_copied_into_the_file_in_blocks_keep_their_values(tmp_path, monkeypatch):
    root = write_segfolder(tmp_path / "src")
    monkeypatch.setattr(hdf5, "COPY_BLOCK", 100)  # each split's masks in several blocks
    convert_quietly(root, tmp_path / "seg.h5")
    folder = segfolder.load(str(root), "pil")
    for split, source in hdf5.load(str(tmp_path / "seg.h5"), "pil").items():
        assert source.mask_offsets[-1] > 2 * hdf5.COPY_BLOCK
        for i in range(len(source)):
            assert np.array_equal(mask_pixels(source.mask(i)), mask_pixels(folder[split].mask(i)))


def test_the_layout_is_flat_arrays_and_offsets(converted):
    root, out = converted
    with h5py.File(out, "r") as file:
        assert file.attrs["kind"] == "segmentation" and int(file.attrs["labrun_format"]) == 1
        assert [c.decode() if isinstance(c, bytes) else c for c in file.attrs["classes"]] == \
            CLASS_NAMES
        group = file["train"]
        offsets = group["image_offsets"][:]
        first = group["images"][offsets[0]:offsets[1]].tobytes()
        assert first == (root / "train" / "images" / "00.jpg").read_bytes()  # kept as the file
        masks = group["mask_offsets"][:]
        for i in range(len(masks) - 1):
            stored = group["masks"][masks[i]:masks[i + 1]].tobytes()
            # Re-encoded (masks.encode_mask): a palette PNG, its rows unfiltered, same values.
            assert stored[:8] == b"\x89PNG\r\n\x1a\n" and stored[25] == 3  # IHDR colour type
            assert set(row_filters(stored)) == {0}
            assert np.array_equal(decode_mask(stored, "stored"),
                                  read_mask(root / "train" / "masks" / f"{i:02d}.png"))


def row_filters(png: bytes) -> list[int]:
    """The filter type of each row of an 8-bit, one-byte-a-pixel PNG."""
    chunks = png_chunks(png)
    (width,) = struct.unpack_from(">I", next(body for kind, body, _ in chunks if kind == b"IHDR"))
    rows = zlib.decompress(b"".join(body for kind, body, _ in chunks if kind == b"IDAT"))
    return list(rows[::width + 1])


def test_convert_seg_refuses_a_stem_without_a_mask_and_writes_nothing(tmp_path, capsys):
    root = write_segfolder(tmp_path / "src", {"train": 3})
    (root / "train" / "masks" / "01.png").unlink()
    out = tmp_path / "out.h5"
    code, stdout, err = labrun_in_process(capsys, "convert", "seg", str(root), str(out))
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith(f"error: {root / 'train' / 'images' / '01.png'} has no mask")
    assert "add it or remove the image" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no OUT.h5, no temporary


def test_convert_seg_refuses_bad_pairs_in_one_line(tmp_path, capsys):
    root = write_segfolder(tmp_path / "src", {"train": 3})
    out = tmp_path / "out.h5"
    Image.new("L", (40, 48)).save(root / "train" / "masks" / "02.png")
    (root / "classes.txt").unlink()
    for args, expected in [
            ((), f"error: {root} has no classes.txt; pass --num-classes N"),
            (("--num-classes", "4"), f"error: {root / 'train' / 'masks' / '02.png'} is 40x48 "
                                     f"(width x height) but its image 02.jpg is 48x48"),
            (("--num-classes", "0"), "error: --num-classes=0 must be a positive number")]:
        code, stdout, err = labrun_in_process(capsys, "convert", "seg", str(root), str(out),
                                              "--workers", "0", *args)
        assert code == 2 and stdout == "" and err.startswith(expected), err
        assert err.count("\n") == 1 and not out.exists()
    Image.new("L", (48, 48)).save(root / "train" / "masks" / "02.png")
    assert labrun_in_process(capsys, "convert", "seg", str(root), str(out), "--workers", "0",
                             "--num-classes", "4")[0] == 0
    assert hdf5.load(str(out), "pil")["train"].class_names == ["0", "1", "2", "3"]
    code, _, err = labrun_in_process(capsys, "convert", "seg", str(root), str(out))
    assert code == 2 and err == f"error: {out} already exists; pass --force to overwrite it\n"


def test_an_interrupted_convert_leaves_no_file(tmp_path, monkeypatch):
    root = write_segfolder(tmp_path / "src", {"train": 6})
    out = tmp_path / "out.h5"
    written = []

    def interrupted(dataset, offsets, index, path):
        if len(written) == 5:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the images
        written.append(path)
        return put(dataset, offsets, index, path)

    put = hdf5._put
    monkeypatch.setattr(hdf5, "_put", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_quietly(root, out)
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_convert_killed_mid_write_leaves_nothing_a_run_could_read(tmp_path):
    """SIGKILL runs no clean-up: the temporary file stays, under its own name, and OUT.h5 was
    never there."""
    root = write_segfolder(tmp_path / "src", {"train": 6})
    out = tmp_path / "out.h5"
    script = (f"import os, signal\n"
              f"from labrun.data.segmentation import hdf5\n"
              f"put, done = hdf5._put, []\n"
              f"def killed(*args):\n"
              f"    if len(done) == 5: os.kill(os.getpid(), signal.SIGKILL)\n"
              f"    done.append(put(*args))\n"
              f"hdf5._put = killed\n"
              f"hdf5.convert({str(root)!r}, {str(out)!r})\n")
    result = subprocess.run([PYTHON, "-c", script], cwd=PROJECT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not out.exists()
    left = [p.name for p in tmp_path.iterdir() if p.name != "src"]
    assert len(left) == 1 and left[0].startswith(".out.h5.tmp"), left
    with pytest.raises(DataError, match="no such file; create it with `labrun convert seg"):
        hdf5.load(str(out), "turbojpeg")
    convert_quietly(root, out)  # a new convert is not in the way of the one killed
    assert len(hdf5.load(str(out), "turbojpeg")["train"]) == 6


def test_a_classification_file_is_refused_naming_the_right_dataset(tmp_path):
    path = tmp_path / "images.h5"
    with h5py.File(path, "w") as file:
        file.attrs["labrun_format"] = 1
        file.attrs["storage"] = "jpeg"
    with pytest.raises(DataError, match="is an image classification file .* read it with "
                                        "dataset=hdf5"):
        hdf5.load(str(path), "turbojpeg")


@pytest.mark.parametrize("dataset", ["seg_hdf5", "segfolder"])
def test_a_short_training_run_reads_the_file(converted, tmp_path, dataset):
    root, out = converted
    where = f"dataset.path={out}" if dataset == "seg_hdf5" else f"dataset.root={root}"
    run_train("task=segmentation", "model=unet", "model.width=8", f"dataset={dataset}", where,
              "dataset.image_size=32", "trainer.max_steps=2", "trainer.batch_size=4",
              "trainer.max_epochs=null", run_dir=tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 2, summary


def test_bench_seg_data_runs_end_to_end_and_reports_the_ratio(tmp_path):
    out = tmp_path / "bench.json"
    result = run_labrun("bench", "seg-data", "--images", "6", "--width", "96", "--height", "64",
                        "--size", "32", "--batch-size", "4", "--workers", "1", "--passes", "1",
                        "--seconds", "0.05", "--rounds", "1", "--work-dir", str(tmp_path),
                        "--json", str(out), "--check", check=False)
    figures = json.loads(out.read_text())
    assert set(figures) == {"torchvision", "segfolder", "seg_hdf5", "speedup", "hdf5_speedup"}
    assert all(value > 0 for value in figures.values())
    assert abs(figures["speedup"] - figures["segfolder"] / figures["torchvision"]) < 0.01
    assert "speedup      (2/1)" in result.stdout and "(reported; no target)" in result.stdout
    (row,) = [line for line in result.stdout.splitlines() if " seg-data speedup " in line]
    (target,) = SEG_DATA_TARGETS
    assert f">= {target.floor:g}" in row and f">= {target.goal:g}" in row  # floor and goal
    # --check: exit 1 exactly when the target is missed by the figures it wrote.
    missed = [t.figure for t in SEG_DATA_TARGETS if not t.met(figures[t.figure])]
    assert result.returncode == (1 if missed else 0), result.stdout + result.stderr
    pairs = tmp_path / f"seg-pairs-v{PAIRS_VERSION}-n6-96x64-seed0"
    assert (tmp_path / f"{pairs.name}.h5").is_file()
    assert os.path.isfile(pairs / "classes.txt")
