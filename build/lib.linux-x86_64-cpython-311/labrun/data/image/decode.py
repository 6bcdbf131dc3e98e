"""Encoded image bytes -> uint8 HxWx3 RGB arrays, with TurboJPEG, Pillow or torchvision.

    decoder = resolve("turbojpeg")         # at start-up: checks the choice, falls back to pil
    image = decode(data, decoder, min_size)
    image = open_image(data, decoder)      # for a transform: a JpegImage, decoded by crop()

JPEG bytes go to the chosen decoder; anything else (PNG, BMP, WebP...) goes to Pillow, so every
decoder reads every format. Grayscale, palette and CMYK images all come out as RGB.

TurboJPEG can decode straight to a reduced size (the scaled IDCT), which is faster: with
`min_size`, it picks the smallest scale that keeps both sides >= min_size. Only 1/2, 1/4 and 1/8
are offered because libjpeg-turbo has SIMD code for those alone; 3/4, 5/8 or 7/8 decode slower
than full size (measured: 1/2 takes 0.8x the time of a full decode, 3/4 takes 1.3x).

Training crops: a JpegImage is known by its header until the transform has chosen its crop;
then crop() decodes only that rectangle (the compiled _jpeg_region module: rows below it are
never read, rows above and columns beside it are not transformed), at the smallest fast DCT
scale that keeps it at least as large as the transform's output. The pixels equal those of a
full decode. Without the compiled module (no C compiler or libjpeg headers when labrun was
installed), crop() decodes the whole image at that scale and slices it.

Decoders are named by a string rather than held as objects, so sources pickle into DataLoader
workers freely; the TurboJPEG library handle is created lazily in each process.
"""

from __future__ import annotations

import functools
import io
import logging
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from labrun.config.dataset_schema import DECODERS
from labrun.core.errors import ConfigError, one_line

FAST_SCALES = ((1, 8), (1, 4), (1, 2))  # smallest first
JPEG_MAGIC = b"\xff\xd8\xff"
# File suffixes taken as images, by image folders (data.imagefolder) and `labrun predict` alike:
# every format Pillow decodes that cameras, datasets and web pages use.
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".gif", ".webp",
                            ".tif", ".tiff", ".ppm", ".pgm", ".pbm"})
TURBOJPEG_PACKAGE = "libturbojpeg0"  # Debian/Ubuntu; macOS: brew install jpeg-turbo

log = logging.getLogger(__name__)

try:
    from labrun.data.image._jpeg_region import decode_region as _decode_region
except ImportError:  # not compiled at install time: JpegImage.crop decodes in full instead
    _decode_region = None


def resolve(name: str) -> str:
    """The decoder to use for `name`: itself, or pil (with one warning) if TurboJPEG is missing."""
    if name not in DECODERS:
        raise ConfigError(f"dataset.decoder={name} is not one of: {', '.join(DECODERS)}")
    if name == "turbojpeg" and turbojpeg_error() is not None:
        _warn_turbojpeg_missing()
        return "pil"
    return name


def decode(data: bytes | np.ndarray, decoder: str = "turbojpeg", min_size: int | None = None
           ) -> np.ndarray:
    """Encoded bytes -> uint8 HxWx3 RGB. May be smaller than the original (see module doc)."""
    if not is_jpeg(data) or decoder == "pil":
        return decode_pil(data)
    if decoder == "turbojpeg":
        return decode_turbojpeg(data, min_size)
    if decoder == "torchvision":
        return decode_torchvision(data)
    raise ConfigError(f"dataset.decoder={decoder} is not one of: {', '.join(DECODERS)}")


def is_jpeg(data: bytes | np.ndarray) -> bool:
    return bytes(data[:3]) == JPEG_MAGIC


def jpeg_size(data: bytes | np.ndarray) -> tuple[int, int] | None:
    """(height, width) of a whole RGB or grayscale JPEG, from its header; None for anything
    else (other formats, CMYK, a file cut short or whose header does not parse), which the
    batched decode (data/image/batched.py) leaves to the workers' decoders, as they name the file."""
    if not is_jpeg(data) or bytes(data[-2:]) != b"\xff\xd9":
        return None
    try:
        with Image.open(io.BytesIO(data)) as image:  # reads the header, decodes nothing
            if image.format == "JPEG" and image.mode in ("RGB", "L"):
                return image.height, image.width
    except (OSError, ValueError, SyntaxError):  # Pillow's errors for a damaged header
        pass
    return None


def decode_pil(data: bytes | np.ndarray) -> np.ndarray:
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError("not an image file (no known image format)") from None
    with image:
        return np.array(image.convert("RGB"))  # a writable copy, as torch.from_numpy wants


def decode_turbojpeg(data: bytes | np.ndarray, min_size: int | None = None) -> np.ndarray:
    from turbojpeg import TJCS_CMYK, TJCS_YCCK, TJPF_RGB

    if bytes(data[-2:]) != b"\xff\xd9":
        # No end-of-image marker: cut short. Pillow raises on it; TurboJPEG would only warn,
        # and catching that warning below is not thread-safe (serve decodes in threads).
        return decode_pil(data)
    turbo = _turbojpeg()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            width, height, _, colorspace = turbo.decode_header(data)
            if colorspace not in (TJCS_CMYK, TJCS_YCCK):  # libjpeg-turbo 2.x: no CMYK -> RGB
                return turbo.decode(data, pixel_format=TJPF_RGB,
                                    scaling_factor=dct_scale(height, width, min_size))
    except UserWarning:
        # libjpeg-turbo reports damage it can decode past ("Premature end of JPEG file") as a
        # warning and returns grey pixels; Pillow then decides, exactly as the baseline would:
        # harmless warnings (extraneous bytes) decode, truncated files raise.
        pass
    except OSError as error:
        try:  # a JPEG variant TurboJPEG rejects may still be one Pillow reads
            return decode_pil(data)
        except Exception:
            raise error from None  # TurboJPEG's reason is the more precise one
    return decode_pil(data)


