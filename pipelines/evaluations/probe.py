"""Linear probe stage: of a saved backbone (`launch.py probe`) or periodically during pretraining (`probe/top1`)."""

from __future__ import annotations


from accelerate import Accelerator

from mpp.config import Config
from mpp.evaluation.baselines import beside
from mpp.metrics import PROBE_TOP1, Category, Metric
from mpp.model.vit import VisionTransformer
from mpp.evaluation.linear_probe import linear_probe_accuracy
from ..run.loaders import FrozenFeatureSets
from .frozen import FrozenFeatureEvaluator, evaluate_checkpoint


PROBE = Category("linear probe", order=50, card_rank=30)


class LinearProbe(FrozenFeatureEvaluator):
    """The labelled training images and the evaluation images, read once; `scores(backbone)` extracts their
    features once and trains a probe on them, and as an evaluator (pipelines.evaluations.evaluators) scores the backbone of the
    objective in training.

    Features are gathered from every process and each trains the same probe on the CPU, so the accuracy is the same
    on every process and for any number of them.
    """

    def __init__(self, cfg: Config, accelerator: Accelerator):
        self.cfg = cfg.probe
        self.sets = FrozenFeatureSets(cfg, accelerator, cfg.probe, "linear probe", "probe", "linear probe training shards")
        self.metrics = (Metric(PROBE_TOP1, PROBE, "linear probe top-1 of frozen features (SGD)", headline=True, percent=True),)
        # Warned of, as kNN's pool is, not refused as few-shot's is: the probe's pool is a sample of a training set
        # (MAE probes on all of ImageNet's), which may miss a few of many classes and still measure the features.
        self.sets.warn_of_missing_classes("linear probe training pool")

    def scores(self, backbone: VisionTransformer) -> dict[str, float]:
        c = self.cfg
        train_x, train_y, eval_x, eval_y = self.sets.features(backbone)
        return {PROBE_TOP1: linear_probe_accuracy(train_x, train_y, eval_x, eval_y, epochs=c.epochs, lr=c.lr,
                                                  batch_size=c.batch_size, seed=c.seed)}


def run(cfg: Config, *, ckpt: str) -> dict:
    """Probe the backbone in `ckpt`; print the accuracy and write it to output_dir/probe.json."""

    def measure(cfg: Config, accelerator, backbone) -> tuple[dict, str]:
        probe, c = LinearProbe(cfg, accelerator), cfg.probe
        result = {"features": c.features, "epochs": c.epochs, "lr": c.lr, "batch_size": c.batch_size, "seed": c.seed,
                  "train_images": probe.sets.pool.total, "eval_images": probe.sets.eval.total,
                  "top1": probe.scores(backbone)[PROBE_TOP1], "baseline": probe.sets.baseline}
        shown = beside(f"{result['top1']:.2%}", probe.sets.baseline, "{:.2%}".format)
        return result, (f"linear probe top-1 {shown} ({c.features} features, {c.epochs} epochs of "
                        f"SGD at lr {c.lr:g} on {probe.sets.pool.total} images, {probe.sets.eval.total} evaluation images)")

    return evaluate_checkpoint(cfg, ckpt, "probe.json", measure)
