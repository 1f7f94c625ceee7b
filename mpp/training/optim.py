"""The optimiser, its parameter groups and the learning-rate schedule.

A parameter group owns what it means: its `lr_scale` (layer-wise lr decay) and whether weight decay applies to it
(`apply_weight_decay`), as timm's groups carry `lr_scale`. Everything that sets a group's lr or weight decay (the
schedule, a resume with new hyperparameters) reads them there, never from the group's position.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

LambdaLR = torch.optim.lr_scheduler.LambdaLR


def param_groups(objective: nn.Module, layer_decay: float) -> list[dict]:
    """One group per (layer scale, weight decay or not), each `{"params", "lr_scale", "apply_weight_decay"}`.

    Layer l (objective.layer_of) learns at lr x layer_decay^(depth + 1 - l) (BEiT/MAE; 1: every scale is 1 and there
    are two groups). Biases, norms and the input tokens of objective.no_weight_decay() get no weight decay (common
    ViT practice).
    """
    depth, tokens = objective.backbone.depth, objective.no_weight_decay()
    groups: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, param in objective.named_parameters():
        if param.requires_grad:
            scale = layer_decay ** (depth + 1 - objective.layer_of(name))
            decayed = param.ndim > 1 and name not in tokens
            groups.setdefault((scale, decayed), []).append(param)
    return [{"params": params, "lr_scale": scale, "apply_weight_decay": decayed}
            for (scale, decayed), params in sorted(groups.items())]


def build_optimizer(groups: list[dict], cfg) -> torch.optim.Optimizer:
    """The optimiser of `cfg` (a TrainConfig) over `groups` (param_groups), each at its peak lr and weight decay.

    Build it from parameters already on their device: the fused kernels (CPU and CUDA: one pass over all parameters,
    and they honour `found_inf`, see train.train_step) check the device when they are made on older torch releases.
    """
    groups = [{**group, **group_hyperparameters(group, cfg)} for group in groups]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    optimizer = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return optimizer(groups, lr=cfg.lr, betas=cfg.betas, fused=True)


def group_hyperparameters(group: dict, cfg) -> dict:
    """A group's peak lr and weight decay under `cfg`, from what the group owns."""
    return {"lr": cfg.lr * group["lr_scale"], "weight_decay": cfg.weight_decay if group["apply_weight_decay"] else 0.0}


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def build_schedule(optimizer: torch.optim.Optimizer, cfg) -> LambdaLR:
    """Linear warmup, then cosine decay to 0, as a factor of every group's own peak lr (so layer decay's ratios hold)."""
    return LambdaLR(optimizer, warmup_cosine(cfg.warmup_steps, cfg.steps))


def head_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the top layer (scale 1), what train/lr shows: the largest group lr."""
    return max(group["lr"] for group in optimizer.param_groups)


def apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg) -> None:
    """Put `cfg` in force over the optimiser and scheduler state a checkpoint restored, which carries the saved run's
    lr, weight decay, betas and momentum; the schedule (its lambda is rebuilt from cfg, not saved) continues from
    the restored step. Each group keeps its own layer scale and weight-decay exemption. With an unchanged config every
    value is the one restored, bit for bit."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    peaks = []
    for group in optimizer.param_groups:
        hyper = group_hyperparameters(group, cfg)
        peaks.append(hyper["lr"])
        group.update(initial_lr=hyper["lr"], lr=hyper["lr"] * factor, weight_decay=hyper["weight_decay"])
        if "betas" in group:
            group["betas"] = cfg.betas
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    scheduler.base_lrs = peaks
