"""Few-shot linear evaluation stage: of a saved backbone (`mpp fewshot`) or periodically during pretraining."""

from __future__ import annotations

import statistics

from accelerate import Accelerator
from pydantic import Field, model_validator

from mpp.config import Config, RESUMABLE, Pooling, Section
from mpp.evaluation.ridge import check_pool, few_shot_accuracy
from mpp.evaluation.baselines import beside
from mpp.metrics import FEWSHOT, Metric
from mpp.model.vit import VisionTransformer
from ..run.loaders import FrozenFeatureSets
from .frozen import FrozenFeatureEvaluator, evaluate_checkpoint


class FewShotConfig(Section):
    every: int = Field(0, ge=0, description="During pretraining, run the few-shot evaluation every N steps and at the end (0 = off).", json_schema_extra=RESUMABLE)
    shots: list[int] = Field([1, 5, 10, 25], min_length=1, description="Labelled examples per class given to the linear classifier; one accuracy per entry.", json_schema_extra=RESUMABLE)
    draws: int = Field(5, gt=0, description="Random draws of the examples per shot count; the accuracy is their mean.", json_schema_extra=RESUMABLE)
    features: Pooling = Field("cls", description="Frozen features: the [class] token's output (cls) or the mean of the patch outputs (mean).", json_schema_extra=RESUMABLE)
    l2: float = Field(1.0, gt=0, description="Ridge penalty of the closed-form least squares (on standardised features).", json_schema_extra=RESUMABLE)
    shards: str | None = Field(None, description="Labelled shards the examples are drawn from; defaults to data.shards.", json_schema_extra=RESUMABLE)
    val_shards: str | None = Field(None, description="Labelled shards the classifiers are scored on; defaults to data.val_shards.", json_schema_extra=RESUMABLE)
    train_images: int = Field(2000, gt=0, description="Images read from the front of the labelled shards to draw the examples from.", json_schema_extra=RESUMABLE)
    eval_images: int = Field(2000, gt=0, description="Images read from the front of fewshot.val_shards to score the classifiers on.", json_schema_extra=RESUMABLE)
    batch_size: int = Field(256, gt=0, description="Images per forward pass when extracting features.", json_schema_extra=RESUMABLE)
    seed: int = Field(0, description="Seed of the example draws (independent of train.seed and of the training run's RNG).", json_schema_extra=RESUMABLE)

    @model_validator(mode="after")
    def _check(self) -> FewShotConfig:
        if any(n <= 0 for n in self.shots):
            raise ValueError(f"fewshot.shots must be positive counts, got {self.shots}")
        return self


class FewShot(FrozenFeatureEvaluator):
    """The labelled example pool and the evaluation images, read once; `scores(backbone)` evaluates a backbone, and
    as an evaluator (pipelines.evaluations.evaluators) the backbone of the objective in training."""

    def __init__(self, cfg: Config, accelerator: Accelerator):
        self.cfg = cfg.fewshot
        self.sets = FrozenFeatureSets(cfg, accelerator, cfg.fewshot, "few-shot", "fewshot", "few-shot training shards")
        self.metrics = tuple(Metric(f"fewshot/{n}shot", FEWSHOT, "few-shot accuracy by shots per class", percent=True)
                             for n in self.cfg.shots)
        # Before any training: a pool that cannot give every class its shots stops a pretraining run at once.
        check_pool(self.sets.pool.all_labels(accelerator), self.sets.eval.all_labels(accelerator), cfg.fewshot.shots)

    def accuracies(self, backbone: VisionTransformer) -> dict[int, list[float]]:
        """{shots: [accuracy of each draw]}, identical on every process."""
        c = self.cfg
        train_x, train_y, eval_x, eval_y = self.sets.features(backbone)
        return few_shot_accuracy(train_x, train_y, eval_x, eval_y, shots=c.shots, draws=c.draws, l2=c.l2, seed=c.seed)

    def scores(self, backbone: VisionTransformer) -> dict[str, float]:
        """{'fewshot/5shot': mean accuracy over the draws, ...} for TensorBoard."""
        return {f"fewshot/{n}shot": statistics.fmean(accs) for n, accs in self.accuracies(backbone).items()}


def run(cfg: Config, *, ckpt: str) -> dict:
    """Evaluate the backbone in `ckpt`; print the accuracies and write them to output_dir/fewshot.json."""

    def measure(cfg: Config, accelerator, backbone) -> tuple[dict, str]:
        fewshot, c = FewShot(cfg, accelerator), cfg.fewshot
        accuracies = fewshot.accuracies(backbone)
        result = {"features": c.features, "l2": c.l2, "draws": c.draws,
                  "train_images": fewshot.sets.pool.total, "eval_images": fewshot.sets.eval.total,
                  "accuracy": {str(n): statistics.fmean(a) for n, a in accuracies.items()},
                  "accuracy_std": {str(n): statistics.pstdev(a) for n, a in accuracies.items()}, "baseline": fewshot.sets.baseline}
        shown = ", ".join(f"{n}-shot {100 * a:.1f}% (+-{100 * result['accuracy_std'][n]:.1f})" for n, a in result["accuracy"].items())
        baseline = beside("", fewshot.sets.baseline, "{:.1%}".format).strip()
        return result, (f"few-shot linear accuracy {shown} against {baseline} ({c.features} features, {c.draws} draws, "
                        f"{fewshot.sets.eval.total} evaluation images)")

    return evaluate_checkpoint(cfg, ckpt, "fewshot.json", measure)
