"""Decoded images to the pixels mpp stores and trains on: upright, 8 bits, RGB, transparency over a grey background.

Every path that turns a file into pixels goes through here (`prepare`'s re-encoding, the training and evaluation
stream, `predict`), so an image means the same everywhere. It loads no torch: prepare's worker processes import it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps

ORIENTATION_TAG = 0x0112  # EXIF
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")  # how PIL opens 16-bit greyscale PNGs and TIFFs
# What a transparent pixel shows: a neutral mid grey, as far from black as from white. PIL's convert("RGB") keeps
# whatever colour a transparent pixel happens to store (black, mostly), so a logo on a transparent background
# would be learnt on black here and on white elsewhere.
BACKGROUND = (128, 128, 128)


def upright(img: Image.Image) -> Image.Image:
    """EXIF orientation applied (a phone photo stored sideways stands up), 16-bit and floating-point greys made 8 bits.

    PIL converts I;16 and I images to L or RGB by clipping at 255, so a 50% grey 16-bit PNG would become white; it
    converts a floating-point image (mode F, a scientific TIFF) the same way, so one of values 0..1 became black.
    Floating-point values within 0..1 are scaled to 0..255; others are taken as 0..255 levels and clipped, as PIL does.
    """
    if img.getexif().get(ORIENTATION_TAG, 1) != 1:
        img = ImageOps.exif_transpose(img)
    if img.mode in SIXTEEN_BIT_MODES:
        pixels = np.clip(np.asarray(img).astype(np.int64), 0, 65535)  # mode I holds 16-bit PNGs in an int32
        img = Image.fromarray(((pixels * 255 + 32767) // 65535).astype(np.uint8), "L")
    elif img.mode == "F":
        values = np.nan_to_num(np.asarray(img, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if values.size and values.min() >= 0 and values.max() <= 1:
            values = values * 255
        img = Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """`img` as RGB; one with transparency (an alpha channel, a palette or a colour marked transparent) composited
    over BACKGROUND, each pixel in proportion to its opacity."""
    if img.has_transparency_data:
        background = Image.new("RGBA", img.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, img.convert("RGBA")).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")
