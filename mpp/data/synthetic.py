"""The embedded default corpus: procedural colour images whose class is the kind of shape drawn.

Every image is a pure function of its index, so the corpus needs no download and any worker can
regenerate any sample. Foreground hues lean towards a hue of their class and backgrounds are
textured in other colours, so a hidden patch's mean colour can be inferred from the shape and the
colours around it.
"""

from __future__ import annotations

import colorsys
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageChops, ImageDraw

CLASS_NAMES = (
    "disc",
    "square",
    "triangle",
    "ring",
    "horizontal_stripes",
    "vertical_stripes",
    "checkerboard",
    "cross",
    "gradient_blob",
    "star",
)
NUM_CLASSES = len(CLASS_NAMES)
SPEC = "synthetic"  # what data.shards (or another *shards key) says to read this corpus


def is_synthetic(spec: str | None) -> bool:
    """Whether a shards setting names the embedded corpus (generated on first use, pipelines.run.loaders.resolve_shards)."""
    return spec == SPEC

RGB = tuple[int, int, int]
_GRAIN = 10  # +- grey levels of per-pixel noise
_RAMP_DIRECTIONS = 16


def synthetic_image(index: int, size: int = 64) -> tuple[Image.Image, int]:
    """RGB image number `index` (size x size) and its class label, identical on every call."""
    rng = np.random.default_rng(index)
    label = index % NUM_CLASSES  # round-robin keeps every prefix of the corpus class-balanced
    tables = _tables(size)
    fg, bg, bg2 = _palette(rng, label)
    background = Image.composite(_solid(bg2, size), _solid(bg, size), _crop(tables.texture, rng, size))
    shade = tables.ramps[rng.integers(_RAMP_DIRECTIONS)]
    foreground = Image.composite(_solid(fg, size), _solid(_dimmed(fg), size), shade)
    image = Image.composite(foreground, background, _MASKS[label](rng, size))
    return ImageChops.add(image, _crop(tables.grain, rng, size), offset=-_GRAIN), label


@dataclass(frozen=True)
class _Tables:
    texture: Image.Image  # smooth grey noise, 3x the image side, cropped at random for backgrounds
    grain: Image.Image  # per-pixel noise in [0, 2 * _GRAIN], 2x the image side
    ramps: tuple[Image.Image, ...]  # linear light ramps, one per direction


@functools.lru_cache(maxsize=4)
def _tables(size: int) -> _Tables:
    """Random-looking textures drawn once per size from a fixed seed: cropping them at a random
    offset is far cheaper than generating fresh noise for each image, and just as deterministic."""
    rng = np.random.default_rng(0x5EED)
    coarse = Image.fromarray(rng.integers(0, 256, (12, 12), dtype=np.uint8))
    texture = coarse.resize((3 * size, 3 * size), Image.Resampling.BICUBIC)
    grain = Image.fromarray(rng.integers(0, 2 * _GRAIN + 1, (2 * size, 2 * size), dtype=np.uint8)).convert("RGB")
    pos = np.linspace(-1, 1, size)
    angles = np.arange(_RAMP_DIRECTIONS) * 2 * np.pi / _RAMP_DIRECTIONS
    ramps = tuple(_grey(0.5 + 0.35 * (np.cos(a) * pos[None, :] + np.sin(a) * pos[:, None])) for a in angles)
    return _Tables(texture, grain, ramps)


def _grey(values: np.ndarray) -> Image.Image:
    """An "L" image from values in [0, 1]."""
    return Image.fromarray((values * 255).astype(np.uint8))


def _crop(table: Image.Image, rng: np.random.Generator, size: int) -> Image.Image:
    x, y = rng.integers(0, table.width - size + 1, 2)
    return table.crop((x, y, x + size, y + size))


def _solid(colour: RGB, size: int) -> Image.Image:
    return Image.new("RGB", (size, size), colour)


def _dimmed(colour: RGB) -> RGB:
    return tuple(round(c * 0.7) for c in colour)


def _hsv(h: float, s: float, v: float) -> RGB:
    return tuple(round(c * 255) for c in colorsys.hsv_to_rgb(h % 1.0, s, v))


def _palette(rng: np.random.Generator, label: int) -> tuple[RGB, RGB, RGB]:
    """Foreground hue usually near the class's own hue, background hues on the far side of the wheel.

    Some foregrounds get any hue, so colour hints at the class but the shape is needed to be sure.
    """
    hue = label / NUM_CLASSES + rng.normal(0, 0.04) if rng.random() < 0.7 else rng.random()
    fg = _hsv(hue, rng.uniform(0.5, 1.0), rng.uniform(0.6, 1.0))
    bg_hue = hue + 0.5 + rng.uniform(-0.3, 0.3)
    bg = _hsv(bg_hue, rng.uniform(0.1, 0.8), rng.uniform(0.15, 0.75))
    bg2 = _hsv(bg_hue + rng.uniform(-0.15, 0.15), rng.uniform(0.1, 0.8), rng.uniform(0.15, 0.75))
    return fg, bg, bg2


