"""Few-shot linear evaluation stage: of a saved backbone (`mpp fewshot`) or periodically during pretraining."""

from __future__ import annotations

import statistics

from accelerate import Accelerator

from mpp.config import Config, Pooling
from mpp.evaluation.ridge import check_pool, few_shot_accuracy
from mpp.evaluation.baselines import beside
from mpp.metrics import Category, Metric
from mpp.model.vit import VisionTransformer
from ..run.loaders import FrozenFeatureSets
from .frozen import FrozenFeatureEvaluator, evaluate_checkpoint


FEWSHOT = Category("few-shot evaluation", order=60, card_rank=40)


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

    def accuracies(self, backbone: VisionTransformer, pooling: Pooling | None = None) -> dict[int, list[float]]:
        """{shots: [accuracy of each draw]}, identical on every process; `pooling` as FrozenFeatureSets.features."""
        c = self.cfg
        train_x, train_y, eval_x, eval_y = self.sets.features(backbone, pooling)
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
