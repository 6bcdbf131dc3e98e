"""dataset.decode=cpu|cuda (data/image/batched.py): the workers read bytes and draw crops, the main
process decodes whole batches with torchvision's decode_jpeg. Tested with decode=cpu, which runs
the same code as cuda on the CPU; decode=cuda itself needs a GPU and is only refused here.

Tolerance, against the workers path on the same images and seed: the same samples in the same
order, each image's mean absolute pixel difference at most TOLERANCE levels of 255 (measured
here: at most 1.1 at 32 px; up to 3 where the workers path decodes at a reduced DCT scale)."""

from __future__ import annotations

import logging

import pytest
import torch
from PIL import Image
from rich.console import Console
from test_data_convert import write_image_folder
from test_data_decode import encode, smooth_image
from test_data_sources import build as build_source

from conftest import read_summary, run_train
from labrun import data
from labrun.config.validation import validate
from labrun.core.errors import ConfigError, DataError, one_line
from labrun.data.image import ImageData, batched, convert
from labrun.data.image.decode import jpeg_size

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision.io, 0.29

TOLERANCE = 3.0
SIZE = 32


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A JPEG folder with a grayscale JPEG, a CMYK JPEG and a PNG in train (the last two go
    the workers' way inside the batched path), and its HDF5 conversion."""
    root = write_image_folder(tmp_path_factory.mktemp("batched") / "src", train=8, val=3,
                              extras=False)
    picture = Image.fromarray(smooth_image(70, 90, seed=11))
    picture.convert("L").save(root / "train" / "cat" / "gray.jpg", quality=90)
    picture.convert("CMYK").save(root / "train" / "dog" / "cmyk.jpg", quality=90)
    picture.save(root / "train" / "bird" / "drawing.png")
    out = root.parent / "images.h5"
    convert.convert(str(root), str(out), console=Console(quiet=True))
    return root, out


def build(name: str, location: str, **overrides) -> ImageData:
    return build_source(name, location, **{"image_size": SIZE, "num_workers": 0, **overrides})


def batches(dataset: ImageData, split: str, seed: int, epoch: int = 1):
    loader = dataset.loader(split, micro_batch_size=8, seed=seed)
    loader.sampler.set_epoch(epoch)
    images, labels = zip(*loader, strict=True)
    return torch.cat(images), torch.cat(labels)


def per_image_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.int() - b.int()).abs().float().mean(dim=(1, 2, 3))


@pytest.mark.parametrize("name", ["imagefolder", "hdf5"])
def test_batched_decode_crops_and_flips_as_the_workers_path(images, name):
    root, out = images
    location = str(out if name == "hdf5" else root)
    workers = build(name, location)
    # Two workers: the encoded batches cross processes as they do in a run.
    batched_cpu = build(name, location, decode="cpu", num_workers=2)
    for split in ("train", "val"):
        expected, expected_labels = batches(workers, split, seed=3)
        got, labels = batches(batched_cpu, split, seed=3)
        assert got.dtype == torch.uint8 and got.device.type == "cpu"
        assert got.shape == expected.shape == (len(expected), 3, SIZE, SIZE)
        assert torch.equal(labels, expected_labels)  # same samples, same order
        difference = per_image_difference(got, expected)
        assert difference.max() <= TOLERANCE, (split, difference)
        if split == "train":
            # Each flip matches: the mirror of the workers' image is much further away
            # (for every image that does not look like its own mirror).
            mirrored = per_image_difference(got, expected.flip(3))
            asymmetric = per_image_difference(expected, expected.flip(3)) > 2 * TOLERANCE
            assert asymmetric.sum() >= len(expected) // 2
            assert torch.all(difference[asymmetric] < mirrored[asymmetric])
            # Another seed crops elsewhere: far outside the tolerance.
            other, _ = batches(workers, split, seed=4)
            assert per_image_difference(got, other).mean() > 5 * TOLERANCE


def damaged_quantization_table(data_: bytes) -> bytes:
    """A JPEG whose header reads fine but whose first component names an undefined
    quantization table: only decoding it fails (here, in the main process)."""
    damaged = bytearray(data_)
    sof = damaged.index(b"\xff\xc0")
    damaged[sof + 12] = 3  # after marker 2, length 2, precision 1, size 4, count 1, id 1,
    return bytes(damaged)  # sampling 1


@pytest.mark.parametrize("case", ["not a JPEG", "fails to decode"])
def test_an_undecodable_file_is_one_line_naming_it(tmp_path, case):
    root = tmp_path / "folder"
    for split in ("train", "val"):
        (root / split / "a").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(smooth_image(40, 50, seed=i)).save(root / split / "a" / f"{i}.jpg")
    bad = root / "train" / "a" / "1.jpg"
    bad.write_bytes(b"hello, this is text" if case == "not a JPEG"
                    else damaged_quantization_table(bad.read_bytes()))
    # The damaged JPEG's header reads: the workers hand it over, this process fails to decode it.
    assert (jpeg_size(bad.read_bytes()) is None) == (case == "not a JPEG")
    dataset = build("imagefolder", str(root), decode="cpu")
    with pytest.raises(DataError) as raised:
        batches(dataset, "train", seed=0)
    message = one_line(raised.value)
    assert message == str(raised.value)
    assert f"({bad}) could not be loaded" in message, message
    reason = "not an image" if case == "not a JPEG" else "Quantization table 0x03 was not defined"
    assert message.endswith(reason) or f"{reason} file" in message, message


