"""A run's weights: written with what they are, and loaded as a backbone from any of the places a run leaves one,
at the resolution the new run asks for.

A run's final model.safetensors carries, as safetensors metadata under the key "mpp", the architecture of its
backbone and what the file holds: a backbone, or a classifier (a fine-tuned backbone and its linear head), for which
it also records what the head reads (`pool`) and, where the training shards named them, its `class_names`. A
checkpoints/step_N/model.safetensors is the objective's whole state as Accelerate saves it (tensors under backbone.*
beside the objective's own); files of older runs carry no metadata, and are read from their tensors as before.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mpp.config import as_saved
from mpp.errors import UserError, command
from mpp.model.hf import (HF_CONFIG, dinov2_extras, from_hf_state_dict, from_timm_state_dict, hf_architecture,
                          hf_class_names, is_hf_dinov2_classifier, is_hf_vit, is_timm_vit, timm_extras, vit_from_dinov2)
from mpp.model.vit import VisionTransformer, resolve_variant, resize_position_weights, resnet_stride
from mpp.rundir import CHECKPOINTS, CONFIG, WEIGHTS, newest_verified, run_config_of, usual_mode

if TYPE_CHECKING:
    from mpp.model.objectives import Objective

VIT_KEYS = ("cls_token", "patch_embed.proj.weight", "norm.weight")
METADATA_KEY = "mpp"  # safetensors metadata: JSON of the backbone's architecture and what the file holds
BACKBONE, CLASSIFIER = "backbone", "classifier"  # what a file holds
LINEAR_HEAD = {"head.weight", "head.bias"}  # a fine-tuned classifier's head (a pretraining objective's head differs)


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


def save_weights(objective: Objective, path: str | Path) -> None:
    """Write `objective.export_weights()` to `path` with the metadata that says what they are (see the module)."""
    weights = objective.export_weights()
    b = objective.backbone
    about = {"width": b.width, "depth": b.depth, "heads": b.heads, "patch_size": b.patch_size, "image_size": b.image_size,
             "stem": b.stem, "pos_embed": b.pos_embed_kind, "holds": CLASSIFIER if LINEAR_HEAD <= set(weights) else BACKBONE}
    if b.stem == "resnet":
        about.update(stem_layers=list(b.stem_layers), stem_width=b.stem_width, stem_padding=b.stem_padding)
    if about["holds"] == CLASSIFIER:  # what predict and export need of a file copied out of its run
        about["pool"] = getattr(objective, "pool", "cls")  # a Classification's; another objective's head reads [class]
        names = getattr(objective, "class_names", ())
        if len(names) == weights["head.weight"].shape[0]:
            about["class_names"] = list(names)
    save_file(weights, str(path), metadata={METADATA_KEY: json.dumps(about)})
    usual_mode(Path(path))


@dataclass(frozen=True)
class SavedWeights:
    """A .safetensors file as stored: its tensors and what its metadata says of them ({} for a file without any)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    about: dict

    @property
    def holds(self) -> str:
        """BACKBONE or CLASSIFIER: the metadata says; a training checkpoint holds a classifier when the objective's
        own tensors are a linear head and nothing else (MPP adds its [mask] embedding, supervised pretraining's head
        is an MLP); an older export, when it has a head."""
        if "holds" in self.about:
            return self.about["holds"]
        own = {k for k in self.tensors if not k.startswith("backbone.")}
        if len(own) < len(self.tensors):
            return CLASSIFIER if own == LINEAR_HEAD else BACKBONE
        return CLASSIFIER if LINEAR_HEAD <= own else BACKBONE


def read_weights(ckpt: str | Path) -> SavedWeights:
    path = resolve_checkpoint(ckpt)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read {path} as safetensors ({exc}); pass a model.safetensors written by this project") from None
    if is_hf_vit(tensors):
        return hf_weights(path, tensors)
    if is_hf_dinov2_classifier(tensors):
        return dinov2_weights(path, tensors)
    if is_timm_vit(tensors):
        return timm_weights(path, tensors)
    try:
        about = json.loads(metadata[METADATA_KEY]) if METADATA_KEY in metadata else {}
    except ValueError:
        raise CheckpointError(f"{path} has unreadable '{METADATA_KEY}' metadata (not JSON); pass a model.safetensors written by this project") from None
    if about.get("stem") == "resnet" and "stem_padding" not in about:
        about["stem_padding"] = "symmetric"  # a hybrid saved before model.stem_padding: the only stem then
    return SavedWeights(path, tensors, about)


