"""Typed run configuration: YAML files plus dotted `key=value` overrides, validated at load."""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from mpp.errors import UserError, command
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator, create_model
from mpp.model.variants import Variant, parse_model_name, resnet_stride, resolve_variant
from pydantic.fields import FieldInfo


class ConfigError(UserError):
    """A user mistake in a config file or override; the message is one sentence with the fix."""


# One vocabulary for what a head or probe reads from the encoder: fine-tuning, few-shot, kNN and the linear probe.
Pooling = Literal["cls", "mean"]


def one_of(key: str, value: str, choices) -> str:
    """`value` if it names one of `choices` (a registry); else the error pydantic gives a Literal, worded the same."""
    if value in choices:
        return value
    names = [f"'{c}'" for c in choices]
    raise ValueError(f"invalid value for '{key}': Input should be {listed(names)} (got {value!r})")


def listed(items: list[str]) -> str:
    """['a', 'b', 'c'] -> 'a, b or c'."""
    return f"{', '.join(items[:-1])} or {items[-1]}" if len(items) > 1 else items[0]


class Section(BaseModel):
    """A config section: its fields (each with a default and a one-line description) and their validation.

    A part with settings of its own (an objective, a target, an evaluator) declares its section in its registry
    module, which loads no torch (mpp/model/registry.py, pipelines/evaluations/registry.py), and registers it there
    (`SECTION_SOURCES`); `check` is where a section validates itself against the rest of the
    run's config; `hparams` names its fields that are HParams columns (the few settings that tell runs apart)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    hparams: ClassVar[tuple[str, ...]] = ()

    def check(self, cfg: Config) -> None:
        """Raise ValueError (one sentence naming the keys and the fix) where this section does not fit `cfg`."""


# Marks a field that a resume may change (json_schema_extra=RESUMABLE): it applies from the resumed step on. Every
# other field shapes the model, its optimiser state or the data stream the checkpoint continues, and a resume that
# changes it is refused.
RESUMABLE = {"resumable": True}


class DataConfig(Section):
    shards: str = Field("synthetic", description="Training shards: a directory of .tar files, a brace pattern, URLs, 'pipe:' commands, or 'synthetic' for the embedded corpus; also a folder of images in class sub-folders or a directory of Parquet files, read as they are (mpp/readers.py).")
    val_shards: str | None = Field(None, description="Evaluation shards (same forms as data.shards); used by fine-tuning, few-shot and kNN evaluation, and the pretext validation of pretraining.", json_schema_extra=RESUMABLE)
    synthetic_size: int = Field(20000, gt=0, description="Images in the embedded synthetic corpus, generated on first use into data/synthetic-<size> (data/synthetic-20000 by default) under the working directory.")
    num_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field("auto", description="Dataloader worker processes per rank that decode images, or auto: on a GPU the CPUs each process may use less one, on a CPU one.")
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
    hparams = ("name", "width", "depth", "patch_size", "image_size", "stem", "stem_layers", "pos_embed")
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
    stem_padding: Literal["same", "symmetric"] = Field("same", description="With model.stem=resnet: how the ResNet pads its strided convolutions and max pool. same, TensorFlow's 'SAME' (the odd pixel after), with GroupNorm epsilon 1e-5, exactly as timm's vit_*_r50_* hybrids (so `export --to timm` can write it); symmetric, PyTorch's symmetric padding with epsilon 1e-6, the stem of runs and weights saved before this setting existed, which keep it.")
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
            if self.stem == "resnet":  # the patch is the stem's stride, which the user may never have set
                raise ValueError(f"model.image_size {self.image_size} is not divisible by the ResNet stem's stride "
                                 f"{self.patch_size} (model.patch_size, from the {len(self.stem_layers)} stages in "
                                 f"model.stem_layers); pick a model.image_size that is a multiple of {self.patch_size}")
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


def default_warmup(steps: int) -> int:
    """train.warmup_steps when unset: 10% of the run, at most 100 steps."""
    return min(100, steps // 10)


class TrainConfig(Section):
    hparams = ("optimizer", "lr", "steps", "seed", "global_batch_size", "layer_decay", "label_smoothing")
    steps: int | None = Field(1000, gt=0, description="Optimiser steps in the whole run (replaced by the steps train.epochs comes to when that is set).", json_schema_extra=RESUMABLE)
    epochs: float | None = Field(None, gt=0, description="The run's length in passes over the training set, instead of train.steps: at the start the run sets train.steps to ceil(epochs x samples / global batch), samples as the reader of data.shards counts them (an image folder's files, Parquet files' rows, the summary.json beside tar shards: shards without one need train.steps), and config.yaml records both. A resume may change it as it may train.steps; a comparison plan sets train.steps instead (its lengths multiply them).", json_schema_extra=RESUMABLE)
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
    compile_mode: Literal["default", "max-autotune-no-cudagraphs"] = Field("default", description="torch.compile mode when compiling: default, or max-autotune-no-cudagraphs, which times several kernels for each matrix multiplication and keeps the fastest (a longer compile; benchmarks/gpu_report.py measures the gain).", json_schema_extra=RESUMABLE)
    cpu_threads: Annotated[int, Field(gt=0)] | Literal["auto"] = Field("auto", description="Torch threads per process when training on CPU: a count, or auto: the CPUs this process may use divided by the processes on this machine.", json_schema_extra=RESUMABLE)
    seed: int = Field(0, description="Seed for model init, corruption and data order.")
    checkpoint_every: int = Field(500, gt=0, description="Save a resumable checkpoint every N steps (and at the end).", json_schema_extra=RESUMABLE)
    keep_checkpoints: int = Field(3, gt=0, description="Resumable checkpoints kept on disk; older ones are deleted.", json_schema_extra=RESUMABLE)
    stop_data_wait_s: float = Field(10.0, gt=0, description="After a stop signal (SIGTERM, SIGUSR1, SIGUSR2, Ctrl-C), the seconds to wait for a batch that has not come (a stalled `pipe:` command or network read) before stopping without it; keep it well below the time the scheduler leaves between its signal and the kill.", json_schema_extra=RESUMABLE)
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
        steps = math.ceil(self.epochs * samples / self.global_batch(processes))
        warmup = default_warmup(steps) if self.warmup_steps is None else self.warmup_steps
        if warmup >= steps:
            raise ConfigError(f"train.warmup_steps ({warmup}) must be smaller than the {steps} steps train.epochs "
                              f"({self.epochs:g}) comes to over {samples} images; lower it or raise train.epochs")
        return self.model_copy(update={"steps": steps, "warmup_steps": warmup})

    def global_batch(self, processes: int) -> int:
        """Images per optimiser step over `processes` processes: train.global_batch_size when set (for_processes
        checks that it splits), else train.batch_size x processes x train.grad_accum."""
        return self.global_batch_size or self.batch_size * processes * self.grad_accum

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
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(["tensorboard"], description="Where the scalars, images, config and final metrics go, through Accelerate's integrations: tensorboard (always, under output_dir/tensorboard), mlflow (its MLFLOW_TRACKING_URI, an http(s) server or file:///path/mlruns; unset: output_dir/mlruns) and wandb (its project = the stage; without an API key or WANDB_MODE, offline under output_dir/wandb); each needs its package installed. output_dir/log.txt gets one JSON line per logged step in any case.", json_schema_extra=RESUMABLE)

    @field_validator("trackers")
    @classmethod
    def _tensorboard_always(cls, trackers: list[str]) -> list[str]:
        return ["tensorboard", *dict.fromkeys(t for t in trackers if t != "tensorboard")]


class FinetuneConfig(Section):
    eval_every: int = Field(500, gt=0, description="Fine-tuning: evaluate top-1/top-5 on data.val_shards every N steps (and at the end).", json_schema_extra=RESUMABLE)
    pool: Pooling = Field("cls", description="What the linear classifier reads: the [class] token's output (cls, the paper) or the mean of the patch outputs (mean, as BEiT, SimMIM and MAE fine-tune).")
    keep_best: bool = Field(False, description="Keep the weights of the evaluation with the best eval/top1 (an exact tie: the later) in output_dir/best.safetensors, checkpointed with the run (results.json's `best` says which step and score); export and predict take it as --ckpt RUN/best.safetensors. Off: only the last step's weights. Fine-tuning only.", json_schema_extra=RESUMABLE)
    class_balance: Literal["none", "loss_weights"] = Field("none", description="Imbalanced training labels: none (every image counts once) or loss_weights (each class's cross-entropy weighted by its inverse frequency among the training images, from summary.json's class_counts or the shards' labels, so every class weighs the same in the loss).")
    val_split: float = Field(0.0, ge=0, lt=1, description="Hold out this fraction of each class of data.shards' images (drawn by train.seed; local shards) to evaluate on in place of data.val_shards, never trained on; 0 = off (data.val_shards needed).")


class Config(Section):
    """The run config: the sections every run has, declared here, and the sections of the registered parts, added
    by `config_schema` (an instance is always of that composed class, so `cfg.knn` and `cfg.mpp` are there)."""

    objective: str = Field("mpp", description="What pretraining trains; the objectives register the choices (config_schema).")
    output_dir: str = Field("runs/pretrain", description="Where checkpoints, TensorBoard events, model.safetensors and config.yaml go.", json_schema_extra=RESUMABLE)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)

    def split_over(self, processes: int) -> Config:
        """This config with train.global_batch_size split over `processes` (TrainConfig.for_processes), a new object:
        this one is not changed."""
        return self.model_copy(update={"train": self.train.for_processes(processes)}, deep=True)

    def __reduce__(self):
        # The composed class is made at run time and cannot be found by name: a pickle rebuilds it from the parts.
        return _composed_config, (self.model_dump(),)

    @model_validator(mode="after")
    def _check(self) -> Config:
        for name in type(self).model_fields:
            if isinstance(section := getattr(self, name), Section):
                section.check(self)
        return self


# Where the config's other fields come from: each registry of parts with settings (objectives, targets, evaluators)
# adds a function returning its fields, {name: (type, Field)}: a part's section ({"knn": (KnnConfig,
# Field(default_factory=KnnConfig))}) or a field naming a part (`objective`, with the registry as its choices). They
# are called at each validation, so a part registered since counts; config imports none of them (each registry
# module appends its function when it is imported; pipelines.parts imports them all).
SECTION_SOURCES: list[Callable[[], dict[str, tuple[Any, FieldInfo]]]] = []


def config_schema() -> type[Config]:
    """The Config class composed of the fields every run has and those the registered parts declare."""
    fields = {name: field for source in SECTION_SOURCES for name, field in source().items()}
    return _composed(tuple(fields.items()))


@functools.lru_cache(maxsize=32)
def _composed(fields: tuple) -> type[Config]:
    return create_model("Config", __base__=Config, **dict(fields))


def _composed_config(values: dict) -> Config:
    return config_schema().model_validate(values)


@functools.lru_cache(maxsize=None)
def section_field(section: type[Section]) -> tuple[type[Section], FieldInfo]:
    """A section as a field of the config: filled with its defaults when the config leaves it out."""
    return section, Field(default_factory=section)


def dotted(tree: dict, prefix: str = "") -> dict:
    """{'train': {'lr': 0.1}} (or {'train.lr': 0.1}) -> {'train.lr': 0.1}: a nested config as dotted keys."""
    flat = {}
    for key, value in tree.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def settings(section: type[BaseModel] | None = None, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every setting of the run config as (dotted key, its field), section by section in the order declared."""
    for name, field in (section or config_schema()).model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from settings(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def resumable_keys() -> set[str]:
    """The dotted keys of the fields marked RESUMABLE."""
    return {key for key, field in settings() if (field.json_schema_extra or {}).get("resumable")}


def config_reference() -> list[tuple[str, str, str]]:
    """(key, default as JSON, description) of every setting: what `--help` lists and docs/reference.md shows."""
    return [(key, json.dumps(field.get_default(call_default_factory=True)), field.description) for key, field in settings()]


def _closest_key(section: type[BaseModel], prefix: str, key: str) -> str:
    matches = difflib.get_close_matches(key, list(section.model_fields), n=1)
    return f" (did you mean '{prefix}{matches[0]}'?)" if matches else ""


def _section_at(loc: tuple) -> type[BaseModel]:
    section: type[BaseModel] = config_schema()
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
        return f"unknown config key '{key}'{hint}; see docs/reference.md or --help"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error":  # our own validators already name the keys and the fix
        return msg
    return f"invalid value for '{key}': {msg} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- `a.b=value` overrides, validated into a Config."""
    return validate_config(read_layers(path, overrides))


def load_saved_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """A run's saved config.yaml (then `overrides`), read as the run it describes was built (as_saved)."""
    return validate_config(as_saved(read_layers(path, overrides)))


def as_saved(tree: dict) -> dict:
    """A run's saved config as data, with what an older mpp left out but built: a model section without
    model.stem_padding was saved before that setting existed, when every hybrid stem padded symmetrically (a patch
    stem pads nothing, so it reads as the default and a finished run stays the same run)."""
    model = tree.get("model")
    if isinstance(model, dict) and "stem_padding" not in model:
        padding = "symmetric" if model.get("stem") == "resnet" else "same"
        return {**tree, "model": {**model, "stem_padding": padding}}
    return tree


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
        cfg = config_schema().model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None
    return cfg


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))
