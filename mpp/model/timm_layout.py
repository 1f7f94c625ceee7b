"""A hybrid ViT (model.stem=resnet) in timm's layout: the model.safetensors and config.json of timm's `vit_*_r*_s*`
hybrids (timm 1.0.31, models/vision_transformer_hybrid.py, resnetv2.py), which `timm.create_model("local-dir:DIR",
pretrained=True)` builds and loads. Written without timm, which cannot be imported on this project's machine.

timm builds those hybrids as a ResNetV2 (preact=False: BiT's non-pre-activation bottlenecks, StdConv2dSame with
epsilon 1e-8, GroupNormAct of 32 groups at epsilon 1e-5, 'SAME' padding on the strided convolutions and the max
pool) inside a HybridEmbed whose 1x1 Conv2d projects each feature-map cell, then its VisionTransformer, whose blocks
are ours (pre-norm, LayerNorm epsilon 1e-6, exact GELU, MLP ratio 4). Our stem with model.stem_padding=same computes
that ResNetV2. Its architecture functions fix the ResNet (units per stage, 64 root channels) and take the
Transformer's sizes as arguments, so only a ResNet one of them names can be written: config.json's `model_args`
give the rest. [class]-token classifiers read `global_pool='token'`; mean-pooled ones `global_pool='avg'` with
`fc_norm=False`, which keeps the final LayerNorm on every token before the mean, as ours (timm's default for 'avg'
normalises the mean instead).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mpp.model.vit import PIXEL_MEAN, PIXEL_STD, VisionTransformer
from mpp.rundir import usual_mode

# Our stem_layers -> the timm architecture that builds that ResNetV2 (vision_transformer_hybrid.py's _resnetv2 calls).
TIMM_HYBRIDS = {(3, 4, 9): "vit_base_r50_s16_224", (2, 2, 2, 2): "vit_base_r26_s32_224",
                (3, 4, 6, 3): "vit_large_r50_s32_224"}
TIMM_STEM_WIDTH = 64  # ResNetV2's stem_chs, which those architectures do not pass on


def timm_refusal(backbone: VisionTransformer) -> str | None:
    """Why `backbone` has no timm hybrid that computes it (one line's reason), or None where one does."""
    if backbone.stem != "resnet":
        return ("it is a plain ViT (model.stem=patch), which `--to hf` writes as transformers' ViT and tests load; "
                "`--to timm` writes hybrids")
    if backbone.stem_padding != "same":
        return ("its ResNet stem pads symmetrically (model.stem_padding=symmetric, as hybrids saved before that setting "
                "do), where timm's hybrids pad 'SAME' with GroupNorm epsilon 1e-5; fine-tune it with "
                "model.stem_padding=same, or pretrain anew, to export it to timm; --to onnx DIR exports it as it is")
    layers = tuple(backbone.stem_layers)
    if layers not in TIMM_HYBRIDS or backbone.stem_width != TIMM_STEM_WIDTH:
        def shown(units) -> str:
            return str(list(units)).replace(" ", "")

        return (f"timm has no hybrid with its ResNet (model.stem_layers={shown(layers)}, model.stem_width="
                f"{backbone.stem_width}): its hybrids fix the ResNet at stem_layers "
                f"{', '.join(map(shown, TIMM_HYBRIDS))} with stem_width {TIMM_STEM_WIDTH}; export it as an ONNX graph "
                f"with --to onnx DIR, or use its model.safetensors with mpp (predict, finetune)")
    return None


def timm_name(key: str) -> str:
    """One of our backbone's tensor names as timm's hybrid names it."""
    if key.startswith("patch_embed.stem.root."):
        layer, kind = key.removeprefix("patch_embed.stem.root.").split(".")
        return f"patch_embed.backbone.stem.{'conv' if layer == '0' else 'norm'}.{kind}"
    if key.startswith("patch_embed.stem.stages."):
        stage, unit, rest = key.removeprefix("patch_embed.stem.stages.").split(".", 2)
        rest = rest.replace("downsample.0.", "downsample.conv.").replace("downsample.1.", "downsample.norm.")
        return f"patch_embed.backbone.stages.{stage}.blocks.{unit}.{rest}"
    return key.replace(".mlp.0.", ".mlp.fc1.").replace(".mlp.2.", ".mlp.fc2.")


def timm_state_dict(backbone: VisionTransformer, head: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our hybrid's weights (and a linear `head`) under timm's names: the cell projection as the 1x1 Conv2d it is
    there, and the position embeddings as the one learned table they add (with [class]'s row)."""
    out = {}
    for key, tensor in backbone.state_dict().items():
        if key.startswith("pos_embed"):
            continue  # written below, whatever kind they are
        out[timm_name(key)] = tensor[:, :, None, None] if key == "patch_embed.proj.weight" else tensor
    positions = backbone.position_embeddings()
    out["pos_embed"] = torch.zeros(1, backbone.num_patches + 1, backbone.width) if positions is None else positions
    if head is not None:
        out["head.weight"], out["head.bias"] = head["weight"], head["bias"]
    return {key: tensor.detach().float().contiguous() for key, tensor in out.items()}


def timm_config(backbone: VisionTransformer, num_classes: int, pool: str, class_names: list[str] | None) -> dict:
    """config.json as timm's save_for_hf writes one, read by create_model("local-dir:DIR"): the architecture, the
    arguments that size it as ours, and the evaluation transform of mpp predict (the centre square, resized with an
    antialiased bilinear filter, scaled to [-1, 1])."""
    size = backbone.image_size
    model_args = {"img_size": size, "embed_dim": backbone.width, "depth": backbone.depth, "num_heads": backbone.heads,
                  "global_pool": "avg" if pool == "mean" else "token"}
    if pool == "mean":
        model_args["fc_norm"] = False  # the final LayerNorm on every token, then the mean: ours
    config = {"architecture": TIMM_HYBRIDS[tuple(backbone.stem_layers)], "num_classes": num_classes,
              "num_features": backbone.width, "global_pool": model_args["global_pool"], "model_args": model_args,
              "pretrained_cfg": {"input_size": [3, size, size], "interpolation": "bilinear", "crop_pct": 1.0,
                                 "crop_mode": "center", "mean": [PIXEL_MEAN] * 3, "std": [PIXEL_STD] * 3,
                                 "num_classes": num_classes, "fixed_input_size": True,
                                 "first_conv": "patch_embed.backbone.stem.conv", "classifier": "head"}}
    if class_names:
        config["label_names"] = list(class_names)
    return config


def export_timm(backbone: VisionTransformer, out_dir: str | Path, head: dict[str, torch.Tensor] | None = None,
                class_names: list[str] | None = None, pool: str = "cls") -> str:
    """Write model.safetensors and config.json of timm's hybrid to out_dir (see the module); returns the
    architecture's name. The caller refuses what timm_refusal names first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_classes = 0 if head is None else head["weight"].shape[0]
    save_file(timm_state_dict(backbone, head), str(out / "model.safetensors"))
    usual_mode(out / "model.safetensors")  # safetensors writes it 0600
    config = timm_config(backbone, num_classes, pool if head is not None else "cls", class_names)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config["architecture"]
