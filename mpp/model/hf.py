"""Our ViT as a Hugging Face `transformers` checkpoint: ViTModel (a backbone), ViTForImageClassification (a
classifier on the [class] token) or Dinov2ForImageClassification (a classifier on the mean of the patch outputs).

The architectures are the same network; only names and two layouts differ: HF embeds patches with a Conv2d
(our Linear reads each patch flattened as (p1 p2 c)) and keeps q, k and v as three Linears (ours is one qkv).
ViTModel's pooler (a Dense + tanh on [class] in BERT's manner) has no counterpart in the paper, whose representation
is the [class] token after the final LayerNorm: it is exported as the identity, so `pooler_output` is exactly that
token and `ViTModel.from_pretrained(DIR)` loads every weight it expects.

A mean-pooled classifier (finetune.pool=mean) normalises every token with the final LayerNorm, then averages the patch
tokens. transformers' BEiT and Data2VecVision (use_mean_pooling) average first and normalise the mean, another
function; DINOv2's classifier reads [class ; mean of the patch tokens], both after the final LayerNorm, and its
blocks are ours with a LayerScale after each branch. With every LayerScale at one and the classifier's [class] half
at zero, Dinov2ForImageClassification computes exactly our logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from mpp.errors import UserError
from mpp.model.vit import PIXEL_MEAN, PIXEL_STD, VisionTransformer, patchify, unpatchify
from mpp.rundir import usual_mode

MLP_RATIO = 4  # Block's hidden width over the model width
HF_CONFIG = "config.json"  # what save_pretrained writes beside model.safetensors


class ExportError(UserError):
    """The export cannot be written as asked; the message names the cause and the fix."""


def hf_config(backbone: VisionTransformer, num_labels: int | None = None) -> dict:
    """ViTConfig arguments describing `backbone` (and a classifier over `num_labels` classes)."""
    config = dict(
        hidden_size=backbone.width, num_hidden_layers=backbone.depth, num_attention_heads=backbone.heads,
        intermediate_size=MLP_RATIO * backbone.width, hidden_act="gelu",  # exact (erf) GELU, as nn.GELU()
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=1e-6, qkv_bias=True,
        image_size=backbone.image_size, patch_size=backbone.patch_size, num_channels=3,
        pooler_act="linear",  # with the identity Dense written by hf_state_dict: pooler_output = [class] token
    )
    if num_labels is not None:
        config["num_labels"] = num_labels
    return config


def hf_position_table(backbone: VisionTransformer) -> torch.Tensor:  # (1, 1 + N, D)
    """transformers' ViT has one learned table: the 2-D kinds are written as the table they add at this resolution
    (the same outputs here; at another resolution transformers interpolates that table, not the rows and columns or
    the sin-cos), no position embeddings as zeros."""
    table = backbone.position_embeddings()
    return torch.zeros(1, backbone.num_patches + 1, backbone.width) if table is None else table.detach()


def hf_state_dict(backbone: VisionTransformer, head: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Our weights under transformers 5 ViT parameter names; with `head` ({'weight', 'bias'}) the classifier's too."""
    ours = backbone.state_dict()
    p = backbone.patch_size
    out = {
        "embeddings.cls_token": ours["cls_token"],
        "embeddings.position_embeddings": hf_position_table(backbone),
        # Linear over patchify's layout -> Conv2d kernel (D, C, P, P): each output's weights unpatchified as one patch.
        "embeddings.patch_embeddings.projection.weight": unpatchify(ours["patch_embed.proj.weight"][:, None], p, grid=1),
        "embeddings.patch_embeddings.projection.bias": ours["patch_embed.proj.bias"],
        "layernorm.weight": ours["norm.weight"],
        "layernorm.bias": ours["norm.bias"],
    }
    for i in range(backbone.depth):
        ours_i, hf_i = f"blocks.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            # qkv's output rows are (three heads head_dim): q, k and v each keep HF's (heads head_dim) order.
            q, k, v = ours[f"{ours_i}attn.qkv.{kind}"].chunk(3, dim=0)
            out.update({
                f"{hf_i}attention.q_proj.{kind}": q, f"{hf_i}attention.k_proj.{kind}": k, f"{hf_i}attention.v_proj.{kind}": v,
                f"{hf_i}attention.o_proj.{kind}": ours[f"{ours_i}attn.proj.{kind}"],
                f"{hf_i}layernorm_before.{kind}": ours[f"{ours_i}norm1.{kind}"],
                f"{hf_i}layernorm_after.{kind}": ours[f"{ours_i}norm2.{kind}"],
                f"{hf_i}mlp.fc1.{kind}": ours[f"{ours_i}mlp.0.{kind}"],
                f"{hf_i}mlp.fc2.{kind}": ours[f"{ours_i}mlp.2.{kind}"],
            })
    if head is None:
        return {**out, "pooler.dense.weight": torch.eye(backbone.width), "pooler.dense.bias": torch.zeros(backbone.width)}
    return {**{f"vit.{k}": v for k, v in out.items()}, "classifier.weight": head["weight"], "classifier.bias": head["bias"]}


