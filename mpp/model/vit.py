"""The Vision Transformer of Dosovitskiy et al. (2021): patches -> linear embedding -> pre-norm Transformer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpp.model.variants import VIT_SIZES, Variant, ViTSize, parse_model_name, resnet_stride, resolve_variant  # noqa: F401 (the model's names)


# Inputs are scaled to [-1, 1]; targets are always computed from the raw uint8 pixels.
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5


def normalize(images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) uint8 -> float in [-1, 1]
    return (images.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:  # (B, C, H, W) -> (B, N, P*P*C), patches row-major
    """The one patch layout: each P x P patch flattened as (p1 p2 c), the order PatchEmbed's weights read."""
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=p, p2=p)


def unpatchify(patches: torch.Tensor, p: int, grid: int) -> torch.Tensor:  # (B, grid*grid, P*P*C) -> (B, C, H, W)
    return rearrange(patches, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=grid, p1=p, p2=p)


class PatchEmbed(nn.Module):
    """Linear projection of flattened P x P patches."""

    def __init__(self, patch_size: int, dim: int, channels: int = 3):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(channels * patch_size * patch_size, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, N, D)
        return self.proj(patchify(images, self.patch_size))

    def filters(self) -> torch.Tensor:  # (D, P, P, C): each output's weights as the patch it reads
        # Detached: einops caches a backend per exact type, and a Parameter's first visit grew the cache that a
        # compiled forward guards on, which recompiled the whole model at the run's first inspection.
        p = self.patch_size
        return rearrange(self.proj.weight.detach(), "d (p1 p2 c) -> d p1 p2 c", p1=p, p2=p)


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding of one axis (timm's get_same_padding): enough for ceil(size / stride) outputs,
    the odd pixel after (bottom, right) rather than before."""
    total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:  # (B, C, H, W)
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """A convolution with weight standardisation (Qiao et al. 2019), as BiT's ResNets: each filter is shifted to zero
    mean and scaled to unit variance (biased, epsilon 1e-8, as timm's hybrids) before it is applied, which suits
    Group Normalization and small batches. `same`: TensorFlow's 'SAME' padding from the input's size (timm's
    StdConv2dSame), else the symmetric `padding` given."""

    def __init__(self, *args, same: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.same = same
        if same:
            self.padding = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        mean, var = w.mean(dim=(1, 2, 3), keepdim=True), w.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        if self.same:
            x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, (w - mean) / (var + 1e-8).sqrt(), self.bias, self.stride, self.padding)


class MaxPoolSame(nn.Module):
    """3 x 3 max pooling at stride 2 with TensorFlow's 'SAME' padding (timm's MaxPool2dSame): padded with -inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(pad_same(x, 3, 2, value=-math.inf), 3, 2)


def group_norm(channels: int, eps: float) -> nn.GroupNorm:
    """BiT's Group Normalization: 32 groups (fewer for a narrow CPU-sized stem: the largest count dividing the channels)."""
    return nn.GroupNorm(math.gcd(32, channels), channels, eps=eps)


# model.stem_padding -> its GroupNorm epsilon: timm's GroupNormAct's 1e-5 with 'SAME', 1e-6 in mpp's first stem.
STEM_NORM_EPS = {"same": 1e-5, "symmetric": 1e-6}


class Bottleneck(nn.Module):
    """A ResNet bottleneck unit with GN and weight-standardised convolutions: 1x1 -> 3x3 (stride) -> 1x1 (4x wider),
    added to the shortcut (a strided 1x1 projection where the shape changes), then ReLU. The last GN starts at zero,
    so every unit starts as its shortcut. `padding`: same or symmetric (ResNetStem)."""

    def __init__(self, channels_in: int, mid: int, stride: int, padding: str = "same"):
        super().__init__()
        out, same, eps = 4 * mid, padding == "same", STEM_NORM_EPS[padding]
        self.conv1, self.norm1 = StdConv2d(channels_in, mid, 1, bias=False), group_norm(mid, eps)
        self.conv2 = StdConv2d(mid, mid, 3, stride=stride, padding=1, bias=False, same=same)
        self.norm2 = group_norm(mid, eps)
        self.conv3, self.norm3 = StdConv2d(mid, out, 1, bias=False), group_norm(out, eps)
        nn.init.zeros_(self.norm3.weight)
        self.downsample = None
        if stride != 1 or channels_in != out:
            self.downsample = nn.Sequential(StdConv2d(channels_in, out, 1, stride=stride, bias=False, same=same),
                                            group_norm(out, eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, H, W) -> (B, 4 mid, H / stride, W / stride)
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(self.norm3(self.conv3(y)) + shortcut)


class ResNetStem(nn.Module):
    """The CNN of the paper's hybrid (section 3.1, appendix B): BiT's ResNet (Kolesnikov et al. 2020), GN and
    weight-standardised convolutions, with `layers` units per stage. The paper's R50 drops ResNet-50's stage 4 and
    moves its units into stage 3: layers (3, 4, 9), a map of 1024 channels at 1/16 of the image side.

    `padding` "same" computes what timm's vit_*_r50_* hybrids compute (the layout of Google's released R50+ViT
    weights): 'SAME' padding on the strided convolutions and the max pool, GroupNorm epsilon 1e-5. "symmetric" is
    mpp's first stem (PyTorch's symmetric padding, epsilon 1e-6), which models saved before the choice keep."""

    def __init__(self, layers=(3, 4, 9), width: int = 64, padding: str = "same"):
        super().__init__()
        self.stride = resnet_stride(layers)
        same = padding == "same"
        self.root = nn.Sequential(StdConv2d(3, width, 7, stride=2, padding=3, bias=False, same=same),
                                  group_norm(width, STEM_NORM_EPS[padding]), nn.ReLU(),
                                  MaxPoolSame() if same else nn.MaxPool2d(3, stride=2, padding=1))
        stages, channels = [], width
        for s, units in enumerate(layers):
            mid = width * 2 ** s
            stages.append(nn.Sequential(*(Bottleneck(channels if u == 0 else 4 * mid, mid, 2 if s > 0 and u == 0 else 1,
                                                     padding) for u in range(units))))
            channels = 4 * mid
        self.stages = nn.Sequential(*stages)
        self.channels = channels

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, C, H / stride, W / stride)
        return self.stages(self.root(images))


class HybridEmbed(nn.Module):
    """The hybrid's patch embedding (section 3.1): the input sequence is the CNN's feature map, each 1x1 cell a patch
    (a `stride` x `stride` region of the image), linearly projected to the model width."""

    def __init__(self, layers, stem_width: int, dim: int, padding: str = "same"):
        super().__init__()
        self.stem = ResNetStem(layers, stem_width, padding)
        self.patch_size = self.stem.stride
        self.proj = nn.Linear(self.stem.channels, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) -> (B, N, D), cells row-major
        return self.proj(rearrange(self.stem(images), "b c h w -> b (h w) c"))

    def filters(self) -> torch.Tensor:  # (C, 7, 7, 3): the first convolution's kernels, what meets the pixels
        return rearrange(self.stem.root[0].weight.detach(), "d c h w -> d h w c")  # detached: see PatchEmbed.filters


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if q.is_cpu and q.dtype == torch.bfloat16:
            # torch's CPU flash-attention kernel is 5x to 7x slower in bf16 than this form (benchmarks/attention.py).
            out = attention_weights(q, k) @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))

    def forward_with_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # (B, N, D), (B, heads, N, N)
        """forward's output and the attention weights, which the fused kernel does not return: for inspection only."""
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        weights = attention_weights(q, k)
        return self.proj(rearrange(weights @ v, "b h n d -> b n (h d)")), weights


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # (B, h, N, d) x 2 -> (B, h, N, N)
    """softmax(q k^T / sqrt(d)): row i is how query i spreads its attention over the keys."""
    return (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).softmax(-1)


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): in training, zero a residual branch for a `rate` fraction of the
    samples and scale the kept ones by 1 / (1 - rate), so the expected output is unchanged; identity in eval."""

    def __init__(self, rate: float = 0.0):
        super().__init__()
        self.rate = rate

    def forward(self, branch: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        if not self.training or self.rate == 0.0:
            return branch
        keep = torch.rand(branch.shape[0], 1, 1, device=branch.device) >= self.rate  # (B, 1, 1)
        return branch * keep.to(branch.dtype) / (1.0 - self.rate)


class Block(nn.Module):
    """Pre-norm Transformer encoder block: x + MSA(LN(x)), then x + MLP(LN(x)), each branch under stochastic depth."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def forward_with_weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward through the explicit attention path, with its weights (B, heads, N, N): for inspection only."""
        attended, weights = self.attn.forward_with_weights(self.norm1(x))
        x = x + self.drop_path(attended)
        return x + self.drop_path(self.mlp(self.norm2(x))), weights


