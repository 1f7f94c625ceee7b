"""Export stage: a checkpoint of this project as a Hugging Face `transformers` ViT (`launch.py export --to hf DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from mpp.checkpoint import load_backbone, resolve_checkpoint
from mpp.config import Config
from mpp.data import DataError, expand_shards
from mpp.hf import ExportError, export_hf

FORMATS = ("hf",)


def run(cfg: Config, *, ckpt: str, to: str, out_dir: str) -> str:
    """Write the backbone in `ckpt` (ViTModel), with its classifier if it was fine-tuned (ViTForImageClassification)."""
    if to not in FORMATS:
        raise ExportError(f"unknown export format '{to}'; use --to hf DIR")
    backbone = load_backbone(ckpt, cfg.model)
    weights = load_file(str(resolve_checkpoint(ckpt)))
    # A fine-tuned model keeps its linear head as head.weight/head.bias; a supervised pretraining MLP head
    # (head.0, head.2) is the paper's throwaway pretraining head and has no ViTForImageClassification form.
    head = {"weight": weights["head.weight"], "bias": weights["head.bias"]} if "head.weight" in weights else None
    kind = export_hf(backbone, out_dir, head, id2label=class_names(cfg) if head is not None else None, pool=cfg.finetune.pool)
    print(f"wrote a transformers {kind} ({backbone.width} wide, {backbone.depth} blocks, patch {backbone.patch_size}, "
          f"{backbone.image_size} px) to {out_dir}; load it with {kind}.from_pretrained('{out_dir}'"
          f"{', add_pooling_layer=False' if head is None else ''})")
    return kind


def class_names(cfg: Config) -> dict[int, str] | None:
    """Class names from the summary.json that `launch.py prepare` wrote beside the training shards, if any."""
    try:
        summary = Path(expand_shards(cfg.data.shards)[0]).parent / "summary.json"
    except DataError:  # 'synthetic' or shards not present here: no names to add
        return None
    names = json.loads(summary.read_text()).get("class_names") if summary.is_file() else None
    return dict(enumerate(names)) if names else None
