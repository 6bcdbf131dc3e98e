"""Decoders and uint8 transforms, on real JPEG/PNG bytes made here."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from labrun.data.image import decode as dec
from labrun.data.image.transforms import TrainTransform, ValTransform, center_crop_box


def smooth_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Photo-like enough for JPEG: smooth colour fields plus mild noise (uint8 HxWx3)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width] / max(height, width)
    base = np.stack([np.sin(xx * rng.uniform(2, 6) + c) * np.cos(yy * rng.uniform(2, 6))
                     for c in range(3)], axis=-1)
    image = 128 + 100 * base + rng.normal(0, 4, (height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def encode(image: np.ndarray | Image.Image, fmt: str = "JPEG", **options) -> bytes:
    pil = Image.fromarray(image) if isinstance(image, np.ndarray) else image
    out = io.BytesIO()
    pil.save(out, format=fmt, **options)
    return out.getvalue()


def pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torchvision.io, deprecated in 0.29
@pytest.mark.parametrize("decoder", ["turbojpeg", "pil", "torchvision"])
def test_every_decoder_gives_rgb_close_to_pil(decoder):
    image = Image.fromarray(smooth_image(61, 83))
    cases = {"rgb": encode(image, quality=90), "gray": encode(image.convert("L")),
             "cmyk": encode(image.convert("CMYK")), "png": encode(image, "PNG")}
    for name, data in cases.items():
        out = dec.decode(data, decoder)
        assert out.shape == (61, 83, 3) and out.dtype == np.uint8, name
        # Different libjpeg-turbo builds may round the IDCT differently by a level or two.
        diff = np.abs(out.astype(int) - pil_rgb(data))
        assert diff.max() <= 3 and diff.mean() < 0.5, (name, diff.max(), diff.mean())
    assert np.array_equal(dec.decode(cases["png"], decoder), np.asarray(image))  # lossless


def test_turbojpeg_dct_scaling_keeps_both_sides_at_least_min_size():
    data = encode(smooth_image(480, 640), quality=90)
    for min_size, shape in [(None, (480, 640)), (60, (60, 80)), (100, (120, 160)),
                            (240, (240, 320)), (241, (480, 640)), (480, (480, 640)),
                            (1000, (480, 640))]:
        out = dec.decode(data, "turbojpeg", min_size)
        assert out.shape == (*shape, 3), (min_size, out.shape)
        assert min(out.shape[:2]) >= min(min_size or 0, 480)
    assert dec.dct_scale(480, 640, 240) == (1, 2) and dec.dct_scale(480, 640, 241) is None
    assert dec.dct_scale(47, 3000, 6) == (1, 8)  # ceil(47 / 8) = 6: the short side decides
    # Scaled decode is a faithful small version of the image, not garbage.
    small = dec.decode(data, "turbojpeg", 240).astype(int)
    full = Image.fromarray(dec.decode(data, "turbojpeg")).resize((320, 240), Image.BILINEAR)
    assert np.abs(small - np.asarray(full)).mean() < 3


def random_regions(height: int, width: int, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        top, left = int(rng.integers(0, height)), int(rng.integers(0, width))
        yield (top, left, int(rng.integers(1, height - top + 1)),
               int(rng.integers(1, width - left + 1)))


@pytest.mark.skipif(dec._decode_region is None, reason="the _jpeg_region extension is not built")
@pytest.mark.parametrize("subsampling", [0, 1, 2])  # 4:4:4, 4:2:2, 4:2:0
def test_region_decode_gives_exactly_the_pixels_of_a_full_decode(subsampling):
    from turbojpeg import TJPF_RGB

    data = encode(smooth_image(203, 317, seed=subsampling), quality=90, subsampling=subsampling)
    for denom in (1, 2, 4):
        full = dec._turbojpeg().decode(data, pixel_format=TJPF_RGB,
                                       scaling_factor=(1, denom) if denom > 1 else None)
        for top, left, height, width in random_regions(*full.shape[:2], 40, seed=denom):
            region = dec.decode_region(data, top, left, height, width, denom)
            assert np.array_equal(region, full[top:top + height, left:left + width]), \
                (denom, top, left, height, width)
    with pytest.raises(ValueError, match="outside the image"):
        dec._decode_region(data, 200, 0, 10, 10, 1)


def test_jpeg_image_crops_like_the_decoded_image_with_or_without_the_extension(monkeypatch):
    image = smooth_image(240, 300)
    data = encode(image, quality=92)
    gray = encode(Image.fromarray(image).convert("L"))
    opened = dec.open_image(data, "turbojpeg")
    assert isinstance(opened, dec.JpegImage) and opened.shape == (240, 300, 3)
    full = dec.decode(data, "turbojpeg")
    # At 160 px no crop of a 240 x 300 image is twice the output: never DCT-scaled, so exact.
    train, val, small = TrainTransform(160), ValTransform(160), TrainTransform(48)
    for extension in (dec._decode_region, None):  # compiled, then the whole-image fallback
        monkeypatch.setattr(dec, "_decode_region", extension)
        assert np.array_equal(opened.crop(10, 20, 100, 90), full[10:110, 20:110])
        # The smallest fast DCT scale that keeps both sides >= min_size: 1/2 for 100, 1/4 for 60.
        assert np.array_equal(opened.crop(0, 0, 240, 300, min_size=100),
                              dec.decode(data, "turbojpeg", min_size=120))
        assert opened.crop(40, 0, 200, 300, min_size=50).shape == (50, 75, 3)
        for seed in range(5):  # the transforms crop a JpegImage as they crop its pixels
            assert torch.equal(train(opened, np.random.default_rng(seed)),
                               train(full, np.random.default_rng(seed)))
        assert torch.equal(val(opened), val(full))
        for seed in range(5):  # at 48 px large crops decode at 1/2 or 1/4: nearly the same
            scaled = small(opened, np.random.default_rng(seed)).int()
            assert (scaled - small(full, np.random.default_rng(seed)).int()).abs().float().mean() < 3
        gray_crop = dec.open_image(gray, "turbojpeg").crop(5, 5, 50, 60)
        assert np.array_equal(gray_crop, dec.decode(gray, "turbojpeg")[5:55, 5:65])
    # Whatever TurboJPEG will not decode lazily comes back decoded: other formats, other
    # decoders, CMYK, a file cut short.
    pil = Image.fromarray(image)
    for data_, decoder in ((encode(image, "PNG"), "turbojpeg"), (data, "pil"),
                           (encode(pil.convert("CMYK")), "turbojpeg")):
        assert isinstance(dec.open_image(data_, decoder), np.ndarray)
    with pytest.raises(OSError, match="truncated"):
        dec.open_image(data[: len(data) // 2], "turbojpeg")


def test_damaged_jpeg_data_found_while_cropping_is_decided_by_pillow():
    data = bytearray(encode(smooth_image(128, 128), quality=90))
    data[len(data) // 2:-2] = b"\x00" * (len(data) // 2 - 2)  # header intact, scan data zeroed
    opened = dec.open_image(bytes(data), "turbojpeg")
    assert isinstance(opened, dec.JpegImage)
    try:
        expected = dec.decode(bytes(data), "turbojpeg")[0:100, 0:100]
    except OSError as error:
        with pytest.raises(type(error)):
            opened.crop(0, 0, 100, 100)
    else:
        assert np.array_equal(opened.crop(0, 0, 100, 100), expected)


def test_damaged_and_non_image_bytes_raise():
    data = encode(smooth_image(64, 64), quality=90)
    with pytest.raises(OSError, match="truncated"):
        dec.decode(data[: len(data) // 2], "turbojpeg")  # TurboJPEG only warns; Pillow decides
    with pytest.raises(ValueError, match="not an image"):
        dec.decode(b"hello, this is text", "turbojpeg")
    with pytest.raises((OSError, ValueError)):  # a JPEG start, then junk and no end marker
        dec.decode(b"\xff\xd8\xff" + b"junk" * 10, "turbojpeg")


def test_unknown_decoder_is_a_config_error(composed, tmp_path):
    from labrun.config.validation import validate
    from labrun.core.errors import ConfigError

    with pytest.raises(ConfigError, match="dataset.decoder=opencv is not one of"):
        dec.resolve("opencv")
    # Refused by validation, before any data loads, for every format that takes the key.
    for dataset in ("imagefolder", "segfolder"):
        task = ["task=segmentation"] if dataset == "segfolder" else []
        with pytest.raises(ConfigError, match="^dataset.decoder=opencv is not one of: "
                                              "turbojpeg, pil, torchvision$"):
            validate(composed(f"dataset={dataset}", f"dataset.root={tmp_path}", *task,
                              "dataset.decoder=opencv"))


def test_missing_libturbojpeg_warns_once_and_falls_back_to_pil():
    script = """
