"""How a segmentation mask is drawn for a person (labrun.tasks.segmentation's answers and
`labrun predict --out`): Pascal VOC's colours, a palette PNG of class indices, an overlay."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

OVERLAY_ALPHA = 0.5  # how much of a pixel's colour in the overlay is its class's


def palette(count: int) -> list[list[int]]:
    """`count` RGB colours, Pascal VOC's colour map: 0 black, 1 dark red, 2 green, 3 olive...,
    all 256 distinct (255, VOC's void, cream), so masks look as VOC's do in any viewer."""
    colours = []
    for index in range(count):
        rgb, bits = [0, 0, 0], index
        for shift in range(7, -1, -1):  # the index's bits, three at a time, from the top bit
            for channel in range(3):
                rgb[channel] |= ((bits >> channel) & 1) << shift
            bits >>= 3
        colours.append(rgb)
    return colours


def mask_png(mask: np.ndarray, colours: np.ndarray) -> bytes:
    """A palette PNG of a uint8 mask: a reader gets the class indices back (Pillow's "P"
    image, numpy.asarray), a viewer shows each class in its colour."""
    image = Image.fromarray(np.ascontiguousarray(mask, dtype=np.uint8))  # "L"
    image.putpalette(colours.reshape(-1).tolist())  # "L" becomes "P", the values untouched
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def overlay_png(pixels: np.ndarray, mask: np.ndarray, colours: np.ndarray) -> bytes:
    """An RGB PNG: each pixel blended with its class's colour (OVERLAY_ALPHA of it)."""
    blended = pixels * (1 - OVERLAY_ALPHA) + colours[mask] * OVERLAY_ALPHA
    buffer = io.BytesIO()
    Image.fromarray(blended.round().astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
