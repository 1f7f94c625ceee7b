"""Evaluators from config: which ones a training stage runs, and the builders that pipelines.evaluations.registry's
EVALUATORS names.

A builder is called once, before training, as build(cfg, accelerator, stage) and returns what the loop calls as
evaluate(objective, step) -> {tag: value} (the contract: mpp.training.loop.Evaluator), with the Metric of every tag it
returns in `evaluate.metrics`: they reach TensorBoard's charts, HParams, the progress bar, results.json and the model
card from there. Evaluators read their images through pipelines.run.loaders.eval_batches; one that scores a fixed
set reads it in its builder, so a bad evaluation set stops the run before its first step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from torch import nn

from mpp.config import Config
from mpp.data.split import HeldOut
from mpp.data.stream import DataError
from mpp.evaluation.ridge import LabelledImages
from mpp.evaluation.baselines import class_baselines
from mpp.metrics import BALANCED_ACC, CLASS_TOP1, EVALUATION, TOP1, TOP5, Metric
from mpp.evaluation.per_class import balanced_accuracy, class_recalls
from mpp.model.objectives import Objective
from mpp.training.loop import Evaluator
from mpp.evaluation.pretext import PretextValidation
from mpp.model.registry import implementation
from .fewshot import FewShot
from .inspection import Inspect
from .knn import Knn
from ..run.loaders import KeptPass, eval_batches, labelled
from .probe import LinearProbe
from .registry import EVALUATORS


class Evaluate(Protocol):
    """What a builder returns: evaluate(objective, step) -> {tag: value}, each tag declared in `metrics`."""

    metrics: tuple[Metric, ...]

    def __call__(self, objective: nn.Module, step: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class Stage:
    """What a training stage tells its evaluators besides the config."""

    name: str  # "pretrain" or "finetune"
    classes: int | None = None  # the classes the objective is trained on; None: trained without labels
    objective: Objective | None = None  # what it trains (the pretext validation scores its loss)
    held_out: HeldOut | None = None  # the images finetune.val_split holds out of data.shards, scored in place of data.val_shards


class TopK:
    """eval/top1 (and eval/top5 with more than 5 classes), eval/balanced_acc and each class's top-1
    (eval/class_top1/<id>) of the classifier being fine-tuned, over one pass of data.val_shards (or the images
    finetune.val_split holds out of data.shards) split across processes; counts are summed over processes, so the
    result is exact however unevenly the shards split. `predictions` holds the last pass's per-image top-1 hit by sample key (gathered from
    every process): what compare pairs between arms scored on the same images; `classified` its label and top-1
    class."""

    def __init__(self, cfg: Config, accelerator: Accelerator, stage: Stage):
        self.cfg, self.accelerator, self.classes, self.held_out = cfg, accelerator, stage.classes, stage.held_out
        where = "data.val_shards" if self.held_out is None else "the images finetune.val_split holds out"
        spec, keep = (cfg.data.val_shards, None) if self.held_out is None else (cfg.data.shards, self.held_out.evaluated)
        self.batches = KeptPass(lambda: eval_batches(spec, cfg, accelerator, cfg.train.batch_size,
                                                     num_workers=cfg.data.num_workers, keep=keep))
        self.predictions: dict[str, bool] = {}
        self.classified: dict[str, tuple[int, int]] = {}  # the last pass's (label, top-1 class) by sample key
        self.labels: list[int] = []  # the last pass's labels, from every process (the majority-class baseline)
        # A chart each: with a comparison's runs, top-1 and top-5 on one chart are two bands of lines of the same
        # colours (Custom Scalars colours by run and shows no legend).
        self.metrics = (Metric(TOP1, EVALUATION, f"top-1 on {where}", headline=True, bar="top1", percent=True),
                        *([Metric(TOP5, EVALUATION, f"top-5 on {where}", headline=True, percent=True)]
                          if self.classes > 5 else []),
                        Metric(BALANCED_ACC, EVALUATION, f"balanced accuracy (the mean of the classes' top-1) on {where}",
                               headline=True, percent=True),
                        *(Metric(f"{CLASS_TOP1}{label}", EVALUATION, f"top-1 of each class on {where} (results.json's "
                                 f"per_class names them)", percent=True) for label in range(self.classes)))

    def __call__(self, classifier: nn.Module, step: int) -> dict[str, float]:
        return self.scores(classifier)

    @torch.no_grad()
    def scores(self, classifier: nn.Module) -> dict[str, float]:
        cfg, accelerator = self.cfg, self.accelerator
        k = min(5, self.classes)
        counts = torch.zeros(3, device=accelerator.device)  # top-1 correct, top-k correct, images
        by_class = torch.zeros(2, self.classes, device=accelerator.device)  # top-1 correct, images, of each class
        keys, top1, labels_seen = [], [], []
        classifier.eval()
        spec = f"data.val_shards ({cfg.data.val_shards})" if self.held_out is None else f"data.shards ({cfg.data.shards})"
        for batch in labelled(self.batches, self.classes, spec):
            labels = batch.labels.to(accelerator.device)
            with accelerator.autocast():
                logits = classifier.logits(batch.images.to(accelerator.device))
            ranked = logits.topk(k, dim=-1).indices  # (B, k)
            hits = ranked == labels[:, None]
            counts += torch.stack([hits[:, 0].sum(), hits.any(dim=-1).sum(), torch.tensor(len(labels), device=labels.device)]).float()
            by_class += torch.stack([torch.bincount(labels[hits[:, 0]], minlength=self.classes),
                                     torch.bincount(labels, minlength=self.classes)]).float()
            keys.extend(batch.keys)
            top1.append(ranked[:, 0])
            labels_seen.append(labels)
        correct, topk, total = accelerator.reduce(counts, reduction="sum").tolist()
        class_correct, class_images = accelerator.reduce(by_class, reduction="sum").tolist()
        mine = zip(keys, torch.cat(labels_seen).tolist(), torch.cat(top1).tolist()) if top1 else ()  # one host read each
        self.classified = {key: (label, predicted) for part in gather_object([list(mine)]) for key, label, predicted in part}
        self.predictions = {key: label == predicted for key, (label, predicted) in self.classified.items()}
        self.labels = [label for label, _ in self.classified.values()]
        if not total:
            raise DataError(f"data.val_shards ({cfg.data.val_shards}) holds no readable images; point it at labelled evaluation shards")
        scores = {TOP1: correct / total}
        if self.classes > 5:
            scores[TOP5] = topk / total
        recalls = class_recalls(class_correct, class_images)
        scores[BALANCED_ACC] = balanced_accuracy(recalls)
        scores.update({f"{CLASS_TOP1}{label}": recall for label, recall in recalls.items()})
        return scores


    def baselines(self) -> dict[str, dict[str, float]]:
        """eval/top1 beside always answering the evaluation images' own largest class (the best a constant answer
        scores on them, however the training labels are spread) and chance; eval/balanced_acc beside a constant answer
        (1 / the classes the evaluation images hold) and chance."""
        seen = Counter(self.labels)
        balanced = {"majority": 1 / len(seen), "chance": 1 / self.classes} if seen else {"chance": 1 / self.classes}
        return {TOP1: class_baselines([seen[label] for label in range(self.classes)], self.labels, self.classes),
                BALANCED_ACC: balanced}


class Pretext:
    """The objective's loss (MPP: val/pretext_loss) and metrics on the first eval.images of data.val_shards, with a fixed corruption."""

    def __init__(self, cfg: Config, accelerator: Accelerator, stage: Stage):
        batches = eval_batches(cfg.data.val_shards, cfg, accelerator, cfg.eval.batch_size, labels=stage.classes is not None)
        if stage.classes:
            batches = labelled(batches, stage.classes, f"data.val_shards ({cfg.data.val_shards})")
        images = LabelledImages(accelerator, batches, cfg.eval.images, f"evaluation shards {cfg.data.val_shards}",
                                need_labels=stage.classes is not None)
        self.validation = PretextValidation(accelerator, images, cfg.eval.batch_size, cfg.eval.seed)
        self.metrics = tuple(stage.objective.metrics("val"))

    def __call__(self, objective: nn.Module, step: int) -> dict[str, float]:
        return self.validation.scores(objective)


