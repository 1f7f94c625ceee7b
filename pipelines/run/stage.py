"""The one sequence every training stage runs (`run_training`).

A training stage plans its run once (plan.RunPlan: its config resolved, its output_dir checked, whether it resumes),
starts, builds what it trains, takes the output_dir's lock, finds the checkpoint to resume from, starts tracking,
builds its evaluators, trains, and writes results.json. Pretraining and fine-tuning differ only in the TrainingStage
they hand over: the objective, its data and their own results.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from accelerate import Accelerator

from mpp.config import Config
from mpp.data.split import HeldOut
from mpp.data.stream import Batch, StreamState
from mpp.training.meters import LOOP_METRICS
from mpp.training.trackers import start_trackers
from mpp.metrics import unique
from mpp.model.objectives import Objective
from mpp.rundir import RESULTS, WEIGHTS, checkpoint_step, write_whole
from mpp.training.runtime import explained_out_of_memory, data_workers
from mpp.training.loop import Evaluator, train
from mpp.data.shardformat import ShardSummary
from .invocation import resume_command
from .plan import plan_run
from .run_policy import OutputDirLock, StartingPoint, resume_point, start_over, record_run_start
from .start import Run, run_settings, start_accelerator
from .results import final_results, show_with_baseline
from .tracking import end_tracking, start_tracking


# What a stage's evaluators are, given the run's config, its Accelerator and the stage (the stages hand over
# pipelines.evaluations.evaluators.stage_evaluators: this sequence sits below the evaluators and does not import them).
EvaluatorsOf = Callable[[Config, Accelerator, "TrainingStage"], Iterable[Evaluator]]


@dataclass
class TrainingStage:
    """What a training stage hands run_training: the rest of the sequence is the same for every one."""

    name: str  # "pretrain" or "finetune": its TensorBoard run, its evaluators' stage, results.json's "stage"
    objective: Objective
    batches: Callable[[StreamState], Iterable[Batch]]  # the training stream from a position (see mpp.training.loop.train)
    data_units: str  # the training data's units, counted ("12 shards", "1500 images"), for the start line
    what: str  # the start line's opening words, e.g. "mpp pretraining of a ViT"
    classes: int | None = None  # the classes trained on (evaluators score them); None: trained without labels
    results: Callable[[dict[str, float]], dict] = lambda scores: {}  # the stage's own results.json entries
    recording: Callable[[Evaluator], Evaluator] = lambda evaluator: evaluator  # wraps each evaluator (fine-tuning's history)
    checkpointed: tuple = field(default_factory=tuple)  # more state saved with every checkpoint (state_dict/load_state_dict)
    data: ShardSummary | None = None  # the summary.json beside the training shards: their images' sizes, their samples
    class_counts: list[int] | None = None  # training images per class, where known (the labels' likely cause)
    held_out: HeldOut | None = None  # the images finetune.val_split holds out of the training shards to evaluate on


def run_training(cfg: Config, build: Callable[[Run], TrainingStage], *, evaluators_of: EvaluatorsOf,
                 resume: bool | Literal["auto"] = False, start: StartingPoint | None = None, overwrite: bool = False) -> dict:
    """Run a training stage under `cfg`: `build(run)` makes what it trains once the run has started; `resume` continues
    the run in output_dir (`auto`: where it holds a checkpoint, see run_policy.continues_a_run); `start` is where
    a fine-tuning's weights come from (None for a stage that starts from nothing else, pretraining), recorded when
    the run starts and held to on a resume; `overwrite` starts over in an output_dir holding a run. Writes
    output_dir/results.json and returns what it holds."""
    plan = plan_run(cfg, resume, start, overwrite)
    started = time.perf_counter()
    run = Run(start_accelerator(plan.cfg), plan.cfg, plan.global_batch)
    accelerator, cfg, run_dir = run.accelerator, plan.cfg, plan.run_dir
    stage = build(run)
    if stage.name == "pretrain" and cfg.finetune.keep_best and accelerator.is_main_process:
        warnings.warn("finetune.keep_best is set, but a pretraining keeps no best (it scores no eval/top1 to pick by): "
                      f"it writes {WEIGHTS}, the last step's weights, only; set keep_best for the fine-tuning")
    with OutputDirLock(accelerator, run_dir.root):
        if overwrite:
            start_over(accelerator, run_dir.root)
        resume_from = resume_point(accelerator, run_dir, plan.resume, plan.changes, cfg.train.global_batch_size)
        started_by = record_run_start(accelerator, run_dir, cfg, start, resumed=resume_from is not None)
        evaluators = tuple(map(stage.recording, evaluators_of(cfg, accelerator, stage)))
        metrics = unique([*stage.objective.metrics("train"), *LOOP_METRICS, *(m for e in evaluators for m in e.metrics)])
        start_trackers(accelerator, stage.name, cfg.log.trackers, cfg.output_dir, plan.settings, resume_from)
        start_tracking(accelerator, plan, stage.name, metrics, resume_from)
        accelerator.print(f"{stage.what} ({describe(stage.objective)}) on {stage.data_units} with "
                          f"{accelerator.num_processes} process(es) on {accelerator.device}"
                          f"{f' ({torch.get_num_threads()} thread(s) each)' if accelerator.device.type == 'cpu' else ''}, "
                          f"{run_settings(accelerator, cfg, plan.global_batch)}; {resolution(cfg.model.image_size, stage.data)}")
        for state in stage.checkpointed:
            accelerator.register_for_checkpointing(state)
        training_started, workers = time.perf_counter(), data_workers(cfg.data.num_workers)
        with explained_out_of_memory(cfg.train):
            trained = train(accelerator, stage.objective, stage.batches, cfg.train, cfg.log, run_dir,
                            resume_from=resume_from, evaluators=evaluators, max_skip_fraction=cfg.data.max_skip_fraction,
                            data_workers=workers, resume_hint=resume_command())
        trained_images = (cfg.train.steps - (checkpoint_step(resume_from) if resume_from else 0)) * plan.global_batch
        # Every start's: the run's images over the seconds every start trained them (as wall_time_s adds them up);
        # this start's alone only where its checkpoint, of an earlier mpp, kept no time.
        images_per_sec = (cfg.train.steps * plan.global_batch / trained.seconds if trained.seconds else
                          trained_images / (time.perf_counter() - training_started))
        timing = {"wall_time_s": time.perf_counter() - started, "images_per_sec": images_per_sec} if trained_images else {}
        results, advice = final_results(plan, stage, metrics, evaluators, trained, resume_from is not None, timing, started_by)
        end_tracking(accelerator, results["final"], cfg.train.steps)
        if accelerator.is_main_process:  # whole or not at all: the other processes of a resumed run read the old one
            write_whole(run_dir.results, json.dumps(results, indent=2) + "\n")
    shown = ", ".join(f"{m.tag} {show_with_baseline(m, results)}" for m in metrics if m.headline and m.tag in results["final"])
    skipped = ", ".join(f"{count:.0f} {reason}" for reason, count in results["skipped"].items())
    this_start = time.perf_counter() - started
    took = (f"{results['wall_time_s']:.0f}s over every start ({this_start:.0f}s in this one)"
            if resume_from is not None and timing and results["wall_time_s"] is not None else f"{this_start:.0f}s")
    accelerator.print(f"{stage.name} done in {took} with {accelerator.num_processes} process(es): "
                      f"{shown or 'no step trained'}; skipped: {skipped or 'none'}; results in {cfg.output_dir}/{RESULTS}, "
                      f"weights in {cfg.output_dir}/{WEIGHTS}")
    if advice:
        accelerator.print(advice)
    return results


def resolution(image_size: int, data: ShardSummary | None) -> str:
    """The start line's training resolution, beside the images' sizes where summary.json records them."""
    sides = data.image_short_side if data else None
    if not sides:
        return f"training at {image_size} px"
    ratio = sides["median"] / image_size
    scale = (f"{ratio:.1f}x smaller than the images' median" if ratio > 1.25 else
             f"{1 / ratio:.1f}x larger than the images' median" if ratio < 0.8 else "about the images' size")
    return (f"training at {image_size} px, {scale} (their short sides are {sides['min']}-{sides['max']} px, median "
            f"{sides['median']}; model.image_size sets it)")


def describe(objective: Objective) -> str:
    b = objective.backbone
    stem = f"hybrid (ResNet stem, units {list(b.stem_layers)}, root width {b.stem_width}), " if b.stem == "resnet" else ""
    positions = "" if b.pos_embed_kind == "learned" else f", position embeddings {b.pos_embed_kind}"
    return (f"{stem}width {b.width}, depth {b.depth}, {b.heads} heads, patch {b.patch_size}, {b.image_size} px{positions}; "
            f"{sum(p.numel() for p in b.parameters()) / 1e6:.1f}M params")
