"""Load a pretrained backbone from any of the places a run leaves one, at the resolution the new run asks for."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file

from mpp.errors import UserError
from mpp.model import VisionTransformer, resize_pos_embed, resolve_variant
from mpp.rundir import WEIGHTS, newest_verified, run_config_of

VIT_KEYS = ("cls_token", "pos_embed", "patch_embed.proj.weight", "norm.weight")


class CheckpointError(UserError):
    """A checkpoint that is missing, unreadable or does not fit the model asked for; one line naming both."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (its model.safetensors, else its newest checkpoint that verifies), a checkpoints/step_N
    directory, or a .safetensors file -> the .safetensors file holding the weights."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a run directory, a checkpoints/step_N directory or a .safetensors file to --ckpt")
    if (path / WEIGHTS).is_file():
        return path / WEIGHTS
    verified = newest_verified(path)
    if verified is not None and (verified / WEIGHTS).is_file():
        return verified / WEIGHTS
    raise CheckpointError(f"{path} holds neither {WEIGHTS} nor a checkpoint that verifies; pass a run directory, a checkpoints/step_N directory or a .safetensors file to --ckpt")


def backbone_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training checkpoint stores the objective (backbone.*, heads, [mask]); an export the backbone (+ head.*)."""
    if any(k.startswith("backbone.") for k in weights):
        return {k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")}
    return {k: v for k, v in weights.items() if not k.startswith("head.")}


def saved_heads(weights_file: Path) -> int | None:
    """Attention heads are not visible in tensor shapes: read them from the run's config.yaml, if there is one."""
    config = run_config_of(weights_file)
    if config is None:
        return None
    model = OmegaConf.to_container(OmegaConf.load(config)).get("model") or {}
    try:
        return resolve_variant(str(model.get("name")), heads=model.get("heads")).heads
    except ValueError:
        return None


def load_backbone(ckpt: str | Path, model_cfg) -> VisionTransformer:
    """The ViT in `ckpt`, shaped by its tensors, with position embeddings interpolated to model_cfg.image_size."""
    path = resolve_checkpoint(ckpt)
    try:
        weights = backbone_weights(load_file(str(path)))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path} as safetensors ({exc}); pass a model.safetensors written by this project") from None
    missing = [k for k in VIT_KEYS if k not in weights]
    if missing:
        found = ", ".join(list(weights)[:3]) or "no tensors"
        raise CheckpointError(f"{path} is not a ViT of this project: it lacks {', '.join(missing)} (it holds {found}, ...); pass a checkpoint written by launch.py pretrain or finetune")

    if not any(k.startswith("blocks.") for k in weights):
        raise CheckpointError(f"{path} holds no Transformer blocks (no blocks.* tensors), so it is not a trained ViT; "
                              f"pass a checkpoint written by launch.py pretrain or finetune")
    proj = tuple(weights["patch_embed.proj.weight"].shape)  # (D, P*P*3)
    pos = tuple(weights["pos_embed"].shape)  # (1, 1 + N, D)
    if len(proj) != 2 or len(pos) != 3:
        raise CheckpointError(f"{path} has a patch projection of shape {proj} and position embeddings of shape {pos}; "
                              f"a ViT of this project has (D, P*P*3) and (1, 1 + N, D): pass a checkpoint written by launch.py")
    if math.isqrt(pos[1] - 1) ** 2 != pos[1] - 1:
        raise CheckpointError(f"{path} has {pos[1] - 1} patch positions, not a square grid, so they cannot be interpolated "
                              f"to model.image_size={model_cfg.image_size}; pass a checkpoint of a square-image ViT")
    width = weights["cls_token"].shape[-1]
    patch = math.isqrt(proj[1] // 3)
    expected = (width, 3 * model_cfg.patch_size ** 2)
    if patch * patch * 3 != proj[1] or patch != model_cfg.patch_size:
        raise CheckpointError(f"{path} has patch embedding weights of shape {proj} (patch size {patch}) but model.patch_size={model_cfg.patch_size} "
                              f"needs {expected}; set model.patch_size={patch} (a ViT cannot change its patch size)")
    depth = len({k.split(".")[1] for k in weights if k.startswith("blocks.")})
    heads = saved_heads(path) or model_cfg.variant.heads
    if width % heads:
        raise CheckpointError(f"{path} has width {width}, which {heads} attention heads do not divide; set model.heads to the pretraining run's value")

    backbone = VisionTransformer(model_cfg.image_size, patch, width, depth, heads)
    weights["pos_embed"] = resize_pos_embed(weights["pos_embed"], backbone.grid)
    try:
        backbone.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        raise CheckpointError(f"{path} does not fit a ViT of width {width}, depth {depth} and patch size {patch}: {detail[:300]}") from None
    return backbone
