"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) of a classification batch, as MAE and DeiT fine-tune.

Batch-level: one weight per batch, each image mixed with the image at the mirrored position of the batch (the batch
reversed), and the labels alike into soft targets. The draws are host-side (Python's `random`, which Accelerate
checkpoints with the run's other RNG states, so a resume is exact); nothing is read back from the device.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mix:
    """One batch's draw: the weight of the batch's own images and labels, and for CutMix the box (top, bottom,
    left, right in pixels) where the reversed batch's pixels replace them."""

    lam: float
    box: tuple[int, int, int, int] | None = None


def cutmix_box(height: int, width: int, lam: float, rng: random.Random) -> tuple[int, int, int, int]:
    """A box of about (1 - lam) of the image at a uniform centre, clipped at the border (so often smaller)."""
    cut = math.sqrt(1.0 - lam)
    half_h, half_w = int(height * cut) // 2, int(width * cut) // 2
    cy, cx = rng.randrange(height), rng.randrange(width)
    return max(cy - half_h, 0), min(cy + half_h, height), max(cx - half_w, 0), min(cx + half_w, width)


@dataclass(frozen=True)
class Mixing:
    """Mixup with weight ~ Beta(mixup, mixup), CutMix with a box share ~ Beta(cutmix, cutmix), or, with both on,
    CutMix for `switch_prob` of the batches and mixup for the rest; 0 turns either off."""

    mixup: float
    cutmix: float
    switch_prob: float
    classes: int

    def draw(self, height: int, width: int, rng: random.Random = random) -> Mix:
        use_cutmix = self.cutmix > 0 and (self.mixup <= 0 or rng.random() < self.switch_prob)
        if not use_cutmix:
            return Mix(rng.betavariate(self.mixup, self.mixup))
        box = cutmix_box(height, width, rng.betavariate(self.cutmix, self.cutmix), rng)
        top, bottom, left, right = box
        return Mix(1.0 - (bottom - top) * (right - left) / (height * width), box)  # the weight the box really leaves

    def apply(self, images: torch.Tensor, labels: torch.Tensor, mix: Mix) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images (B, 3, H, W) and labels (B,) -> the mixed uint8 images and soft targets (B, classes)."""
        other = images.flip(0)
        if mix.box is None:
            mixed = (images.float() * mix.lam + other.float() * (1.0 - mix.lam)).round().to(torch.uint8)
        else:
            top, bottom, left, right = mix.box
            mixed = images.clone()
            mixed[..., top:bottom, left:right] = other[..., top:bottom, left:right]
        # scatter, not F.one_hot: that checks the labels' range on the host, a device read on some devices
        one_hot = torch.zeros(len(labels), self.classes, device=labels.device).scatter_(1, labels[:, None], 1.0)
        return mixed, one_hot * mix.lam + one_hot.flip(0) * (1.0 - mix.lam)

    def __post_init__(self) -> None:
        # Eager even inside a compiled forward: the box bounds change every batch and would recompile the graph.
        # Wrapped here, not by a decorator: torch.compiler.disable imports torch._dynamo (about a second), which only
        # a run that mixes needs, not every command that imports the model (predict, export, the evaluations).
        object.__setattr__(self, "mix_eagerly", torch.compiler.disable(self.mix))

    def __reduce__(self):  # a copy or a pickle is made anew, its own eager wrapper with it (a wrapper does not pickle)
        return type(self), (self.mixup, self.cutmix, self.switch_prob, self.classes)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mix_eagerly(images, labels)

    def mix(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.apply(images, labels, self.draw(*images.shape[-2:]))
