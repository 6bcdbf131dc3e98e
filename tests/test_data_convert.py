"""`labrun convert` and `labrun convert --verify`, run as the real command on real files."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from PIL import Image
from test_data_decode import smooth_image

from conftest import run_labrun
from labrun import cli
from labrun.data.image import hdf5, imagefolder
from labrun.data.image.decode import is_jpeg

CLASSES = ("bird", "cat", "dog")


def write_image_folder(root: Path, train: int = 6, val: int = 2, extras: bool = True,
                       size: tuple[int, int] | None = None) -> Path:
    """root/{train,val}/<class>/NN.jpg with varied sizes; with `extras`, also a grayscale JPEG,
    a PNG, a corrupt .jpg and files that are not images at all."""
    for split, count in (("train", train), ("val", val)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                height, width = size or (40 + 7 * i, 48 + 9 * c)
                Image.fromarray(smooth_image(height, width, seed=100 * c + i)).save(
                    folder / f"{i:02d}.jpg", quality=90)
    if extras:
        Image.fromarray(smooth_image(50, 60, seed=7)).convert("L").save(
            root / "train" / "cat" / "gray.jpg")
        Image.fromarray(smooth_image(45, 70, seed=8)).save(root / "train" / "dog" / "drawing.png")
        (root / "train" / "bird" / "broken.jpg").write_bytes(b"this is not a JPEG at all")
        (root / "train" / "cat" / "notes.txt").write_text("not an image, not even by name")
        (root / "train" / "README").write_text("a file beside the class folders")
    return root


def labrun_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """The same CLI code path without a new interpreter (each costs ~2 s of imports)."""
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def pil_rgb(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = write_image_folder(tmp_path_factory.mktemp("images") / "src")
    out = tmp_path_factory.mktemp("h5") / "data.h5"
    result = run_labrun("convert", str(root), str(out), "--workers", "2")
    return root, out, result


def test_convert_writes_the_layout_and_reads_back_exactly(converted):
    root, out, result = converted
    text = result.stdout + result.stderr
    assert f"skipped {root / 'train' / 'bird' / 'broken.jpg'}" in text
    assert "1 unreadable file(s) skipped" in text and "classes: 3 (bird, cat, dog)" in text

    with h5py.File(out, "r") as file:
        assert file.attrs["labrun_format"] == 1 and file.attrs["storage"] == "jpeg"
        assert list(file.attrs["classes"]) == list(CLASSES)
        assert file.attrs["source"] == str(root.resolve())
        assert set(file) == {"train", "val"}
        for split in file:
            group = file[split]
            assert group["data"].dtype == np.uint8 and group["data"].chunks is None  # contiguous
            assert group["offsets"].dtype == np.int64 and group["labels"].dtype == np.int64
            assert len(group["offsets"]) == len(group["labels"]) + 1

    splits, class_names = imagefolder.scan(root)
    sources = hdf5.load(str(out), "turbojpeg")
    assert class_names == list(CLASSES) and set(sources) == {"train", "val"}
    for split, source in sources.items():
        files = [splits[split].folder / f.decode() for f in splits[split].files]
        labels = splits[split].labels
        keep = [i for i, f in enumerate(files) if f.name != "broken.jpg"]
        assert len(source) == len(keep) == (20 if split == "train" else 6)
        assert source.class_names == list(CLASSES)
        assert np.array_equal(source.labels, labels[keep])
        for i, k in enumerate(keep):
            stored, original = source.read(i).tobytes(), files[k].read_bytes()
            image, expected = source.load(i), pil_rgb(files[k])
            assert image.shape == expected.shape and image.dtype == np.uint8
            diff = np.abs(image.astype(int) - expected)
            if files[k].suffix == ".jpg":
                assert stored == original  # JPEG bytes are kept as they are
                assert diff.max() <= 3, files[k]  # decoder rounding only
            else:
                assert is_jpeg(stored)  # the PNG was re-encoded at --quality 90
                assert diff.mean() < 5, files[k]  # lossy, 4:2:0: noise is lost


def test_verify_accepts_a_good_file_and_names_a_damaged_sample(converted, tmp_path):
    _, out, _ = converted
    result = run_labrun("convert", "--verify", str(out), "--workers", "2")
    assert "OK:" in result.stdout and "26 samples in 2 split(s), 3 classes" in result.stdout

    damaged = tmp_path / "damaged.h5"
    shutil.copy(out, damaged)
    with h5py.File(damaged, "r+") as file:
        start = file["train/offsets"][3]
        file["train/data"][start:start + 16] = 0  # sample 3 no longer starts like any image
    result = run_labrun("convert", "--verify", str(damaged), check=False)
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and "1 of 26 samples do not decode" in error[0]
    assert "train sample 3" in error[0] and str(damaged) in error[0]


def test_refuses_to_overwrite_without_force(converted, tmp_path, capsys):
    root, out, _ = converted
    target = tmp_path / "copy.h5"
    shutil.copy(out, target)
    before = target.stat().st_mtime_ns
    result = run_labrun("convert", str(root), str(target), check=False)
    assert result.returncode == 2 and target.stat().st_mtime_ns == before
    assert result.stderr.strip() == f"error: {target} already exists; pass --force to overwrite it"
    assert labrun_in_process(capsys, "convert", str(root), str(target), "--force",
                             "--workers", "0")[0] == 0
    assert target.stat().st_mtime_ns != before
    assert len(hdf5.load(str(target), "turbojpeg")["train"]) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["copy.h5"]  # no temporary file left


def test_strict_makes_a_corrupt_file_an_error_and_writes_nothing(converted, tmp_path):
    root, _, _ = converted
    result = run_labrun("convert", str(root), str(tmp_path / "out.h5"), "--strict", check=False)
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and str(root / "train" / "bird" / "broken.jpg") in error[0]
    assert "drop --strict" in error[0]
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary file


def test_raw_storage_keeps_exact_pixels_of_one_size(tmp_path, capsys):
    root = tmp_path / "cifar_like"
    pixels = {}
    for c, name in enumerate(CLASSES[:2]):
        (root / name).mkdir(parents=True)  # class folders only: split "train"
        for i in range(3):
            pixels[(name, i)] = smooth_image(32, 32, seed=10 * c + i)
            Image.fromarray(pixels[(name, i)]).save(root / name / f"{i}.png")
    out = tmp_path / "raw.h5"
    run_labrun("convert", str(root), str(out), "--storage", "raw", "--workers", "0")
    with h5py.File(out, "r") as file:
        assert file.attrs["storage"] == "raw" and list(file.attrs["shape"]) == [32, 32, 3]
        assert set(file) == {"train"}
    source = hdf5.load(str(out), "turbojpeg")["train"]
    expected = [pixels[key] for key in sorted(pixels)]
    assert [source.load(i).tolist() for i in range(6)] == [e.tolist() for e in expected]
    assert source.labels.tolist() == [0, 0, 0, 1, 1, 1]

    Image.fromarray(smooth_image(40, 30)).save(root / CLASSES[1] / "9.png")
    code, _, err = labrun_in_process(capsys, "convert", str(root), str(tmp_path / "mixed.h5"),
                                     "--storage", "raw", "--workers", "0")
    assert code == 2 and "9.png is 40x30" in err and "pass --size N" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "mixed.h5").exists()

    sized = tmp_path / "sized.h5"
    assert labrun_in_process(capsys, "convert", str(root), str(sized), "--storage", "raw",
                             "--size", "16", "--workers", "0")[0] == 0
    assert len(hdf5.load(str(sized), "turbojpeg")["train"]) == 7
    assert hdf5.load(str(sized), "turbojpeg")["train"].load(6).shape == (16, 16, 3)
    code, out, _ = labrun_in_process(capsys, "convert", "--verify", str(sized))
    assert code == 0 and "OK:" in out


def test_max_side_reencodes_only_larger_images(tmp_path, capsys):
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    Image.fromarray(smooth_image(90, 120)).save(root / "a" / "big.jpg", quality=95)
    Image.fromarray(smooth_image(30, 40)).save(root / "a" / "small.jpg", quality=95)
    out = tmp_path / "small.h5"
    code, stdout, _ = labrun_in_process(capsys, "convert", str(root), str(out), "--max-side",
                                        "64", "--quality", "80", "--workers", "0")
    assert code == 0 and "re-encoded" in stdout
    source = hdf5.load(str(out), "turbojpeg")["train"]
    assert source.load(0).shape == (48, 64, 3)  # big.jpg, longer side now 64
    assert source.read(1).tobytes() == (root / "a" / "small.jpg").read_bytes()
    shrunk = np.asarray(Image.open(root / "a" / "big.jpg").convert("RGB").resize((64, 48)))
    assert np.abs(source.load(0).astype(int) - shrunk).mean() < 4


@pytest.mark.parametrize("case", ["missing", "no_classes", "empty_class", "unknown_val_class"])
def test_bad_folders_end_in_one_line(tmp_path, case):
    root = tmp_path / "src"
    if case != "missing":
        write_image_folder(root, train=1, val=1, extras=False)
    expected = {"missing": f"{root}: no such folder",
                "no_classes": f"{root / 'train'} has no class folders",
                "empty_class": f"{root / 'train' / 'cat'} is an empty class folder",
                "unknown_val_class": f"{root / 'val' / 'fish'} is a class that train/ does not"
                }[case]
    if case == "no_classes":
        for folder in (root / "train").iterdir():
            shutil.rmtree(folder)
        (root / "train" / "stray.jpg").write_bytes(b"")
    elif case == "empty_class":
        for image in (root / "train" / "cat").iterdir():
            image.unlink()
        (root / "train" / "cat" / "notes.txt").write_text("no images here")
    elif case == "unknown_val_class":
        (root / "val" / "fish").mkdir()
        shutil.copy(root / "val" / "cat" / "00.jpg", root / "val" / "fish" / "00.jpg")
    if case == "missing":  # once through the real command; the rest in-process (faster)
        result = run_labrun("convert", str(root), str(tmp_path / "x.h5"), check=False)
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.startswith(f"error: {expected}") and result.stderr.count("\n") == 1
        assert not (tmp_path / "x.h5").exists()
    from labrun.core.errors import DataError

    with pytest.raises(DataError) as error:
        imagefolder.load(str(root), "turbojpeg")
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)


def test_command_line_mistakes_are_one_line(tmp_path, capsys):
    for args, expected in [((), "give SRC_DIR and OUT.h5"),
                           ((str(tmp_path), "o.h5", "--storage", "raw", "--max-side", "10"),
                            "--max-side is for --storage jpeg"),
                           ((str(tmp_path), "o.h5", "--quality", "0"), "--quality=0 must be"),
                           (("--verify", "a.h5", "b.h5"), "--verify takes only the file")]:
        code, out, err = labrun_in_process(capsys, "convert", *args)
        assert code == 2 and out == "" and err.startswith("error: ") and expected in err, err
        assert err.count("\n") == 1


def test_pil_and_turbojpeg_agree_on_the_converted_file(converted):
    """The same stored bytes through both decoders (what dataset.decoder switches)."""
    _, out, _ = converted
    turbo = hdf5.load(str(out), "turbojpeg")["val"]
    pil = hdf5.load(str(out), "pil")["val"]
    for i in range(len(turbo)):
        a, b = turbo.load(i), pil.load(i)
        assert a.shape == b.shape and np.abs(a.astype(int) - b).max() <= 3
        assert np.array_equal(b, np.asarray(Image.open(io.BytesIO(pil.read(i).tobytes()))
                                            .convert("RGB")))