# A transformers ViT block's names against DINOv2's (the rest of a block is named alike in both).
DINOV2_BLOCK_NAMES = {"layernorm_before": "norm1", "layernorm_after": "norm2"}


def dinov2_config(backbone: VisionTransformer, num_labels: int) -> dict:
    """Dinov2Config arguments describing `backbone` and a classifier over `num_labels` classes: ViT's, with
    LayerScale (written as ones), no [mask] token (DINOv2's pretraining's, unused by its classifier)."""
    vit = hf_config(backbone, num_labels)
    shared = ("hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act", "hidden_dropout_prob",
              "attention_probs_dropout_prob", "layer_norm_eps", "qkv_bias", "image_size", "patch_size", "num_channels",
              "num_labels")
    return {**{key: vit[key] for key in shared}, "mlp_ratio": MLP_RATIO, "layerscale_value": 1.0,
            "use_swiglu_ffn": False, "use_mask_token": False, "drop_path_rate": 0.0}


def dinov2_state_dict(backbone: VisionTransformer, head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our weights and mean-pooled `head` under Dinov2ForImageClassification's names: each LayerScale one (the
    identity), the classifier's weights over [class ; mean of the patch tokens] zero on the [class] half."""
    out = {}
    for key, tensor in hf_state_dict(backbone).items():
        if key.startswith("pooler."):
            continue  # ViTModel's; DINOv2 has none
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            name, kind = rest.rsplit(".", 1)
            key = f"encoder.layer.{i}.{DINOV2_BLOCK_NAMES.get(name, name)}.{kind}"
        out[f"dinov2.{key}"] = tensor
    for i in range(backbone.depth):
        for scale in ("layer_scale1", "layer_scale2"):
            out[f"dinov2.encoder.layer.{i}.{scale}.lambda1"] = torch.ones(backbone.width)
    weight = head["weight"]
    out["classifier.weight"] = torch.cat([torch.zeros_like(weight), weight], dim=1)  # (K, 2D): [class] ignored
    out["classifier.bias"] = head["bias"]
    return out


def is_hf_vit(tensors: dict[str, torch.Tensor]) -> bool:
    """Tensors named as transformers names a ViTModel's (or a ViTForImageClassification's, under vit.)."""
    return any(k in tensors for k in ("embeddings.cls_token", "vit.embeddings.cls_token"))


# How save_pretrained names a ViT block's tensors on disk (the Hub's layout, unchanged since transformers 4; version 5
# renames them in memory only), against ours.
HF_BLOCK_NAMES = {
    "attention.output.dense": "attn.proj", "layernorm_before": "norm1", "layernorm_after": "norm2",
    "intermediate.dense": "mlp.0", "output.dense": "mlp.2",
}


