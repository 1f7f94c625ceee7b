"""Export stage: a checkpoint of this project as a Hugging Face `transformers` ViT (`mpp export --to hf DIR`), with a
model card (README.md) that says what it is and how it was made."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from mpp.checkpoint import load_backbone, resolve_checkpoint
from mpp.config import Config
from mpp.data import DataError, expand_shards
from mpp.hf import ExportError, export_hf
from mpp.model import VisionTransformer
from mpp.objectives import OBJECTIVES
from mpp.rundir import RESULTS, checkpoint_step, is_checkpoint, run_dir_of
from mpp.synthetic import CLASS_NAMES as SYNTHETIC_CLASS_NAMES
from pipelines.common import command_line

FORMATS = ("hf",)
CARD_METRICS = ("train/loss", "train/loss_prior", "train/color_acc", "train/color_acc_prior", "train/accuracy")


def run(cfg: Config, *, ckpt: str, to: str, out_dir: str) -> str:
    """Write the backbone in `ckpt` (ViTModel), with its classifier if it was fine-tuned (ViTForImageClassification)."""
    if to not in FORMATS:
        raise ExportError(f"unknown export format '{to}'; use --to hf DIR")
    backbone = load_backbone(ckpt, cfg.model)
    weights_file = resolve_checkpoint(ckpt)
    weights = load_file(str(weights_file))
    # A fine-tuned model keeps its linear head as head.weight/head.bias; a supervised pretraining MLP head
    # (head.0, head.2) is the paper's throwaway pretraining head and has no ViTForImageClassification form.
    head = {"weight": weights["head.weight"], "bias": weights["head.bias"]} if "head.weight" in weights else None
    kind = export_hf(backbone, out_dir, head, id2label=class_names(cfg) if head is not None else None,
                     pool=cfg.finetune.pool)
    (Path(out_dir) / "README.md").write_text(model_card(cfg, backbone, weights_file, kind, out_dir))
    print(f"wrote a transformers {kind} ({backbone.width} wide, {backbone.depth} blocks, patch {backbone.patch_size}, "
          f"{backbone.image_size} px) and its model card to {out_dir}; load it with {kind}.from_pretrained('{out_dir}')")
    return kind


def class_names(cfg: Config) -> dict[int, str] | None:
    """Class names from the summary.json that `mpp prepare` wrote beside the training shards, if any."""
    if cfg.data.shards == "synthetic":
        return dict(enumerate(SYNTHETIC_CLASS_NAMES))
    summary = shards_summary(cfg)
    return dict(enumerate(summary["class_names"])) if summary.get("class_names") else None


def shards_summary(cfg: Config) -> dict:
    """The summary.json beside the training shards; {} for shards without one or not present here."""
    try:
        path = Path(expand_shards(cfg.data.shards)[0]).parent / "summary.json"
    except DataError:
        return {}
    return json.loads(path.read_text()) if path.is_file() else {}


def run_record(weights_file: Path) -> tuple[dict, int | None]:
    """The results.json of the run that wrote `weights_file` ({} if none) and, for a checkpoints/step_N, its step."""
    step = checkpoint_step(weights_file.parent) if is_checkpoint(weights_file.parent) else None
    results = run_dir_of(weights_file) / RESULTS
    return (json.loads(results.read_text()) if results.is_file() else {}), step


def model_card(cfg: Config, backbone: VisionTransformer, weights_file: Path, kind: str, out_dir: str) -> str:
    record, step = run_record(weights_file)
    fine_tuned = kind == "ViTForImageClassification"
    summary = shards_summary(cfg)
    data = f"`{cfg.data.shards}`" + (f" ({summary['samples']:,} images, {summary['classes']} classes)" if summary else "")
    if fine_tuned:
        start = record.get("ckpt") or "a fresh backbone (training from scratch)"
        objective = f"fine-tuned as a classifier (linear head on the [class] token) from {start}"
        metrics = {k: record[k] for k in ("top1", "top5") if k in record}
        metrics_line = ", ".join(f"{k.replace('top', 'top-')} {100 * v:.2f}%" for k, v in metrics.items())
        metrics_line += f" on `{cfg.data.val_shards}`" if metrics else ""
    else:
        objective = OBJECTIVES[cfg.objective].description + " (pretraining; the pretraining head is not exported)"
        final = record.get("final", {})
        shown = [*CARD_METRICS, *sorted(k for k in final if k.startswith("fewshot/"))]
        metrics_line = ", ".join(f"{name.removeprefix('train/')} {final[name]:.4g}" for name in shown if name in final)
    if step is not None and step != cfg.train.steps:
        metrics_line = f"not recorded for step {step} (the run's final metrics are for step {cfg.train.steps})"
    steps = f"{step if step is not None else cfg.train.steps} of {cfg.train.steps}"
    batch = cfg.train.global_batch_size or f"{cfg.train.batch_size} per process x {cfg.train.grad_accum} accumulation"
    lines = [
        "---", "library_name: transformers", f"pipeline_tag: {'image-classification' if fine_tuned else 'image-feature-extraction'}",
        "tags: [vit, mpp, masked-patch-prediction]", "---", "",
        f"# ViT ({backbone.width} wide, {backbone.depth} blocks, {backbone.heads} heads, patch {backbone.patch_size}, "
        f"{backbone.image_size} px), {'fine-tuned' if fine_tuned else 'pretrained'} with mpp", "",
        f"- **Objective**: {objective}.",
        f"- **Data**: {data}.",
        f"- **Steps**: {steps}, batch {batch}, {cfg.train.optimizer} at peak lr {cfg.train.lr:g}.",
        f"- **Resolution**: {backbone.image_size} x {backbone.image_size} px; **patch size** {backbone.patch_size} "
        f"({(backbone.image_size // backbone.patch_size) ** 2} patches).",
        "- **Pooling**: the [class] token after the final LayerNorm (`last_hidden_state[:, 0]`); the exported pooler is "
        "the identity, so `pooler_output` is that same token" + (" and the classifier reads it." if fine_tuned else "."),
        f"- **Final metrics**: {metrics_line or 'not recorded (no results.json beside the weights)'}.",
        f"- **Produced by**: `{record['command']}`" if record.get("command") else "- **Produced by**: not recorded.",
        f"- **Exported by**: `{command_line()}`.", "",
        "## Use", "", "```python",
    ]
    if fine_tuned:
        lines += ["from transformers import pipeline", "",
                  f"classify = pipeline('image-classification', model='{out_dir}')", "print(classify('image.jpg'))"]
    else:
        lines += ["from transformers import ViTModel", "",
                  f"model = ViTModel.from_pretrained('{out_dir}')",
                  "features = model(pixel_values=pixels).pooler_output  # (B, D): the [class] token"]
    lines += ["```", ""]
    if not fine_tuned:
        lines += ["**This is a backbone without a classifier.** `pipeline('image-classification')` or "
                  "`ViTForImageClassification.from_pretrained` on it adds a randomly initialised 2-class head and prints "
                  "meaningless labels: fine-tune it first (`mpp finetune --ckpt RUN`, then export that run).", ""]
    lines += ["Inputs are scaled as in training, (x / 255 - 0.5) / 0.5 per channel (preprocessor_config.json).", ""]
    return "\n".join(lines)
