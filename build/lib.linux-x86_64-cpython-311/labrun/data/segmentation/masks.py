"""Mask PNGs -> uint8 HxW class indices: the one reader of masks, whichever format holds them.

    mask = open_mask(data, name)   # for a transform: a PngMask, decoded by crop()
    mask = decode_mask(data, name) # the whole mask, now
    data = encode_mask(mask)       # the PNG that decodes fastest (labrun convert seg stores it)

A mask is a grey or palette PNG; a palette PNG gives its indices, not its colours, and a 1-bit
PNG gives 0 and 1. Anything else (colours, values beyond a byte, a damaged file) is refused in
one line naming the file.

Training crops: a PngMask is known by its header until the transform has chosen its crop; then
crop() decodes the rows down to the crop's bottom with libpng (the compiled _png_rows module),
as a JpegImage decodes only its region. Rows above the crop are decoded too (each PNG row is
filtered against the one above), rows below it are not. The masks it does not take (16-bit,
interlaced, colour, damaged) and every mask without it (no C compiler or libpng headers when
labrun was installed) are decoded whole by Pillow, which also words the refusals.

Not torchvision's decode_png: it decodes every row, and a damaged IDAT chunk crashed the
process (a segmentation fault, here) where a file should be named and refused.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from labrun.core.errors import DataError, one_line

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GREY, PALETTE = 0, 3  # PNG colour types a mask may have

try:
    from labrun.data.segmentation._png_rows import decode_rows as _decode_rows
except ImportError:  # not compiled at install time: masks are decoded whole, by Pillow
    _decode_rows = None


def read_mask(path: Path) -> np.ndarray:
    """uint8 HxW class indices of a mask PNG; DataError naming the file for one that is not."""
    return decode_mask(path.read_bytes(), str(path))


def decode_mask(data: bytes | np.ndarray, name: str) -> np.ndarray:
    """uint8 HxW class indices of a mask PNG's bytes; DataError naming `name` for one that is
    not a readable grey or palette PNG of values up to 255."""
    return mask_pixels(open_mask(data, name))


@dataclass(frozen=True, eq=False)  # eq=False: the bytes may be a numpy array
class PngMask:
    """An 8-bit grey or palette PNG, known by its header until a transform crops it."""

    data: bytes | np.ndarray
    name: str  # the file, for errors
    height: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.height, self.width

    def crop(self, top: int, left: int, height: int, width: int) -> np.ndarray:
        """uint8 mask[top:top + height, left:left + width], decoding no row below it."""
        decoded = _decode_rows(self.data, top + height)
        if decoded is None:  # damaged: Pillow names the problem (or reads what libpng cannot)
            return decode_whole(self.data, self.name)[top:top + height, left:left + width]
        pixels, row_width = decoded
        rows = np.frombuffer(pixels, dtype=np.uint8).reshape(top + height, row_width)
        return rows[top:, left:left + width]

    def pixels(self) -> np.ndarray:
        return self.crop(0, 0, self.height, self.width)


def open_mask(data: bytes | np.ndarray, name: str) -> np.ndarray | PngMask:
    """What a transform takes: a PngMask for an 8-bit grey or palette PNG that is not
    interlaced (what _png_rows decodes), else the decoded mask."""
    if _decode_rows is not None:
        header = bytes(data[:29])  # the signature and the IHDR chunk, which comes first
        if len(header) == 29 and header[:8] == PNG_SIGNATURE and header[12:16] == b"IHDR":
            width, height, depth, colour, _, _, interlaced = struct.unpack_from(
                ">IIBBBBB", header, 16)
            if depth == 8 and colour in (GREY, PALETTE) and not interlaced:
                return PngMask(data, name, height, width)
    return decode_whole(data, name)


def decode_whole(data: bytes | np.ndarray, name: str) -> np.ndarray:
    """Any mask PNG, decoded whole by Pillow; DataError naming `name` for one that is no mask."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "PNG":
                raise DataError(f"{name} is a {image.format} file; masks are PNG files of "
                                f"class indices")
            values = np.array(image)  # P: the palette's indices; 1: bool; I;16: uint16
    except (OSError, SyntaxError, ValueError) as error:  # Pillow's errors for a damaged file
        raise DataError(f"{name} is not a readable PNG ({one_line(error)}); masks are PNG "
                        f"files of class indices") from None
    if values.ndim == 3:
        raise DataError(f"{name} has {values.shape[2]} channels; a mask holds one class index "
                        f"per pixel (a grey or palette PNG)")
    if values.max(initial=0) > 255:
        raise DataError(f"{name} holds value {int(values.max())}; masks hold class indices up "
                        f"to 255")
    return values.astype(np.uint8, copy=False)


def encode_mask(mask: np.ndarray) -> bytes:
    """uint8 HxW class indices -> a palette PNG whose indices are the values (its palette grey).
    Pillow writes a palette image's rows unfiltered, as PNG advises for palettes, and unfiltered
    rows decode about 3x faster than a grey mask's Sub, Up and Paeth rows (0.44 against 1.35 ms
    for the bench's 1024x768 masks, here), at about the same size."""
    out = io.BytesIO()
    Image.fromarray(mask).convert("P").save(out, format="PNG")
    return out.getvalue()


def mask_pixels(mask: np.ndarray | PngMask) -> np.ndarray:
    """The whole mask, decoded."""
    return mask.pixels() if isinstance(mask, PngMask) else mask
