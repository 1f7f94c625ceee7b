"""Export stage: a checkpoint of this project as a Hugging Face `transformers` model (`mpp export --to hf DIR`), or
a hybrid as a timm model (`--to timm DIR`), with a model card (README.md) that says what it is and how it was made."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from mpp.model.checkpoint import SavedWeights, classifier_head, classifier_pool, load_backbone, read_weights, run_files_in
from mpp.config import Config
from mpp.data.stream import DataError
from mpp.data.readers import expand_shards
from mpp.data.shardformat import ShardSummary, shard_summary
from mpp.model.hf import ExportError, export_hf
from mpp.model.timm_layout import export_timm, timm_refusal
from mpp.model.vit import VisionTransformer
from mpp.model.registry import OBJECTIVES
from mpp.metrics import TOP1
from mpp.rundir import BEST, RESULTS, WEIGHTS, checkpoint_step, is_checkpoint, run_config_of, run_dir_of, too_long, OutputNotWritten, staged
from mpp.data.synthetic import CLASS_NAMES as SYNTHETIC_CLASS_NAMES, is_synthetic
from ..run.invocation import command_line
from ..run.run_policy import check_writable

FORMATS = ("hf", "timm")  # --to: transformers (plain ViTs), timm's layout (hybrids)


def run(cfg: Config, *, ckpt: str, to: str, out_dir: str) -> str:
    """Write the backbone in `ckpt` (ViTModel), with its classifier if it was fine-tuned (ViTForImageClassification
    on the [class] token, Dinov2ForImageClassification on the mean of the patch outputs: mpp.model.hf).

    A pretraining run's head (MPP's colour head, supervised pretraining's MLP) is the paper's throwaway pretraining
    head: a pretraining checkpoint exports as a backbone. `to` timm: a hybrid as timm's vit_*_r*_s* (mpp.model.timm_layout)."""
    if to not in FORMATS:
        raise ExportError(f"unknown export format '{to}'; use --to hf DIR (a plain ViT) or --to timm DIR (a hybrid)")
    check_export_dir(Path(out_dir), to)
    backbone = load_backbone(ckpt, cfg.model)
    refusal = timm_refusal(backbone) if to == "timm" else None
    if refusal is not None:
        raise ExportError(f"cannot export to timm's layout: {refusal}")
    saved = read_weights(ckpt)
    head = classifier_head(ckpt)
    names, unnamed, naming = classifier_names(cfg, saved, head["weight"].shape[0]) if head is not None else (None, "", "")
    pool = classifier_pool(saved, cfg.finetune) if head is not None else "cls"
    try:
        with staged(Path(out_dir), out_dir) as stage:  # all the export's files, or none
            if to == "timm":
                kind = export_timm(backbone, stage, head, list(names.values()) if names else None, pool)
            else:
                kind = export_hf(backbone, stage, head, id2label=names, pool=pool)
            card = model_card(cfg, backbone, saved.path, kind, out_dir, pool if head is not None else None, to)
            (stage / "README.md").write_text(card)
    except OutputNotWritten as failed:
        fix = "free some space" if failed.full else "make it writable"
        raise ExportError(f"{failed}; nothing was written: {fix}, or choose another directory (--to {to} DIR)") from None
    if head is not None and names is None:  # said once the export is written (a refused one says why)
        labels = "without names" if to == "timm" else f"as LABEL_0 to LABEL_{head['weight'].shape[0] - 1}"
        warnings.warn(f"{unnamed}, so the classifier's labels were exported {labels}; {naming}", stacklevel=2)
    if to == "timm":
        print(f"wrote timm's {kind} ({backbone.width} wide, {backbone.depth} blocks, {backbone.image_size} px; "
              f"config.json's model_args size it) and its model card to {out_dir}; load it with "
              f"timm.create_model('local-dir:{out_dir}', pretrained=True)")
        return kind
    print(f"wrote a transformers {kind} ({backbone.width} wide, {backbone.depth} blocks, patch {backbone.patch_size}, "
          f"{backbone.image_size} px) and its model card to {out_dir}; load it with {kind}.from_pretrained('{out_dir}')")
    return kind