def stem_padding_of(saved: SavedWeights) -> str:
    """The padding a hybrid's weights were trained with (model.stem_padding): their metadata says; a training
    checkpoint's file has none, and the config.yaml its checkpoint (else its run) carries says; "symmetric" where
    neither does, as every hybrid was before the setting."""
    if "stem_padding" in saved.about:
        return saved.about["stem_padding"]
    carried = saved.path.parent / CONFIG
    config = carried if carried.is_file() else run_config_of(saved.path)
    model = (OmegaConf.to_container(OmegaConf.load(config)) or {}).get("model") if config is not None else None
    return as_saved({"model": model})["model"]["stem_padding"] if isinstance(model, dict) else "symmetric"


def hf_weights(path: Path, tensors: dict[str, torch.Tensor]) -> SavedWeights:
    """A transformers ViT (as `export --to hf` or save_pretrained writes it) under our names, its architecture read
    from the config.json beside it and checked against the tensors wherever they show it."""
    architecture = hf_architecture(path)
    if architecture is None:
        raise CheckpointError(f"{path} holds a Hugging Face ViT but no ViT {HF_CONFIG} lies beside it to say its heads "
                              f"and image size; pass the directory that save_pretrained wrote, with its {HF_CONFIG}")
    try:
        ours = from_hf_state_dict(tensors)
    except KeyError as missing:
        raise CheckpointError(f"{path} is not a complete Hugging Face ViT: it lacks {missing}; pass the directory that "
                              f"`{command('export')} --to hf` or save_pretrained wrote") from None
    conv = tensors.get("embeddings.patch_embeddings.projection.weight", tensors.get("vit.embeddings.patch_embeddings.projection.weight"))
    positions = ours["pos_embed"].shape[1] - 1
    patch, grid = architecture["patch_size"], architecture["image_size"] // architecture["patch_size"]
    shown = {  # config.json's key -> (what it says, what the weights hold)
        "hidden_size": (architecture["width"], ours["cls_token"].shape[-1]),
        "num_hidden_layers": (architecture["depth"], len({k.split(".")[1] for k in ours if k.startswith("blocks.")})),
        "patch_size": (patch, conv.shape[-1]),
        "image_size": (f"{architecture['image_size']} ({grid * grid} positions of patch {patch})", f"{positions} positions"),
    }
    config_file = path.parent / HF_CONFIG
    config = json.loads(config_file.read_text())  # read whole by hf_architecture
    channels = config.get("num_channels", 3)
    if channels != conv.shape[1]:
        shown["num_channels"] = (channels, conv.shape[1])
    for key, (said, held) in shown.items():
        if said != held and not (key == "image_size" and grid * grid == positions):
            raise CheckpointError(f"{config_file} gives {key} {said} but the weights beside it hold {held}; correct "
                                  f"{key} in it, or pass the directory that save_pretrained wrote, with its {HF_CONFIG} as written")
    if architecture["width"] % architecture["heads"]:
        raise CheckpointError(f"{config_file} gives num_attention_heads {architecture['heads']}, which does not divide "
                              f"hidden_size {architecture['width']}; correct num_attention_heads in it (the weights "
                              f"cannot show it: the value save_pretrained wrote)")
    if not LINEAR_HEAD <= set(ours):
        return SavedWeights(path, ours, {**architecture, "holds": BACKBONE})
    about = {**architecture, "holds": CLASSIFIER, "pool": "cls"}  # ViTForImageClassification reads the [class] token
    names = hf_class_names(config, ours["head.weight"].shape[0])
    return SavedWeights(path, ours, about if names is None else {**about, "class_names": names})