import turbojpeg
def missing(self, lib_path=None):
    raise OSError("libturbojpeg.so.0: cannot open shared object file: No such file or directory")
turbojpeg.TurboJPEG.__init__ = missing
from labrun.data.image import decode
print(decode.resolve("turbojpeg"), decode.resolve("turbojpeg"), decode.resolve("pil"))
"""
    # A Python that imports labrun.data: a few seconds; 60 s only stops a hang.
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.split() == ["pil", "pil", "pil"]
    warning = result.stderr.strip().splitlines()
    assert len(warning) == 1 and "libturbojpeg0" in warning[0], result.stderr


def test_train_transform_is_uint8_chw_deterministic_and_scale_aware():
    transform = TrainTransform(32, scale=(0.2, 1.0))
    image = smooth_image(120, 160)

    def run(seed: int, img: np.ndarray = image) -> torch.Tensor:
        return transform(img, np.random.default_rng([seed, 0, 7]))

    out = run(0)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8 and out.is_contiguous()
    assert torch.equal(out, run(0)) and not torch.equal(out, run(1))
    # A DCT-scaled (half-size) decode gets the same relative crop: nearly the same output.
    half = np.asarray(Image.fromarray(image).resize((80, 60), Image.BILINEAR))
    assert (run(0, half).int() - out.int()).abs().float().mean() < 6
    gray = transform(image[:, :, 0], np.random.default_rng(0))
    assert gray.shape == (3, 32, 32) and torch.equal(gray[0], gray[1])


def test_val_transform_matches_torchvision_resize_and_center_crop():
    import torchvision.transforms.v2.functional as F

    image = smooth_image(150, 200)
    ours = ValTransform(64, 0.875)(image)
    chw = torch.from_numpy(image).permute(2, 0, 1)
    reference = F.center_crop(F.resize(chw, [round(64 / 0.875)], antialias=True), [64, 64])
    assert ours.shape == (3, 64, 64) and ours.dtype == torch.uint8
    assert (ours.int() - reference.int()).abs().float().mean() < 2
    assert center_crop_box(150, 200, 64, 0.875) == (9, 34, 131, 131)
    assert ValTransform(224, 0.875).min_size == 256