def _placement(rng: np.random.Generator, size: int) -> tuple[float, float, float]:
    """Centre (x, y) and radius in pixels, keeping most of the shape inside the frame."""
    cx, cy = rng.uniform(0.3, 0.7, 2) * size
    return cx, cy, rng.uniform(0.18, 0.38) * size


def _draw(size: int, paint: Callable[[ImageDraw.ImageDraw], None]) -> Image.Image:
    canvas = Image.new("L", (size, size), 0)
    paint(ImageDraw.Draw(canvas))
    return canvas


def _polygon(rng: np.random.Generator, size: int, radii: list[float], turn: float) -> Image.Image:
    cx, cy, r = _placement(rng, size)
    angles = turn + np.arange(len(radii)) * 2 * np.pi / len(radii)
    lengths = r * np.array(radii)
    points = list(zip((cx + lengths * np.cos(angles)).tolist(), (cy + lengths * np.sin(angles)).tolist()))
    return _draw(size, lambda d: d.polygon(points, fill=255))


def _disc(rng: np.random.Generator, size: int) -> Image.Image:
    cx, cy, r = _placement(rng, size)
    return _draw(size, lambda d: d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255))


def _ring(rng: np.random.Generator, size: int) -> Image.Image:
    cx, cy, r = _placement(rng, size)
    width = max(2, round(r * rng.uniform(0.25, 0.45)))
    return _draw(size, lambda d: d.ellipse((cx - r, cy - r, cx + r, cy + r), outline=255, width=width))


def _square(rng: np.random.Generator, size: int) -> Image.Image:
    # Vertices start on the diagonals; a small tilt keeps it a square rather than a diamond.
    return _polygon(rng, size, [1.0] * 4, turn=np.pi / 4 + rng.uniform(-np.pi / 12, np.pi / 12))


def _triangle(rng: np.random.Generator, size: int) -> Image.Image:
    return _polygon(rng, size, [1.0] * 3, turn=rng.uniform(0, 2 * np.pi))


def _star(rng: np.random.Generator, size: int) -> Image.Image:
    return _polygon(rng, size, [1.0, 0.42] * 5, turn=rng.uniform(0, 2 * np.pi))


def _cross(rng: np.random.Generator, size: int) -> Image.Image:
    cx, cy, r = _placement(rng, size)
    arm = r * rng.uniform(0.25, 0.4)

    def paint(d: ImageDraw.ImageDraw) -> None:
        d.rectangle((cx - r, cy - arm, cx + r, cy + arm), fill=255)
        d.rectangle((cx - arm, cy - r, cx + arm, cy + r), fill=255)

    return _draw(size, paint)


def _periodic(rng: np.random.Generator, size: int) -> tuple[np.ndarray, ...]:
    """Stripe parity of each row and column, and which rows and columns a box around a random
    placement covers: 1-D pieces whose outer products make stripes and checkerboards cheaply."""
    cx, cy, r = _placement(rng, size)
    period = rng.uniform(0.07, 0.16) * size
    pos = np.arange(size)
    row_on, col_on = ((pos[None, :] + rng.uniform(0, period, (2, 1))) // period % 2).astype(bool)
    return row_on, col_on, np.abs(pos - cy) <= 1.3 * r, np.abs(pos - cx) <= 1.3 * r


def _binary(rows: np.ndarray, cols: np.ndarray) -> Image.Image:
    return Image.fromarray((rows[:, None] & cols[None, :]).astype(np.uint8) * 255)


def _horizontal_stripes(rng: np.random.Generator, size: int) -> Image.Image:
    row_on, _, in_rows, in_cols = _periodic(rng, size)
    return _binary(row_on & in_rows, in_cols)


def _vertical_stripes(rng: np.random.Generator, size: int) -> Image.Image:
    _, col_on, in_rows, in_cols = _periodic(rng, size)
    return _binary(in_rows, col_on & in_cols)


def _checkerboard(rng: np.random.Generator, size: int) -> Image.Image:
    row_on, col_on, in_rows, in_cols = _periodic(rng, size)
    cells = (row_on[:, None] ^ col_on[None, :]) & in_rows[:, None] & in_cols[None, :]
    return Image.fromarray(cells.astype(np.uint8) * 255)


def _gradient_blob(rng: np.random.Generator, size: int) -> Image.Image:
    """A soft Gaussian spot: the one class whose edge is a gradient rather than a step."""
    cx, cy, r = _placement(rng, size)
    pos = np.arange(size)
    sigma = 0.6 * r
    return _grey(np.outer(np.exp(-((pos - cy) ** 2) / (2 * sigma**2)), np.exp(-((pos - cx) ** 2) / (2 * sigma**2))))


# Indexed by label, in the order of CLASS_NAMES.
_MASKS = (
    _disc,
    _square,
    _triangle,
    _ring,
    _horizontal_stripes,
    _vertical_stripes,
    _checkerboard,
    _cross,
    _gradient_blob,
    _star,
)