def dinov2_weights(path: Path, tensors: dict[str, torch.Tensor]) -> SavedWeights:
    """A Dinov2ForImageClassification as `export` writes a mean-pooled classifier: our ViT and a head on the mean of
    the patch outputs. One with parts our ViT has not (public DINOv2 weights) is refused by name."""
    extras = dinov2_extras(tensors)
    if extras:
        raise CheckpointError(f"{path} holds a DINOv2 classifier with {' and '.join(extras)}, which this project's ViT "
                              f"(the paper's) has not; pass a Hugging Face ViT directory, or the export of an mpp "
                              f"classifier fine-tuned with finetune.pool=mean")
    saved = hf_weights(path, vit_from_dinov2(tensors))
    return SavedWeights(saved.path, saved.tensors, {**saved.about, "pool": "mean"})


def timm_weights(path: Path, tensors: dict[str, torch.Tensor]) -> SavedWeights:
    """A timm ViT's model.safetensors under our names. Its file says nothing of its attention heads: model.heads (or
    model.name's variant) gives them."""
    extras = timm_extras(tensors)
    if extras:
        raise CheckpointError(f"{path} holds a timm ViT with {' and '.join(extras)}, which this project's ViT (the "
                              f"paper's) has not; pass a plain timm ViT (vit_*_patch*: a [class] token, learned position "
                              f"embeddings, a final LayerNorm) or a Hugging Face ViT directory")
    ours = from_timm_state_dict(tensors)
    return SavedWeights(path, ours, {"stem": "patch", "pos_embed": "learned",
                                     "holds": CLASSIFIER if LINEAR_HEAD <= set(ours) else BACKBONE})


def check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Weights with a NaN or an infinity give meaningless features, scores and exports: refuse them by name."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path} holds non-finite values (NaN or infinity) in {name}: the run that wrote it "
                                  f"diverged or the file is damaged; pass an earlier checkpoint of that run "
                                  f"(RUN/checkpoints/step_N) or retrain it")


def backbone_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A training checkpoint stores the objective (backbone.*, heads, [mask]); an export the backbone (+ head.*)."""
    if any(k.startswith("backbone.") for k in weights):
        return {k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")}
    return {k: v for k, v in weights.items() if not k.startswith("head.")}


def classifier_head(ckpt: str | Path) -> dict[str, torch.Tensor] | None:
    """The linear head ({'weight', 'bias'}) of a fine-tuned classifier in `ckpt`; None where `ckpt` holds a backbone,
    including a pretraining checkpoint, whose head (MPP's colours, supervised pretraining's MLP) is no classifier."""
    saved = read_weights(ckpt)
    if saved.holds != CLASSIFIER:
        return None
    head = {name: saved.tensors[f"head.{name}"] for name in ("weight", "bias")}
    check_finite(saved.path, {f"head.{name}": tensor for name, tensor in head.items()})
    return head


def classifier_pool(saved: SavedWeights, finetune_cfg) -> str:
    """What the classifier in `saved` reads (finetune.pool: cls or mean): what its file records (a different
    finetune.pool given is refused), else the finetune.pool of the run it lies in or of the config given; an older
    mpp's file outside its run says neither, and a wrong guess gives other classes with no error, so it is refused."""
    recorded, given = saved.about.get("pool"), "pool" in finetune_cfg.model_fields_set
    if recorded is not None:
        if given and finetune_cfg.pool != recorded:
            raise CheckpointError(f"{saved.path} holds a classifier fine-tuned with finetune.pool={recorded} but the config "
                                  f"says finetune.pool={finetune_cfg.pool}; drop that setting (a head reads what it was "
                                  f"trained on)")
        return recorded
    if given or run_config_of(saved.path) is not None:
        return finetune_cfg.pool
    raise CheckpointError(f"{saved.path} does not record whether its classifier reads the [class] token or the mean of "
                          f"the patch outputs (an older mpp's file, with no run's config.yaml beside it); set "
                          f"finetune.pool=cls or finetune.pool=mean as its fine-tuning did (its run's config.yaml says), "
                          f"or pass the file inside its run directory")


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


