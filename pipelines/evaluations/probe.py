"""Linear probe stage: of a saved backbone (`launch.py probe`) or periodically during pretraining (`probe/top1`)."""

from __future__ import annotations


from accelerate import Accelerator
from pydantic import Field

from mpp.config import RESUMABLE, Config, Pooling, Section
from mpp.evaluation.baselines import beside
from mpp.metrics import PROBE, PROBE_TOP1, Metric
from mpp.model.vit import VisionTransformer
from mpp.evaluation.linear_probe import linear_probe_accuracy
from ..run.loaders import FrozenFeatureSets
from .frozen import FrozenFeatureEvaluator, evaluate_checkpoint


class ProbeConfig(Section):
    every: int = Field(0, ge=0, description="During pretraining, run the linear probe every N steps and at the end (0 = off).", json_schema_extra=RESUMABLE)
    epochs: int = Field(90, gt=0, description="Passes of SGD over the cached frozen features (MAE's linear probe: 90).", json_schema_extra=RESUMABLE)
    lr: float = Field(0.1, gt=0, description="Peak learning rate of the probe's SGD (momentum 0.9, no weight decay, cosine decay to 0 over its steps).", json_schema_extra=RESUMABLE)
    features: Pooling = Field("cls", description="Frozen features: the [class] token's output (cls) or the mean of the patch outputs (mean).", json_schema_extra=RESUMABLE)
    shards: str | None = Field(None, description="Labelled shards the probe is trained on; defaults to data.shards.", json_schema_extra=RESUMABLE)
    val_shards: str | None = Field(None, description="Labelled shards the probe is scored on; defaults to data.val_shards.", json_schema_extra=RESUMABLE)
    train_images: int = Field(5000, gt=0, description="Images read from the front of the labelled shards to train the probe on.", json_schema_extra=RESUMABLE)
    eval_images: int = Field(2000, gt=0, description="Images read from the front of probe.val_shards to score the probe on.", json_schema_extra=RESUMABLE)
    batch_size: int = Field(256, gt=0, description="Images per forward pass when extracting features, and features per SGD step of the probe.", json_schema_extra=RESUMABLE)
    seed: int = Field(0, description="Seed of the probe's initialisation and feature order (a private generator, independent of the training run's RNG).", json_schema_extra=RESUMABLE)


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
