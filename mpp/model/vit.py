"""The Vision Transformer of Dosovitskiy et al. (2021): patches -> linear embedding -> pre-norm Transformer."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpp.model.variants import VIT_SIZES, Variant, ViTSize, parse_model_name, resolve_variant  # noqa: F401 (the model's names)


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


class VisionTransformer(nn.Module):
    """Backbone only: heads belong to the objectives that train it.

    `embed_patches` and `encode` are separate so an objective can alter patch embeddings
    (MPP corrupts them) after the projection and before position embeddings are added.
    """

    def __init__(self, image_size: int, patch_size: int, width: int, depth: int, heads: int, drop_path: float = 0.0,
                 grad_checkpointing: bool = False):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not divisible by patch size {patch_size}")
        self.image_size, self.patch_size, self.width = image_size, patch_size, width
        self.depth, self.heads = depth, heads
        self.grid = image_size // patch_size
        self.num_patches = self.grid * self.grid
        self.patch_embed = PatchEmbed(patch_size, width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches + 1, width))
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
        trunc_normal(self.pos_embed)
        trunc_normal(self.cls_token)
        self.apply(init_weights)

    def no_weight_decay(self) -> set[str]:
        """The input tokens, exempt from weight decay (timm's convention; biases and norms are exempt anyway)."""
        return {"cls_token", "pos_embed"}

    def layer_of(self, name: str) -> int:
        """The layer of parameter `name` (as named_parameters() gives it) in BEiT/MAE's numbering for layer-wise lr
        decay: the patch embedding and the input tokens are layer 0, block i is layer i + 1, the final norm depth + 1."""
        if name in self.no_weight_decay() or name.startswith("patch_embed."):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return self.depth + 1

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, H, W) float -> (B, N, D)
        return self.patch_embed(images)

    def tokens(self, patch_tokens: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 1 + N, D)
        """The encoder's input: [class] before the patch tokens, position embeddings added."""
        cls = self.cls_token.expand(patch_tokens.shape[0], -1, -1)
        return torch.cat([cls, patch_tokens], dim=1) + self.pos_embed

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
        explicit attention path (mpp.inspection reads them); training never takes this path."""
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


def trunc_normal(tensor: torch.Tensor, std: float = 0.02) -> None:
    # torch's default bounds are +-2 in absolute terms, i.e. no truncation at std 0.02; cut at 2 std instead.
    nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def init_weights(module: nn.Module) -> None:
    """Truncated-normal linear weights, zero biases, unit LayerNorm: common ViT practice."""
    if isinstance(module, nn.Linear):
        trunc_normal(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_vit(name: str, image_size: int, patch_size: int | None = None, *, width: int | None = None,
              depth: int | None = None, heads: int | None = None, drop_path: float = 0.0,
              grad_checkpointing: bool = False) -> VisionTransformer:
    """A named variant (vit_b16, vit_ti, ...), optionally with its width, depth or heads overridden."""
    v = resolve_variant(name, patch_size, width=width, depth=depth, heads=heads)
    return VisionTransformer(image_size, v.patch_size, v.width, v.depth, v.heads, drop_path, grad_checkpointing)


def build_backbone(model) -> VisionTransformer:
    """A fresh backbone as a run's `model` config section (a ModelConfig) describes it."""
    return build_vit(model.name, model.image_size, model.patch_size, width=model.width, depth=model.depth,
                     heads=model.heads, drop_path=model.drop_path, grad_checkpointing=model.grad_checkpointing)