def check_export_dir(out: Path, to: str = "hf") -> None:
    """Refuse, before any work, a directory the export cannot be written to or must not be: one holding a run, whose
    model.safetensors the transformers layout would replace (after which no stage could read the run)."""
    reason = too_long(out)
    if reason is not None:
        raise ExportError(f"export directory {out} cannot be created: {reason}; choose a shorter path (--to {to} DIR)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"export directory {out} is a file; choose a directory (--to {to} DIR)")
    check_writable(out, "export directory", f"set --to {to} DIR to")
    found = run_files_in(out) if out.is_dir() else None
    if found is not None:
        raise ExportError(f"{out} holds a run of this project ({found}); the export would replace its {WEIGHTS} with "
                          f"{'timm' if to == 'timm' else 'the transformers'} layout, which finetune, fewshot and knn cannot read: choose another "
                          f"directory (--to {to} DIR)")


def classifier_names(cfg: Config, saved: SavedWeights, outputs: int) -> tuple[dict[int, str] | None, str, str]:
    """The names of the classifier's `outputs` classes; without them, None, why none and how to give them. The file's
    own come first (its `mpp` metadata's, an export's config.json id2label); else, for a file inside its run (an
    older mpp's, or whose shards named no classes) or where data.shards is set, the training shards' summary.json.
    A file outside its run is never named by the default config's shards, the embedded synthetic corpus."""
    if "class_names" in saved.about:
        return dict(enumerate(saved.about["class_names"])), "", ""
    if run_config_of(saved.path) is None and "shards" not in cfg.data.model_fields_set:
        return None, f"{saved.path} records no class names and lies outside its run", "set data.shards to its training shards to name them"
    names = class_names(cfg)
    if names is None:
        return None, (f"the training shards ({cfg.data.shards}) name no classes (no class_names in a summary.json beside "
                      f"them)"), "prepare the shards with --class-names, or set data.shards to shards whose summary.json names them"
    if len(names) != outputs:
        # The run's own model.num_classes sized the classifier: its shards are the right ones, and name too few.
        fix = (f"the fine-tuning set model.num_classes={outputs}, so no names are known for its other outputs"
               if cfg.model.num_classes == outputs else "set data.shards to the fine-tuning's shards to name them")
        return None, f"the training shards ({cfg.data.shards}) name {len(names)} classes but the classifier has {outputs} outputs", fix
    return names, "", ""


def class_names(cfg: Config) -> dict[int, str] | None:
    """Class names from the summary.json that `mpp prepare` wrote beside the training shards, if any."""
    if is_synthetic(cfg.data.shards):
        return dict(enumerate(SYNTHETIC_CLASS_NAMES))
    summary = shards_summary(cfg)
    return dict(enumerate(summary.class_names)) if summary and summary.class_names else None


def shards_summary(cfg: Config) -> ShardSummary | None:
    """The summary.json beside the training shards, checked; None for shards without one or not present here."""
    try:
        return shard_summary(expand_shards(cfg.data.shards))
    except DataError:
        return None


def run_record(weights_file: Path) -> tuple[dict, int | None]:
    """The results.json of the run that wrote `weights_file` ({} if none) and, for a checkpoints/step_N, its step."""
    step = checkpoint_step(weights_file.parent) if is_checkpoint(weights_file.parent) else None
    results = run_dir_of(weights_file) / RESULTS
    return (json.loads(results.read_text()) if results.is_file() else {}), step


def pooling_line(fine_tuned: bool, mean_pooled: bool, to: str) -> str:
    """The model card's line on what the representation (and the classifier) reads."""
    if to == "timm":
        if mean_pooled:
            return ("- **Pooling**: the mean of the patch outputs after the final LayerNorm (finetune.pool=mean): "
                    "global_pool='avg' with fc_norm=False, which keeps that LayerNorm on every token before the mean.")
        return "- **Pooling**: the [class] token after the final LayerNorm (global_pool='token')."
    if mean_pooled:
        return ("- **Pooling**: the mean of the patch outputs after the final LayerNorm (finetune.pool=mean). "
                "Dinov2ForImageClassification's classifier reads [class ; mean of the patch outputs]; the [class] half "
                "of its weights is zero and every LayerScale is one, so it computes the trained model's logits exactly.")
    return ("- **Pooling**: the [class] token after the final LayerNorm (`last_hidden_state[:, 0]`); the exported pooler is "
            "the identity, so `pooler_output` is that same token" + (" and the classifier reads it." if fine_tuned else "."))


def model_card(cfg: Config, backbone: VisionTransformer, weights_file: Path, kind: str, out_dir: str,
               pool: str | None = None, to: str = "hf") -> str:
    """README.md of an export of `kind` (a transformers class, or timm's architecture with `to` timm); `pool` what its
    classifier reads (cls, mean), None for a backbone."""
    record, step = run_record(weights_file)
    fine_tuned, mean_pooled = pool is not None, pool == "mean"
    library = "timm" if to == "timm" else "transformers"
    summary = shards_summary(cfg)
    data = f"`{cfg.data.shards}`" + (f" ({summary.samples:,} images, {summary.classes} classes)" if summary and summary.samples is not None else "")
    if fine_tuned:
        if "ckpt" not in record:  # a fine-tuning not finished, or its results.json lost
            start = "a starting point not recorded (no results.json beside the weights)"
        else:
            start = record["ckpt"] or "a fresh backbone (training from scratch)"
        read = "the mean of the patch outputs" if mean_pooled else "the [class] token"
        objective = f"fine-tuned as a classifier (linear head on {read}) from {start}"
    else:
        described = record.get("description") or OBJECTIVES[cfg.objective].summary
        objective = f"{described} (pretraining; the pretraining head is not exported)"
    # Every model metric the run's objective and evaluators declared (results.json's final_shown, in their order).
    metrics_at, metrics_line = "Final metrics", ", ".join(f"{tag} {shown}" for tag, shown in record.get("final_shown", {}).items())
    kept_best = weights_file.name == BEST  # finetune.keep_best's weights: those of its best evaluation, not the last step's
    if kept_best:
        best = record.get("best")
        step = int(best["step"]) if best else None
        metrics_at = f"Metrics at step {step}, its best evaluation (finetune.keep_best)" if best else "Metrics"
        metrics_line = f"{TOP1} {best[TOP1]:.1%}" if best else ""
    if fine_tuned and metrics_line:
        metrics_line += f" (eval/*: on `{cfg.data.val_shards}`)"
    if step is not None and step != cfg.train.steps and not kept_best:
        metrics_line = f"not recorded for step {step} (the run's final metrics are for step {cfg.train.steps})"
    steps = f"{step if step is not None else cfg.train.steps} of {cfg.train.steps}"
    if kept_best and step is None:
        steps = f"not recorded for these best weights (no results.json `best` beside them), of a run of {cfg.train.steps}"
    continued = "".join(f", continued with `{resume}`" for resume in record.get("resumed_with", []))
    batch = cfg.train.global_batch_size or f"{cfg.train.batch_size} per process x {cfg.train.grad_accum} accumulation"
    lines = [
        "---", f"library_name: {library}", f"pipeline_tag: {'image-classification' if fine_tuned else 'image-feature-extraction'}",
        f"tags: [vit, mpp, masked-patch-prediction{', hybrid' if backbone.stem == 'resnet' else ''}]", "---", "",
        f"# ViT ({backbone.width} wide, {backbone.depth} blocks, {backbone.heads} heads, patch {backbone.patch_size}, "
        f"{backbone.image_size} px), {'fine-tuned' if fine_tuned else 'pretrained'} with mpp", "",
        f"- **Objective**: {objective}.",
        f"- **Data**: {data}.",
        f"- **Steps**: {steps}, batch {batch}, {cfg.train.optimizer} at peak lr {cfg.train.lr:g}.",
        f"- **Resolution**: {backbone.image_size} x {backbone.image_size} px; **patch size** {backbone.patch_size} "
        f"({(backbone.image_size // backbone.patch_size) ** 2} patches).",
        *([] if backbone.pos_embed_kind == "learned" else [
            f"- **Position embeddings**: trained as {backbone.pos_embed_kind}, written as the one table they add at "
            f"{backbone.image_size} px ({kind} has a learned table only); at another resolution {library} "
            f"interpolates that table."]),
        *([] if backbone.stem != "resnet" else [
            f"- **Stem**: a ResNet (stem_layers {list(backbone.stem_layers)}, {backbone.stem_width} root channels) "
            f"whose feature-map cells are the tokens, padded 'SAME' with GroupNorm epsilon 1e-5 as timm's {kind}."]),
        pooling_line(fine_tuned, mean_pooled, to),
        f"- **{metrics_at}**: {metrics_line or 'not recorded (no results.json beside the weights)'}.",
        f"- **Produced by**: `{record['command']}`{continued}." if record.get("command") else "- **Produced by**: not recorded.",
        f"- **Exported by**: `{command_line()}`.", "",
    ]
    return "\n".join(lines + usage_lines(fine_tuned, out_dir, to))


def usage_lines(fine_tuned: bool, out_dir: str, to: str) -> list[str]:
    """The card's "Use" section: loading the export with its library, and how inputs are prepared."""
    lines = ["## Use", "", "```python"]
    if to == "timm":
        lines += ["import timm", "",
                  f"model = timm.create_model('local-dir:{out_dir}', pretrained=True).eval()",
                  "transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))",
                  "outputs = model(transform(image)[None])  # " + ("(1, classes) logits" if fine_tuned else
                                                                    "(1, D): the [class] token (num_classes 0)"),
                  "```", "",
                  "Written to timm 1.0.31's layout (tensor names and shapes as its source builds this architecture) "
                  "and not loaded by timm, which could not run where it was written. timm's evaluation transform "
                  "resizes the short side, then crops the centre square; mpp crops the centre square, then resizes "
                  "(bilinear, antialiased) to the model's size and scales to (x / 255 - 0.5) / 0.5 per channel: on "
                  "non-square images the two can sample slightly different pixels.", ""]
        return lines
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
    lines += ["Inputs are prepared as mpp evaluates: the centre square of the short side, resized (bilinear) to the "
              "model's size and scaled to (x / 255 - 0.5) / 0.5 per channel (preprocessor_config.json).", ""]
    return lines
