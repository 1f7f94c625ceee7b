"""kNN evaluation stage: of a saved backbone (`mpp knn`) or periodically during pretraining (`knn/top1`)."""

from __future__ import annotations

from accelerate import Accelerator

from mpp.config import Config, Pooling
from mpp.evaluation.baselines import beside
from mpp.evaluation.neighbours import knn_accuracy
from mpp.metrics import KNN_TOP1, Category, Metric
from mpp.model.vit import VisionTransformer
from ..run.loaders import FrozenFeatureSets
from .frozen import FrozenFeatureEvaluator, evaluate_checkpoint


KNN = Category("kNN evaluation", order=40, card_rank=20)


class Knn(FrozenFeatureEvaluator):
    """The labelled neighbour pool and the evaluation images, read once; `scores(backbone)` evaluates a backbone, and
    as an evaluator (pipelines.evaluations.evaluators) the backbone of the objective in training.

    Features are gathered from every process before voting, so the accuracy is the same however many there are.
    """

    def __init__(self, cfg: Config, accelerator: Accelerator):
        self.cfg = cfg.knn
        self.sets = FrozenFeatureSets(cfg, accelerator, cfg.knn, "kNN", "knn", "kNN neighbour shards")
        self.metrics = (Metric(KNN_TOP1, KNN, "kNN top-1 of frozen features", headline=True, percent=True),)

        self.sets.warn_of_missing_classes("kNN neighbour pool")

    def scores(self, backbone: VisionTransformer, pooling: Pooling | None = None) -> dict[str, float]:
        c = self.cfg
        train_x, train_y, eval_x, eval_y = self.sets.features(backbone, pooling)
        return {KNN_TOP1: knn_accuracy(train_x, train_y, eval_x, eval_y, k=c.k, temperature=c.temperature)}


def run(cfg: Config, *, ckpt: str) -> dict:
    """Evaluate the backbone in `ckpt`; print the accuracy and write it to output_dir/knn.json."""

    def measure(cfg: Config, accelerator, backbone) -> tuple[dict, str]:
        knn, c = Knn(cfg, accelerator), cfg.knn
        result = {"features": c.features, "k": c.k, "temperature": c.temperature, "train_images": knn.sets.pool.total,
                  "eval_images": knn.sets.eval.total, "top1": knn.scores(backbone)[KNN_TOP1], "baseline": knn.sets.baseline}
        shown = beside(f"{result['top1']:.2%}", knn.sets.baseline, "{:.2%}".format)
        return result, (f"kNN top-1 {shown} ({c.features} features, k={c.k}, T={c.temperature:g}, "
                        f"{knn.sets.pool.total} neighbours, {knn.sets.eval.total} evaluation images)")

    return evaluate_checkpoint(cfg, ckpt, "knn.json", measure)
