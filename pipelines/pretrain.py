"""Pretraining stage: masked patch prediction on (possibly unlabelled) shards, or supervised on labelled ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from mpp.config import Config
from mpp.objectives import OBJECTIVES, Objective
from mpp.rundir import RESULTS, WEIGHTS
from mpp.runtime import explained_out_of_memory
from mpp.train import train
from pipelines.common import (OutputDirLock, build_backbone, check_output_dir, command_line, end_tracking, labelled,
                              num_classes, resolve_shards, resume_command, resume_point, run_settings, start_run,
                              start_tracking, train_loader)
from pipelines.evaluators import Stage, build_evaluators


def build_objective(cfg: Config, classes: int | None) -> Objective:
    return OBJECTIVES[cfg.objective].build(build_backbone(cfg), cfg, classes)


def run(cfg: Config, *, resume: bool = False) -> dict[str, float]:
    """Pretrain and write output_dir/results.json; returns the last logged scalars and images_seen."""
    changes = check_output_dir(cfg, resume)
    accelerator, cfg, global_batch = start_run(cfg)
    urls = resolve_shards(cfg.data.shards, cfg, accelerator)
    classes = num_classes(cfg, urls) if OBJECTIVES[cfg.objective].reads_labels else None
    objective = build_objective(cfg, classes)
    with OutputDirLock(accelerator, cfg.output_dir):
        resume_from = resume_point(accelerator, cfg, resume, changes)
        start_tracking(accelerator, cfg, "pretrain", objective.headline_charts(), resume_from, changes)
        b = objective.backbone
        accelerator.print(
            f"{cfg.objective} pretraining of a ViT (width {b.width}, depth {b.depth}, {b.heads} heads, patch {b.patch_size}, "
            f"{b.image_size} px; {sum(p.numel() for p in b.parameters()) / 1e6:.1f}M params) "
            f"on {len(urls)} shards with {accelerator.num_processes} process(es) on {accelerator.device}"
            f"{f' ({torch.get_num_threads()} thread(s) each)' if accelerator.device.type == 'cpu' else ''}, "
            f"{run_settings(accelerator, cfg, global_batch)}")
        evaluators = build_evaluators(cfg, accelerator, Stage("pretrain", classes))
        started = time.perf_counter()

        def batches(state):
            loader = train_loader(urls, cfg, accelerator, state, labels=classes is not None)
            return labelled(loader, classes, f"data.shards ({cfg.data.shards})") if classes else loader

        with explained_out_of_memory(cfg.train):
            results = train(accelerator, objective, batches,
                            cfg.train, cfg.log, cfg.output_dir, resume_from=resume_from, max_skip_fraction=cfg.data.max_skip_fraction,
                            evaluators=evaluators, resume_hint=resume_command())
        end_tracking(accelerator)
        if accelerator.is_main_process:
            (Path(cfg.output_dir) / RESULTS).write_text(json.dumps(
                {"objective": cfg.objective, "steps": cfg.train.steps, "final": {k: v for k, v in results.items() if k.startswith(("train/", "fewshot/"))},
                 "command": command_line()}, indent=2) + "\n")
    summary = ", ".join(f"{k.split('/')[-1]} {v:.4g}" for k, v in results.items() if k.startswith("train/") and k != "train/lr")
    skipped = ", ".join(f"{v:.0f} {k.removeprefix('data/skipped_')}" for k, v in results.items() if k.startswith("data/skipped_") and v)
    accelerator.print(f"done in {time.perf_counter() - started:.0f}s with {accelerator.num_processes} process(es): {summary or 'no step trained'}; "
                      f"skipped: {skipped or 'none'}; weights in {cfg.output_dir}/{WEIGHTS}")
    return {**results, "images_seen": cfg.train.steps * global_batch}
