"""What a corrupted patch predicts in masked patch prediction (`mpp.target`): one strategy object per target.

A target owns everything that depends on what is predicted: the per-patch targets computed from the raw uint8
pixels, the head's output size, the loss and the metrics it declares, how targets look in the TensorBoard panel,
and how the model card describes it. To add one, write a `Target` subclass and give it an entry in
mpp.model.registry.TARGETS (its meaning, head size and settings, read without torch); `mpp.target=<name>` then selects
it, its settings join the `mpp` config section (with their defaults and meanings, in --help and docs/reference.md),
and its metrics reach TensorBoard, the progress bar and results.json.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from mpp.metrics import PRETEXT_LOSS, Metric, split_metric
from mpp.model.registry import cells_4x4, color_classes
from mpp.model.vit import PIXEL_MEAN, PIXEL_STD, normalize, patchify, unpatchify

FIXED_CORRUPTION = "held-out images, fixed corruption"  # what the pretext validation holds fixed for MPP


def quantize_color_sums(sums: torch.Tensor, pixels: int, bits: int) -> torch.Tensor:
    """Per-channel pixel sums (B, 3, ...) of `pixels` pixels -> colour class ids (B, ...).

    Integer arithmetic on the sums, so a mean exactly on a bin edge (e.g. 32 for 3 bits) lands in the upper bin.
    """
    levels = 1 << bits
    q = (sums.round().long() * levels) // (256 * pixels)  # floor(mean / (256 / levels))
    return (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]


def mean_color_targets(images: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N) class ids of each patch's mean colour, `bits` per channel."""
    sums = F.avg_pool2d(images.float(), patch_size, divisor_override=1)  # exact integer sums
    return quantize_color_sums(sums, patch_size * patch_size, bits).flatten(1)


def color4x4_targets(images: torch.Tensor, patch_size: int, bits: int = 3) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N, 16) class ids of each patch downsized to 4 x 4."""
    cell = patch_size // 4
    sums = F.avg_pool2d(images.float(), cell, divisor_override=1)
    classes = quantize_color_sums(sums, cell * cell, bits)  # (B, 4h, 4w)
    return patchify(classes[:, None], 4)  # each patch's 4 x 4 cells, row-major


def pixel_targets(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, 3, H, W) uint8 -> (B, N, P*P*3) normalised pixels, in PatchEmbed's flattening order."""
    return patchify(normalize(images), patch_size)