def attention_heads(saved: SavedWeights, model_cfg) -> int:
    """The head count the file was trained with: its metadata's, else, for files without metadata, that of the run's
    config.yaml (either way, a different explicit model.heads is refused), else an explicit model.heads, else the
    config's variant's, with a warning."""
    heads = int(saved.about["heads"]) if "heads" in saved.about else saved_heads(saved.path)
    if heads is None and model_cfg.heads is not None:  # the file cannot say; the user has
        return model_cfg.heads
    if heads is None:  # tensor shapes do not show it, and nothing else here says it
        heads = model_cfg.variant.heads
        warnings.warn(f"{saved.path} carries no architecture metadata (an older mpp's file, or another tool's) and no "
                      f"config.yaml beside it: its attention head count cannot be checked, and {heads} is assumed; if it "
                      f"was trained with another, set model.heads to that", stacklevel=3)
        return heads
    if model_cfg.heads is not None and model_cfg.heads != heads:
        raise CheckpointError(f"{saved.path} holds a ViT with {heads} attention heads but model.heads={model_cfg.heads}; "
                              f"set model.heads={heads} or drop the override (a ViT cannot change its head count)")
    return heads


def load_backbone(ckpt: str | Path, model_cfg) -> VisionTransformer:
    """The ViT in `ckpt`, shaped by its tensors, with position embeddings interpolated to model_cfg.image_size."""
    saved = read_weights(ckpt)
    path, weights = saved.path, backbone_weights(saved.tensors)
    missing = [k for k in VIT_KEYS if k not in weights]
    if missing:
        found = ", ".join(list(weights)[:3]) or "no tensors"
        raise CheckpointError(f"{path} is not a ViT of this project: it lacks {', '.join(missing)} (it holds {found}, ...); pass a checkpoint written by `{command('pretrain')}` or `{command('finetune')}`")

    if not any(k.startswith("blocks.") for k in weights):
        raise CheckpointError(f"{path} holds no Transformer blocks (no blocks.* tensors), so it is not a trained ViT; "
                              f"pass a checkpoint written by `{command('pretrain')}` or `{command('finetune')}`")
    check_finite(path, weights)
    width = weights["cls_token"].shape[-1]
    stem = saved.about.get("stem") or ("resnet" if any(k.startswith("patch_embed.stem.") for k in weights) else "patch")
    stem_padding = "same"  # unused by a linear patch embedding
    if stem == "resnet":
        patch, stem_layers, stem_width = resnet_architecture(path, weights, model_cfg)
        stem_padding = stem_padding_of(saved)
        if "stem_padding" in model_cfg.model_fields_set and model_cfg.stem_padding != stem_padding:
            raise CheckpointError(f"{path} holds a hybrid ViT trained with model.stem_padding={stem_padding} but the "
                                  f"config says model.stem_padding={model_cfg.stem_padding}; set "
                                  f"model.stem_padding={stem_padding} (its weights were trained with that stem)")
    else:
        patch, stem_layers, stem_width = patch_size_of(path, weights, model_cfg), (), 0
    pos_embed = position_kind(path, saved.about, weights, model_cfg)
    depth = len({k.split(".")[1] for k in weights if k.startswith("blocks.")})
    heads = attention_heads(saved, model_cfg)
    if width % heads:
        raise CheckpointError(f"{path} has width {width}, which {heads} attention heads do not divide; set model.heads to the pretraining run's value")

    backbone = VisionTransformer(model_cfg.image_size, patch, width, depth, heads, stem=stem, stem_layers=stem_layers or (3, 4, 9),
                                 stem_width=stem_width or 64, pos_embed=pos_embed, stem_padding=stem_padding)
    weights = resize_position_weights(weights, backbone.grid)
    try:
        backbone.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())
        raise CheckpointError(f"{path} does not fit a ViT of width {width}, depth {depth} and patch size {patch}: {detail[:300]}") from None
    return backbone