# The builders of the evaluators that score the backbone alone, whatever the stage trains.

def fewshot(cfg: Config, accelerator: Accelerator, stage: Stage) -> FewShot:
    return FewShot(cfg, accelerator)


def knn(cfg: Config, accelerator: Accelerator, stage: Stage) -> Knn:
    return Knn(cfg, accelerator)


def probe(cfg: Config, accelerator: Accelerator, stage: Stage) -> LinearProbe:
    return LinearProbe(cfg, accelerator)


def inspect(cfg: Config, accelerator: Accelerator, stage: Stage) -> Inspect:
    return Inspect(cfg, accelerator)


def build_evaluators(cfg: Config, accelerator: Accelerator, stage: Stage) -> tuple[Evaluator, ...]:
    """The evaluators of `stage` that `cfg` turns on, in EVALUATORS' order, each built (its images read) now."""
    built = [(every, implementation(registration.build)(cfg, accelerator, stage)) for registration in EVALUATORS.values()
             if stage.name in registration.stages and (every := registration.every(cfg))]
    return tuple(Evaluator(every, evaluate, tuple(evaluate.metrics), getattr(evaluate, "baselines", dict)) for every, evaluate in built)


def stage_evaluators(cfg: Config, accelerator: Accelerator, stage) -> tuple[Evaluator, ...]:
    """The evaluators of a training stage (pipelines.run.stage.TrainingStage): what pretrain and finetune hand
    run_training."""
    return build_evaluators(cfg, accelerator, Stage(stage.name, stage.classes, stage.objective, stage.held_out))
