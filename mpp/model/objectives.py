"""Training objectives over a ViT backbone. Each maps a uint8 batch to a loss and metrics; the loop is shared.

The loop knows an objective only through `Objective`; OBJECTIVES maps the config's `objective` name to its kind
(its builder from the run's config, whether it reads labels, a short summary, its config section). The objectives
and their sections reach the run config through mpp.config.SECTION_SOURCES (`objective_fields`).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field, create_model, field_validator, model_validator
from torch import nn

from mpp.config import SECTION_SOURCES, Section, listed, one_of, section_field
from mpp.metrics import PRETEXT_LOSS, Metric, split_metric
from mpp.model.mixup import Mixing
from mpp.model.vit import VisionTransformer, init_weights, normalize, patchify, pool, trunc_normal, unpatchify
from mpp.model.targets import TARGETS, MeanColor, Target

MASK, RANDOM, KEEP = 0, 1, 2


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_name: str = "loss"  # logged as train/<loss_name> (val/<loss_name>): a classification loss, or MPP's pretext loss


class Objective(nn.Module, ABC):
    """What the training loop trains: a ViT `backbone` with the heads and loss of one task.

    An implementer provides:
    - `backbone`: the VisionTransformer it trains (the evaluators score it, checkpoints name it `backbone.*`);
    - `forward(images, labels) -> StepOutput`: images (B, 3, H, W) uint8, labels (B,) or None on unlabelled
      shards -> the loss (logged as train/<its loss_name>) and the metrics logged as train/<name>;
    - `metrics(split)`: the Metric of the loss and of every metric forward returns, on split "train" (train/<name>)
      or "val" (the pretext validation's val/<name>): see mpp.metrics.split_metric;
    - `description`: what it trains the backbone to do, one line for the model card and results.json;
    - `export_weights()`: what model.safetensors holds at the end of the run.
    and may override:
    - `no_weight_decay()`: add the names of its own input tokens (MPP's [mask]); they join the patch embedding at
      layer 0 of layer-wise lr decay (`layer_of`), its other parameters (heads) the top layer;
    - `panel(images)`: images for TensorBoard's panel (none by default);
    - `fixed_randomness(batch_size, generator, device)`: forward's random choices, fixed for the pretext validation
      (none by default: a deterministic forward).
    Register it in OBJECTIVES (its builder, whether it reads labels, a summary) to make it selectable with
    `objective=<name>`; its metrics then reach TensorBoard, the progress bar, results.json and the model card.
    """

    backbone: VisionTransformer
    description: str

    @abstractmethod
    def metrics(self, split: str) -> list[Metric]: ...

    @abstractmethod
    def forward(self, images: torch.Tensor, labels: torch.Tensor | None) -> StepOutput: ...

    @abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]: ...

    def no_weight_decay(self) -> set[str]:
        """Names (as named_parameters() gives them) of the input tokens and embeddings, as timm's no_weight_decay:
        they get no weight decay, and layer decay counts them with the patch embedding (layer 0)."""
        return {f"backbone.{name}" for name in self.backbone.no_weight_decay()}

    def layer_of(self, name: str) -> int:
        """The layer-decay layer of parameter `name`: the backbone's own numbering, the objective's input tokens
        (no_weight_decay) with the patch embedding at layer 0, its heads with the final norm at the top."""
        if name.startswith("backbone."):
            return self.backbone.layer_of(name.removeprefix("backbone."))
        return 0 if name in self.no_weight_decay() else self.backbone.depth + 1

    def panel(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `images` (each (B, 3, H, W) uint8) for TensorBoard's panel, one column each under its name;
        empty: no panel."""
        return {}

    def fixed_randomness(self, batch_size: int, generator: torch.Generator, device) -> dict[str, object]:
        """Keyword arguments of forward fixing its random choices for a batch of `batch_size`, drawn from `generator`
        (on the CPU) and moved to `device`. The pretext validation draws them once and reuses them, so each
        evaluation scores the same task."""
        return {}


# ---------------------------------------------------------------- corruption

PANEL_SEED = 0  # the panel's corruption, fixed (MaskedPatchPrediction.panel)


@dataclass
class Corruption:
    positions: torch.Tensor  # (B, K) patch indices that were corrupted
    kinds: torch.Tensor  # (B, K) MASK, RANDOM or KEEP
    sources: torch.Tensor  # (B, K) flat index into (B * N) of the patch that supplied the embedding

    def to(self, device) -> Corruption:
        return Corruption(self.positions.to(device), self.kinds.to(device), self.sources.to(device))


def num_corrupted(num_patches: int, rate: float) -> int:
    """A fixed count per image keeps shapes static (one head matmul over B * K rows, compile-friendly)."""
    return max(1, round(rate * num_patches))


def random_rectangles(b: int, grid: int, min_area: float, max_area: torch.Tensor, device, generator=None) -> torch.Tensor:
    """One axis-aligned rectangle of patches per image (B, grid, grid) bool, as BEiT draws its blocks:
    area uniform in [min_area, max_area] (max_area per image, (B,)), aspect ratio log-uniform in [0.3, 1/0.3]."""
    u = torch.rand(b, 4, device=device, generator=generator)
    area = min_area + u[:, 0] * (max_area - min_area).clamp(min=0)
    aspect = torch.exp((u[:, 1] * 2 - 1) * math.log(1 / 0.3))
    h = (area * aspect).sqrt().round().clamp(1, grid).long()  # (B,)
    w = (area / aspect).sqrt().round().clamp(1, grid).long()
    top = (u[:, 2] * (grid - h + 1)).long()
    left = (u[:, 3] * (grid - w + 1)).long()
    index = torch.arange(grid, device=device)
    rows = (index >= top[:, None]) & (index < (top + h)[:, None])  # (B, grid)
    cols = (index >= left[:, None]) & (index < (left + w)[:, None])
    return rows[:, :, None] & cols[:, None, :]


def block_positions(b: int, grid: int, k: int, device, generator=None) -> torch.Tensor:
    """BEiT's blockwise masking with exactly k positions per image (B, K), static shapes and no host sync.

    A bounded number of rounds each draws one rectangle per image and keeps it where it does not overshoot k;
    the few positions still missing are then topped up at random (taking every rectangle position first, by rank).
    """
    n = grid * grid
    min_area = max(1.0, 16 * n / 196)  # BEiT's smallest block, 16 of 14 x 14 patches, scaled to this grid
    mask = torch.zeros(b, n, dtype=torch.bool, device=device)
    for _ in range(2 * math.ceil(k / min_area) + 4):
        count = mask.sum(dim=1)  # (B,)
        block = random_rectangles(b, grid, min_area, (k - count).float(), device, generator).reshape(b, n)
        fits = count + (block & ~mask).sum(dim=1) <= k
        mask = mask | (block & fits[:, None])
    rank = mask.float() + 0.5 * torch.rand(b, n, device=device, generator=generator)  # rectangles first, then random
    return rank.topk(k, dim=1).indices


def draw_corruption(b: int, n: int, rate: float, mask_prob: float, random_prob: float, masking: str = "random",
                    device=None, generator: torch.Generator | None = None) -> Corruption:
    """Which `rate` of the N positions of each of B images are corrupted, and how (MASK, RANDOM or KEEP).

    `generator` (on `device`) gives a reproducible corruption without touching the global RNG.
    """
    k = num_corrupted(n, rate)
    if masking == "block":
        positions = block_positions(b, math.isqrt(n), k, device, generator)
    else:
        positions = torch.rand(b, n, device=device, generator=generator).argsort(dim=1)[:, :k]  # (B, K)
    u = torch.rand(b, k, device=device, generator=generator)
    # torch.where, not boolean-index assignment: no data-dependent shapes, so no host sync on GPU.
    kinds = torch.where(u < mask_prob, MASK, torch.where(u < mask_prob + random_prob, RANDOM, KEEP))
    own = positions + torch.arange(b, device=device)[:, None] * n  # (B, K) flat indices
    other = torch.randint(0, b * n - 1, (b, k), device=device, generator=generator)
    other = other + (other >= own).long()  # skip the patch itself: uniform over the other B*N - 1
    return Corruption(positions, kinds, torch.where(kinds == RANDOM, other, own))


def apply_corruption(tokens: torch.Tensor, mask_embedding: torch.Tensor, corruption: Corruption) -> torch.Tensor:
    """Patch embeddings (B, N, D), or patches of pixels (B, N, P*P*3), with the corrupted positions replaced as
    `corruption` says."""
    b, n, d = tokens.shape
    flat = tokens.reshape(b * n, d)
    replacement = torch.where((corruption.kinds == MASK)[..., None], mask_embedding.to(tokens.dtype), flat[corruption.sources])
    return tokens.scatter(1, corruption.positions[..., None].expand(-1, -1, d), replacement)


def gather_positions(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # (B, N, ...) , (B, K) -> (B, K, ...)
    index = positions.view(*positions.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


# ---------------------------------------------------------------- the objective


def corruption_space(corrupt_in: str, stem: str) -> str:
    """mpp.corrupt_in resolved: auto corrupts a plain ViT's embeddings (the paper) and a hybrid's pixels, since a
    hybrid's token embeddings come out of convolutions that have already shown each patch's pixels to its neighbours."""
    if corrupt_in != "auto":
        return corrupt_in
    return "pixels" if stem == "resnet" else "embeddings"


class MaskedPatchPrediction(Objective):
    """Corrupt patches, encode, and predict each corrupted patch's target from its own output.

    `corrupt_in="embeddings"` replaces a corrupted patch's embedding after the stem (the paper's ViT: [mask] is a
    learnable embedding); "pixels" replaces its pixels before the stem ([mask] is a learnable P x P patch), so a
    convolutional stem (the hybrid) never sees them through a neighbour's receptive field."""

    def __init__(self, backbone: VisionTransformer, target: Target | None = None, corrupt_rate: float = 0.5,
                 mask_prob: float = 0.8, random_prob: float = 0.1, masking: str = "random", corrupt_in: str = "auto"):
        super().__init__()
        self.backbone = backbone
        self.target = target or MeanColor(backbone.patch_size)  # the paper's 3-bit mean colour
        self.corrupt_rate, self.mask_prob, self.random_prob = corrupt_rate, mask_prob, random_prob
        self.masking = masking
        self.corrupt_in = corruption_space(corrupt_in, backbone.stem)
        if self.corrupt_in == "pixels":
            self.mask_patch = nn.Parameter(torch.zeros(3 * backbone.patch_size ** 2))  # (P*P*3,) in patchify's layout
            trunc_normal(self.mask_patch)
        else:
            self.mask_embedding = nn.Parameter(torch.zeros(backbone.width))
            trunc_normal(self.mask_embedding)
        self.head = nn.Linear(backbone.width, self.target.outputs)
        init_weights(self.head)

    def targets(self, images: torch.Tensor) -> torch.Tensor:  # (B, N, ...) as the target computes them
        return self.target(images)

    def draw_corruption(self, batch_size: int, device=None, generator: torch.Generator | None = None) -> Corruption:
        return draw_corruption(batch_size, self.backbone.num_patches, self.corrupt_rate, self.mask_prob, self.random_prob,
                               self.masking, device, generator)

    def fixed_randomness(self, batch_size: int, generator: torch.Generator, device) -> dict[str, object]:
        return {"corruption": self.draw_corruption(batch_size, "cpu", generator).to(device)}

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"mask_patch" if self.corrupt_in == "pixels" else "mask_embedding"}

    def metrics(self, split: str) -> list[Metric]:
        return self.target.metrics(split)

    @property
    def description(self) -> str:
        masking = "in rectangles of patches (blockwise)" if self.masking == "block" else "at random"
        where = "patch embeddings" if self.corrupt_in == "embeddings" else "patches (in pixels, before the stem)"
        return (f"masked patch prediction (Dosovitskiy et al. 2021, section 4.6): {self.corrupt_rate:.0%} of the "
                f"{where} corrupted {masking} ({self.mask_prob:.0%} [mask], {self.random_prob:.0%} another patch's, the "
                f"rest kept), each predicting {self.target.description}")

    def predict(self, images: torch.Tensor, corruption: Corruption | None = None) -> tuple[torch.Tensor, Corruption]:
        """(B, 3, H, W) uint8 -> head outputs at the corrupted positions only (B, K, out); a fresh corruption
        unless one is given (the pretext validation reuses a fixed one)."""
        if corruption is None:
            corruption = self.draw_corruption(images.shape[0], images.device)
        if self.corrupt_in == "pixels":
            p, grid = self.backbone.patch_size, self.backbone.grid
            pixels = apply_corruption(patchify(normalize(images), p), self.mask_patch, corruption)  # (B, N, P*P*3)
            tokens = self.backbone.embed_patches(unpatchify(pixels, p, grid))
        else:
            tokens = apply_corruption(self.backbone.embed_patches(normalize(images)), self.mask_embedding, corruption)
        encoded = self.backbone.encode(tokens)[:, 1:]  # drop [class]
        return self.head(gather_positions(encoded, corruption.positions)), corruption

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None, corruption: Corruption | None = None) -> StepOutput:
        predictions, corruption = self.predict(images, corruption)
        targets = gather_positions(self.targets(images), corruption.positions)
        return StepOutput(*self.target.loss(predictions.float(), targets), loss_name=PRETEXT_LOSS)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """What model.safetensors holds after pretraining: the backbone alone."""
        return self.backbone.state_dict()

    @torch.no_grad()
    def panel(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Images for TensorBoard (each (B, 3, H, W) uint8): crops, corrupted view, true and predicted targets.

        The corruption comes from a private generator, the same at every panel: drawing the panel leaves the
        training's RNG alone, so log.images_every cannot change what a run learns."""
        generator = torch.Generator().manual_seed(PANEL_SEED)
        predictions, corruption = self.predict(images, self.draw_corruption(images.shape[0], "cpu", generator).to(images.device))
        p, grid = self.backbone.patch_size, self.backbone.grid
        true = self.target.render(self.targets(images))  # (B, N, P*P*3)
        predicted = self.target.render(self.target.decode(predictions.float()))  # (B, K, P*P*3)
        mosaic = true.scatter(1, corruption.positions[..., None].expand(-1, -1, true.shape[-1]), predicted)
        pixels = patchify(images, p)
        b, n, _ = pixels.shape
        seen = pixels.reshape(b * n, -1)[corruption.sources]
        seen[corruption.kinds == MASK] = 127
        corrupted = pixels.scatter(1, corruption.positions[..., None].expand(-1, -1, pixels.shape[-1]), seen)
        return {"crops": images, "corrupted": unpatchify(corrupted, p, grid),
                "target": unpatchify(true, p, grid), "predicted": unpatchify(mosaic, p, grid)}


# ---------------------------------------------------------------- classification


def pretraining_head(width: int, num_classes: int) -> nn.Sequential:
    """The paper's head for supervised pretraining: an MLP with one (tanh) hidden layer on the [class] token."""
    head = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, num_classes))
    head.apply(init_weights)
    return head


def finetuning_head(width: int, num_classes: int) -> nn.Linear:
    """The paper's head for fine-tuning: one zero-initialised D x K linear layer."""
    head = nn.Linear(width, num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head


class Classification(Objective):
    """Cross-entropy on the [class] token's output (or the mean patch output, pool="mean"): supervised pretraining
    and fine-tuning differ only in the head.

    `export_head` says whether model.safetensors keeps the head (fine-tuning: a usable classifier, keys
    `head.weight` and `head.bias` beside the backbone's) or holds the backbone alone (pretraining).
    With `mixing`, training batches are mixed (mixup/CutMix) into soft targets, and train/accuracy counts a hit
    on the dominant label of each mixed image (the one weighted at least half).
    """

    def __init__(self, backbone: VisionTransformer, head: nn.Module, *, export_head: bool, pool: str = "cls",
                 label_smoothing: float = 0.0, mixing: Mixing | None = None):
        super().__init__()
        self.backbone, self.head, self.export_head = backbone, head, export_head
        self.pool, self.label_smoothing, self.mixing = pool, label_smoothing, mixing

    def logits(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) uint8 -> (B, K)
        return self.head(pool(self.backbone(normalize(images)), self.pool))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        targets = labels
        if self.mixing is not None and self.training:
            images, targets = self.mixing(images, labels)  # soft targets (B, K)
        logits = self.logits(images).float()
        loss = F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)  # soft or hard targets alike
        dominant = targets.argmax(-1) if targets.is_floating_point() else targets
        return StepOutput(loss, {"accuracy": (logits.argmax(-1) == dominant).float().mean()})

    def metrics(self, split: str) -> list[Metric]:
        batches = "the training batches" + (" (mixed: against the dominant label)" if self.mixing else "")
        return [split_metric(split, "loss", "classification loss (cross-entropy on the labels)", headline=True, bar="loss"),
                split_metric(split, "accuracy", f"accuracy on {batches}" if split == "train" else "accuracy",
                             headline=True, bar="acc", percent=True)]

    @property
    def description(self) -> str:
        pooled = "the [class] token" if self.pool == "cls" else "the mean of the patch outputs"
        mixed = ""
        if self.mixing is not None:
            alphas = [f"{name} {alpha:g}" for name, alpha in (("mixup", self.mixing.mixup), ("CutMix", self.mixing.cutmix)) if alpha > 0]
            mixed = f", training batches mixed by {' or '.join(alphas)}"
        return f"classification of the shards' labels from {pooled}{mixed}" + ("" if self.export_head else
                                                                               " (the paper's MLP pretraining head, not exported)")

    def export_weights(self) -> dict[str, torch.Tensor]:
        weights = self.backbone.state_dict()
        if self.export_head:
            weights.update({f"head.{name}": value for name, value in self.head.state_dict().items()})
        return weights


# ---------------------------------------------------------------- the registry

MAX_HEAD_BYTES = 10**9  # a larger MPP head (e.g. color4x4 at 8 bits: 268M outputs) only exhausts memory


class MPPConfig(Section):
    """The `mpp` section: masked patch prediction's settings; each target's own (`Target.settings`) join it."""

    hparams = ("target", "masking", "corrupt_rate", "corrupt_in")

    target: str = Field("color", description="What a corrupted patch predicts (the targets register the choices).")
    corrupt_rate: float = Field(0.5, gt=0, lt=1, description="Fraction of patch positions corrupted per image (paper: 0.5; 0.15 also tried).")
    mask_prob: float = Field(0.8, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by the learnable [mask] embedding.")
    random_prob: float = Field(0.1, ge=0, le=1, description="Of the corrupted patches, the fraction replaced by a random other patch's embedding (the rest keep their own).")
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

    def check(self, cfg) -> None:
        """The target fits the model: a patch size it can use (from_settings raises), a head of at most 1 GB."""
        if OBJECTIVES[cfg.objective].section is not OBJECTIVES["mpp"].section:
            return
        target = TARGETS[self.target]
        outputs = target.from_settings(cfg.model.patch_size, self).outputs
        width = cfg.model.variant.width
        head_bytes = 4 * (width + 1) * outputs  # fp32 weights and biases
        if head_bytes > MAX_HEAD_BYTES:
            own = [f"mpp.{key}" for key in (target.settings.model_fields if target.settings else ())]
            values = "".join(f" with {key}={getattr(self, key.removeprefix('mpp.'))}" for key in own)
            raise ValueError(f"mpp.target={self.target}{values} needs a {outputs:,}-way prediction head of "
                             f"{head_bytes / 1e9:.1f} GB (width {width}); heads over {MAX_HEAD_BYTES / 1e9:.1f} GB are refused, "
                             f"{f'lower {listed(own)} or ' if own else ''}pick a target with fewer outputs per patch")


@functools.lru_cache(maxsize=32)
def mpp_section(targets: tuple[tuple[str, type[Target]], ...]) -> type[MPPConfig]:
    """The `mpp` section with `targets`' own settings as fields and the choices of mpp.target described."""
    choices = [f"{name}, {target.meaning}" for name, target in targets]
    meanings = "; ".join(choices[:-1]) + f"; or {choices[-1]}" if len(choices) > 1 else choices[0]
    described = Field("color", description=f"What a corrupted patch predicts: {meanings}.")
    own = tuple(dict.fromkeys(target.settings for _, target in targets if target.settings))
    section = create_model("MPPConfig", __base__=(*own, MPPConfig), target=(str, described))  # MPPConfig's fields first
    section.hparams = (*MPPConfig.hparams, *(key for settings in own for key in settings.hparams))
    return section


def masked_patch_prediction(backbone: VisionTransformer, cfg, classes: int | None) -> MaskedPatchPrediction:
    m = cfg.mpp
    return MaskedPatchPrediction(backbone, target=TARGETS[m.target].from_settings(backbone.patch_size, m),
                                 corrupt_rate=m.corrupt_rate, mask_prob=m.mask_prob, random_prob=m.random_prob,
                                 masking=m.masking, corrupt_in=m.corrupt_in)


def batch_mixing(train, classes: int) -> Mixing | None:
    """The mixup/CutMix that `train` (the run's TrainConfig) asks for; None when both are off."""
    if not (train.mixup > 0 or train.cutmix > 0):
        return None
    return Mixing(train.mixup, train.cutmix, train.mixup_switch_prob, classes)


def supervised(backbone: VisionTransformer, cfg, classes: int | None) -> Classification:
    return Classification(backbone, pretraining_head(backbone.width, classes), export_head=False,
                          label_smoothing=cfg.train.label_smoothing, mixing=batch_mixing(cfg.train, classes))


@dataclass(frozen=True)
class ObjectiveKind:
    """What a stage needs to know of an objective before it exists."""

    build: Callable[..., Objective]  # (fresh backbone, the run's Config, classes) -> the objective
    reads_labels: bool  # the stage reads the shards' labels and passes their class count to `build` (else None)
    summary: str  # a few words for tables (compare's report)
    meaning: str = ""  # what `objective=<name>` trains, for the config reference (default: the summary)
    section: Callable[[], tuple[str, type[Section]]] | None = None  # its own config section: () -> (key, Section)
    reads: tuple[str, ...] = ()  # settings of other sections that only objectives declaring them read (HParams)

    def settings(self) -> tuple[str, ...]:
        """The config keys (a section as its prefix, "mpp.") that apply to this objective alone."""
        return (*((f"{self.section()[0]}.",) if self.section else ()), *self.reads)


CLASSIFICATION_SETTINGS = ("train.label_smoothing",)  # what supervised pretraining and fine-tuning read alone

# The config's `objective` -> its kind.
OBJECTIVES: dict[str, ObjectiveKind] = {
    "mpp": ObjectiveKind(masked_patch_prediction, reads_labels=False, summary="masked patch prediction",
                         section=lambda: ("mpp", mpp_section(tuple(TARGETS.items())))),
    "supervised": ObjectiveKind(supervised, reads_labels=True, summary="supervised (upstream labels)",
                                meaning="classification of the shards' cls labels", reads=CLASSIFICATION_SETTINGS),
}


def objective_fields() -> dict[str, tuple]:
    """The run config's `objective` (its choices and their meanings from OBJECTIVES) and the objectives' sections."""
    sections = dict(kind.section() for kind in OBJECTIVES.values() if kind.section)
    return _objective_fields(tuple((name, kind.meaning or kind.summary) for name, kind in OBJECTIVES.items()),
                             tuple(sections.items()))


@functools.lru_cache(maxsize=32)
def _objective_fields(meanings: tuple[tuple[str, str], ...], sections: tuple) -> dict[str, tuple]:
    known = Annotated[str, AfterValidator(lambda name: one_of("objective", name, OBJECTIVES))]
    described = listed([f"{name} ({meaning})" for name, meaning in meanings])
    return {"objective": (known, Field("mpp", description=f"Pretraining objective: {described}.")),
            **{key: section_field(section) for key, section in sections}}


SECTION_SOURCES.append(objective_fields)
