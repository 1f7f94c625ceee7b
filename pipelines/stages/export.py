"""Export stage: a checkpoint of this project as a Hugging Face `transformers` model (`mpp export --to hf DIR`), a
hybrid as a timm model (`--to timm DIR`) or any as an ONNX graph (`--to onnx DIR`), with a model card (README.md) that
says what it is and how it was made. The formats: export_formats.FORMATS."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from mpp.model.checkpoint import SavedWeights, classifier_head, classifier_pool, load_backbone, read_weights, run_files_in
from mpp.config import Config
from mpp.data.stream import DataError
from mpp.data.readers import expand_shards
from mpp.data.shardformat import ShardSummary, shard_summary
from mpp.model.hf import ExportError
from mpp.model.vit import VisionTransformer
from mpp.model.registry import OBJECTIVES
from mpp.metrics import TOP1
from mpp.rundir import BEST, RESULTS, checkpoint_step, is_checkpoint, run_config_of, run_dir_of, too_long, OutputNotWritten, staged
from mpp.data.synthetic import CLASS_NAMES as SYNTHETIC_CLASS_NAMES, is_synthetic
from ..run.invocation import command_line
from ..run.run_policy import check_writable
from .export_formats import FORMATS, ExportFormat


def run(cfg: Config, *, ckpt: str, to: str, out_dir: str) -> str:
    """Write the backbone in `ckpt`, with its classifier if it was fine-tuned, in format `to` (FORMATS); returns
    what was written (a transformers class, timm's architecture, ONNX's classifier or backbone).

    A pretraining run's head (MPP's colour head, supervised pretraining's MLP) is the paper's throwaway pretraining
    head: a pretraining checkpoint exports as a backbone."""
    if to not in FORMATS:
        raise ExportError(f"unknown export format '{to}'; use --to hf DIR (a plain ViT), --to timm DIR (a hybrid) or "
                          f"--to onnx DIR (any)")
    form = FORMATS[to]
    check_export_dir(Path(out_dir), to)
    backbone = load_backbone(ckpt, cfg.model)
    refusal = form.refusal(backbone)
    if refusal is not None:
        raise ExportError(f"cannot export to {form.library}'s layout: {refusal}")
    saved = read_weights(ckpt)
    head = classifier_head(ckpt)
    names, unnamed, naming = classifier_names(cfg, saved, head["weight"].shape[0]) if head is not None else (None, "", "")
    pool = classifier_pool(saved, cfg.finetune) if head is not None else "cls"
    try:
        with staged(Path(out_dir), out_dir) as stage:  # all the export's files, or none
            kind = form.write(backbone, stage, head, names, pool)
            card = model_card(cfg, backbone, saved.path, kind, out_dir, pool if head is not None else None, form)
            (stage / "README.md").write_text(card)
    except OutputNotWritten as failed:
        fix = "free some space" if failed.full else "make it writable"
        raise ExportError(f"{failed}; nothing was written: {fix}, or choose another directory (--to {to} DIR)") from None
    if head is not None and names is None:  # said once the export is written (a refused one says why)
        labels = form.unnamed(head["weight"].shape[0])
        warnings.warn(f"{unnamed}, so the classifier's labels were exported {labels}; {naming}", stacklevel=2)
    print(form.written(kind, backbone, out_dir))
    return kind


def check_export_dir(out: Path, to: str = "hf") -> None:
    """Refuse, before any work, a directory the export cannot be written to or must not be: one holding a run, whose
    model.safetensors the transformers or timm layout would replace (after which no stage could read the run)."""
    reason = too_long(out)
    if reason is not None:
        raise ExportError(f"export directory {out} cannot be created: {reason}; choose a shorter path (--to {to} DIR)")
    if out.exists() and not out.is_dir():
        raise ExportError(f"export directory {out} is a file; choose a directory (--to {to} DIR)")
    check_writable(out, "export directory", f"set --to {to} DIR to")
    found = run_files_in(out) if out.is_dir() else None
    if found is not None:
        raise ExportError(f"{out} holds a run of this project ({found}); the export would {FORMATS[to].into_run}: "
                          f"choose another directory (--to {to} DIR)")

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


def model_card(cfg: Config, backbone: VisionTransformer, weights_file: Path, kind: str, out_dir: str,
               pool: str | None, form: ExportFormat) -> str:
    """README.md of an export of `kind` (what form.write returned) in format `form`; `pool` what its classifier reads
    (cls, mean), None for a backbone."""
    record, step = run_record(weights_file)
    fine_tuned, mean_pooled = pool is not None, pool == "mean"
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
        "---", f"library_name: {form.library}", f"pipeline_tag: {'image-classification' if fine_tuned else 'image-feature-extraction'}",
        f"tags: [vit, mpp, masked-patch-prediction{', hybrid' if backbone.stem == 'resnet' else ''}]", "---", "",
        f"# ViT ({backbone.width} wide, {backbone.depth} blocks, {backbone.heads} heads, patch {backbone.patch_size}, "
        f"{backbone.image_size} px), {'fine-tuned' if fine_tuned else 'pretrained'} with mpp", "",
        f"- **Objective**: {objective}.",
        f"- **Data**: {data}.",
        f"- **Steps**: {steps}, batch {batch}, {cfg.train.optimizer} at peak lr {cfg.train.lr:g}.",
        f"- **Resolution**: {backbone.image_size} x {backbone.image_size} px; **patch size** {backbone.patch_size} "
        f"({(backbone.image_size // backbone.patch_size) ** 2} patches).",
        *filter(None, [form.position_line(backbone, kind)]),
        *([] if backbone.stem != "resnet" else [form.stem_line(backbone, kind)]),
        form.pooling_line(fine_tuned, mean_pooled),
        f"- **{metrics_at}**: {metrics_line or 'not recorded (no results.json beside the weights)'}.",
        f"- **Produced by**: `{record['command']}`{continued}." if record.get("command") else "- **Produced by**: not recorded.",
        f"- **Exported by**: `{command_line()}`.", "",
    ]
    return "\n".join(lines + form.usage(fine_tuned, out_dir))