STEMS = ("patch", "resnet")  # model.stem: the paper's linear patch embedding, or the hybrid's ResNet
POS_EMBEDS = ("learned", "learned_2d", "sincos_2d", "none")  # model.pos_embed (the paper's appendix D.4, plus fixed sin-cos)


def sincos_2d(grid: int, dim: int) -> torch.Tensor:  # (grid * grid, dim), positions row-major
    """Fixed 2-D sine-cosine position embeddings (as MoCo v3 and MAE): a quarter of the channels each are sin and cos
    of the row, sin and cos of the column, at frequencies 1 / 10000^(i / (dim / 4))."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))  # (dim / 4,)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64), indexing="ij")
    angles_r, angles_c = rows.flatten()[:, None] * omega, cols.flatten()[:, None] * omega  # (N, dim / 4) each
    return torch.cat([angles_r.sin(), angles_r.cos(), angles_c.sin(), angles_c.cos()], dim=1).float()


class VisionTransformer(nn.Module):
    """Backbone only: heads belong to the objectives that train it.

    `embed_patches` and `encode` are separate so an objective can alter patch embeddings
    (MPP corrupts them) after the projection and before position embeddings are added.

    `stem`: patch, the paper's linear projection of P x P patches; resnet, the hybrid, whose tokens are the 1x1 cells
    of a ResNet's feature map (`stem_layers` units per stage, `stem_width` root channels, `stem_padding` as
    ResNetStem's), a P x P region each, P the ResNet's stride. `pos_embed` (appendix D.4): learned, one learned
    vector per position (the paper's choice); learned_2d, a learned row vector and a learned column vector of width
    D/2 each, concatenated; sincos_2d, fixed sines and cosines of the row and column; none. The 2-D kinds give
    [class] no position embedding.
    """

    def __init__(self, image_size: int, patch_size: int, width: int, depth: int, heads: int, drop_path: float = 0.0,
                 grad_checkpointing: bool = False, stem: str = "patch", stem_layers=(3, 4, 9), stem_width: int = 64,
                 pos_embed: str = "learned", stem_padding: str = "same"):
        super().__init__()
        if stem == "resnet" and patch_size != resnet_stride(stem_layers):
            raise ValueError(f"patch size {patch_size} does not match the ResNet stem's stride {resnet_stride(stem_layers)}")
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not divisible by patch size {patch_size}")
        self.image_size, self.patch_size, self.width = image_size, patch_size, width
        self.depth, self.heads = depth, heads
        self.stem, self.stem_layers, self.stem_width, self.pos_embed_kind = stem, tuple(stem_layers), stem_width, pos_embed
        self.stem_padding = stem_padding
        self.grid = image_size // patch_size
        self.num_patches = self.grid * self.grid
        self.patch_embed = (PatchEmbed(patch_size, width) if stem == "patch"
                            else HybridEmbed(stem_layers, stem_width, width, stem_padding))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches + 1, width))  # (1, 1 + N, D)
        elif pos_embed == "learned_2d":
            self.pos_embed_rows = nn.Parameter(torch.zeros(1, self.grid, width // 2))  # (1, grid, D/2)
            self.pos_embed_cols = nn.Parameter(torch.zeros(1, self.grid, width - width // 2))
        elif pos_embed == "sincos_2d":
            # Computed from the grid, so not saved: a new resolution recomputes it.
            self.register_buffer("pos_embed_fixed", sincos_2d(self.grid, width)[None], persistent=False)  # (1, N, D)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.set_drop_path(drop_path)
        self.grad_checkpointing = grad_checkpointing
        self.reset_parameters()

    def set_drop_path(self, rate: float) -> None:
        """Stochastic depth rising linearly over the blocks, from 0 at the first to `rate` at the last (as in DeiT, BEiT)."""
        for i, block in enumerate(self.blocks):
            block.drop_path.rate = rate * i / max(1, self.depth - 1)

    def reset_parameters(self) -> None:
        # In a fixed order (no_weight_decay is a set, whose order changes with each process's hash seed): the same
        # seed must give the same weights in every process, or two processes start apart from one.
        for name in ("pos_embed", "pos_embed_rows", "pos_embed_cols", "cls_token"):
            if name in self.no_weight_decay():
                trunc_normal(getattr(self, name))
        self.apply(init_weights)

    def no_weight_decay(self) -> set[str]:
        """The input tokens, exempt from weight decay (timm's convention; biases and norms are exempt anyway)."""
        learned = {"learned": ["pos_embed"], "learned_2d": ["pos_embed_rows", "pos_embed_cols"]}
        return {"cls_token", *learned.get(self.pos_embed_kind, [])}

    def layer_of(self, name: str) -> int:
        """The layer of parameter `name` (as named_parameters() gives it) in BEiT/MAE's numbering for layer-wise lr
        decay: the patch embedding (a hybrid's whole ResNet, as timm counts it) and the input tokens are layer 0,
        block i is layer i + 1, the final norm depth + 1."""
        if name in self.no_weight_decay() or name.startswith("patch_embed."):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.depth + 1

    def position_embeddings(self) -> torch.Tensor | None:  # (1, 1 + N, D), [class] first; None without any
        """What is added to the tokens: the learned table, the row and column halves concatenated per position, or
        the fixed sin-cos (the 2-D kinds with a zero vector for [class])."""
        if self.pos_embed_kind == "learned":
            return self.pos_embed
        if self.pos_embed_kind == "learned_2d":
            g = self.grid
            rows = self.pos_embed_rows[:, :, None].expand(-1, -1, g, -1)  # (1, g, g, D/2): row i everywhere on row i
            cols = self.pos_embed_cols[:, None].expand(-1, g, -1, -1)  # (1, g, g, D/2)
            patches = torch.cat([rows, cols], dim=-1).flatten(1, 2)  # (1, N, D)
        elif self.pos_embed_kind == "sincos_2d":
            patches = self.pos_embed_fixed
        else:
            return None
        return torch.cat([patches.new_zeros(1, 1, self.width), patches], dim=1)

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) float -> (B, N, D)
        return self.patch_embed(images)

    def tokens(self, patch_tokens: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 1 + N, D)
        """The encoder's input: [class] before the patch tokens, position embeddings added."""
        cls = self.cls_token.expand(patch_tokens.shape[0], -1, -1)
        x = torch.cat([cls, patch_tokens], dim=1)
        position = self.position_embeddings()
        return x if position is None else x + position

    def encode(self, patch_tokens: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 1 + N, D)
        x = self.tokens(patch_tokens)
        for block in self.blocks:
            # Recomputed in the backward pass with the RNG state of the forward, so stochastic depth drops alike.
            x = checkpoint(block, x, use_reentrant=False) if self.grad_checkpointing and self.training else block(x)
        return self.norm(x)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 1 + N, D)
        return self.encode(self.embed_patches(images))

    def forward_with_attention(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """forward's output and every block's attention weights [(B, heads, 1 + N, 1 + N)] * depth, through the
        explicit attention path (mpp.evaluation.views reads them); training never takes this path."""
        x, maps = self.tokens(self.embed_patches(images)), []
        for block in self.blocks:
            x, weights = block.forward_with_weights(x)
            maps.append(weights)
        return self.norm(x), maps


def pool(encoded: torch.Tensor, pooling: str) -> torch.Tensor:
    """Encoder outputs (B, 1 + N, D) -> (B, D): the [class] token's output (cls) or the mean of the patch outputs (mean)."""
    return encoded[:, 0] if pooling == "cls" else encoded[:, 1:].mean(dim=1)


def resize_pos_embed(pos_embed: torch.Tensor, grid: int) -> torch.Tensor:
    """(1, 1 + g*g, D) -> (1, 1 + grid*grid, D): the paper's 2-D interpolation for a new resolution.

    The patch positions are resampled bicubically as an image over their g x g grid; [class] keeps its embedding.
    """
    cls, patches = pos_embed[:, :1], pos_embed[:, 1:]
    old = math.isqrt(patches.shape[1])
    if old * old != patches.shape[1]:
        raise ValueError(f"position embeddings of {patches.shape[1]} patches do not form a square grid")
    if old == grid:
        return pos_embed
    image = rearrange(patches, "1 (h w) d -> 1 d h w", h=old)
    resized = F.interpolate(image.float(), size=(grid, grid), mode="bicubic", align_corners=False).to(pos_embed.dtype)
    return torch.cat([cls, rearrange(resized, "1 d h w -> 1 (h w) d")], dim=1)


def resize_rows(embed: torch.Tensor, grid: int) -> torch.Tensor:
    """(1, g, D') -> (1, grid, D'): learned_2d's row (or column) embeddings resampled bicubically along their axis."""
    if embed.shape[1] == grid:
        return embed
    line = rearrange(embed, "1 g d -> 1 d g 1")
    resized = F.interpolate(line.float(), size=(grid, 1), mode="bicubic", align_corners=False).to(embed.dtype)
    return rearrange(resized, "1 d g 1 -> 1 g d")


def resize_position_weights(weights: dict[str, torch.Tensor], grid: int) -> dict[str, torch.Tensor]:
    """A backbone's state dict with its learned position embeddings resampled to a grid x grid image (the fixed
    sin-cos kind is recomputed by the model, `none` has nothing to resample)."""
    weights = dict(weights)
    if "pos_embed" in weights:
        weights["pos_embed"] = resize_pos_embed(weights["pos_embed"], grid)
    for axis in ("pos_embed_rows", "pos_embed_cols"):
        if axis in weights:
            weights[axis] = resize_rows(weights[axis], grid)
    return weights


def trunc_normal(tensor: torch.Tensor, std: float = 0.02) -> None:
    # torch's default bounds are +-2 in absolute terms, i.e. no truncation at std 0.02; cut at 2 std instead.
    nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def init_weights(module: nn.Module) -> None:
    """Truncated-normal linear weights, zero biases, unit LayerNorm: common ViT practice; convolutions (the hybrid's
    ResNet) He-normal over their outputs, as ResNets are initialised."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(module, nn.Linear):
        trunc_normal(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_vit(name: str, image_size: int, patch_size: int | None = None, *, width: int | None = None,
              depth: int | None = None, heads: int | None = None, drop_path: float = 0.0,
              grad_checkpointing: bool = False, stem: str = "patch", stem_layers=(3, 4, 9), stem_width: int = 64,
              pos_embed: str = "learned", stem_padding: str = "same") -> VisionTransformer:
    """A named variant (vit_b16, vit_ti, ...), optionally with its width, depth or heads overridden; with
    stem="resnet" the hybrid, whose patch size is the ResNet's stride unless given."""
    if stem == "resnet" and patch_size is None and parse_model_name(name)[1] is None:
        patch_size = resnet_stride(stem_layers)
    v = resolve_variant(name, patch_size, width=width, depth=depth, heads=heads)
    return VisionTransformer(image_size, v.patch_size, v.width, v.depth, v.heads, drop_path, grad_checkpointing,
                             stem, stem_layers, stem_width, pos_embed, stem_padding)


def build_backbone(model) -> VisionTransformer:
    """A fresh backbone as a run's `model` config section (a ModelConfig) describes it."""
    return build_vit(model.name, model.image_size, model.patch_size, width=model.width, depth=model.depth,
                     heads=model.heads, drop_path=model.drop_path, grad_checkpointing=model.grad_checkpointing,
                     stem=model.stem, stem_layers=model.stem_layers, stem_width=model.stem_width,
                     pos_embed=model.pos_embed, stem_padding=model.stem_padding)
