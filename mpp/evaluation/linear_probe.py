"""Linear probing as MAE evaluates it (He et al. 2022): a linear classifier trained by SGD on frozen
features, behind a BatchNorm without affine parameters that normalises them (MIM features differ widely in scale).

The features are extracted once and held on the CPU; the probe trains on them for a few epochs, with its own
generator for the initialisation and the order of the features, so an evaluation inside a training run neither
reads nor moves the run's random stream, and the same features always give the same probe.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpp.errors import UserError

MOMENTUM = 0.9
INIT_STD = 0.01  # MAE's probe head: truncated normal, std 0.01, bias 0


def train_linear_probe(features: torch.Tensor, labels: torch.Tensor, num_classes: int, *, epochs: int, lr: float,
                       batch_size: int, seed: int = 0) -> nn.Module:
    """(n, D) features with labels (n,) -> BatchNorm (no affine) + linear layer, trained by SGD with momentum and a
    cosine decay of `lr` to 0 over its steps, no weight decay. Batches of one feature (BatchNorm cannot use them) are
    left out."""
    n, width = features.shape
    if n < 2:
        raise UserError(f"the linear probe needs at least 2 training images, got {n}; raise probe.train_images")
    generator = torch.Generator().manual_seed(seed)
    linear = nn.utils.skip_init(nn.Linear, width, num_classes)  # its default init would draw from the global RNG
    nn.init.trunc_normal_(linear.weight, std=INIT_STD, a=-2 * INIT_STD, b=2 * INIT_STD, generator=generator)
    nn.init.zeros_(linear.bias)
    probe = nn.Sequential(nn.BatchNorm1d(width, affine=False, momentum=None), linear)  # momentum=None: running stats are the mean over all batches
    optimizer = torch.optim.SGD(probe.parameters(), lr=lr, momentum=MOMENTUM)
    steps = epochs * math.ceil(n / batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    x, y = features.float(), labels
    probe.train()
    for _ in range(epochs):
        for index in torch.randperm(n, generator=generator).split(batch_size):
            if len(index) > 1:
                loss = F.cross_entropy(probe(x[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            schedule.step()
    return probe.eval()


def linear_probe_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, eval_x: torch.Tensor, eval_y: torch.Tensor, *,
                          epochs: int, lr: float, batch_size: int, seed: int = 0) -> float:
    """Top-1 on (eval_x, eval_y) of train_linear_probe fit to (train_x, train_y)."""
    num_classes = int(max(train_y.max(), eval_y.max())) + 1
    probe = train_linear_probe(train_x, train_y, num_classes, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    with torch.no_grad():
        return (probe(eval_x.float()).argmax(dim=1) == eval_y).double().mean().item()
