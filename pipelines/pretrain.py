"""Pretraining stage: masked patch prediction on (possibly unlabelled) shards, or supervised on labelled ones."""

from __future__ import annotations

import time

import torch
from torch import nn

from mpp.config import Config
from mpp.fewshot import LabelledImages
from mpp.objectives import Classification, MaskedPatchPrediction, pretraining_head
from mpp.train import Evaluator, precision_label, train
from mpp.validation import PretextValidation
from pipelines.common import (build_backbone, check_output_dir, labelled, num_classes, resolve_shards, resume_command,
                              start_training, start_tracking, train_loader)
from pipelines import knn
from pipelines.fewshot import eval_batches, training_evaluator


def build_objective(cfg: Config, classes: int | None) -> nn.Module:
    backbone = build_backbone(cfg)
    if cfg.objective == "supervised":
        return Classification(backbone, pretraining_head(backbone.width, classes), export_head=False,
                              label_smoothing=cfg.train.label_smoothing)
    m = cfg.mpp
    return MaskedPatchPrediction(backbone, target=m.target, corrupt_rate=m.corrupt_rate, mask_prob=m.mask_prob,
                                 random_prob=m.random_prob, color_bits=m.color_bits, masking=m.masking)


def pretext_evaluator(cfg: Config, accelerator, classes: int | None) -> Evaluator:
    """val/loss and the objective's metrics on the first eval.images of data.val_shards, with a fixed corruption."""
    batches = eval_batches(cfg.data.val_shards, cfg, accelerator, cfg.eval.batch_size)
    if classes:
        batches = labelled(batches, classes, f"data.val_shards ({cfg.data.val_shards})")
    images = LabelledImages(accelerator, batches, cfg.eval.images, f"evaluation shards {cfg.data.val_shards}",
                            need_labels=classes is not None)
    validation = PretextValidation(accelerator, images, cfg.eval.batch_size, cfg.eval.seed)
    return Evaluator(cfg.eval.every, lambda module, step: validation.scores(module))


def run(cfg: Config, *, resume: bool = False) -> dict[str, float]:
    check_output_dir(cfg, resume)
    accelerator = start_training(cfg)
    urls = resolve_shards(cfg.data.shards, cfg, accelerator)
    classes = num_classes(cfg, urls) if cfg.objective == "supervised" else None
    objective = build_objective(cfg, classes)
    start_tracking(accelerator, cfg, "pretrain")
    accelerator.print(
        f"{cfg.objective} pretraining of {cfg.model.name} ({sum(p.numel() for p in objective.backbone.parameters()) / 1e6:.1f}M params) "
        f"on {len(urls)} shards with {accelerator.num_processes} process(es) on {accelerator.device}"
        f"{f' ({torch.get_num_threads()} thread(s) each)' if accelerator.device.type == 'cpu' else ''}, "
        f"{precision_label(accelerator.mixed_precision)}, global batch {cfg.train.batch_size * accelerator.num_processes * cfg.train.grad_accum}")
    evaluators = (training_evaluator(cfg, accelerator),) if cfg.fewshot.every else ()
    evaluators += (knn.training_evaluator(cfg, accelerator),) if cfg.knn.every else ()
    evaluators += (pretext_evaluator(cfg, accelerator, classes),) if cfg.eval.every and cfg.data.val_shards else ()
    started = time.perf_counter()

    def batches(state):
        loader = train_loader(urls, cfg, accelerator, state)
        return labelled(loader, classes, f"data.shards ({cfg.data.shards})") if classes else loader

    results = train(accelerator, objective, batches,
                    cfg.train, cfg.log, cfg.output_dir, resume=resume, max_skip_fraction=cfg.data.max_skip_fraction,
                    evaluators=evaluators, resume_hint=resume_command())
    accelerator.end_training()
    summary = ", ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in results.items() if k.startswith("train/") and k != "train/lr")
    skipped = ", ".join(f"{v:.0f} {k.removeprefix('data/skipped_')}" for k, v in results.items() if k.startswith("data/skipped_") and v)
    accelerator.print(f"done in {time.perf_counter() - started:.0f}s with {accelerator.num_processes} process(es): {summary}; "
                      f"skipped: {skipped or 'none'}; weights in {cfg.output_dir}/model.safetensors")
    return results