def patch_size_of(path: Path, weights: dict[str, torch.Tensor], model_cfg) -> int:
    """A plain ViT's patch size, from its patch projection (D, P*P*3); model.patch_size must agree."""
    proj = tuple(weights["patch_embed.proj.weight"].shape)  # (D, P*P*3)
    if len(proj) != 2:
        raise CheckpointError(f"{path} has a patch projection of shape {proj}; a ViT of this project has (D, P*P*3): "
                              f"pass a checkpoint written by `{command('pretrain')}`")
    patch = math.isqrt(proj[1] // 3)
    if model_cfg.stem != "patch":
        raise CheckpointError(f"{path} holds a ViT with a linear patch embedding but model.stem={model_cfg.stem}; set "
                              f"model.stem=patch (a ViT cannot change its stem)")
    if patch * patch * 3 != proj[1] or patch != model_cfg.patch_size:
        expected = (proj[0], 3 * model_cfg.patch_size ** 2)
        raise CheckpointError(f"{path} has patch embedding weights of shape {proj} (patch size {patch}) but model.patch_size={model_cfg.patch_size} "
                              f"needs {expected}; set model.patch_size={patch} (a ViT cannot change its patch size)")
    return patch


def resnet_architecture(path: Path, weights: dict[str, torch.Tensor], model_cfg) -> tuple[int, tuple[int, ...], int]:
    """A hybrid's patch size (its ResNet's stride), units per stage and root width, read from its tensors; the
    model section must agree."""
    units: dict[int, set[str]] = {}
    for key in weights:
        if key.startswith("patch_embed.stem.stages."):
            stage, unit = key.split(".")[3:5]
            units.setdefault(int(stage), set()).add(unit)
    layers = tuple(len(units[s]) for s in sorted(units))
    width = weights["patch_embed.stem.root.0.weight"].shape[0]
    for key, saved, asked in (("stem", "resnet", model_cfg.stem), ("stem_layers", list(layers), list(model_cfg.stem_layers)),
                              ("stem_width", width, model_cfg.stem_width)):
        if saved != asked:
            shown = str(saved).replace(" ", "")
            raise CheckpointError(f"{path} holds a hybrid ViT with model.{key}={shown} but the config says model.{key}="
                                  f"{str(asked).replace(' ', '')}; set model.{key}={shown} (a ViT cannot change its stem)")
    return resnet_stride(layers), layers, width


def position_kind(path: Path, about: dict, weights: dict[str, torch.Tensor], model_cfg) -> str:
    """Which position embeddings the file's ViT has: its metadata says; else its tensors (a learned table, learned
    rows and columns), else model.pos_embed; model.pos_embed must agree."""
    kind = about.get("pos_embed") or ("learned" if "pos_embed" in weights else "learned_2d" if "pos_embed_rows" in weights
                                      else model_cfg.pos_embed)
    if kind != model_cfg.pos_embed:
        raise CheckpointError(f"{path} holds a ViT with model.pos_embed={kind} but the config says model.pos_embed="
                              f"{model_cfg.pos_embed}; set model.pos_embed={kind}")
    if kind == "learned":
        positions = tuple(weights["pos_embed"].shape) if "pos_embed" in weights else None
        if positions is None or len(positions) != 3 or math.isqrt(positions[1] - 1) ** 2 != positions[1] - 1:
            raise CheckpointError(f"{path} has position embeddings of shape {positions}, not (1, 1 + N, D) over a square grid, "
                                  f"so they cannot be interpolated to model.image_size={model_cfg.image_size}; pass a "
                                  f"checkpoint of a square-image ViT written by `{command('pretrain')}`")
    return kind


def run_files_in(directory: Path) -> str | None:
    """What in `directory` belongs to a run of this project (its config.yaml, its checkpoints, weights in this
    project's layout), or None: a directory an export must not write into."""
    if (directory / CONFIG).is_file():
        return f"its {CONFIG}"
    if (directory / CHECKPOINTS).is_dir():
        return f"its {CHECKPOINTS}/"
    if (directory / WEIGHTS).is_file():
        try:
            with safe_open(str(directory / WEIGHTS), framework="pt") as f:
                ours = METADATA_KEY in (f.metadata() or {}) or any(k in VIT_KEYS or k.startswith("backbone.") for k in f.keys())
        except (SafetensorError, OSError):
            return None
        return f"its {WEIGHTS}, in this project's layout" if ours else None
    return None
