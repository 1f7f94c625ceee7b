"""The evaluations' settings, as the run config knows them, without loading torch: the sections `eval` (the pretext
validation), `fewshot`, `knn`, `probe` and `inspect`. They belong to the library, so that `mpp.config.load_config`
reads every shipped config with `mpp` alone; pipelines.evaluations.registry pairs each with the builder a training
stage runs.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from mpp.config import RESUMABLE, DataConfig, Pooling, SECTION_SOURCES, Section, section_field


class EvalConfig(Section):
    every: int = Field(500, ge=0, description="Pretext validation: when data.val_shards is set, pretraining computes its loss and metrics (MPP: val/pretext_loss, val/color_acc) on held-out images every N steps and at the end (0 = off).")
    images: int = Field(512, gt=0, description="Images read from the front of data.val_shards for the pretext validation; the same images and corrupted positions at every evaluation.")
    batch_size: int = Field(128, gt=0, description="Images per forward pass of the pretext validation.")
    seed: int = Field(0, description="Seed of the pretext validation's fixed corruption (a private generator, independent of the training run's RNG).")


class ReadsLabelledShards:
    """A frozen-feature evaluation's section: it reads a labelled pool (`shards`) and images to score (`val_shards`),
    each the run's data.shards or data.val_shards where unset."""

    def shards_read(self, data: DataConfig) -> dict[str, str | None]:
        """Its shard keys as the run reads them, data's standing in for those left unset (None: none to read)."""
        return {"shards": self.shards or data.shards, "val_shards": self.val_shards or data.val_shards}


class FewShotConfig(ReadsLabelledShards, Section):
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


class KnnConfig(ReadsLabelledShards, Section):
    every: int = Field(0, ge=0, description="During pretraining, run the kNN evaluation every N steps and at the end (0 = off).")
    k: int = Field(20, gt=0, description="Neighbours that vote (DINO's k=20).")
    temperature: float = Field(0.07, gt=0, description="Votes are weighted by exp(cosine similarity / temperature) (DINO's 0.07).")
    features: Pooling = Field("cls", description="Frozen features: the [class] token's output (cls) or the mean of the patch outputs (mean).")
    shards: str | None = Field(None, description="Labelled shards the neighbours come from; defaults to data.shards.")
    val_shards: str | None = Field(None, description="Labelled shards whose images are classified; defaults to data.val_shards (set it when pretraining validates on other classes than kNN scores).")
    train_images: int = Field(5000, gt=0, description="Images read from the front of the labelled shards as the neighbour pool.")
    eval_images: int = Field(2000, gt=0, description="Images read from the front of knn.val_shards to classify.")
    batch_size: int = Field(256, gt=0, description="Images per forward pass when extracting features.")


class ProbeConfig(ReadsLabelledShards, Section):
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


class InspectConfig(Section):
    every: int = Field(0, ge=0, description="During pretraining and fine-tuning, draw the inspection views (patch-embedding filters, position-embedding similarity, mean attention distance, attention rollout) in TensorBoard every N steps and at the end (0 = off).", json_schema_extra=RESUMABLE)
    shards: str | None = Field(None, description="Shards whose images the attention views are computed on; defaults to data.val_shards, else data.shards.", json_schema_extra=RESUMABLE)
    images: int = Field(64, gt=0, description="Images read from the front of inspect.shards; the mean attention distance averages over all of them.", json_schema_extra=RESUMABLE)
    rollout_images: int = Field(4, gt=0, description="How many of them the attention-rollout figure overlays.", json_schema_extra=RESUMABLE)
    filters: int = Field(28, gt=0, description="Principal components of the patch embedding's filters shown (the paper's Figure 7 shows 28).", json_schema_extra=RESUMABLE)
    batch_size: int = Field(64, gt=0, description="Images per forward pass of the explicit-attention path.", json_schema_extra=RESUMABLE)

    def shards_read(self, data: DataConfig) -> dict[str, str | None]:
        """inspect.shards as the run reads it: data.val_shards, else data.shards, where unset."""
        return {"shards": self.shards or data.val_shards or data.shards}

    @model_validator(mode="after")
    def _rollout_among_images(self) -> InspectConfig:
        if self.rollout_images > self.images:
            raise ValueError(f"inspect.rollout_images={self.rollout_images} is more than the inspect.images={self.images} "
                             f"read; lower it or raise inspect.images")
        return self


# Each section under its key in the run config.
EVALUATION_SECTIONS: dict[str, type[Section]] = {
    "eval": EvalConfig, "fewshot": FewShotConfig, "knn": KnnConfig, "probe": ProbeConfig, "inspect": InspectConfig,
}
SECTION_SOURCES.append(lambda: {key: section_field(section) for key, section in EVALUATION_SECTIONS.items()})
