"""Fine-tuning stage: a pretrained (or fresh) backbone plus a zero-initialised linear head, trained on labelled
shards and evaluated on held-out ones, as in the ViT paper's transfer experiments."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from accelerate import Accelerator
from torch import nn

from mpp.model.checkpoint import load_backbone, save_weights
from mpp.config import Config, ConfigError
from mpp.data.stream import BadLabel, DataError, LabelReader, label_members
from mpp.metrics import TOP1, TOP5
from mpp.rundir import PREDICTIONS, BEST
from mpp.data.readers import counted
from mpp.data.shardformat import is_remote, shard_summary
from mpp.model.vit import build_backbone
from mpp.model.objectives import Classification, batch_mixing, finetuning_head
from mpp.training.loop import Evaluator
from ..run.loaders import class_names, labelled, num_classes, resolve_shards, train_loader
from ..run.run_policy import StartingPoint
from ..evaluations.evaluators import stage_evaluators
from ..run.stage import TrainingStage, run_training
from ..run.start import Run


class History:
    """(step, top-1) of every evaluation, checkpointed, so a resumed run reports the whole curve; and the last
    evaluation's per-image label and top-1 class (what predictions.json holds)."""

    def __init__(self) -> None:
        self.points: list[list[float]] = []
        self.classified: dict[str, tuple[int, int]] = {}
        self.best: list[float] | None = None  # [step, top-1] of the best evaluation, with finetune.keep_best
        self.keep: Callable[[nn.Module], None] | None = None  # saves the weights of a new best (main process)

    def state_dict(self) -> dict:
        return {"points": self.points, "best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.points = [list(p) for p in state["points"]]
        self.best = state.get("best")  # absent from the checkpoints of an earlier mpp

    def recording(self, evaluator: Evaluator) -> Evaluator:
        """`evaluator`, with each top-1 it scores added to the curve."""
        def run(module: nn.Module, step: int) -> dict[str, float]:
            scores = evaluator.run(module, step)
            if TOP1 in scores:
                self.points.append([step, scores[TOP1]])
                self.classified = evaluator.run.classified
                if self.keep is not None and (self.best is None or scores[TOP1] > self.best[1]):
                    self.best = [step, scores[TOP1]]
                    self.keep(module)
            return scores

        return Evaluator(evaluator.every, run, evaluator.metrics, evaluator.baselines)


def keep_weights(accelerator: Accelerator, path: Path, module: nn.Module) -> None:
    """Save `module`'s weights (as model.safetensors holds them) to `path`, whole or not at all."""
    if accelerator.is_main_process:
        partial = path.with_name(f".partial-{path.name}")
        save_weights(module, partial)
        os.replace(partial, path)


def prediction_records(classified: dict[str, tuple[int, int]]) -> dict[str, dict[str, int]]:
    """predictions.json: {sample key: {"label": its class id, "predicted": the top-1 class id, "correct": 1 or 0}}."""
    return {key: {"label": label, "predicted": predicted, "correct": int(label == predicted)}
            for key, (label, predicted) in sorted(classified.items())}


def training_class_counts(urls: list[str], classes: int, names: tuple[str, ...]) -> list[int] | None:
    """Training images per class: from the summary.json beside the shards (`prepare` writes it), else counted from the
    labels of local shards (the image bytes are skipped over); None for streamed shards without one."""
    summary = shard_summary(urls)
    if summary is not None and summary.class_counts is not None and len(summary.class_counts) <= classes:
        return summary.class_counts + [0] * (classes - len(summary.class_counts))
    if any(is_remote(url) for url in urls):
        return None
    counts, reader = [0] * classes, LabelReader(names)
    for url in urls:
        for sample in label_members(url):
            with contextlib.suppress(BadLabel):
                label = reader(sample)
                if 0 <= label < classes:
                    counts[label] += 1
    return counts


def build_classifier(cfg: Config, ckpt: str | None, classes: int) -> Classification:
    """The one difference between fine-tuning and training from scratch is where the backbone comes from."""
    backbone = load_backbone(ckpt, cfg.model) if ckpt else build_backbone(cfg.model)
    backbone.set_drop_path(cfg.model.drop_path)
    backbone.grad_checkpointing = cfg.model.grad_checkpointing
    return Classification(backbone, finetuning_head(backbone.width, classes), export_head=True, pool=cfg.finetune.pool,
                          label_smoothing=cfg.train.label_smoothing, mixing=batch_mixing(cfg.train, classes))


def check_evaluation_labels(urls: list[str], classes: int, spec: str, names: tuple[str, ...]) -> None:
    """Read the labels of the local evaluation shards (small; the image bytes are skipped over) before training,
    so a label the head cannot score stops the run now rather than at its first evaluation."""
    reader = LabelReader(names)
    for url in urls:
        if is_remote(url):
            continue  # streamed: checked batch by batch at evaluation
        for sample in label_members(url):
            try:
                label = reader(sample)
            except BadLabel:
                continue  # the evaluation stream counts it as a skipped sample
            if label >= classes:
                raise DataError(f"data.val_shards ({spec}) holds label {label} (in {url}) but the head has {classes} classes "
                                f"(0 to {classes - 1}); set model.num_classes or fix the evaluation shards")


def run(cfg: Config, *, ckpt: str | None, resume: bool | Literal["auto"] = False, overwrite: bool = False) -> dict:
    """Fine-tune the backbone in `ckpt` (None: a fresh one, same recipe) and write output_dir/results.json; returns
    what it holds (top1, top5, the evaluation history, ...)."""
    if cfg.data.val_shards is None:
        raise ConfigError("fine-tuning needs held-out labelled images to evaluate on; set data.val_shards")
    history = History()

    def stage(run: Run) -> TrainingStage:
        accelerator, cfg = run.accelerator, run.cfg
        urls = resolve_shards(cfg.data.shards, cfg, accelerator)
        val_urls = resolve_shards(cfg.data.val_shards, cfg, accelerator)
        classes = num_classes(cfg, urls)
        names = class_names(cfg, accelerator, cfg.data.shards, cfg.data.val_shards)
        if cfg.finetune.keep_best:
            history.keep = functools.partial(keep_weights, accelerator, Path(cfg.output_dir) / BEST)
        check_evaluation_labels(val_urls, classes, cfg.data.val_shards, names)

        def batches(state):
            return labelled(train_loader(urls, cfg, accelerator, state), classes, f"data.shards ({cfg.data.shards})")

        def results(final: dict[str, float]) -> dict:
            if accelerator.is_main_process:
                (Path(cfg.output_dir) / PREDICTIONS).write_text(json.dumps(prediction_records(history.classified)) + "\n")
            best = {"best": {"step": int(history.best[0]), TOP1: history.best[1], "weights": str(Path(cfg.output_dir) / BEST)}} if history.best else {}
            return {"top1": final[TOP1], **({"top5": final[TOP5]} if TOP5 in final else {}),
                    "ckpt": None if ckpt is None else str(ckpt), "num_classes": classes, "history": history.points, **best}

        start = "a fresh backbone (no --ckpt)" if ckpt is None else ckpt
        return TrainingStage("finetune", build_classifier(cfg, ckpt, classes), batches, counted(urls),
                             f"fine-tuning {start} for {classes} classes", classes, results=results,
                             recording=history.recording, checkpointed=(history,), data=shard_summary(urls),
                             class_counts=training_class_counts(urls, classes, names))

    return run_training(cfg, stage, evaluators_of=stage_evaluators, resume=resume, start=StartingPoint.of(ckpt),
                        overwrite=overwrite)
