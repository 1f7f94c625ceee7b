"""The image panel in TensorBoard: what an objective draws (MPP: crops, corrupted view, true and predicted targets),
one column each under its name, so row i shows image i in every view."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from PIL import Image, ImageDraw, ImageFont

from mpp.data.stream import Batch
from mpp.model.objectives import Objective
from mpp.training.trackers import log_image

# TensorBoard shrinks an image to fit its card: Time Series into about 370 x 210 px, the Images tab to about 325 px
# wide. Three images in four views (532 x 438 px at 32-px crops) show there with cells of ~60 px and names ~12 px high.
PANEL_IMAGES = 3
PANEL_TAG = "train/panel"  # in the train/ group, which Time Series opens first (mpp/training/meters.py says why)
PANEL_GAP = 4  # white pixels between the panel's cells
FONT_PROBE = 100  # font size at which the names are measured to size them


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
    grid = panel_grid({name: for_display(images) for name, images in panel.items()})  # (3, H, W)
    log_image(accelerator, PANEL_TAG, grid.permute(1, 2, 0).cpu().numpy(), step)


def panel_grid(columns: dict[str, torch.Tensor], gap: int = PANEL_GAP) -> torch.Tensor:
    """One image (3, H, W) uint8: a column per entry of `columns` (each (B, 3, h, w) uint8) under its name, so row i
    shows image i in every view (crop, corrupted view, true and predicted targets).

    The names are set as large as the longest fits in a cell's width (at most a quarter of it), so they scale with the
    cells when TensorBoard shrinks the panel to its card.
    """
    names, images = list(columns), list(columns.values())
    b, _, h, w = images[0].shape
    probe = ImageFont.load_default(size=FONT_PROBE)
    size = max(8, min(w // 4, math.floor(FONT_PROBE * (w - gap) / max(probe.getlength(name) for name in names))))
    font = ImageFont.load_default(size=size)
    header = gap + round(size * 1.4)
    grid = Image.new("RGB", (gap + len(columns) * (w + gap), header + b * (h + gap)), "white")
    draw = ImageDraw.Draw(grid)
    for c, (name, column) in enumerate(zip(names, images)):
        left = gap + c * (w + gap)
        draw.text((left + w / 2, header - gap // 2), name, fill="black", font=font, anchor="md")
        for r in range(b):
            grid.paste(Image.fromarray(column[r].permute(1, 2, 0).numpy()), (left, header + r * (h + gap)))
    return torch.from_numpy(np.array(grid)).permute(2, 0, 1)
