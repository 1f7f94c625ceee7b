"""Inspecting a ViT (the paper's section 4.5): its views (mpp.evaluation.views) on fixed images, drawn during pretraining
and fine-tuning (the `inspect` evaluator: TensorBoard images under inspect/ and the first and last layers' mean
attention distance) and for any checkpoint (`mpp inspect --ckpt PATH`: PNGs and inspect.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import nn

from mpp.config import Config
from mpp.evaluation.ridge import LabelledImages
from mpp.evaluation.views import (attention_distance, attention_rollout, patch_distances, patch_filters,
                            position_similarity, rollout_to_patches)
from mpp.metrics import Category, Metric
from mpp.model.vit import VisionTransformer, normalize
from mpp.training.trackers import log_image
from .frozen import evaluate_checkpoint
from ..run.loaders import eval_batches

DISTANCE_FIRST, DISTANCE_LAST = "inspect/attention_distance_first", "inspect/attention_distance_last"
POOLINGS = {"cls": "[class] token", "mean": "mean of patches"}  # the outputs the rollout is drawn to
FOLDER = "inspect"  # what `mpp inspect` writes in output_dir


INSPECTION = Category("inspection", order=70, card_rank=60)  # what the model has learnt to attend to


@dataclass(frozen=True)
class Views:
    """The four views of one backbone, as numbers on the CPU."""

    filters: torch.Tensor  # (K, 3, P, P) principal components of the patch embedding's filters
    explained: torch.Tensor  # (K,) fraction of the filters' variance each explains
    similarity: torch.Tensor | None  # (N, N) cosine similarity of the patch positions' embeddings; None without any
    distance: torch.Tensor  # (depth, heads) mean attention distance in pixels
    uniform_distance: float  # what uniform attention over the patches gives, in pixels
    images: torch.Tensor  # (R, 3, H, W) uint8, the images the rollout is drawn on
    rollout: dict[str, torch.Tensor]  # pooling -> (R, N) how much each patch reaches that output
    grid: int
    patch_size: int
    images_averaged: int  # how many images the mean attention distance averages over
    grey: bool  # the images are grey (R = G = B), so the filters are shown as grey images meet them

    def scalars(self) -> dict[str, float]:
        """The first and the last layer's mean attention distance over their heads, in pixels."""
        return {DISTANCE_FIRST: float(self.distance[0].mean()), DISTANCE_LAST: float(self.distance[-1].mean())}

    def figures(self) -> dict[str, object]:
        """{name: matplotlib Figure} of each view."""
        # matplotlib (a third of a second to import) loads when a figure is drawn, not at every start of a stage.
        from . import inspection_figures as draw

        reach = {POOLINGS[pooling]: maps.numpy() for pooling, maps in self.rollout.items()}
        figures = {
            "filters": draw.filters_figure(self.filters.numpy(), self.explained.numpy(), self.grey),
            "position_similarity": None if self.similarity is None else draw.similarity_figure(self.similarity.numpy(), self.grid),
            "attention_distance": draw.distance_figure(self.distance.numpy(), self.uniform_distance, self.grid * self.patch_size),
            "rollout": draw.rollout_figure(self.images.numpy(), reach, self.grid),
        }
        return {name: figure for name, figure in figures.items() if figure is not None}  # model.pos_embed=none: no view

    def numbers(self) -> dict:
        """The views as JSON-ready numbers (inspect.json)."""
        def rounded(tensor: torch.Tensor, digits: int = 4) -> list:
            return np.round(tensor.numpy().astype(float), digits).tolist()

        return {
            "image_size": self.grid * self.patch_size, "patch_size": self.patch_size, "grid": self.grid,
            "images": self.images_averaged, "grey": self.grey,
            "attention_distance_px": rounded(self.distance, 3),  # [layer][head]
            "attention_distance_mean_px": rounded(self.distance.mean(dim=1), 3),  # [layer]
            "uniform_attention_distance_px": round(self.uniform_distance, 3),
            "filters_explained_variance": rounded(self.explained),
            # [position][position], row-major positions; null for model.pos_embed=none
            "position_similarity": None if self.similarity is None else rounded(self.similarity),
            "rollout": {pooling: rounded(reach) for pooling, reach in self.rollout.items()},  # [image][position]
        }


