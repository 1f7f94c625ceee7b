"""The commands that score a saved backbone (`fewshot`, `knn`, `probe`, `inspect`): one shape for all four, and where
they write by default."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from accelerate import Accelerator
from torch import nn

from mpp.evaluation.baselines import beside, not_above
from mpp.model.checkpoint import load_backbone
from mpp.config import Config
from mpp.metrics import Metric
from mpp.model.vit import VisionTransformer
from ..run.start import start_run
from mpp.errors import UserError
from mpp.model.hf import HF_CONFIG
from mpp.rundir import CHECKPOINTS, CONFIG, RUN_MANIFEST, OutputNotWritten, is_checkpoint, staged
from ..run.loaders import FrozenFeatureSets
from ..run.run_policy import check_writable

class FrozenFeatureEvaluator:
    """What few-shot, kNN and the linear probe share: `sets` (a labelled pool and the evaluation images, read once),
    `scores(backbone)` of their frozen features under `metrics`, each shown beside the pool's baselines; as an
    evaluator during pretraining (pipelines.evaluations.evaluators), the backbone of the objective in training."""

    sets: FrozenFeatureSets
    metrics: tuple[Metric, ...]

    def baselines(self) -> dict[str, dict[str, float]]:
        return {metric.tag: self.sets.baseline for metric in self.metrics}

    def __call__(self, objective: nn.Module, step: int) -> dict[str, float]:
        return self.scores(objective.backbone)

    def scores(self, backbone: VisionTransformer) -> dict[str, float]:
        raise NotImplementedError


EVALUATED = "-eval"  # the suffix of the folder beside a checkpoint that is not a run directory


def beside_checkpoint(ckpt: str | Path) -> Path:
    """Where a stage that scores `ckpt` writes unless output_dir is set: the run directory `ckpt` names, where it now
    lies (never the output_dir its config.yaml recorded, nor the default run's); for a checkpoints/step_N of a run,
    RUN/step_N-eval; for anything else (a Hugging Face export, a weights file), NAME-eval beside it, so an export
    folder keeps only what the export wrote."""
    path = Path(ckpt)
    path = path if path.name else path.absolute()
    if path.is_file():
        if is_checkpoint(path.parent):
            path = path.parent
        elif any((path.parent / name).exists() for name in (RUN_MANIFEST, CONFIG, CHECKPOINTS)):
            return path.parent  # a run's own weights: the run
        else:
            return path.with_name(f"{path.stem}{EVALUATED}")
    if is_checkpoint(path):
        return path.parent.parent / f"{path.name}{EVALUATED}"
    if (path / HF_CONFIG).is_file():
        return path.with_name(f"{path.name}{EVALUATED}")
    return path


Measure = Callable[[Config, Accelerator, VisionTransformer], tuple[dict, str]]


def evaluate_checkpoint(cfg: Config, ckpt: str, file_name: str, measure: Measure,
                        draw: Callable[[Path], None] | None = None) -> dict:
    """Load the backbone in `ckpt`, `measure(cfg, accelerator, backbone)` -> (result, one line saying it), write
    output_dir/`file_name` (and what `draw(folder)` writes, in the same folder under output_dir: all of it, or none)
    and print the line from the main process; returns the result (with the checkpoint)."""
    out = Path(cfg.output_dir)
    check_writable(out)  # before the work, which takes minutes
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    backbone = load_backbone(ckpt, cfg.model).to(accelerator.device)
    measured, line = measure(cfg, accelerator, backbone)
    result = {"ckpt": str(ckpt), **measured}
    target = out / file_name
    if accelerator.is_main_process:
        folder = Path(file_name).parts[0]  # the file itself, or the folder it lies in (inspect/)
        try:
            with staged(out, str(out / folder)) as stage:
                (stage / file_name).parent.mkdir(parents=True, exist_ok=True)
                (stage / file_name).write_text(json.dumps(result, indent=2) + "\n")
                if draw is not None:
                    draw((stage / file_name).parent)
        except OutputNotWritten as failed:
            fix = "free some space" if failed.full else "make it writable"
            raise UserError(f"{failed}; nothing was written: {fix}, or set output_dir to another directory") from None
        print(f"{line} of {ckpt} ({accelerator.num_processes} process(es)); written to {target}")
        scores = [measured["top1"]] if "top1" in measured else list(measured.get("accuracy", {}).values())
        if scores and "baseline" in measured and all(not_above("top1", s, measured["baseline"]) for s in scores):
            baseline = beside("", measured["baseline"], "{:.1%}".format).strip()
            print(f"warning: the frozen features score at or below the baseline {baseline}: "
                  f"they separate these classes no better than a guess. Likely causes: a backbone pretrained too briefly "
                  f"or at a resolution far below the images' (model.image_size), or too few labelled images")
    accelerator.wait_for_everyone()  # no process tears down its process group while another still uses it
    return result
