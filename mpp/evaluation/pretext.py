"""Pretext validation: the pretraining loss and its metrics on held-out images, the same every time.

Pretext validation loss tracks fine-tuning accuracy in masked image modelling (Xie et al., CVPR 2023), so it is
the signal for "is pretraining long enough?". To be comparable across evaluations, it scores the same images with
the same corruption (drawn once from a private generator, never the training run's RNG) in eval mode.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from mpp.evaluation.ridge import LabelledImages
from mpp.model.objectives import Objective


class PretextValidation:
    """`scores(objective)` -> {'val/<loss name>': ..., 'val/<metric>': ...}, image-weighted means over every process."""

    def __init__(self, accelerator: Accelerator, images: LabelledImages, batch_size: int, seed: int):
        self.accelerator, self.images, self.batch_size, self.seed = accelerator, images, batch_size, seed
        self.fixed: list[dict[str, object]] | None = None

    def _fixed_randomness(self, objective: Objective) -> list[dict[str, object]]:
        """The objective's random choices (MPP: its corruption) for each evaluation batch, drawn once on the CPU and
        kept: the same task at every evaluation."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.accelerator.process_index)
        return [objective.fixed_randomness(min(self.batch_size, self.images.images.shape[0] - start), generator,
                                           self.accelerator.device) for start in self.starts]

    @property
    def starts(self) -> range:
        return range(0, self.images.images.shape[0], self.batch_size)

    @torch.no_grad()
    def scores(self, objective: Objective) -> dict[str, float]:
        if self.fixed is None:
            self.fixed = self._fixed_randomness(objective)
        device = self.accelerator.device
        was_training = objective.training
        objective.eval()
        sums: dict[str, torch.Tensor] = {}
        for start, fixed in zip(self.starts, self.fixed):
            images = self.images.images[start : start + self.batch_size].to(device)
            labels = self.images.labels[start : start + self.batch_size].to(device)
            with self.accelerator.autocast():
                out = objective(images, labels, **fixed)
            for name, value in {out.loss_name: out.loss, **out.metrics}.items():
                sums[name] = sums.get(name, 0) + value.detach().float() * images.shape[0]
        objective.train(was_training)
        names = sorted(sums)
        if self.accelerator.num_processes > 1:  # a process can hold none of the images: it learns the names from the others
            names = sorted({n for part in gather_object([names]) for n in part})
        zero = torch.zeros((), device=device)
        local = torch.stack([sums.get(n, zero) for n in names] + [torch.tensor(float(self.images.images.shape[0]), device=device)])
        totals = self.accelerator.reduce(local, reduction="sum").tolist()
        return {f"val/{n}": s / totals[-1] for n, s in zip(names, totals)}