class Inspector:
    """The fixed images the attention views are computed on, read once (inspect.shards, else data.val_shards, else
    data.shards: the first inspect.images of them); `views(backbone)` computes all four, the same on every process."""

    def __init__(self, cfg: Config, accelerator: Accelerator):
        c = cfg.inspect
        spec = c.shards_read(cfg.data)["shards"]
        batches = eval_batches(spec, cfg, accelerator, c.batch_size, labels=False)
        self.images = LabelledImages(accelerator, batches, c.images, f"inspection shards {spec}", need_labels=False)
        # The first few images, from whichever processes hold them (a process may hold none), for the rollout figure.
        held = gather_object([self.images.images[: c.rollout_images]])
        self.shown = torch.cat([part for part in held if len(part)])[: c.rollout_images]
        coloured = (self.images.images != self.images.images[:, :1]).any()
        self.grey = not accelerator.reduce(coloured.float().to(accelerator.device), reduction="sum").item()
        self.cfg, self.accelerator = c, accelerator

    @torch.no_grad()
    def views(self, backbone: VisionTransformer) -> Views:
        accelerator, device = self.accelerator, self.accelerator.device
        was_training = backbone.training
        backbone.eval()
        sums = torch.zeros(backbone.depth, backbone.heads, device=device)
        # fp32 and no autocast: a few images, and the weights are the numbers being shown.
        for start in range(0, self.images.images.shape[0], self.cfg.batch_size):
            batch = self.images.images[start: start + self.cfg.batch_size]
            _, maps = backbone.forward_with_attention(normalize(batch.to(device)))
            sums += attention_distance(maps, backbone.grid, backbone.patch_size) * len(batch)
        distance = accelerator.reduce(sums, reduction="sum") / self.images.total  # every process's images alike
        _, maps = backbone.forward_with_attention(normalize(self.shown.to(device)))
        rollout = attention_rollout(maps)
        filters, explained = patch_filters(backbone, self.cfg.filters, self.grey)
        similarity = position_similarity(backbone.position_embeddings())
        similarity = None if similarity is None else similarity.cpu()
        backbone.train(was_training)
        return Views(filters, explained, similarity, distance.cpu(),
                     float(patch_distances(backbone.grid, backbone.patch_size).mean()), self.shown,
                     {pooling: rollout_to_patches(rollout, pooling).cpu() for pooling in POOLINGS},
                     backbone.grid, backbone.patch_size, self.images.total, self.grey)


class Inspect:
    """The evaluator: every inspect.every steps, the four views of the backbone in training as TensorBoard images
    (inspect/filters, inspect/position_similarity, inspect/attention_distance, inspect/rollout, drawn by the main
    process) and the first and last layers' mean attention distance as scalars."""

    def __init__(self, cfg: Config, accelerator: Accelerator):
        self.inspector, self.accelerator = Inspector(cfg, accelerator), accelerator
        self.metrics = (Metric(DISTANCE_FIRST, INSPECTION, "mean attention distance of the first layer (pixels)"),
                        Metric(DISTANCE_LAST, INSPECTION, "mean attention distance of the last layer (pixels)"))

    def __call__(self, objective: nn.Module, step: int) -> dict[str, float]:
        views = self.inspector.views(objective.backbone)
        if self.accelerator.is_main_process:
            from .inspection_figures import pixels

            for name, figure in views.figures().items():
                log_image(self.accelerator, f"inspect/{name}", pixels(figure), step)
        return views.scalars()


def run(cfg: Config, *, ckpt: str) -> dict:
    """The four views of the backbone in `ckpt`: PNGs and inspect.json in output_dir/inspect/."""
    drawn = {}

    def measure(cfg: Config, accelerator: Accelerator, backbone: VisionTransformer) -> tuple[dict, str]:
        views = Inspector(cfg, accelerator).views(backbone)
        if accelerator.is_main_process:
            drawn.update(views.figures())
        first, last = views.scalars().values()
        return views.numbers(), (f"mean attention distance {first:.1f} px in layer 1 and {last:.1f} px in layer "
                                 f"{backbone.depth} (uniform attention: {views.uniform_distance:.1f} px) over "
                                 f"{views.images_averaged} images; figures (filters, position_similarity, "
                                 f"attention_distance, rollout .png) in {Path(cfg.output_dir) / FOLDER}")

    def draw(folder: Path) -> None:
        for name, figure in drawn.items():
            figure.savefig(folder / f"{name}.png", dpi=120)

    return evaluate_checkpoint(cfg, ckpt, f"{FOLDER}/inspect.json", measure, draw)