def from_hf_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers ViT's weights as save_pretrained writes them (or the Hub holds them) under our names: the
    classifier of a ViTForImageClassification as head.*; the pooler, which the paper's ViT has not, dropped."""
    hf = {k.removeprefix("vit."): v for k, v in tensors.items()}
    conv = hf["embeddings.patch_embeddings.projection.weight"]  # (D, C, P, P)
    ours = {
        "cls_token": hf["embeddings.cls_token"],
        "pos_embed": hf["embeddings.position_embeddings"],
        "patch_embed.proj.weight": patchify(conv, conv.shape[-1])[:, 0],  # each kernel flattened as one patch
        "patch_embed.proj.bias": hf["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": hf["layernorm.weight"],
        "norm.bias": hf["layernorm.bias"],
    }
    depth = len({k.split(".")[2] for k in hf if k.startswith("encoder.layer.")})
    for i in range(depth):
        hf_i = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            attention = [hf[f"{hf_i}attention.attention.{x}.{kind}"] for x in ("query", "key", "value")]
            ours[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(attention)
            ours.update({f"blocks.{i}.{mine}.{kind}": hf[f"{hf_i}{theirs}.{kind}"] for theirs, mine in HF_BLOCK_NAMES.items()})
    if "classifier.weight" in hf:
        ours.update({"head.weight": hf["classifier.weight"], "head.bias": hf["classifier.bias"]})
    return ours


# How save_pretrained names a DINOv2 block's tensors on disk where they differ from a ViT's (HF_BLOCK_NAMES' keys).
DINOV2_DISK_NAMES = {"norm1": "layernorm_before", "norm2": "layernorm_after", "mlp.fc1": "intermediate.dense",
                     "mlp.fc2": "output.dense"}


def is_hf_dinov2_classifier(tensors: dict[str, torch.Tensor]) -> bool:
    """Tensors named as save_pretrained names a Dinov2ForImageClassification's (`export` writes a mean-pooled one so)."""
    return "dinov2.embeddings.cls_token" in tensors and "classifier.weight" in tensors


def dinov2_extras(tensors: dict[str, torch.Tensor]) -> list[str]:
    """What a Dinov2ForImageClassification holds that a mean-pooled classifier of ours has not: a LayerScale other
    than one, a classifier that reads the [class] token (its weights' first half not zero)."""
    extras = []
    if any(k.endswith(".lambda1") and not torch.all(v == 1) for k, v in tensors.items()):
        extras.append("LayerScale (not one)")
    weight = tensors["classifier.weight"]
    if torch.any(weight[:, : weight.shape[1] // 2] != 0):
        extras.append("a classifier that reads the [class] token beside the mean of the patch outputs")
    return extras


def vit_from_dinov2(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Dinov2ForImageClassification's tensors (without dinov2_extras) named as a ViTForImageClassification's on
    disk, its classifier's mean half as the classifier: what from_hf_state_dict reads."""
    out = {}
    for key, tensor in tensors.items():
        if key.endswith(".lambda1") or key == "dinov2.embeddings.mask_token":
            continue  # ones (checked), and DINOv2's pretraining's [mask]
        for dinov2, vit in DINOV2_DISK_NAMES.items():
            key = key.replace(f".{dinov2}.", f".{vit}.")
        out[key.replace("dinov2.", "vit.", 1)] = tensor
    weight = tensors["classifier.weight"]
    out["classifier.weight"] = weight[:, weight.shape[1] // 2:]
    return out


# timm's ViT (timm.models.vision_transformer) as its model.safetensors names it: our layout (cls_token, pos_embed,
# blocks.N.norm1 / attn.qkv / attn.proj / norm2, norm, head) but for its patch embedding, a Conv2d as transformers',
# and its MLP's names. Read here without timm.
TIMM_MLP_NAMES = {"mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}
# What some timm ViTs add that the paper's has not, by the name of its tensors: refused rather than loaded without it.
TIMM_EXTRAS = {"reg_token": "register tokens", "fc_norm": "a LayerNorm after mean pooling (global_pool='avg')",
               "norm_pre": "a LayerNorm before the blocks (CLIP's)", "ls1": "LayerScale", "q_norm": "query-key normalisation",
               "attn_pool": "attention pooling", "dist_token": "a distillation token (DeiT's)"}


def is_timm_vit(tensors: dict[str, torch.Tensor]) -> bool:
    """Tensors named as timm names a ViT's (its MLP's fc1 is ours mlp.0)."""
    return "cls_token" in tensors and "blocks.0.mlp.fc1.weight" in tensors


def timm_extras(tensors: dict[str, torch.Tensor]) -> list[str]:
    """What of TIMM_EXTRAS a timm ViT's tensors hold."""
    parts = {part for key in tensors for part in key.split(".")}
    return [what for name, what in TIMM_EXTRAS.items() if name in parts]


def from_timm_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A timm ViT's weights under our names: the patch Conv2d flattened as our Linear reads a patch, the MLP renamed,
    and position embeddings without a [class] row (timm's no_embed_class) given a zero one, which adds what they add."""
    ours = {}
    for key, tensor in tensors.items():
        for theirs, mine in TIMM_MLP_NAMES.items():
            key = key.replace(f".{theirs}.", f".{mine}.")
        ours[key] = tensor
    conv = ours["patch_embed.proj.weight"]  # (D, C, P, P)
    if conv.ndim == 4:
        ours["patch_embed.proj.weight"] = patchify(conv, conv.shape[-1])[:, 0]
    positions = ours.get("pos_embed")
    if positions is not None and positions.ndim == 3 and math.isqrt(positions.shape[1]) ** 2 == positions.shape[1]:
        ours["pos_embed"] = torch.cat([torch.zeros_like(positions[:, :1]), positions], dim=1)
    return ours


HF_ARCHITECTURE = {"width": "hidden_size", "depth": "num_hidden_layers", "heads": "num_attention_heads",
                   "patch_size": "patch_size", "image_size": "image_size"}  # ours -> config.json's


def hf_architecture(weights_file: Path) -> dict | None:
    """What the transformers config.json beside `weights_file` says of the ViT ({width, depth, heads, patch_size,
    image_size}, as our checkpoints' metadata says it); None where there is no config.json beside it. One that is
    there but cannot say it (not JSON, not a ViT's, a key missing or not a whole number, a non-square size) is
    refused with a line naming the file and what is wrong in it."""
    config_file = weights_file.parent / HF_CONFIG
    if not config_file.is_file():
        return None
    fix = "correct it, or pass the directory that save_pretrained wrote, with its config.json as written"
    try:
        config = json.loads(config_file.read_text())
    except UnicodeDecodeError:
        raise UserError(f"{config_file} is not text, so not the ViT config.json expected beside {weights_file.name}; {fix}") from None
    except ValueError as exc:
        raise UserError(f"{config_file} is not valid JSON ({exc}); {fix}") from None
    except OSError as exc:
        raise UserError(f"{config_file} cannot be read ({exc.strerror}); {fix}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in ("vit", "dinov2"):  # dinov2: a mean-pooled classifier, as `export` writes one
        found = f"model_type {model_type!r}" if model_type else "no model_type"
        raise UserError(f"{config_file} describes no Hugging Face ViT ({found}, where a ViT's is 'vit'), so the weights "
                        f"beside it cannot be read as one; pass a ViT's directory (ViTModel or ViTForImageClassification)")
    architecture = {}
    for ours, key in HF_ARCHITECTURE.items():
        value = config.get(key)
        if key in ("image_size", "patch_size") and isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # transformers also takes a side as (height, width)
        if key not in config:
            raise UserError(f"{config_file} lacks {key}, which a ViT's config.json gives ({', '.join(HF_ARCHITECTURE.values())}); {fix}")
        if isinstance(value, list):
            raise UserError(f"{config_file} gives {key} {value}, not square; this project's ViT takes square images and "
                            f"patches only, so these weights cannot be read by it")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{config_file} gives {key} as {json.dumps(value)}, not a positive whole number; {fix}")
        architecture[ours] = value
    return architecture


def hf_class_names(config: dict, outputs: int) -> list[str] | None:
    """The names a ViTForImageClassification's config.json gives its `outputs` classes (id2label, whose JSON keys
    are the ids as text), in id order; None where it does not name each of them."""
    labels = config.get("id2label")
    if not isinstance(labels, dict):
        return None
    names = [labels.get(str(i)) for i in range(outputs)]
    return names if all(isinstance(name, str) for name in names) else None


def preprocessor_config(image_size: int) -> dict:
    """Image processor settings that do what our evaluation does (mpp.data.EvalTransform): the centre square of the
    short side, resized to image_size with an antialiased bilinear filter, scaled as (x / 255 - 0.5) / 0.5.

    transformers' PerceiverImageProcessor is the one it ships that crops before resizing: its centre crop keeps
    crop_size / size of the short side, the whole of it when they are equal. ViTImageProcessor would squash a
    non-square image to a square; the processors that resize the short side and then crop (CLIP's, BiT's, ConvNeXt's)
    round the long side to whole pixels first and sample a non-square image slightly off our grid.
    """
    square = {"height": image_size, "width": image_size}
    return {
        "image_processor_type": "PerceiverImageProcessor", "do_center_crop": True, "crop_size": square,
        "do_resize": True, "size": square, "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [PIXEL_MEAN] * 3, "image_std": [PIXEL_STD] * 3,
    }


# Why a hybrid (model.stem=resnet) is not written here: one line, with where it goes.
HYBRID_REFUSAL = (
    "this is a hybrid ViT (model.stem=resnet), which transformers 5 has no class for (ViTHybrid was removed; ViTModel "
    "embeds patches linearly); export it to timm's layout with --to timm DIR (timm's vit_*_r*_s* hybrids), or as an "
    "ONNX graph with --to onnx DIR (any hybrid)")


def export_hf(backbone: VisionTransformer, out_dir: str | Path, head: dict[str, torch.Tensor] | None = None,
              id2label: dict[int, str] | None = None, pool: str = "cls") -> str:
    """Write a transformers checkpoint (config.json, model.safetensors, preprocessor_config.json) to out_dir.

    Without `head`: ViTModel, its pooler the identity (`pooler_output` = `last_hidden_state[:, 0]`, the paper's
    representation). With `head` on the [class] token (`pool="cls"`): ViTForImageClassification; on the mean of the
    patch outputs (`pool="mean"`): Dinov2ForImageClassification (see the module); either with `id2label` naming its
    classes. Returns the class name. A hybrid is refused (HYBRID_REFUSAL).
    """
    if backbone.stem != "patch":
        raise ExportError(HYBRID_REFUSAL)
    try:
        import transformers
        from transformers import Dinov2Config, Dinov2ForImageClassification, ViTConfig, ViTForImageClassification, ViTModel
    except ImportError:
        raise ExportError("exporting to Hugging Face needs the transformers package: pip install 'mpp[hf]' (in a checkout: pip install -e '.[hf]')") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise ExportError(f"exporting needs transformers 5 or newer (found {transformers.__version__}): pip install -U 'mpp[hf]'")
    if head is None:
        model, weights = ViTModel(ViTConfig(**hf_config(backbone))), hf_state_dict(backbone)
    elif pool == "cls":
        model = ViTForImageClassification(ViTConfig(**hf_config(backbone, head["weight"].shape[0])))
        weights = hf_state_dict(backbone, head)
    else:
        model = Dinov2ForImageClassification(Dinov2Config(**dinov2_config(backbone, head["weight"].shape[0])))
        weights = dinov2_state_dict(backbone, head)
    if id2label:
        model.config.id2label, model.config.label2id = dict(id2label), {name: i for i, name in id2label.items()}
    model.load_state_dict({k: v.detach().float().contiguous() for k, v in weights.items()}, strict=True)
    out = Path(out_dir)
    model.save_pretrained(out)
    usual_mode(*out.glob("*.safetensors"))  # safetensors writes them 0600
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(backbone.image_size), indent=2) + "\n")
    return type(model).__name__
