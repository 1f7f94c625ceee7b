"""Training objectives over a ViT backbone. Each maps a uint8 batch to a loss and metrics; the loop is shared.

The loop knows an objective only through `Objective`; mpp.model.registry.OBJECTIVES maps the config's `objective`
name to its kind (its builder here, whether it reads labels, a short summary, its config section), and the kinds and
their sections reach the run config from there without loading torch.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mpp.metrics import PRETEXT_LOSS, Metric, split_metric
from mpp.model.mixup import Mixing
from mpp.model.vit import VisionTransformer, init_weights, normalize, patchify, pool, trunc_normal, unpatchify
from mpp.model.registry import TARGETS
from mpp.model.targets import MeanColor, Target

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
    Register it in mpp.model.registry.OBJECTIVES (its builder, whether it reads labels, a summary) to make it selectable with
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
    `class_names` (id = position) name the head's outputs where the training shards name them; the exported
    weights carry them and `pool` (mpp.model.checkpoint.save_weights), so a copied file still says what it predicts.
    With `class_weights` (K,), each class's cross-entropy is weighted (finetune.class_balance=loss_weights:
    `balancing_weights`), so a rare class counts as much in the loss as a common one.
    """

    def __init__(self, backbone: VisionTransformer, head: nn.Module, *, export_head: bool, pool: str = "cls",
                 label_smoothing: float = 0.0, mixing: Mixing | None = None, class_names: tuple[str, ...] = (),
                 class_weights: torch.Tensor | None = None):
        super().__init__()
        self.backbone, self.head, self.export_head = backbone, head, export_head
        self.pool, self.label_smoothing, self.mixing = pool, label_smoothing, mixing
        self.class_names = tuple(class_names)
        # A buffer follows the model to its device; not persistent: the weights are the run's data, not its state.
        self.register_buffer("class_weights", class_weights, persistent=False)

    def logits(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) uint8 -> (B, K)
        return self.head(pool(self.backbone(normalize(images)), self.pool))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> StepOutput:
        targets = labels
        if self.mixing is not None and self.training:
            images, targets = self.mixing(images, labels)  # soft targets (B, K)
        logits = self.logits(images).float()
        loss = F.cross_entropy(logits, targets, weight=self.class_weights,  # soft or hard targets alike
                               label_smoothing=self.label_smoothing)
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
        weighted = "" if self.class_weights is None else ", each class's loss weighted by its inverse frequency"
        return f"classification of the shards' labels from {pooled}{mixed}{weighted}" + ("" if self.export_head else
                                                                               " (the paper's MLP pretraining head, not exported)")

    def export_weights(self) -> dict[str, torch.Tensor]:
        weights = self.backbone.state_dict()
        if self.export_head:
            weights.update({f"head.{name}": value for name, value in self.head.state_dict().items()})
        return weights


# ---------------------------------------------------------------- the builders (mpp.model.registry names them)

def masked_patch_prediction(backbone: VisionTransformer, cfg, classes: int | None) -> MaskedPatchPrediction:
    m = cfg.mpp
    return MaskedPatchPrediction(backbone, target=TARGETS[m.target].build(backbone.patch_size, m),
                                 corrupt_rate=m.corrupt_rate, mask_prob=m.mask_prob, random_prob=m.random_prob,
                                 masking=m.masking, corrupt_in=m.corrupt_in)


def balancing_weights(class_counts: list[int]) -> torch.Tensor:
    """Inverse class frequency, scaled so that the weight of an average training image is 1: images / (classes with
    images x that class's images), scikit-learn's "balanced" class weights; a class without training images keeps 1."""
    present = [count for count in class_counts if count]
    total = sum(present)
    return torch.tensor([total / (len(present) * count) if count else 1.0 for count in class_counts])


def batch_mixing(train, classes: int) -> Mixing | None:
    """The mixup/CutMix that `train` (the run's TrainConfig) asks for; None when both are off."""
    if not (train.mixup > 0 or train.cutmix > 0):
        return None
    return Mixing(train.mixup, train.cutmix, train.mixup_switch_prob, classes)


def supervised(backbone: VisionTransformer, cfg, classes: int | None) -> Classification:
    return Classification(backbone, pretraining_head(backbone.width, classes), export_head=False,
                          label_smoothing=cfg.train.label_smoothing, mixing=batch_mixing(cfg.train, classes))