@dataclass(frozen=True, eq=False)  # eq=False: the bytes may be a numpy array
class JpegImage:
    """A JPEG that TurboJPEG decodes, known by its header until a transform crops it."""

    data: bytes | np.ndarray
    height: int
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.height, self.width, 3

    def crop(self, top: int, left: int, height: int, width: int, min_size: int | None = None
             ) -> np.ndarray:
        """uint8 pixels of image[top:top + height, left:left + width]; smaller by a DCT scale
        when both of its sides stay >= min_size."""
        num, den = dct_scale(height, width, min_size) or (1, 1)
        # The rectangle in the scaled image, whose sizes libjpeg-turbo rounds up.
        y0, y1 = top * num // den, -(-(top + height) * num // den)
        x0, x1 = left * num // den, -(-(left + width) * num // den)
        try:
            region = decode_region(self.data, y0, x0, y1 - y0, x1 - x0, den)
        except (ValueError, OSError):
            region = None
        if region is None:  # damaged data: decoded, or refused, exactly as decode() would
            return decode(self.data, "turbojpeg")[top:top + height, left:left + width]
        return region


def open_image(data: bytes | np.ndarray, decoder: str = "turbojpeg") -> np.ndarray | JpegImage:
    """What a transform takes: a JpegImage if TurboJPEG is to decode `data`, else the pixels."""
    if decoder == "turbojpeg" and is_jpeg(data) and bytes(data[-2:]) == b"\xff\xd9":
        from turbojpeg import TJCS_CMYK, TJCS_YCCK

        try:
            width, height, _, colorspace = _turbojpeg().decode_header(data)
        except OSError:
            pass  # decode() below names the problem, or Pillow reads what TurboJPEG cannot
        else:
            if colorspace not in (TJCS_CMYK, TJCS_YCCK):
                return JpegImage(data, height, width)
    return decode(data, decoder)


def decode_region(data: bytes | np.ndarray, top: int, left: int, height: int, width: int,
                  scale_denom: int = 1) -> np.ndarray | None:
    """uint8 height x width x 3 RGB: a rectangle of the JPEG decoded at 1/scale_denom, in that
    scale's pixels; None when libjpeg-turbo warns that the data is damaged."""
    decoded = (_decode_region or _decode_region_in_full)(data, top, left, height, width,
                                                         scale_denom)
    if decoded is None:
        return None
    pixels, row_start, row_width = decoded
    rows = np.frombuffer(pixels, dtype=np.uint8).reshape(height, row_width, 3)
    return rows[:, left - row_start:left - row_start + width]


def _decode_region_in_full(data: bytes | np.ndarray, top: int, left: int, height: int,
                           width: int, scale_denom: int) -> tuple[np.ndarray, int, int] | None:
    """The compiled decode_region's contract, by decoding every row and column."""
    from turbojpeg import TJPF_RGB

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            image = _turbojpeg().decode(data, pixel_format=TJPF_RGB, scaling_factor=(
                (1, scale_denom) if scale_denom > 1 else None))
        except UserWarning:
            return None
    return image[top:top + height], 0, image.shape[1]


def decode_torchvision(data: bytes | np.ndarray) -> np.ndarray:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    # A writable copy: torch refuses to wrap read-only buffers without a warning.
    encoded = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    return decode_jpeg(encoded, mode=ImageReadMode.RGB).permute(1, 2, 0).contiguous().numpy()


def dct_scale(height: int, width: int, min_size: int | None) -> tuple[int, int] | None:
    """The smallest fast TurboJPEG scale keeping both sides >= min_size; None for full size."""
    if not min_size:
        return None
    short = min(height, width)
    for num, den in FAST_SCALES:
        if -(-short * num // den) >= min_size:  # libjpeg-turbo rounds scaled sizes up
            return num, den
    return None


def encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    """uint8 HxWx3 RGB -> JPEG bytes (4:2:0, like most cameras and Pillow's default)."""
    if turbojpeg_error() is None:
        from turbojpeg import TJPF_RGB, TJSAMP_420

        return _turbojpeg().encode(np.ascontiguousarray(image), quality=quality,
                                   pixel_format=TJPF_RGB, jpeg_subsample=TJSAMP_420)
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="JPEG", quality=quality)
    return out.getvalue()


@functools.cache
def turbojpeg_error() -> str | None:
    """Why TurboJPEG cannot be used here, or None when it can."""
    try:
        _turbojpeg()
    except ImportError:
        return "the PyTurboJPEG package is not installed (pip install 'PyTurboJPEG<2')"
    except (OSError, RuntimeError) as error:  # the shared library is missing or unloadable
        return f"libturbojpeg could not be loaded ({one_line(error)})"
    return None


@functools.cache
def _turbojpeg():
    from turbojpeg import TurboJPEG

    return TurboJPEG()


@functools.cache  # once per process
def _warn_turbojpeg_missing() -> None:
    log.warning("TurboJPEG is unavailable: %s; decoding with Pillow instead, which is slower. "
                "Install it with: sudo apt-get install %s", turbojpeg_error(), TURBOJPEG_PACKAGE)
