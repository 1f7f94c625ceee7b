"""What a ViT has learnt, as numbers: the views of section 4.5 of Dosovitskiy et al. (2021), Figures 6 and 7.

- patch_filters: the principal components of the linear patch projection's filters (Fig. 7 left);
- position_similarity: the cosine similarity of every patch position's embedding to every other's (Fig. 7 centre);
- attention_distance: per head of each layer, the mean image-space distance from a query patch to the patches it
  attends to, weighted by attention (Fig. 7 right);
- attention_rollout (Abnar & Zuidema, 2020): how much each input patch reaches an output token through all the
  layers' attention and residual connections (Fig. 6).

The attention weights come from VisionTransformer.forward_with_attention, the explicit path kept for inspection.
pipelines/inspection.py draws these views and logs them.
"""

from __future__ import annotations

import torch
from einops import rearrange

from mpp.model.vit import VisionTransformer


def patch_filters(backbone: VisionTransformer, count: int, grey: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` principal components of the patch projection's D filters, as patches (count, 3, P, P), and
    the fraction of the filters' variance each explains (count,). For a hybrid: of its ResNet's first convolution,
    the filters that meet the pixels, (count, 3, 7, 7).

    grey=True (for a model trained on grey images, R = G = B): each filter summed over its colour channels first, the
    only part of it a grey image meets; what varies between channels never got a gradient and is initial noise."""
    filters = backbone.patch_embed.filters().float().cpu()  # (D, h, w, c)
    h, w = filters.shape[1:3]
    if grey:
        filters = filters.sum(dim=-1, keepdim=True)
    centred = (filters - filters.mean(dim=0, keepdim=True)).flatten(1)  # (D, P*P*channels)
    _, singular, components = torch.linalg.svd(centred, full_matrices=False)
    count = min(count, components.shape[0])
    variance = singular.square()
    patches = rearrange(components[:count], "k (h w c) -> k c h w", h=h, w=w).expand(-1, 3, -1, -1)
    return patches, variance[:count] / variance.sum().clamp_min(1e-12)


def position_similarity(pos_embed: torch.Tensor | None) -> torch.Tensor | None:  # (1, 1 + N, D) -> (N, N)
    """Cosine similarity between the position embeddings of every pair of patch positions ([class]'s left out), as
    VisionTransformer.position_embeddings gives them; None for a ViT without position embeddings."""
    if pos_embed is None:
        return None
    positions = torch.nn.functional.normalize(pos_embed.detach().float()[0, 1:], dim=-1)  # (N, D)
    return positions @ positions.T


def patch_distances(grid: int, patch_size: int) -> torch.Tensor:  # (N, N)
    """Euclidean distance in pixels between the centres of every pair of patches of a grid x grid image."""
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=-1).float() * patch_size  # (N, 2)
    return torch.cdist(centres, centres)


def patch_attention(maps: torch.Tensor) -> torch.Tensor:  # (B, heads, 1 + N, 1 + N) -> (B, heads, N, N)
    """Attention among the patches: [class] has no place in the image, so its row and column are left out and each
    query's weights over the patches are renormalised to sum to 1."""
    among = maps[:, :, 1:, 1:].float()
    return among / among.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def attention_distance(maps: list[torch.Tensor], grid: int, patch_size: int) -> torch.Tensor:  # (depth, heads)
    """Per head of each layer, the attention-weighted query-to-key distance in pixels, averaged over the queries of
    every image the maps were computed on."""
    distances = patch_distances(grid, patch_size).to(maps[0].device)
    return torch.stack([(patch_attention(layer) * distances).sum(dim=-1).mean(dim=(0, 2)) for layer in maps])


def attention_rollout(maps: list[torch.Tensor]) -> torch.Tensor:  # [(B, heads, T, T)] * depth -> (B, T, T)
    """Abnar & Zuidema's rollout: each layer's attention averaged over heads, with the residual connection as an
    identity of equal weight (0.5 A + 0.5 I, rows renormalised), multiplied from the first layer to the last. Row t
    says how much each input token reaches output token t."""
    rollout = None
    for layer in maps:
        mixed = 0.5 * layer.float().mean(dim=1) + 0.5 * torch.eye(layer.shape[-1], device=layer.device)  # (B, T, T)
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout
    return rollout


def rollout_to_patches(rollout: torch.Tensor, pooling: str) -> torch.Tensor:  # (B, 1 + N, 1 + N) -> (B, N)
    """How much each input patch reaches the representation: the [class] token's output (cls) or the mean of the
    patch outputs (mean), as a distribution over the patches (sums to 1)."""
    reach = rollout[:, 0, 1:] if pooling == "cls" else rollout[:, 1:, 1:].mean(dim=1)
    return reach / reach.sum(dim=-1, keepdim=True)
