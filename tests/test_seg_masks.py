"""Mask PNGs (data/segmentation/masks.py): a training crop decodes the rows down to its bottom
with the compiled _png_rows module, and gives exactly the pixels of a whole decode."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from labrun.core.errors import DataError
from labrun.data.segmentation import masks
from labrun.data.segmentation.masks import PngMask, decode_mask, open_mask

needs_rows = pytest.mark.skipif(
    masks._decode_rows is None,
    reason="the _png_rows extension is not built (no C compiler or libpng headers at install)")


def mask_png(mask: np.ndarray, mode: str = "L") -> bytes:
    """PNG bytes as Pillow writes them: grey with adaptive row filters (Sub, Up, Paeth...), or
    a palette PNG (unfiltered rows), as Pascal VOC's masks are."""
    image = Image.fromarray(mask, "L")
    if mode == "P":
        image = image.convert("P")  # same indices, stored as a palette
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def png_chunks(png: bytes) -> list[tuple[bytes, bytes, int]]:
    """(type, data, the offset just past it) of each chunk of a PNG file, in order."""
    chunks, offset = [], len(masks.PNG_SIGNATURE)
    while offset < len(png):
        (length,) = struct.unpack_from(">I", png, offset)
        end = offset + 12 + length  # length, type, data, CRC
        chunks.append((png[offset + 4:offset + 8], png[offset + 8:offset + 8 + length], end))
        offset = end
    return chunks


def regions(rng: np.random.Generator, height: int, width: int, count: int):
    yield 0, 0, height, width
    yield height - 1, width - 1, 1, 1  # the last pixel: every row decoded
    yield 0, 0, 1, width  # the first row alone
    for _ in range(count):
        top, left = int(rng.integers(0, height)), int(rng.integers(0, width))
        yield top, left, int(rng.integers(1, height - top + 1)), int(rng.integers(1, width - left + 1))


def blobs(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Class regions with void (255) between some, so that the encoder picks varied filters."""
    mask = np.zeros((height, width), np.uint8)
    for _ in range(6):
        y, x = rng.integers(0, height), rng.integers(0, width)
        h, w = rng.integers(3, height), rng.integers(3, width)
        mask[y:y + h, x:x + w] = rng.integers(1, 5)
    mask[rng.random((height, width)) < 0.02] = 255
    return mask


@needs_rows
@pytest.mark.parametrize("mode", ["L", "P"])
def test_a_crop_equals_the_same_region_of_the_whole_decode(mode):
    rng = np.random.default_rng(0)
    for height, width in ((37, 53), (96, 128)):
        mask = blobs(rng, height, width)
        data = mask_png(mask, mode)
        opened = open_mask(data, "m.png")
        assert isinstance(opened, PngMask) and opened.shape == (height, width)
        whole = decode_mask(data, "m.png")
        assert np.array_equal(whole, mask)
        for top, left, h, w in regions(rng, height, width, 40):
            crop = opened.crop(top, left, h, w)
            assert np.array_equal(crop, mask[top:top + h, left:left + w]), (top, left, h, w)


@needs_rows
def test_no_row_below_the_crop_is_decoded():
    # Noise does not compress, so Pillow writes the rows in several IDAT chunks; cutting the
    # file after the second leaves only the top rows readable.
    rng = np.random.default_rng(1)
    mask = rng.integers(0, 256, (512, 512), dtype=np.uint8)
    data = mask_png(mask)
    idat_ends = [end for kind, _, end in png_chunks(data) if kind == b"IDAT"]
    assert len(idat_ends) >= 3, "the test needs a mask stored in several IDAT chunks"
    cut = data[:idat_ends[1]]
    opened = open_mask(cut, "cut.png")
    assert isinstance(opened, PngMask)
    assert np.array_equal(opened.crop(10, 20, 40, 30), mask[10:50, 20:50])
    with pytest.raises(DataError, match="cut.png is not a readable PNG"):
        opened.crop(400, 0, 112, 512)  # the crop reaches rows that were cut off
    with pytest.raises(DataError, match="cut.png is not a readable PNG"):
        decode_mask(cut, "cut.png")


@needs_rows
def test_damaged_data_is_refused_naming_the_file():
    # A changed byte in the compressed rows: inflate fails before the chunk's CRC is read.
    # (torchvision's decode_png, which read masks before, crashed the process on this file.)
    data = bytearray(mask_png(blobs(np.random.default_rng(2), 40, 40)))
    start = data.index(b"IDAT") + 4
    data[start + 20] ^= 0xFF
    opened = open_mask(bytes(data), "damaged.png")
    assert isinstance(opened, PngMask)
    with pytest.raises(DataError, match="damaged.png is not a readable PNG"):
        opened.crop(0, 0, 40, 40)
    with pytest.raises(DataError, match="damaged.png is not a readable PNG"):
        decode_mask(bytes(data), "damaged.png")


def test_masks_the_row_decoder_does_not_take_are_decoded_whole():
    mask = blobs(np.random.default_rng(3), 20, 30)
    binary = io.BytesIO()
    Image.fromarray(mask > 0).save(binary, format="PNG")  # 1-bit: classes 0 and 1
    assert np.array_equal(decode_mask(binary.getvalue(), "binary.png"), mask > 0)
    sixteen = io.BytesIO()
    Image.fromarray(mask.astype(np.uint16)).save(sixteen, format="PNG")  # 16-bit grey
    opened = open_mask(sixteen.getvalue(), "deep.png")
    assert isinstance(opened, np.ndarray) and np.array_equal(opened, mask)
    colour = io.BytesIO()
    Image.fromarray(np.stack([mask] * 3, axis=2)).save(colour, format="PNG")
    with pytest.raises(DataError, match="colour.png has 3 channels"):
        open_mask(colour.getvalue(), "colour.png")
    with pytest.raises(DataError, match="short.png is not a readable PNG"):
        open_mask(b"\x89PNG\r\n", "short.png")


def test_without_the_row_decoder_masks_are_decoded_whole(monkeypatch):
    # As on a machine that installed labrun without a C compiler or libpng's headers.
    monkeypatch.setattr(masks, "_decode_rows", None)
    mask = blobs(np.random.default_rng(4), 30, 40)
    for mode in ("L", "P"):
        opened = open_mask(mask_png(mask, mode), "m.png")
        assert isinstance(opened, np.ndarray) and np.array_equal(opened, mask)
    with pytest.raises(DataError, match="short.png is not a readable PNG"):
        open_mask(mask_png(mask)[:60], "short.png")
