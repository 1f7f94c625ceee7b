"""Typed run configuration: YAML files plus dotted `key=value` overrides, validated at load."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from mpp.errors import UserError, command
from mpp.model import Variant, parse_model_name, resnet_stride, resolve_variant
from mpp.objectives import OBJECTIVES
from mpp.targets import TARGETS
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo


MAX_HEAD_BYTES = 10**9  # a larger MPP head (e.g. color4x4 at 8 bits: 268M outputs) only exhausts memory


class ConfigError(UserError):
    """A user mistake in a config file or override; the message is one sentence with the fix."""


# One vocabulary for what a head or probe reads from the encoder: fine-tuning, few-shot, kNN and the linear probe.
Pooling = Literal["cls", "mean"]


def one_of(key: str, value: str, choices) -> str:
    """`value` if it names one of `choices` (a registry); else the error pydantic gives a Literal, worded the same."""
    if value in choices:
        return value
    names = [f"'{c}'" for c in choices]
    listed = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    raise ValueError(f"invalid value for '{key}': Input should be {listed} (got {value!r})")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Marks a field that a resume may change (json_schema_extra=RESUMABLE): it applies from the resumed step on. Every
# other field shapes the model, its optimiser state or the data stream the checkpoint continues, and a resume that
# changes it is refused.
RESUMABLE = {"resumable": True}


class DataConfig(Section):
    shards: str = Field("synthetic", description="Training shards: a directory of .tar files, a brace pattern, URLs, 'pipe:' commands, or 'synthetic' for the embedded corpus.")
    val_shards: str | None = Field(None, description="Evaluation shards (same forms as data.shards); used by fine-tuning, few-shot and kNN evaluation, and the pretext validation of pretraining.", json_schema_extra=RESUMABLE)
    synthetic_size: int = Field(20000, gt=0, description="Images in the embedded synthetic corpus, generated on first use into data/synthetic-<size> (data/synthetic-20000 by default) under the working directory.")
    num_workers: int = Field(2, ge=0, description="Dataloader worker processes per rank that decode images.")
    shuffle_buffer: int = Field(2000, ge=0, description="Samples held in the shuffle buffer of each worker (0 disables shuffling).")
    resampled: bool = Field(True, description="Draw shards with replacement forever (no rank ever runs dry); false streams each pass over the shards exactly once per rank.")
    crop_scale: tuple[float, float] = Field((0.08, 1.0), description="Area fraction range of the random-resized crop.")
    hflip: bool = Field(True, description="Random horizontal flip during training.")
    randaugment_ops: int = Field(0, ge=0, description="RandAugment (Cubuk et al. 2020) of the training crops: operations applied per image, each drawn from the paper's 13 (rotate, shear, translate, colour, contrast, solarize, ...); 0 = off (DeiT and MAE fine-tune with 2).")
    randaugment_magnitude: float = Field(9.0, ge=0, le=10, description="RandAugment's magnitude M of every operation, from 0 to 10 (timm's rand-m9: 9).")
    randaugment_magnitude_std: float = Field(0.5, ge=0, description="Standard deviation of the Gaussian noise added to the magnitude at each operation (timm's mstd0.5); 0 = the paper's fixed M.")
    max_skip_fraction: float = Field(0.05, ge=0, le=1, description="Stop with an error when more than this fraction of the samples read are unusable (corrupt, missing image, bad label) or lost in shards that could not be read to their end.", json_schema_extra=RESUMABLE)

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"data.crop_scale must satisfy 0 < min <= max <= 1, got {list(self.crop_scale)}")
        return self


class ModelConfig(Section):
    name: str = Field("vit_ti", description="ViT variant: vit_ti, vit_s, vit_b, vit_l or vit_h, optionally with the patch size appended (vit_b16).")
    image_size: int = Field(224, gt=0, description="Input resolution in pixels (square).")
    patch_size: int | None = Field(None, gt=0, description="Patch side in pixels; defaults to the number in model.name, else 16.")
    width: int | None = Field(None, gt=0, description="Override the variant's embedding width.")
    depth: int | None = Field(None, gt=0, description="Override the variant's number of Transformer blocks.")
    heads: int | None = Field(None, gt=0, description="Override the variant's number of attention heads (must divide the width).")
    num_classes: int | None = Field(None, gt=0, description="Classes of the classification head (supervised pretraining, fine-tuning); null reads them from summary.json beside the training shards.")
    drop_path: float = Field(0.0, ge=0, lt=1, description="Stochastic depth: the rate at which the last block's residual branches are dropped per sample in training, rising linearly from 0 at the first block (off in eval).")
    grad_checkpointing: bool = Field(False, description="Activation checkpointing: keep only each block's input and recompute its activations in the backward pass (about a third more compute for a fraction of the activation memory; for large models and batches).", json_schema_extra=RESUMABLE)
    stem: Literal["patch", "resnet"] = Field("patch", description="What turns the image into tokens: patch, a linear projection of each patch (the paper's ViT); resnet, the paper's hybrid, a ResNet (BiT's: Group Normalization, weight-standardised convolutions) whose feature map's 1x1 cells are the tokens, each the image region of the ResNet's stride (model.patch_size, which defaults to that stride).")
    stem_layers: list[int] = Field([3, 4, 9], min_length=1, max_length=4, description="With model.stem=resnet: bottleneck units per ResNet stage; the stride is 4 x 2^(stages - 1). The paper's R50 hybrid: [3, 4, 9] (ResNet-50 with stage 4's units moved into stage 3), stride 16.")
    stem_width: int = Field(64, gt=0, description="With model.stem=resnet: channels of the ResNet's root convolution; stage s has 4 x width x 2^s output channels (ResNet-50: 64).")
    pos_embed: Literal["learned", "learned_2d", "sincos_2d", "none"] = Field("learned", description="Position embeddings (the paper's appendix D.4): learned, one learned vector per patch position (the paper); learned_2d, a learned row and a learned column vector of half the width each, concatenated; sincos_2d, fixed 2-D sines and cosines (width divisible by 4); none. Learned kinds are interpolated when fine-tuning at another resolution.")

    @model_validator(mode="before")
    @classmethod
    def _resolve_patch_size(cls, raw: dict) -> dict:
        if not isinstance(raw, dict):
            return raw
        name = raw.get("name", cls.model_fields["name"].default)
        _, named_patch = parse_model_name(str(name))
        patch = raw.get("patch_size")
        layers = raw.get("stem_layers", cls.model_fields["stem_layers"].default)
        if raw.get("stem") == "resnet" and patch is None and named_patch is None and isinstance(layers, list) and layers:
            patch = resnet_stride(layers)  # the hybrid's patch is the stem's stride
        if patch is not None and named_patch is not None and patch != named_patch:
            raise ValueError(f"model.name {name} implies patch size {named_patch} but model.patch_size is {patch}; drop the number from the name or the override")
        return {**raw, "patch_size": resolve_variant(str(name), patch).patch_size}

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.stem == "resnet":
            if any(units < 1 for units in self.stem_layers):
                raise ValueError(f"model.stem_layers must count at least one unit per stage, got {self.stem_layers}")
            stride = resnet_stride(self.stem_layers)
            if self.patch_size != stride:
                raise ValueError(f"model.patch_size {self.patch_size} does not match the ResNet stem's stride {stride} "
                                 f"({len(self.stem_layers)} stages in model.stem_layers); set model.patch_size={stride} "
                                 f"(or drop it and the number in model.name), or change model.stem_layers")
        if self.image_size % self.patch_size:
            raise ValueError(f"model.image_size {self.image_size} is not divisible by model.patch_size {self.patch_size}; pick sizes where it is (e.g. 224 and 16)")
        width, heads = self.variant.width, self.variant.heads
        if self.pos_embed == "learned_2d" and width % 2 or self.pos_embed == "sincos_2d" and width % 4:
            raise ValueError(f"model.pos_embed={self.pos_embed} splits the width over rows and columns, but width {width} "
                             f"is not divisible by {2 if self.pos_embed == 'learned_2d' else 4}; pick such a model.width or "
                             f"another model.pos_embed")
        if width % heads:
            raise ValueError(f"model width {width} is not divisible by {heads} heads; set model.heads to a divisor of the width")
        return self

    @property
    def variant(self) -> Variant:
        return resolve_variant(self.name, self.patch_size, width=self.width, depth=self.depth, heads=self.heads)


class MPPConfig(Section):
    target: str = Field("color", description="What a corrupted patch predicts: color, its mean colour at mpp.color_bits per channel (512 classes at 3 bits, the paper); color4x4, the colours of its 4x4 downsizing (16 x 512); or pixels, its pixel values (L2 loss).")
    corrupt_rate: float = Field(0.5, gt=0, lt=1, description="Fraction of patch positions corrupted per image (paper: 0.5; 0.15 also tried).")
    mask_prob: float = Field(0.8, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by the learnable [mask] embedding.")
    random_prob: float = Field(0.1, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by a random other patch's embedding (the rest keep their own).")
    color_bits: int = Field(3, ge=1, le=8, description="Bits per RGB channel of the colour targets (3 gives 512 classes).")
    masking: Literal["random", "block"] = Field("random", description="Which positions are corrupted: random, uniformly at random (the paper), or block, in rectangles of patches (BEiT's blockwise masking); the count per image is the same.")
    corrupt_in: Literal["auto", "embeddings", "pixels"] = Field("auto", description="Where a corrupted patch is replaced: embeddings, its token after the patch embedding (the paper); pixels, its pixels before the stem (a learnable mask patch, another patch's pixels, or its own), as SimMIM does for convolutional stems; auto: embeddings for model.stem=patch, pixels for model.stem=resnet. A hybrid corrupted in embeddings leaks: its convolutions show a masked patch's pixels to its neighbours' tokens (kept to measure that).")

    @field_validator("target")
    @classmethod
    def _known_target(cls, target: str) -> str:
        return one_of("mpp.target", target, TARGETS)

    @model_validator(mode="after")
    def _check(self) -> MPPConfig:
        if self.mask_prob + self.random_prob > 1:
            raise ValueError(f"mpp.mask_prob + mpp.random_prob must be at most 1, got {self.mask_prob} + {self.random_prob}")
        return self


def default_warmup(steps: int) -> int:
    """train.warmup_steps when unset: 10% of the run, at most 100 steps."""
    return min(100, steps // 10)


class TrainConfig(Section):
    steps: int | None = Field(1000, gt=0, description="Optimiser steps in the whole run (replaced by the steps train.epochs comes to when that is set).", json_schema_extra=RESUMABLE)
    epochs: float | None = Field(None, gt=0, description="The run's length in passes over the training set, instead of train.steps: at the start the run sets train.steps to ceil(epochs x samples / global batch), samples from the summary.json beside data.shards (shards without one need train.steps), and config.yaml records both. A resume may change it as it may train.steps; a comparison plan sets train.steps instead (its lengths multiply them).", json_schema_extra=RESUMABLE)
    batch_size: int = Field(64, gt=0, description="Images per process per micro-batch (global batch = batch_size x processes x grad_accum).")
    global_batch_size: int | None = Field(None, gt=0, description="Images per optimiser step over all processes; when set, it replaces train.batch_size, which becomes global / (processes x grad_accum), or with train.micro_batch_size set, it fixes train.grad_accum instead; either must come out whole. A run that sets it can resume on another number of processes.")
    micro_batch_size: int | None = Field(None, gt=0, description="With train.global_batch_size: the images per process per forward pass (what must fit in memory); train.grad_accum becomes global / (processes x micro_batch_size), so the global batch holds on any number of GPUs. Null: train.grad_accum as given.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimiser step (derived when train.micro_batch_size is set).")
    optimizer: Literal["adam", "adamw", "sgd"] = Field("adamw", description="Optimiser: adam, adamw or sgd (with momentum).")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate, reached after the warmup.", json_schema_extra=RESUMABLE)
    weight_decay: float = Field(0.05, ge=0, description="Decoupled weight decay (adamw) or L2 (adam, sgd); not applied to biases, norms, tokens and position embeddings.", json_schema_extra=RESUMABLE)
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas, each in [0, 1).", json_schema_extra=RESUMABLE)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.", json_schema_extra=RESUMABLE)
    layer_decay: float = Field(1.0, gt=0, le=1, description="Layer-wise lr decay (BEiT/MAE): block i gets lr x decay^(depth - i), the embeddings decay^(depth + 1), the final norm and heads the full lr; 1 = off.")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Label smoothing of the classification loss (supervised pretraining, fine-tuning); 0 = off.")
    mixup: float = Field(0.0, ge=0, description="Mixup (Zhang et al. 2018) of classification batches: each batch blended with itself reversed, images and labels alike, by a weight drawn from Beta(mixup, mixup) (MAE fine-tunes with 0.8, MAE-Lite's ViT-Tiny with 0.2); 0 = off.")
    cutmix: float = Field(0.0, ge=0, description="CutMix (Yun et al. 2019) of classification batches: a box of the reversed batch pasted into each image, labels mixed by its area, drawn from Beta(cutmix, cutmix) (MAE: 1.0); 0 = off.")
    mixup_switch_prob: float = Field(0.5, ge=0, le=1, description="With train.mixup and train.cutmix both on: the probability that a batch gets CutMix rather than mixup (MAE, DeiT: 0.5).")
    ema_decay: float | None = Field(None, ge=0, lt=1, description="Keep an exponential moving average of the weights, after every step decay x average + (1 - decay) x weights (timm's model EMA, e.g. 0.9999; about 1 / (1 - decay) steps are averaged): the evaluators score it and model.safetensors holds it; null = off.")
    warmup_steps: int | None = Field(None, ge=0, description="Linear warmup steps from 0 to train.lr; cosine decay to 0 afterwards; null: 10% of train.steps, at most 100.", json_schema_extra=RESUMABLE)
    clip_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this value (null disables).", json_schema_extra=RESUMABLE)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description="Precision of the forward and backward pass: auto, no (fp32), bf16 or fp16 (GPUs only, with a loss scaler); auto: bf16 where the hardware computes it (Ampere and newer GPUs, CPUs with AVX512-BF16 or AMX), fp16 on older GPUs, fp32 on other CPUs.")
    compile: bool | Literal["auto"] = Field("auto", description="torch.compile the model: true, false or auto; auto: on GPUs that Triton supports (compute capability 7.0 and newer), where it pays for its compile time, never on a CPU.", json_schema_extra=RESUMABLE)
    compile_backend: str = Field("inductor", description="torch.compile backend when compiling: inductor generates fused kernels; aot_eager traces without generating code (to tell a compile problem from a model one).", json_schema_extra=RESUMABLE)
    cpu_threads: Annotated[int, Field(gt=0)] | Literal["auto"] = Field("auto", description="Torch threads per process when training on CPU: a count, or auto: the CPUs this process may use divided by the processes on this machine.", json_schema_extra=RESUMABLE)
    seed: int = Field(0, description="Seed for model init, corruption and data order.")
    checkpoint_every: int = Field(500, gt=0, description="Save a resumable checkpoint every N steps (and at the end).", json_schema_extra=RESUMABLE)
    keep_checkpoints: int = Field(3, gt=0, description="Resumable checkpoints kept on disk; older ones are deleted.", json_schema_extra=RESUMABLE)
    max_nonfinite_steps: int = Field(5, gt=0, description="Stop after this many consecutive steps with a non-finite loss or gradient (each is skipped; checked at each log line).", json_schema_extra=RESUMABLE)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        return "no" if value is False else value  # YAML reads a bare `no` (mixed_precision=no) as false

    @model_validator(mode="before")
    @classmethod
    def _default_warmup(cls, raw: dict) -> dict:
        # Resolved here, not where it is used, so config.yaml records the warmup the run really had; with
        # train.epochs, once the steps are known (with_epochs).
        if not isinstance(raw, dict) or raw.get("warmup_steps") is not None or raw.get("epochs") is not None:
            return raw
        steps = raw.get("steps", cls.model_fields["steps"].default)
        return {**raw, "warmup_steps": default_warmup(steps)} if isinstance(steps, int) and steps > 0 else raw

    @field_validator("betas")
    @classmethod
    def _betas_below_one(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"train.betas must both lie in [0, 1), got {list(betas)}; the paper's Adam uses [0.9, 0.999]")
        return betas

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.epochs is not None:
            return self  # the length is known at the start of the run: with_epochs checks the warmup against it
        if self.steps is None:
            raise ValueError("train.steps is null and train.epochs is not set; set one of them to give the run a length")
        if self.warmup_steps >= self.steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be smaller than train.steps ({self.steps})")
        return self

    def with_epochs(self, samples: int, processes: int) -> TrainConfig:
        """This config with train.steps from train.epochs over `samples` training images at the global batch of
        `processes` processes, and an unset warmup from those steps; itself without train.epochs."""
        if self.epochs is None:
            return self
        split = self.for_processes(processes)
        steps = math.ceil(self.epochs * samples / (split.batch_size * processes * split.grad_accum))
        warmup = default_warmup(steps) if self.warmup_steps is None else self.warmup_steps
        if warmup >= steps:
            raise ConfigError(f"train.warmup_steps ({warmup}) must be smaller than the {steps} steps train.epochs "
                              f"({self.epochs:g}) comes to over {samples} images; lower it or raise train.epochs")
        return self.model_copy(update={"steps": steps, "warmup_steps": warmup})

    def for_processes(self, processes: int) -> TrainConfig:
        """This config with train.global_batch_size split over `processes`: into train.batch_size per process and
        micro-batch (given train.grad_accum), or, with train.micro_batch_size, into train.grad_accum steps of it."""
        total = self.global_batch_size
        if total is None:
            if self.micro_batch_size is not None:
                raise ConfigError("train.micro_batch_size splits train.global_batch_size, which is not set; set "
                                  "train.global_batch_size, or set train.batch_size and train.grad_accum instead")
            return self
        if self.micro_batch_size is not None:
            steps, rest = divmod(total, processes * self.micro_batch_size)
            if rest or not steps:
                raise ConfigError(f"train.global_batch_size {total} is not a whole number of micro-batches of {self.micro_batch_size} "
                                  f"images on each of {processes} process(es); make it a multiple of "
                                  f"{processes * self.micro_batch_size} or pick a train.micro_batch_size that divides "
                                  f"{total // processes if total % processes == 0 else total}")
            return self.model_copy(update={"batch_size": self.micro_batch_size, "grad_accum": steps})
        share, rest = divmod(total, processes * self.grad_accum)
        if rest or not share:
            raise ConfigError(f"train.global_batch_size {total} does not split evenly over {processes} process(es) "
                              f"x {self.grad_accum} accumulation step(s); make it a multiple of {processes * self.grad_accum} "
                              f"or set train.batch_size per process instead")
        return self.model_copy(update={"batch_size": share})


class LogConfig(Section):
    every: int = Field(10, gt=0, description="Log scalars to TensorBoard every N steps.", json_schema_extra=RESUMABLE)
    images_every: int = Field(200, gt=0, description="Log the image panel (crops, corrupted view, true and predicted colours) every N steps.", json_schema_extra=RESUMABLE)


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


class FinetuneConfig(Section):
    eval_every: int = Field(500, gt=0, description="Fine-tuning: evaluate top-1/top-5 on data.val_shards every N steps (and at the end).", json_schema_extra=RESUMABLE)
    pool: Pooling = Field("cls", description="What the linear classifier reads: the [class] token's output (cls, the paper) or the mean of the patch outputs (mean, as BEiT, SimMIM and MAE fine-tune).")


class EvalConfig(Section):
    every: int = Field(500, ge=0, description="Pretext validation: when data.val_shards is set, pretraining computes its loss and metrics (MPP: val/loss, val/color_acc) on held-out images every N steps and at the end (0 = off).")
    images: int = Field(512, gt=0, description="Images read from the front of data.val_shards for the pretext validation; the same images and corrupted positions at every evaluation.")
    batch_size: int = Field(128, gt=0, description="Images per forward pass of the pretext validation.")
    seed: int = Field(0, description="Seed of the pretext validation's fixed corruption (a private generator, independent of the training run's RNG).")


class KnnConfig(Section):
    every: int = Field(0, ge=0, description="During pretraining, run the kNN evaluation every N steps and at the end (0 = off).")
    k: int = Field(20, gt=0, description="Neighbours that vote (DINO's k=20).")
    temperature: float = Field(0.07, gt=0, description="Votes are weighted by exp(cosine similarity / temperature) (DINO's 0.07).")
    features: Pooling = Field("cls", description="Frozen features: the [class] token's output (cls) or the mean of the patch outputs (mean).")
    shards: str | None = Field(None, description="Labelled shards the neighbours come from; defaults to data.shards.")
    val_shards: str | None = Field(None, description="Labelled shards whose images are classified; defaults to data.val_shards (set it when pretraining validates on other classes than kNN scores).")
    train_images: int = Field(5000, gt=0, description="Images read from the front of the labelled shards as the neighbour pool.")
    eval_images: int = Field(2000, gt=0, description="Images read from the front of knn.val_shards to classify.")
    batch_size: int = Field(256, gt=0, description="Images per forward pass when extracting features.")


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


class InspectConfig(Section):
    every: int = Field(0, ge=0, description="During pretraining and fine-tuning, draw the inspection views (patch-embedding filters, position-embedding similarity, mean attention distance, attention rollout) in TensorBoard every N steps and at the end (0 = off).", json_schema_extra=RESUMABLE)
    shards: str | None = Field(None, description="Shards whose images the attention views are computed on; defaults to data.val_shards, else data.shards.", json_schema_extra=RESUMABLE)
    images: int = Field(64, gt=0, description="Images read from the front of inspect.shards; the mean attention distance averages over all of them.", json_schema_extra=RESUMABLE)
    rollout_images: int = Field(4, gt=0, description="How many of them the attention-rollout figure overlays.", json_schema_extra=RESUMABLE)
    filters: int = Field(28, gt=0, description="Principal components of the patch embedding's filters shown (the paper's Figure 7 shows 28).", json_schema_extra=RESUMABLE)
    batch_size: int = Field(64, gt=0, description="Images per forward pass of the explicit-attention path.", json_schema_extra=RESUMABLE)

    @model_validator(mode="after")
    def _rollout_among_images(self) -> InspectConfig:
        if self.rollout_images > self.images:
            raise ValueError(f"inspect.rollout_images={self.rollout_images} is more than the inspect.images={self.images} "
                             f"read; lower it or raise inspect.images")
        return self


class Config(Section):
    objective: str = Field("mpp", description="Pretraining objective: mpp (masked patch prediction) or supervised (classification of the shards' cls labels).")
    output_dir: str = Field("runs/pretrain", description="Where checkpoints, TensorBoard events, model.safetensors and config.yaml go.", json_schema_extra=RESUMABLE)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mpp: MPPConfig = Field(default_factory=MPPConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    fewshot: FewShotConfig = Field(default_factory=FewShotConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    knn: KnnConfig = Field(default_factory=KnnConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    inspect: InspectConfig = Field(default_factory=InspectConfig)

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, objective: str) -> str:
        return one_of("objective", objective, OBJECTIVES)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.objective != "mpp":
            return self
        bits = self.mpp.color_bits
        outputs = TARGETS[self.mpp.target].from_settings(self.model.patch_size, self.mpp).outputs  # raises for a patch size it cannot use
        width = self.model.variant.width
        head_bytes = 4 * (width + 1) * outputs  # fp32 weights and biases
        if head_bytes > MAX_HEAD_BYTES:
            raise ValueError(f"mpp.target={self.mpp.target} with mpp.color_bits={bits} needs a {outputs:,}-way prediction head of "
                             f"{head_bytes / 1e9:.1f} GB (width {width}); heads over {MAX_HEAD_BYTES / 1e9:.1f} GB are refused, "
                             f"lower mpp.color_bits (the paper uses 3)")
        return self


def dotted(tree: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 0.1}} (or {'train.lr': 0.1}) -> {'train.lr': 0.1}: a nested config as dotted keys."""
    flat = {}
    for key, value in tree.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def settings(section: type[BaseModel] | None = None, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every setting of the run config as (dotted key, its field), section by section in the order declared."""
    for name, field in (section or Config).model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from settings(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def resumable_keys() -> set[str]:
    """The dotted keys of the fields marked RESUMABLE."""
    return {key for key, field in settings() if (field.json_schema_extra or {}).get("resumable")}


def config_reference() -> list[tuple[str, str, str]]:
    """(key, default as JSON, description) of every setting: what `--help` lists and README's config reference shows."""
    return [(key, json.dumps(field.get_default(call_default_factory=True)), field.description) for key, field in settings()]


def _closest_key(section: type[BaseModel], prefix: str, key: str) -> str:
    matches = difflib.get_close_matches(key, list(section.model_fields), n=1)
    return f" (did you mean '{prefix}{matches[0]}'?)" if matches else ""


def _section_at(loc: tuple) -> type[BaseModel]:
    section: type[BaseModel] = Config
    for part in loc:
        field = section.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            break
        section = field.annotation
    return section


def _explain(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    key = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        prefix = "".join(f"{p}." for p in loc[:-1])
        hint = _closest_key(_section_at(loc[:-1]), prefix, str(loc[-1]))
        return f"unknown config key '{key}'{hint}; see the config reference in README.md"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error":  # our own validators already name the keys and the fix
        return msg
    return f"invalid value for '{key}': {msg} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, validated into a Config."""
    return validate_config(read_layers(path, overrides))


def read_layers(path: str | Path | None, overrides: list[str], what: str = "config file", example: str | None = None) -> dict:
    """A YAML file (a mapping; none: {}) with dotted `key=value` overrides merged over it, as plain data. `what` and
    `example` name the kind of file in the one-line errors (a run config, a comparison plan)."""
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{what} {path} does not exist; pass an existing YAML file to --config")
        not_yaml = f"{what} {path} is not valid YAML ({{}}); fix its syntax"
        try:
            top = yaml.safe_load(path.read_text())  # plainly first: OmegaConf takes a top-level scalar for a file name
        except Exception as exc:
            raise ConfigError(not_yaml.format(exc.__class__.__name__)) from None
        if top is not None and not isinstance(top, dict):
            held = "a list" if isinstance(top, list) else f"the single value {top!r}"
            example = example or (f"(train:, model:, ...) as in the shipped configs (`{command('--list-configs')}` shows "
                                  f"where they are)")
            raise ConfigError(f"{what} {path} holds {held} at its top level; it must be a mapping of sections {example}")
        try:
            layers.append(OmegaConf.load(path))
        except Exception as exc:
            raise ConfigError(not_yaml.format(exc.__class__.__name__)) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=1000)")
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.to_container(OmegaConf.merge(*layers), resolve=True)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the overrides given ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
                          f"write each as key=value, YAML flow values with a space after ':' (grid=[{{train.lr: 0.1}}])") from None
    return merged or {}


def validate_config(raw: dict) -> Config:
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    return cfg


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