def test_decode_cuda_without_a_gpu_and_mismatches_are_config_errors(images, composed):
    root, _ = images
    cfg = composed("dataset=imagefolder", f"dataset.root={root}", "dataset.decode=cuda")
    validate(cfg)  # accelerator auto: the GPU is looked for when the data is built
    with pytest.raises(ConfigError, match=r"^dataset.decode=cuda needs a CUDA GPU, .*"
                                          r"use dataset.decode=cpu or workers$"):
        data.build(cfg.dataset)
    with pytest.raises(ConfigError, match="trainer.accelerator=cpu; use dataset.decode=cpu"):
        validate(composed("dataset=imagefolder", f"dataset.root={root}",
                          "dataset.decode=cuda", "trainer.accelerator=cpu"))
    with pytest.raises(ConfigError, match="dataset.decode=gpu is not one of: workers, cpu, cuda"):
        validate(composed("dataset=imagefolder", f"dataset.root={root}", "dataset.decode=gpu"))


def test_decode_cpu_on_a_dataset_without_jpegs_is_a_config_error(images, composed, tmp_path):
    with pytest.raises(ConfigError, match="^dataset.decode=cpu decodes JPEG files in batches, "
                                          "but digits/train holds no JPEG files; use "
                                          "dataset.decode=workers$"):
        data.build(composed("dataset=digits", "dataset.decode=cpu").dataset)
    root, _ = images
    raw = tmp_path / "raw.h5"
    convert.convert(str(root), str(raw), convert.Options(storage="raw", size=SIZE),
                    console=Console(quiet=True))
    with pytest.raises(ConfigError, match=f"but {raw}:/train holds no JPEG files"):
        build("hdf5", str(raw), decode="cpu")
    assert len(build("hdf5", str(raw)).splits["train"]) == 27  # the workers path reads it


def test_missing_nvjpeg_falls_back_to_the_cpu_with_one_warning(monkeypatch, caplog):
    """Only a missing nvJPEG falls back; CUDA itself cannot run here, so it is stood in for."""
    import torchvision.io

    def decode_jpeg(*args, **kwargs):
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    for cached in (batched._nvjpeg_error, batched._warn_nvjpeg_missing):
        cached.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="labrun.data.image.batched"):
            assert batched.decode_device("cuda") == torch.device("cpu")
            assert batched.decode_device("cuda") == torch.device("cpu")
        assert len(caplog.records) == 1
        assert "nvJPEG is unavailable (decode_jpegs_cuda: torchvision not compiled with nvJPEG " \
               "support); decoding batches on the CPU" in caplog.records[0].getMessage()

        def broken(*args, **kwargs):
            raise RuntimeError("CUDA error: out of memory")

        batched._nvjpeg_error.cache_clear()
        monkeypatch.setattr(torchvision.io, "decode_jpeg", broken)
        with pytest.raises(RuntimeError, match="out of memory"):  # not a missing nvJPEG
            batched.decode_device("cuda")
    finally:
        for cached in (batched._nvjpeg_error, batched._warn_nvjpeg_missing):
            cached.cache_clear()


def test_train_py_decode_cuda_without_a_gpu_exits_2_in_one_line(images, tmp_path):
    root, _ = images
    result = run_train("dataset=imagefolder", f"dataset.root={root}", "dataset.decode=cuda",
                       run_dir=tmp_path / "run", check=False)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: dataset.decode=cuda needs a CUDA GPU"), result.stderr


def test_one_epoch_trains_with_decode_cpu(images, tmp_path):
    root, _ = images
    run_dir = tmp_path / "run"
    run_train("dataset=imagefolder", f"dataset.root={root}", "dataset.decode=cpu",
              f"dataset.image_size={SIZE}", "trainer.max_epochs=1", "trainer.batch_size=9",
              "model=simple_cnn", run_dir=run_dir)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["step"] == 3, summary  # 27 images / 9
    assert 0 <= summary["val/acc"] <= 1


def test_jpeg_size_reads_the_header_and_refuses_what_decode_jpeg_should_not_get():
    image = Image.fromarray(smooth_image(30, 45))
    assert jpeg_size(encode(image, quality=90)) == (30, 45)
    assert jpeg_size(encode(image.convert("L"))) == (30, 45)
    data_ = encode(image, quality=90)
    for refused in (encode(image.convert("CMYK")), encode(image, "PNG"), data_[:len(data_) // 2],
                    b"\xff\xd8\xff" + b"junk" + b"\xff\xd9"):
        assert jpeg_size(refused) is None
