"""Pretraining stage: masked patch prediction on (possibly unlabelled) shards, or supervised on labelled ones."""

from __future__ import annotations

from typing import Literal

from mpp.config import Config
from mpp.model.vit import build_backbone
from mpp.model.objectives import Objective
from mpp.model.registry import OBJECTIVES
from ..run.loaders import labelled, num_classes, resolve_shards, train_loader
from ..evaluations.evaluators import stage_evaluators
from ..run.stage import TrainingStage, run_training
from ..run.start import Run
from mpp.data.readers import counted
from mpp.data.shardformat import shard_summary


def build_objective(cfg: Config, classes: int | None) -> Objective:
    return OBJECTIVES[cfg.objective].objective(build_backbone(cfg.model), cfg, classes)


def run(cfg: Config, *, resume: bool | Literal["auto"] = False, overwrite: bool = False) -> dict:
    """Pretrain and write output_dir/results.json; returns what it holds. `resume` continues the run in output_dir,
    `overwrite` starts over there."""

    def stage(run: Run) -> TrainingStage:
        accelerator, cfg = run.accelerator, run.cfg
        urls = resolve_shards(cfg.data.shards, cfg, accelerator)
        classes = num_classes(cfg, urls) if OBJECTIVES[cfg.objective].reads_labels else None

        def batches(state):
            loader = train_loader(urls, cfg, accelerator, state, labels=classes is not None)
            return labelled(loader, classes, f"data.shards ({cfg.data.shards})") if classes else loader

        return TrainingStage("pretrain", build_objective(cfg, classes), batches, counted(urls),
                             f"{cfg.objective} pretraining of a ViT", classes, data=shard_summary(urls))

    return run_training(cfg, stage, evaluators_of=stage_evaluators, resume=resume, overwrite=overwrite)
