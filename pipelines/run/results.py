"""What a training run reports as it ends: results.json (what ran, its final metrics beside their baselines, the
samples it skipped, how long it took, the command that started it), and the likely causes where a metric ended at or
below its baseline, which the closing line adds."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from mpp.evaluation.baselines import beside, below_baseline, likely_causes, not_above, with_priors
from mpp.metrics import Metric, model_metrics
from mpp.training.loop import Evaluator, Trained
from mpp.training.meters import SKIP_REASONS
from .invocation import command_line
from .plan import RunPlan
from .tracking import stage_objective

if TYPE_CHECKING:  # the sequence in stage.py hands its stage over, and imports this module
    from .stage import TrainingStage


def final_results(plan: RunPlan, stage: TrainingStage, metrics: list[Metric], evaluators: tuple[Evaluator, ...],
                  trained: Trained, resumed: bool, timing: dict[str, float], started_by: str | None) -> tuple[dict, str | None]:
    """(results.json's content, the closing line's advice): stage_results, with the baselines of each final metric
    (the evaluators' and the priors', mpp.evaluation.baselines) and the metrics at or below them, for which the
    advice names the likely causes (None where no metric is)."""
    results = stage_results(plan, stage, metrics, trained, resumed, timing, started_by)
    results["baselines"] = with_priors(results["final"], {tag: b for e in evaluators for tag, b in e.baselines().items()})
    declared = {m.tag: m for m in metrics}
    worse = {tag: beside(declared[tag].show(value), results["baselines"][tag], declared[tag].show)
             for tag, value in results["final"].items()
             if tag in results["baselines"] and tag in declared and not_above(tag, value, results["baselines"][tag])}
    results["at_or_below_baseline"] = sorted(worse)
    cfg = plan.cfg
    advice = below_baseline(worse, likely_causes(
        steps=cfg.train.steps, global_batch=plan.global_batch, samples=plan.samples,
        image_size=cfg.model.image_size, short_side=stage.data.image_short_side if stage.data else None,
        lr=cfg.train.lr, warmup=cfg.train.warmup_steps, class_counts=stage.class_counts,
        ema_decay=cfg.train.ema_decay)) if worse else None
    return results, advice


def stage_results(plan: RunPlan, stage: TrainingStage, metrics: list[Metric], trained: Trained, resumed: bool,
                  timing: dict[str, float], started_by: str | None) -> dict:
    """results.json: what ran, its final model metrics (those the objective and evaluators declare), the samples it
    skipped, how long it took (`timing`: wall_time_s of this invocation and images_per_sec over every invocation,
    empty if it trained nothing; wall_time_s then adds the earlier invocations' training up to the checkpoint this
    one resumed from), the stage's own entries, and the command that started the run (`started_by`, as run.json
    records it; None where an mpp without run.json started it) and `resumed_with`, the resumes that trained more steps.

    A resumed run keeps what the earlier invocations measured and it did not measure again: a finished run resumed
    trains nothing and logs no training metric, and its results must not lose them, nor the command that trained it.
    """
    earlier = {}
    cfg, saved = plan.cfg, plan.run_dir.results
    if resumed and saved.is_file():
        earlier = json.loads(saved.read_text())
    scores = trained.scores
    final = {**earlier.get("final", {}), **model_metrics(metrics, scores)}
    declared = {m.tag: m for m in metrics}
    shown = {tag: declared[tag].show(value) for tag, value in final.items() if tag in declared}
    skipped = {reason: scores[f"data/skipped_{reason}"] for reason in SKIP_REASONS if scores.get(f"data/skipped_{reason}")}
    if timing:  # over every invocation; a checkpoint of an earlier mpp kept no time: the last finished invocation's then
        before = trained.earlier_seconds if trained.earlier_seconds is not None else earlier.get("wall_time_s", 0.0)
        timing = {**timing, "wall_time_s": before + timing["wall_time_s"]}
    now = command_line()
    resumed_with = [*earlier.get("resumed_with", []), *([now] if resumed and timing else [])]
    return {"stage": stage.name, "objective": stage_objective(cfg, stage.name),
            "description": stage.objective.description, "steps": cfg.train.steps, "images_seen": cfg.train.steps * plan.global_batch,
            "wall_time_s": earlier.get("wall_time_s"), "images_per_sec": earlier.get("images_per_sec"), **timing,
            "final": final, "final_shown": shown, "skipped": skipped or earlier.get("skipped", {}), **stage.results(final),
            "command": started_by or earlier.get("command") or now,
            **({"resumed_with": resumed_with} if resumed_with else {})}


def show_with_baseline(metric: Metric, results: dict) -> str:
    """A headline metric's final value, with its baselines where it has any."""
    value = metric.show(results["final"][metric.tag])
    baseline = results["baselines"].get(metric.tag)
    return beside(value, baseline, metric.show) if baseline else value