def color_class_to_rgb(classes: torch.Tensor, bits: int = 3) -> torch.Tensor:
    """Class ids (...) -> uint8 RGB bin centres (..., 3)."""
    levels = 1 << bits
    rgb = torch.stack([classes // (levels * levels), (classes // levels) % levels, classes % levels], dim=-1)
    return ((rgb * 256 + 128) // levels).to(torch.uint8)


class Target(ABC):
    """The contract of a target. An implementer provides, for patches of `patch_size` pixels:

    - `outputs`: the head's outputs per patch (its registry entry's `outputs` for the same settings);
    - `__call__(images)`: (B, 3, H, W) uint8 -> the targets of every patch, (B, N, ...);
    - `loss(predictions, targets)`: fp32 head outputs (B, K, outputs) at the K corrupted positions and their
      targets (B, K, ...) -> (loss, {name: value}); the loss is logged as train/pretext_loss (PRETEXT_LOSS), each
      value as train/<name> (val/... in the pretext validation), and each must be declared by `metrics`;
    - `metrics(split)`: the Metric of the loss (named PRETEXT_LOSS) and of each value (split "train" or "val", see
      split_metric);
    - `decode(predictions)`: head outputs (B, K, outputs) -> the targets they predict (B, K, ...);
    - `render(targets)`: targets (B, K, ...) -> uint8 patches (B, K, P*P*3) in patchify's layout, for the panel;
    - `description`: what a corrupted patch predicts, for the model card ("its 3-bit mean colour (512 classes)").

    A run builds it with `from_settings(patch_size, settings)`, `settings` being the run's `mpp` config section, of
    which it reads the keys it uses. It raises ValueError, naming the config keys, for a patch size it cannot use.
    """

    outputs: int
    description: str

    def __init__(self, patch_size: int):
        self.patch_size = patch_size

    @classmethod
    def from_settings(cls, patch_size: int, settings) -> Target:
        return cls(patch_size)

    @abstractmethod
    def __call__(self, images: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def loss(self, predictions: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    @abstractmethod
    def decode(self, predictions: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def render(self, targets: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def metrics(self, split: str) -> list[Metric]: ...


class ColorClasses(Target):
    """Targets that are colour classes, `mpp.color_bits` per channel: cross-entropy, scored against the batch's prior."""

    def __init__(self, patch_size: int, bits: int = 3):
        super().__init__(patch_size)
        self.bits, self.num_colors = bits, color_classes(bits)

    @classmethod
    def from_settings(cls, patch_size: int, settings) -> ColorClasses:
        return cls(patch_size, settings.color_bits)

    def loss(self, predictions: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = predictions.reshape(-1, self.num_colors)
        targets = targets.reshape(-1)
        loss = F.cross_entropy(logits, targets)
        accuracy = (logits.argmax(-1) == targets).float().mean()
        # scatter_add, not bincount: bincount sizes its output from the data, a host sync on GPU.
        counts = torch.zeros(self.num_colors, device=targets.device).scatter_add_(0, targets, torch.ones_like(logits[:, 0]))
        prior = counts.max() / targets.numel()
        return loss, {"color_acc": accuracy, "color_acc_prior": prior}

    def decode(self, predictions: torch.Tensor) -> torch.Tensor:  # (B, K, cells * colours) -> (B, K[, cells])
        return predictions.unflatten(-1, (-1, self.num_colors)).argmax(-1).squeeze(-1)

    def metrics(self, split: str) -> list[Metric]:
        # Accuracy and its prior on one chart, so that beating it shows at a glance. Custom Scalars colours lines by
        # run, not by tag, and shows no legend: the title says which line is which.
        accuracy = ("colour accuracy on the corrupted patches, and the lower line, its prior's (always the batch's most "
                    "frequent colour): what it must beat")
        return [split_metric(split, PRETEXT_LOSS, "pretext loss", held_out=FIXED_CORRUPTION, headline=True, bar="loss"),
                split_metric(split, "color_acc", accuracy, held_out=FIXED_CORRUPTION, headline=True, bar="color_acc", percent=True),
                split_metric(split, "color_acc_prior", accuracy, held_out=FIXED_CORRUPTION, percent=True)]


class MeanColor(ColorClasses):
    """The paper's target: each patch's mean colour, one of 512 classes at 3 bits."""

    def __init__(self, patch_size: int, bits: int = 3):
        super().__init__(patch_size, bits)
        self.outputs = self.num_colors
        self.description = f"its {self.bits}-bit mean colour ({self.num_colors} classes)"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:  # (B, N)
        return mean_color_targets(images, self.patch_size, self.bits)

    def render(self, targets: torch.Tensor) -> torch.Tensor:  # (B, K) -> (B, K, P*P*3)
        rgb = color_class_to_rgb(targets, self.bits)
        return rgb[:, :, None, :].expand(-1, -1, self.patch_size ** 2, -1).flatten(2)


class Color4x4(ColorClasses):
    """The paper's variant: each patch downsized to 4 x 4, a colour class per cell (16 predictions per patch)."""

    def __init__(self, patch_size: int, bits: int = 3):
        super().__init__(patch_size, bits)
        self.outputs = cells_4x4(patch_size) * self.num_colors
        self.description = f"its 4x4-downsized {self.bits}-bit colours (16 x {self.num_colors} classes)"

    def __call__(self, images: torch.Tensor) -> torch.Tensor:  # (B, N, 16)
        return color4x4_targets(images, self.patch_size, self.bits)

    def render(self, targets: torch.Tensor) -> torch.Tensor:  # (B, K, 16) -> (B, K, P*P*3)
        b, k, _ = targets.shape
        cells = unpatchify(color_class_to_rgb(targets, self.bits).reshape(b * k, 1, -1), 4, grid=1)  # (B*K, 3, 4, 4)
        cells = F.interpolate(cells.float(), scale_factor=self.patch_size // 4, mode="nearest").to(torch.uint8)
        return patchify(cells, self.patch_size).reshape(b, k, -1)


class Pixels(Target):
    """The normalised pixels of each patch, regressed with an L2 loss and scored against the batch's mean patch."""

    description = "its normalised pixels (L2 regression)"

    def __init__(self, patch_size: int):
        super().__init__(patch_size)
        self.outputs = 3 * patch_size * patch_size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:  # (B, N, P*P*3)
        return pixel_targets(images, self.patch_size)

    def loss(self, predictions: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = F.mse_loss(predictions, targets)
        prior = F.mse_loss(targets.mean(dim=(0, 1)).expand_as(targets), targets)
        return loss, {f"{PRETEXT_LOSS}_prior": prior}

    def decode(self, predictions: torch.Tensor) -> torch.Tensor:
        return predictions

    def metrics(self, split: str) -> list[Metric]:
        # A chart each: Custom Scalars colours lines by run, not by tag, and shows no legend.
        return [split_metric(split, PRETEXT_LOSS, "pretext loss", held_out=FIXED_CORRUPTION, headline=True, bar="loss"),
                split_metric(split, f"{PRETEXT_LOSS}_prior", "the prior's loss (always predicting the batch's mean pixels): what "
                             "the loss must beat", held_out=FIXED_CORRUPTION)]

    def render(self, targets: torch.Tensor) -> torch.Tensor:
        return ((targets * PIXEL_STD + PIXEL_MEAN) * 255).clamp(0, 255).to(torch.uint8)

