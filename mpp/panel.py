"""The image panel in TensorBoard: what an objective draws (MPP: crops, corrupted view, true and predicted targets),
one labelled row each, so column j of every row shows the same image."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from PIL import Image, ImageDraw, ImageFont

from mpp.data import Batch
from mpp.objectives import Objective

PANEL_IMAGES = 8
PANEL_GAP = 4  # white pixels between the panel's cells


def for_display(images: torch.Tensor, min_size: int = 128) -> torch.Tensor:
    """Small crops are upscaled (nearest) so patches stay visible in TensorBoard."""
    scale = max(1, min_size // images.shape[-1])
    return F.interpolate(images.float(), scale_factor=scale, mode="nearest").to(torch.uint8).cpu()


def log_panel(accelerator: Accelerator, objective: Objective, batch: Batch, step: int) -> None:
    """The panel of `objective` for this batch, if it draws one (see Objective.panel), from the main process."""
    if not accelerator.is_main_process:
        return
    objective.eval()
    with accelerator.autocast():
        panel = objective.panel(batch.images[:PANEL_IMAGES])
    objective.train()
    if not panel:
        return
    tracker = accelerator.get_tracker("tensorboard", unwrap=True)
    tracker.add_image("panel", panel_grid({name: for_display(images) for name, images in panel.items()}), global_step=step)


def panel_grid(rows: dict[str, torch.Tensor], gap: int = PANEL_GAP) -> torch.Tensor:
    """One image (3, H, W) uint8: a row per entry of `rows` (each (B, 3, h, w) uint8), labelled with its name on
    the left, so column j of every row shows the same image (crop, corrupted view, true and predicted targets)."""
    names, images = list(rows), list(rows.values())
    b, _, h, w = images[0].shape
    font = ImageFont.load_default(size=max(10, min(16, h // 3)))
    label_width = gap + max(math.ceil(font.getlength(name)) for name in names) + gap
    grid = Image.new("RGB", (label_width + b * (w + gap), gap + len(rows) * (h + gap)), "white")
    draw = ImageDraw.Draw(grid)
    for r, (name, row) in enumerate(zip(names, images)):
        top = gap + r * (h + gap)
        draw.text((gap, top + h / 2), name, fill="black", font=font, anchor="lm")
        for c in range(b):
            grid.paste(Image.fromarray(row[c].permute(1, 2, 0).numpy()), (label_width + c * (w + gap), top))
    return torch.from_numpy(np.array(grid)).permute(2, 0, 1)
