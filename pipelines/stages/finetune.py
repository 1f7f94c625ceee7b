"""Fine-tuning stage: a pretrained (or fresh) backbone plus a zero-initialised linear head, trained on labelled
shards and evaluated on held-out ones, as in the ViT paper's transfer experiments."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Literal

from accelerate import Accelerator
from torch import nn

from mpp.model.checkpoint import load_backbone, save_weights
from mpp.config import Config, ConfigError
from mpp.data.split import hold_out
from mpp.errors import command
from mpp.evaluation.per_class import per_class_report
from mpp.data.stream import BadLabel, DataError, LabelReader, label_members
from mpp.metrics import BALANCED_ACC, TOP1, TOP5
from mpp.rundir import PREDICTIONS, BEST, written_whole
from mpp.data.readers import counted
from mpp.data.shardformat import is_remote, shard_summary
from mpp.model.vit import build_backbone
from mpp.model.objectives import Classification, balancing_weights, batch_mixing, finetuning_head
from mpp.training.loop import Evaluator
from ..run.loaders import class_names, label_reader, labelled, num_classes, resolve_shards, train_loader
from ..run.run_policy import StartingPoint
from ..evaluations.evaluators import stage_evaluators
from ..run.stage import TrainingStage, run_training
from ..run.start import Run


class History:
    """(step, top-1) of every evaluation, checkpointed, so a resumed run reports the whole curve; and the last
    evaluation's per-image label and top-1 class (what predictions.json holds).

    With finetune.keep_best, the best evaluation's step and score, and the bytes of best.safetensors written for it,
    are checkpointed too: a resume puts back the file of the best its checkpoint knows, so a best found after the last
    checkpoint by a run that was killed (a step trained again, or not at all, by the resumed run) never stays in
    best.safetensors beside a results.json naming another step. An evaluation that ties the best replaces it: the
    later, longer-trained weights, as compare breaks exact ties towards the longer training."""

    def __init__(self) -> None:
        self.points: list[list[float]] = []
        self.classified: dict[str, tuple[int, int]] = {}
        self.best: list[float] | None = None  # [step, top-1] of the best evaluation, with finetune.keep_best
        self.best_weights: bytes | None = None  # best.safetensors as written for it (main process)
        self.keep: BestWeights | None = None  # where the best's weights go, with finetune.keep_best

    def state_dict(self) -> dict:
        return {"points": self.points, "best": self.best, "best_weights": self.best_weights}

    def load_state_dict(self, state: dict) -> None:
        self.points = [list(p) for p in state["points"]]
        self.best = state.get("best")  # absent from the checkpoints of an earlier mpp
        if self.keep is not None and "best_weights" in state:  # an earlier mpp's checkpoint kept no weights: left as is
            self.best_weights = state["best_weights"]
            self.keep.restore(self.best_weights)
        if self.keep is not None and self.best is None and self.points:
            self.keep.accelerator.print(
                f"finetune.keep_best: the run kept no best before this resume, so best.safetensors will hold the best "
                f"of the evaluations from here on; its earlier ones (up to step {int(self.points[-1][0])}) were scored, "
                f"but their weights were not kept")

    def recording(self, evaluator: Evaluator) -> Evaluator:
        """`evaluator`, with each top-1 it scores added to the curve."""
        def run(module: nn.Module, step: int) -> dict[str, float]:
            scores = evaluator.run(module, step)
            if TOP1 in scores:
                self.points.append([step, scores[TOP1]])
                self.classified = evaluator.run.classified
                if self.keep is not None and (self.best is None or scores[TOP1] >= self.best[1]):
                    self.best = [step, scores[TOP1]]
                    self.best_weights = self.keep.write(module)
            return scores

        return Evaluator(evaluator.every, run, evaluator.metrics, evaluator.baselines)


class BestWeights:
    """best.safetensors (finetune.keep_best), written whole or not at all by the main process."""

    def __init__(self, accelerator: Accelerator, path: Path):
        self.accelerator, self.path = accelerator, path

    def write(self, module: nn.Module) -> bytes | None:
        """Save `module`'s weights (as model.safetensors holds them); their file's bytes (None on other processes)."""
        if not self.accelerator.is_main_process:
            return None
        written_whole(self.path, lambda temporary: save_weights(module, temporary))
        return self.path.read_bytes()

    def restore(self, written: bytes | None) -> None:
        """Put back the file a checkpoint kept (`written`), or, where it kept none, remove one a later run left."""
        if not self.accelerator.is_main_process:
            return
        if written is None:
            self.path.unlink(missing_ok=True)
            return
        written_whole(self.path, lambda temporary: temporary.write_bytes(written))


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


def build_classifier(cfg: Config, ckpt: str | None, classes: int, names: tuple[str, ...] = (),
                     class_counts: list[int] | None = None) -> Classification:
    """The one difference between fine-tuning and training from scratch is where the backbone comes from. `names`
    (the training shards' class names) go into the weights it saves, so a copied file still names its classes;
    `class_counts` (training images per class) weight the loss under finetune.class_balance=loss_weights (scoring
    a trained classifier needs none)."""
    backbone = load_backbone(ckpt, cfg.model) if ckpt else build_backbone(cfg.model)
    backbone.set_drop_path(cfg.model.drop_path)
    backbone.grad_checkpointing = cfg.model.grad_checkpointing
    balanced = cfg.finetune.class_balance == "loss_weights" and class_counts is not None
    weights = balancing_weights(class_counts) if balanced else None
    return Classification(backbone, finetuning_head(backbone.width, classes), export_head=True, pool=cfg.finetune.pool,
                          label_smoothing=cfg.train.label_smoothing, mixing=batch_mixing(cfg.train, classes),
                          class_names=names, class_weights=weights)


def check_evaluation_labels(urls: list[str], classes: int, spec: str, reader: LabelReader) -> None:
    """Read the labels of the local evaluation shards (small; the image bytes are skipped over) through `reader`
    before training, so a label the head cannot score stops the run now rather than at its first evaluation."""
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
    if cfg.data.val_shards is None and not cfg.finetune.val_split:
        raise ConfigError("fine-tuning needs held-out labelled images to evaluate on; set data.val_shards, or "
                          "finetune.val_split=0.1 to hold out a tenth of each class of data.shards")
    # A split asked for replaces the evaluation shards a config file names (the default one names Fashion-MNIST's).
    unread = cfg.data.val_shards if cfg.finetune.val_split else None
    if unread is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"val_shards": None})})
    history = History()

    def stage(run: Run) -> TrainingStage:
        accelerator, cfg = run.accelerator, run.cfg
        urls = resolve_shards(cfg.data.shards, cfg, accelerator)
        classes = num_classes(cfg, urls)
        names = class_names(cfg, accelerator, cfg.data.shards)
        if cfg.finetune.keep_best:
            history.keep = BestWeights(accelerator, Path(cfg.output_dir) / BEST)
        held_out = None
        if cfg.finetune.val_split:
            held_out = hold_out(urls, names, classes, cfg.finetune.val_split, cfg.train.seed, cfg.data.shards)
            counts = list(held_out.trained_counts)
            fewest, most = min(held_out.held_counts), max(held_out.held_counts)
            accelerator.print(f"finetune.val_split={cfg.finetune.val_split:g}: {sum(held_out.held_counts)} of the "
                              f"{sum(held_out.held_counts) + sum(counts)} images of data.shards held out to evaluate on "
                              f"({fewest if fewest == most else f'{fewest}-{most}'} of each class), never trained on"
                              f"{'' if unread is None else f'; data.val_shards ({unread}) is not read'}")
        else:
            check_evaluation_labels(resolve_shards(cfg.data.val_shards, cfg, accelerator), classes, cfg.data.val_shards,
                                    label_reader(cfg, accelerator, cfg.data.val_shards))
            counts = training_class_counts(urls, classes, names)
        if cfg.finetune.class_balance == "loss_weights" and counts is None:
            raise DataError(f"finetune.class_balance=loss_weights needs the training images per class, which data.shards "
                            f"({cfg.data.shards}) does not give (streamed shards without a summary.json with class_counts); "
                            f"write the shards with `{command('prepare')}`, or set finetune.class_balance=none")

        def batches(state):
            stream = train_loader(urls, cfg, accelerator, state, keep=held_out.trained if held_out else None)
            return labelled(stream, classes, f"data.shards ({cfg.data.shards})")

        def results(final: dict[str, float]) -> dict:
            if accelerator.is_main_process:
                (Path(cfg.output_dir) / PREDICTIONS).write_text(json.dumps(prediction_records(history.classified)) + "\n")
            best = {"best": {"step": int(history.best[0]), TOP1: history.best[1], "weights": str(Path(cfg.output_dir) / BEST)}} if history.best else {}
            split = {"val_split": {"fraction": held_out.fraction, "seed": cfg.train.seed, "held_out": sum(held_out.held_counts),
                                   "trained_on": sum(held_out.trained_counts)}} if held_out else {}
            return {"top1": final[TOP1], **({"top5": final[TOP5]} if TOP5 in final else {}),
                    **({"balanced_acc": final[BALANCED_ACC]} if BALANCED_ACC in final else {}),
                    "per_class": per_class_report(history.classified.values(), names, classes),
                    "ckpt": None if ckpt is None else str(ckpt), "num_classes": classes, "history": history.points,
                    **best, **split}

        start = "a fresh backbone (no --ckpt)" if ckpt is None else ckpt
        return TrainingStage("finetune", build_classifier(cfg, ckpt, classes, names, counts), batches, counted(urls),
                             f"fine-tuning {start} for {classes} classes", classes, results=results,
                             recording=history.recording, checkpointed=(history,), data=shard_summary(urls),
                             class_counts=counts, held_out=held_out)

    return run_training(cfg, stage, evaluators_of=stage_evaluators, resume=resume, start=StartingPoint.of(ckpt),
                        overwrite=overwrite)
