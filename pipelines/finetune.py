"""Fine-tuning stage: a pretrained (or fresh) backbone plus a zero-initialised linear head, trained on labelled
shards and evaluated on held-out ones, as in the ViT paper's transfer experiments."""

from __future__ import annotations

import json
import time
from pathlib import Path

from torch import nn

from mpp.checkpoint import load_backbone
from mpp.config import Config, ConfigError
from mpp.data import BadLabel, DataError, LabelReader, label_members
from mpp.objectives import Classification, finetuning_head
from mpp.rundir import RESULTS, WEIGHTS
from mpp.runtime import explained_out_of_memory
from mpp.train import Evaluator, train
from pipelines.common import (OutputDirLock, build_backbone, check_output_dir, class_names, command_line, end_tracking,
                              labelled, num_classes, resolve_shards, resume_command, resume_point, run_settings,
                              start_run, start_tracking, train_loader)
from pipelines.evaluators import Stage, build_evaluators


class History:
    """(step, top-1) of every evaluation; checkpointed, so a resumed run reports the whole curve."""

    def __init__(self) -> None:
        self.points: list[list[float]] = []

    def state_dict(self) -> dict:
        return {"points": self.points}

    def load_state_dict(self, state: dict) -> None:
        self.points = [list(p) for p in state["points"]]

    def recording(self, evaluator: Evaluator) -> Evaluator:
        """`evaluator`, with each top-1 it scores added to the curve."""
        def run(module: nn.Module, step: int) -> dict[str, float]:
            scores = evaluator.run(module, step)
            if "eval/top1" in scores:
                self.points.append([step, scores["eval/top1"]])
            return scores

        return Evaluator(evaluator.every, run)


def build_classifier(cfg: Config, ckpt: str | None, classes: int) -> Classification:
    """The one difference between fine-tuning and training from scratch is where the backbone comes from."""
    backbone = load_backbone(ckpt, cfg.model) if ckpt else build_backbone(cfg)
    backbone.set_drop_path(cfg.model.drop_path)
    backbone.grad_checkpointing = cfg.model.grad_checkpointing
    return Classification(backbone, finetuning_head(backbone.width, classes), export_head=True, pool=cfg.finetune.pool,
                          label_smoothing=cfg.train.label_smoothing)


def check_evaluation_labels(urls: list[str], classes: int, spec: str, names: tuple[str, ...]) -> None:
    """Read the labels of the local evaluation shards (small; the image bytes are skipped over) before training,
    so a label the head cannot score stops the run now rather than at its first evaluation."""
    reader = LabelReader(names)
    for url in urls:
        if url.startswith("pipe:") or "://" in url:
            continue  # streamed: checked batch by batch at evaluation
        for sample in label_members(url):
            try:
                label = reader(sample)
            except BadLabel:
                continue  # the evaluation stream counts it as a skipped sample
            if label >= classes:
                raise DataError(f"data.val_shards ({spec}) holds label {label} (in {url}) but the head has {classes} classes "
                                f"(0 to {classes - 1}); set model.num_classes or fix the evaluation shards")


def run(cfg: Config, *, ckpt: str | None, resume: bool = False) -> dict[str, float]:
    """Fine-tune the backbone in `ckpt` (None: a fresh one, same recipe) and write output_dir/results.json."""
    if cfg.data.val_shards is None:
        raise ConfigError("fine-tuning needs held-out labelled images to evaluate on; set data.val_shards")
    changes = check_output_dir(cfg, resume)
    started = time.perf_counter()
    accelerator, cfg, global_batch = start_run(cfg)
    urls = resolve_shards(cfg.data.shards, cfg, accelerator)
    val_urls = resolve_shards(cfg.data.val_shards, cfg, accelerator)
    classes = num_classes(cfg, urls)
    check_evaluation_labels(val_urls, classes, cfg.data.val_shards, class_names(cfg, accelerator, cfg.data.shards, cfg.data.val_shards))
    classifier = build_classifier(cfg, ckpt, classes)
    with OutputDirLock(accelerator, cfg.output_dir):
        resume_from = resume_point(accelerator, cfg, resume, changes)
        start_tracking(accelerator, cfg, "finetune", {**classifier.headline_charts(), "top-1 and top-5 on data.val_shards": ["^eval/"]},
                       resume_from, changes)
        b = classifier.backbone
        accelerator.print(
            f"fine-tuning {'a fresh backbone (no --ckpt)' if ckpt is None else ckpt} (width {b.width}, depth {b.depth}, "
            f"{b.heads} heads, patch {b.patch_size}, {b.image_size} px) for {classes} classes on {len(urls)} shards with "
            f"{accelerator.num_processes} process(es), {run_settings(accelerator, cfg, global_batch)}")

        history = History()
        accelerator.register_for_checkpointing(history)

        evaluators = build_evaluators(cfg, accelerator, Stage("finetune", classes))

        def batches(state):
            return labelled(train_loader(urls, cfg, accelerator, state), classes, f"data.shards ({cfg.data.shards})")

        with explained_out_of_memory(cfg.train):
            results = train(accelerator, classifier, batches, cfg.train, cfg.log, cfg.output_dir, resume_from=resume_from,
                            evaluators=tuple(history.recording(e) for e in evaluators),
                            max_skip_fraction=cfg.data.max_skip_fraction, resume_hint=resume_command())
        end_tracking(accelerator)
    summary = {
        "top1": results["eval/top1"],
        **({"top5": results["eval/top5"]} if "eval/top5" in results else {}),
        "steps": cfg.train.steps,
        "ckpt": None if ckpt is None else str(ckpt),
        "num_classes": classes,
        "images_seen": cfg.train.steps * global_batch,
        "wall_time_s": time.perf_counter() - started,
        "history": history.points,
        "command": command_line(),
    }
    if accelerator.is_main_process:
        out = Path(cfg.output_dir) / RESULTS
        out.write_text(json.dumps(summary, indent=2) + "\n")
        top5 = f", top-5 {100 * summary['top5']:.2f}%" if "top5" in summary else ""
        print(f"fine-tuned {cfg.train.steps} steps in {summary['wall_time_s']:.0f}s: top-1 {100 * summary['top1']:.2f}%{top5} "
              f"on data.val_shards; results in {out}, weights in {cfg.output_dir}/{WEIGHTS}")
    return {k: v for k, v in summary.items() if k in ("top1", "top5", "steps", "images_seen", "wall_time_s")}
