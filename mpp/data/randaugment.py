"""RandAugment (Cubuk et al. 2020): N image operations drawn at random per image, each at one shared magnitude M.

The operations are the paper's (its Identity aside, as timm leaves it out), written with PIL on the training crop
in the data workers. Magnitudes run from 0 to 10 (MAX_MAGNITUDE, as in AutoAugment, timm and the paper's M=9 for
ImageNet); each use of an operation adds Gaussian noise of `magnitude_std` to M (timm's `mstd`), and the geometric and
enhancing operations go either way at random. Every draw comes from the worker's own `random.Random`, so the
augmentation of a sample is fixed by the stream's seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageOps

MAX_MAGNITUDE = 10.0
FILL = (128, 128, 128)  # what geometric operations move into the frame: mid grey, as timm fills


def _affine(img: Image.Image, matrix: tuple[float, ...]) -> Image.Image:
    return img.transform(img.size, Image.Transform.AFFINE, matrix, resample=Image.Resampling.BILINEAR, fillcolor=FILL)


def _enhance(kind) -> Callable[[Image.Image, float], Image.Image]:
    """An ImageEnhance operation at factor 1 + 0.9 x level (either sign): 0.1 to 1.9 at full magnitude."""
    return lambda img, level: kind(img).enhance(1.0 + 0.9 * level)


# Each operation: (PIL image, level in [-1, 1] (signed) or [0, 1]) -> PIL image; whether its level takes a sign.
OPERATIONS: dict[str, tuple[Callable[[Image.Image, float], Image.Image], bool]] = {
    "auto_contrast": (lambda img, level: ImageOps.autocontrast(img), False),
    "equalize": (lambda img, level: ImageOps.equalize(img), False),
    "rotate": (lambda img, level: img.rotate(30.0 * level, resample=Image.Resampling.BILINEAR, fillcolor=FILL), True),
    "solarize": (lambda img, level: ImageOps.solarize(img, threshold=256 - round(256 * level)), False),
    "posterize": (lambda img, level: ImageOps.posterize(img, 8 - round(4 * level)), False),  # 8 bits down to 4
    "color": (_enhance(ImageEnhance.Color), True),
    "contrast": (_enhance(ImageEnhance.Contrast), True),
    "brightness": (_enhance(ImageEnhance.Brightness), True),
    "sharpness": (_enhance(ImageEnhance.Sharpness), True),
    "shear_x": (lambda img, level: _affine(img, (1, 0.3 * level, 0, 0, 1, 0)), True),
    "shear_y": (lambda img, level: _affine(img, (1, 0, 0, 0.3 * level, 1, 0)), True),
    "translate_x": (lambda img, level: _affine(img, (1, 0, 0.45 * level * img.size[0], 0, 1, 0)), True),
    "translate_y": (lambda img, level: _affine(img, (1, 0, 0, 0, 1, 0.45 * level * img.size[1])), True),
}


@dataclass(frozen=True)
class RandAugment:
    """`ops` operations per image, drawn with replacement, at magnitude `magnitude` (0-10) plus N(0, magnitude_std)."""

    ops: int = 2
    magnitude: float = 9.0
    magnitude_std: float = 0.5

    def apply(self, img: Image.Image, name: str, magnitude: float, sign: int = 1) -> Image.Image:
        """Operation `name` at `magnitude` (0-10), towards `sign` where the operation has two directions."""
        operation, signed = OPERATIONS[name]
        level = min(max(magnitude, 0.0), MAX_MAGNITUDE) / MAX_MAGNITUDE
        return operation(img, sign * level if signed else level)

    def __call__(self, image: torch.Tensor, rng: random.Random) -> torch.Tensor:
        """(3, H, W) uint8 -> (3, H, W) uint8, augmented."""
        img = Image.fromarray(image.permute(1, 2, 0).numpy())
        for name in rng.choices(list(OPERATIONS), k=self.ops):
            magnitude = rng.gauss(self.magnitude, self.magnitude_std) if self.magnitude_std else self.magnitude
            img = self.apply(img, name, magnitude, rng.choice((-1, 1)))
        return torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()
