"""The ViT sizes a model name stands for (the paper's Table 1 plus DeiT's Ti and S), without torch: the config
validates model names with them, and `mpp --help` must not wait for torch to load."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ViTSize:
    width: int
    depth: int
    heads: int


@dataclass(frozen=True)
class Variant:
    """What a model name and its overrides build: the one place the name, the overrides and the defaults meet."""

    width: int
    depth: int
    heads: int
    patch_size: int


# The paper's Table 1 plus the DeiT Ti/S sizes that are customary for small-scale work.
VIT_SIZES = {
    "vit_ti": ViTSize(192, 12, 3),
    "vit_s": ViTSize(384, 12, 6),
    "vit_b": ViTSize(768, 12, 12),
    "vit_l": ViTSize(1024, 24, 16),
    "vit_h": ViTSize(1280, 32, 16),
}

_NAME = re.compile(r"^(vit_(?:ti|s|b|l|h))(\d+)?$")


def parse_model_name(name: str) -> tuple[ViTSize, int | None]:
    """'vit_b16' -> (ViT-B size, 16); 'vit_ti' -> (ViT-Ti size, None)."""
    match = _NAME.match(name)
    if not match:
        raise ValueError(f"unknown model '{name}'; choose one of {', '.join(VIT_SIZES)}, optionally with a patch size (vit_b16)")
    return VIT_SIZES[match.group(1)], int(match.group(2)) if match.group(2) else None


def resolve_variant(name: str, patch_size: int | None = None, *, width: int | None = None, depth: int | None = None,
                    heads: int | None = None) -> Variant:
    """'vit_b16' plus overrides -> its width, depth, heads and patch size (the override, else the name's number, else 16)."""
    size, named_patch = parse_model_name(name)
    return Variant(width or size.width, depth or size.depth, heads or size.heads, patch_size or named_patch or 16)


def resnet_stride(layers) -> int:
    """The stem's downsampling: 4 in the root (a stride-2 convolution, a stride-2 max pool), 2 in each stage after the first."""
    return 4 * 2 ** (len(layers) - 1)
