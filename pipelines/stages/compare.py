"""Comparison stage: every arm of a plan (pipelines/plan.py) fine-tuned at its best recipe and compared, paired.

`run` is plan -> execute -> collect. The plan is the loaded CompareConfig. Executing it runs, for each arm, stages
that each live in their own directory under output_dir (so `tensorboard --logdir output_dir` shows every run):

    split/ (or split/fold<i>/)    the dev split(s) held out of the downstream training shards, first, so a split too
                                  small to rank the grid is refused before any pretraining
    pre/<arm>                     the arm's pretraining (none for scratch, nor for an arm of given weights)
    ft/<arm>/<recipe>[-f<i>]      every grid recipe fine-tuned and scored on the dev split (or each fold)
    ft/<arm>/<pick>-x<m>[-f<i>]   the pick longer (`lengths`, then doubled up to `max_length`) while dev top-1 holds
    ft/<arm>/<kept>-s<seed>       the kept recipe and length at the other seeds (every seed under cross-validation,
                                  on all labelled images); every recipe for the arms in `ablate`
    test/<arm>/<run>              each of those runs scored on the evaluation shards, image by image
    frozen/<arm>                  kNN and few-shot accuracy of the frozen backbone
    ft/<arm>/<kept>-p<step>...    for ablated arms, the pick from earlier pretraining checkpoints (`checkpoints`)
    noise/                        the pure-noise images a negative-control arm (control: noise) pretrains on
    summary/<arm>                 the arm's test scores (mean over seeds) as a TensorBoard run, for HParams and Scalars

With label budgets (`labels_per_class`, `label_fractions`), budgets/<n> holds each budget's draw of the labelled
images and budget-<n>/ everything above but pre/ and noise/ (one pretraining per arm, at the top) for that budget.
With pretraining lengths (`pretrain_lengths`), x1 is all of the above in output_dir itself and pretrain-x<m>/ holds
the same for the pretrained arms pretrained m times as long (scratch runs once, at x1).

Collecting writes results.json, report.md (every gap with its paired 95% interval) and comparison.png/svg. A
finished stage leaves stage.json and is skipped when the command is repeated; an interrupted training stage resumes
from its newest checkpoint.

The stages run one after another in this process, each started by start.start_run with its own Accelerator.
Accelerate keeps one state per process, which the first Accelerator sets and nothing public resets, so every stage of
a plan must agree on train.mixed_precision: a plan that does not is refused when it is loaded. Each training stage
compiles its own model from a clean dynamo state.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import io
import json
import math
import statistics
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import numpy as np
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file

from mpp.model.checkpoint import load_backbone, resolve_checkpoint
from mpp.config import Config, Pooling, as_saved
from mpp.data.stream import BadLabel, LabelReader
from mpp.metrics import KNN_TOP1, TOP1, TOP5
from mpp.model.vit import build_backbone
from mpp.rundir import (PREDICTIONS, RESULTS, TENSORBOARD, WEIGHTS, RunDir, checkpoint_step, complete_checkpoints, sha256,
                        write_whole)
from mpp.training.runtime import process_state
from mpp.data.shardformat import IMAGE_KEYS
from mpp.data.prepare_inputs import Sample, Source
from mpp.data.shardwriter import write_shards
from mpp.evaluation.baselines import evaluation_baselines
from mpp.evaluation.settings import EVALUATION_SECTIONS
from mpp.evaluation.stats import Candidate, dev_resolution, dev_split, gap_resolution, pick_recipe, stratified_folds
from mpp.data.tars import ShardEnd, shard_samples
from . import finetune, pretrain
from ..evaluations.evaluators import Stage, TopK
from ..evaluations.fewshot import FewShot
from ..evaluations.knn import Knn
from ..run.loaders import class_names, num_classes, resolve_shards
from ..comparison.groups import key_groups
from ..comparison.gaps import balanced_over_seeds, gaps, pretrain_length_results
from ..comparison.plan import (STAGE_DONE, Arm, CompareConfig, CompareError, arm_plan, budget_names, budget_takes,
                               finished_training, next_length, pretrain_config, pretrain_length_dir, pretrain_length_plan,
                               recipes, result_settings, searches_length, settings, stage_config, training_bound,
                               trial_name)
from ..comparison.plots import comparison_figure, label_efficiency_figure, pretrain_length_figure
from ..comparison.report import (PRETRAIN_CURVES, budget_markdown, budget_summary, design_lines, design_record,
                                 pretrain_length_markdown, report_markdown, scalar_history)
from ..run.start import start_run
from ..run.tracking import TRIAL_NAMES, log_scores, log_session

# Fewer dev images of a class than this and the pick is noise: one image moves that class's accuracy by over 10
# points, and with 10 classes (100 images) top-1's binomial standard error is still up to 5 points.
DEV_MIN_PER_CLASS = 10
# Under this many labelled downstream training images, `dev_folds: auto` picks by AUTO_FOLDS-fold cross-validation:
# a 10% dev split of 500 images is 50 images, whose top-1 standard error is up to 7 points.
SMALL_DOWNSTREAM = 500
AUTO_FOLDS = 5
SIGNIFICANCE = 0.05  # a dev difference with McNemar's exact p below this is one the dev split resolves


def run(cc: CompareConfig) -> dict:
    """Run the plan `cc` (resuming what an earlier invocation left) and write its report; returns results.json."""
    naming = TRIAL_NAMES.set(functools.partial(trial_name, root=Path(cc.output_dir)))
    try:
        return run_pretrain_lengths(cc) if cc.pretrain_lengths else run_once(cc, {})
    finally:
        TRIAL_NAMES.reset(naming)


def run_once(cc: CompareConfig, entries: dict[str, dict[str, dict]]) -> dict:
    """The plan at one pretraining length. `entries` ({budget name, '' without budgets: {arm: its entry}}) receives
    every arm's entry, per-image test hits included; an arm already there is reused, not run again."""
    if cc.labels_per_class or cc.label_fractions:
        return run_budgets(cc, entries)
    return run_plan(cc, Path(cc.output_dir) / "pre", entries.setdefault("", {}))


def run_pretrain_lengths(cc: CompareConfig) -> dict:
    """The plan once per pretraining length (plan.pretrain_length_plan: x1 is the plan without the axis, in
    output_dir itself, the others in pretrain-x<m>/), each pretrained arm pretrained anew to that length's own
    schedule; the scratch arm's runs at x1 serve every length, since nothing of them depends on pretraining. Then
    pretrain_length.md/.json/.png/.svg: each gap over scratch per pretraining length."""
    reports, entries, steps = {}, {}, {}
    for multiple in cc.pretrain_lengths:
        plan = pretrain_length_plan(cc, multiple)
        first = entries.get(f"{cc.pretrain_lengths[0]:g}", {})
        entries[f"{multiple:g}"] = {budget: {arm: e for arm, e in arms.items() if e["pretrain"] is None}
                                    for budget, arms in first.items()}
        steps[f"{multiple:g}"] = {arm.name: pretrain_config(arm_plan(plan, arm), arm).train.steps
                                  for arm in plan.arms if arm.objective}
        print(f"[compare] pretraining length x{multiple:g} (in {pretrain_length_dir(cc, multiple)}):", flush=True)
        reports[f"{multiple:g}"] = run_once(plan, entries[f"{multiple:g}"])
    result = pretrain_length_results(cc, reports, entries, steps)
    out = Path(cc.output_dir)
    publish(result, out / "pretrain_length.json", out / "pretrain_length.md", lambda: pretrain_length_markdown(result, cc),
            lambda: pretrain_length_figure(result, out / "pretrain_length.png"),
            f"pretraining-length report in {out / 'pretrain_length.md'}, its figure in {out / 'pretrain_length.png'} "
            f"and .svg; x1's own report is {out / 'report.md'}")
    return result


def publish(result: dict, json_path: Path, md_path: Path, markdown: Callable[[], str], draw: Callable[[], None],
            said: str) -> None:
    """On the main process only: a comparison's results as json_path, its report as md_path, its figure (`draw`),
    and a line saying where they are."""
    if not process_state().is_main_process:
        return
    # Each replaced whole: a kill or a full disk mid-write leaves the earlier report, never one cut short.
    write_whole(json_path, json.dumps(result, indent=2, default=str) + "\n")
    write_whole(md_path, markdown())
    draw()
    print(f"[compare] {said}", flush=True)


def run_budgets(cc: CompareConfig, entries: dict[str, dict[str, dict]]) -> dict:
    """The plan once per label budget, each on its draw of the labelled images (`budget_stage`) under budget-<name>/,
    every arm pretrained once under pre/; then the label-efficiency report over the budgets. `entries`: as run_once's."""
    out = Path(cc.output_dir)
    base = stage_config(cc, "finetune")
    names = budget_names(cc)
    draws = stage(out / "budgets", f"label budgets of {base.data.shards}",
                  {"shards": base.data.shards, "labels_per_class": cc.labels_per_class, "label_fractions": cc.label_fractions},
                  lambda: budget_stage(base, out / "budgets", cc))
    reports = {}
    for name in names:
        finetune = OmegaConf.merge(OmegaConf.create(cc.finetune), {"data": {"shards": draws[name]["shards"]}})
        plan = cc.model_copy(update={"output_dir": str(out / f"budget-{name}"), "labels_per_class": [],
                                     "label_fractions": [], "finetune": OmegaConf.to_container(finetune)})
        print(f"[compare] label budget {name} ({draws[name]['images']} labelled images):", flush=True)
        reports[name] = run_plan(plan, out / "pre", entries.setdefault(name, {}))
    return collect_budgets(cc, draws, reports)


def run_plan(cc: CompareConfig, pre: Path, entries: dict[str, dict]) -> dict:
    """The plan on its finetune data.shards, every arm pretrained in pre/<arm> (shared by the label budgets); an arm
    in `entries` is reused as it is there, and every arm's entry is put there."""
    out = Path(cc.output_dir)
    base = stage_config(cc, "finetune")
    grid = recipes(cc)
    # First, so a useless split costs no pretraining; useless only where nothing is picked: one recipe at one length.
    selection = Selection.of(cc, base, out, select=len(grid) > 1 or searches_length(cc))
    labels = test_labels(base)
    dev_images = (selection.info.get("images") or selection.info["dev_images"]) if selection.splits else None
    design = design_record(cc, labels, len(cc.seeds or [base.train.seed]), dev_images)
    say_design(design)
    arms = {arm.name: entries.get(arm.name) or ArmRun(arm_plan(cc, arm), arm, base, grid, selection, pre).run()
            for arm in cc.arms}
    entries.update(arms)
    return collect(cc, base, grid, selection, arms, design, labels)


def check(cc: CompareConfig) -> dict:
    """compare --dry-run: what the plan's design resolves, from its data, without writing or training anything."""
    base = stage_config(cc, "finetune")
    select = len(recipes(cc)) > 1 or searches_length(cc)
    budgets = bool(cc.labels_per_class or cc.label_fractions)
    if budgets:  # each budget's run states its own dev images when it starts; the dry run says them here
        per_class = Counter(label for _, _, label in labelled_samples(base))
        check_budgets(cc, base, per_class)
    design = design_record(cc, test_labels(base), len(cc.seeds or [base.train.seed]),
                           dev_image_count(cc, base) if select and not budgets else None)
    if budgets and select:
        design["budgets"] = {name: budget_dev(cc, take) for name, take in budget_takes(cc, per_class).items()}
    folds = ({name: budget["folds"] for name, budget in design["budgets"].items()} if "budgets" in design else
             dict.fromkeys(budget_names(cc) or [""], plan_folds(cc, base)))
    design["most_training"] = training_bound(cc, folds)
    design["finished_training"] = finished_training(cc.output_dir)
    say_design(design)
    return design


def budget_dev(cc: CompareConfig, take: dict[int, int]) -> dict:
    """A label budget's labelled images, the folds its picks use (0: one dev split), the images they are scored on, and
    the gap between two candidates those resolve: as its run will split its draw."""
    folds = cc.dev_folds if cc.dev_folds != "auto" else auto_fold_count(take)
    images = sum(take.values())
    dev = images if folds else sum(math.floor(cc.dev_fraction * n + 0.5) for n in take.values())
    return {"images": images, "folds": folds, "dev_images": dev,
            "dev_resolvable": gap_resolution(dev, 1, cc.assumed_disagreement).resolvable}


def say_design(design: dict) -> None:
    if process_state().is_main_process:
        for line in design_lines(design):
            print(line if line.startswith("warning:") else f"[compare] design: {line}", flush=True)


def test_labels(base: Config) -> dict[str, int]:
    """{sample: class id} of every labelled image of the evaluation shards (finetune's data.val_shards), the keys
    named as the fine-tuning runs' per-image results name them."""
    val = base.model_copy(update={"data": base.data.model_copy(update={"shards": base.data.val_shards})})
    labels = {ident: label for ident, _, label in labelled_samples(val)}
    if not labels:
        raise CompareError(f"the evaluation shards ({base.data.val_shards}) hold no labelled images, so no arm can be "
                           f"scored on them; point the plan's finetune data.val_shards at labelled shards")
    return labels


def plan_folds(cc: CompareConfig, base: Config) -> int:
    """The folds the plan's picks use on all its labelled images (no label budgets), 0 for one dev split."""
    return cc.dev_folds if cc.dev_folds != "auto" else auto_folds(base)[0]


def dev_image_count(cc: CompareConfig, base: Config) -> int:
    """The images the plan's candidates are scored on, as Selection.of will split them: every labelled image under
    k-fold, else the dev split's (whole groups where the plan names image_groups)."""
    samples = [(ident, label) for ident, _, label in labelled_samples(base)]
    return len(samples) if plan_folds(cc, base) else len(dev_split(samples, cc.dev_fraction, key_groups(cc.image_groups, (i for i, _ in samples))))


@contextlib.contextmanager
def held_by_this_process(directory: Path, name: str) -> Iterator[None]:
    """Hold the stage in `directory` for this compare process: several processes of one plan (one per core, over
    disjoint arms, say) share its stages, and one that reaches a stage another is running, a data split as much as a
    training run, waits here and then reuses it. An flock on a file beside the directory: the kernel drops it when
    its process dies, so a crashed process never blocks the next. The main process holds it for every rank."""
    if not process_state().is_main_process:
        yield
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    path = directory.parent / f".{directory.name}.stage-lock"
    with path.open("a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[compare] {name}: running in another process, waiting for it", flush=True)
            fcntl.flock(file, fcntl.LOCK_EX)
        yield
        # Finished (stage.json written): a process that takes a lock file gone meanwhile finds the stage done all the
        # same, so the file goes, not to litter the plan's folders. After a failure it stays; closing it releases it.
        path.unlink(missing_ok=True)


def stage(directory: Path, name: str, inputs: dict, work: Callable[[], dict]) -> dict:
    """Run `work` unless a previous invocation finished it with the same `inputs` (settings, as JSON);
    record those and what `work` returns in directory/stage.json."""
    marker = directory / STAGE_DONE
    inputs = json.loads(json.dumps(inputs, default=str))
    state = process_state()
    with held_by_this_process(directory, name):
        state.wait_for_everyone()
        if marker.is_file():
            done = json.loads(marker.read_text())
            finished = result_settings(as_saved(done.get("inputs") or {}))  # as an older mpp built them
            if finished != inputs:
                changed = sorted(k for k in {*inputs, *finished} if inputs.get(k) != finished.get(k))
                raise CompareError(f"{directory} holds a {name} finished with other settings ({', '.join(changed)}); "
                                   f"set output_dir to a new directory, or delete {directory} to redo that stage")
            print(f"[compare] {name}: finished before, skipped ({marker})", flush=True)
            return done
        print(f"[compare] {name}: running in {directory}", flush=True)
        started = time.perf_counter()
        info = {**work(), "inputs": inputs, "stage_wall_time_s": time.perf_counter() - started}
        if state.is_main_process:
            directory.mkdir(parents=True, exist_ok=True)
            # Whole or not at all: a marker cut short (a kill, a full disk) would stop every later invocation at its
            # JSON, where a missing one only has the stage run again.
            write_whole(marker, json.dumps(info, indent=2) + "\n")
        state.wait_for_everyone()
    return info


def resuming(cfg: Config) -> bool:
    """A stage's run continues from a checkpoint an interrupted invocation left, or starts (without a word about
    resuming: a fresh stage has nothing to resume)."""
    return bool(complete_checkpoints(cfg.output_dir))


def pretrain_stage(cfg: Config) -> dict:
    results = pretrain.run(cfg, resume=resuming(cfg))
    return {key: results[key] for key in ("objective", "description", "steps", "images_seen", "wall_time_s", "final")}


def finetune_stage(cfg: Config, ckpt: str | None) -> dict:
    finetune.run(cfg, ckpt=ckpt, resume=resuming(cfg))
    process_state().wait_for_everyone()  # the main process writes results.json and predictions.json
    directory = Path(cfg.output_dir)
    records = json.loads((directory / PREDICTIONS).read_text())
    return {**json.loads((directory / RESULTS).read_text()), "correct": {key: r["correct"] for key, r in records.items()}}


def test_stage(cfg: Config, run_dir: Path) -> dict:
    """The fine-tuned classifier in run_dir scored on cfg.data.val_shards, image by image."""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    classes = num_classes(cfg, resolve_shards(cfg.data.shards, cfg, accelerator))
    classifier = finetune.build_classifier(cfg, str(run_dir), classes)
    weights = load_file(str(run_dir / WEIGHTS))
    classifier.head.load_state_dict({"weight": weights["head.weight"], "bias": weights["head.bias"]})
    top = TopK(cfg, accelerator, Stage("finetune", classes))
    scores = top.scores(classifier.to(accelerator.device))
    return {"run": str(run_dir), "top1": scores[TOP1], **({"top5": scores[TOP5]} if TOP5 in scores else {}),
            "correct": {key: int(hit) for key, hit in sorted(top.predictions.items())}}


def frozen_stage(cfg: Config, ckpt: str | None) -> dict:
    """kNN top-1 and few-shot accuracy of the frozen backbone (`None`: a fresh one), read from both poolings: MPP never
    trains the [class] token that supervised pretraining trains, so one pooling for every arm would handicap one.
    Neighbours and examples come from knn.shards / fewshot.shards (default: the downstream training shards), the
    images classified from their val_shards (default: the evaluation shards). -> {pooling: {knn, fewshot: {shots: acc}}}"""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    backbone = (load_backbone(ckpt, cfg.model) if ckpt else build_backbone(cfg.model)).to(accelerator.device)
    knn, fewshot = Knn(cfg, accelerator), FewShot(cfg, accelerator)  # each reads its images once, for both poolings
    return {pool: {"knn": knn.scores(backbone, pool)[KNN_TOP1],
                   "fewshot": {str(n): statistics.fmean(a) for n, a in fewshot.accuracies(backbone, pool).items()}}
            for pool in get_args(Pooling)}


# ---------------------------------------------------------------- the dev split and the folds


@dataclass(frozen=True)
class Selection:
    """Where candidates (recipes, lengths) are scored and the tested runs train.

    One dev split: `splits` = [(train, dev)] and `final` = that train part. Cross-validation (dev_folds k): `splits`
    = the k (all but fold i, fold i) pairs, every labelled image scored once by a run that did not train on it, and
    `final` = all the labelled images. Without a grid to choose from: no split, `final` the plan's training shards.
    """

    splits: tuple[tuple[str, str], ...]
    final: str
    final_val: str  # what the tested runs evaluate on while they train: the dev split, or the evaluation shards
    info: dict  # what the report says of it: images, per class, folds

    @classmethod
    def of(cls, cc: CompareConfig, base: Config, out: Path, *, select: bool) -> Selection:
        if not select:
            return cls((), base.data.shards, base.data.val_shards, {})
        folds, auto = (cc.dev_folds, None) if cc.dev_folds != "auto" else auto_folds(base)
        grouped = {"image_groups": cc.image_groups} if cc.image_groups else {}  # ungrouped plans' stages resume as before
        if folds:
            info = stage(out / "split", f"{folds}-fold split of {base.data.shards}",
                         {"shards": base.data.shards, "dev_folds": folds, **grouped},
                         lambda: fold_stage(base, out / "split", folds, cc.image_groups))
            splits = tuple((fold["train"], fold["dev"]) for fold in info["folds"])
            return cls(splits, base.data.shards, base.data.val_shards, {**info, "auto_folds": auto})
        info = stage(out / "split", f"dev split ({cc.dev_fraction:.0%} of {base.data.shards})",
                     {"shards": base.data.shards, "dev_fraction": cc.dev_fraction, **grouped},
                     lambda: split_stage(base, out / "split", cc.dev_fraction, cc.image_groups))
        return cls(((info["train"], info["dev"]),), info["train"], info["dev"], info)

    @property
    def folds(self) -> int:
        return len(self.splits) if len(self.splits) > 1 else 0


def auto_folds(base: Config) -> tuple[int, dict | None]:
    """`dev_folds: auto`: k-fold picks (AUTO_FOLDS, fewer where a class has fewer images) when the downstream training
    set holds under SMALL_DOWNSTREAM labelled images, where one dev split of it would resolve top-1 to several points;
    else one dev split (0). Returns k and what the report says of the choice (None for one split)."""
    per_class: dict[int, int] = {}
    for images, (_, _, label) in enumerate(labelled_samples(base), start=1):
        per_class[label] = per_class.get(label, 0) + 1
        if images >= SMALL_DOWNSTREAM:
            return 0, None
    k = auto_fold_count(per_class)
    return (k, {"images": sum(per_class.values()), "below": SMALL_DOWNSTREAM}) if k else (0, None)


def auto_fold_count(per_class: dict[int, int]) -> int:
    """The folds `dev_folds: auto` takes for these labelled images per class (0: one dev split)."""
    if sum(per_class.values()) >= SMALL_DOWNSTREAM:
        return 0
    k = min(AUTO_FOLDS, min(per_class.values(), default=0))
    return k if k >= 2 else 0


def labelled_samples(cfg: Config) -> Iterator[tuple[str, dict, int]]:
    """(key, sample, class id) of every labelled image sample of cfg.data.shards, read as training reads labels
    (cls, json or txt; class names through the shard set's names); unreadable labels are left out. The key is the
    sample's "<shard file name>/<key>", as Batch.keys name it."""
    accelerator = process_state()
    urls = resolve_shards(cfg.data.shards, cfg, accelerator)  # 'synthetic' is generated here if needed
    reader = LabelReader(class_names(cfg, accelerator, cfg.data.shards))

    def whole(end: ShardEnd) -> None:  # a split of a damaged shard would silently leave images out
        if end.damage:
            raise CompareError(f"shard {end.url} could not be read to its end ({end.damage}); repair or remove it "
                               f"before splitting {cfg.data.shards}")

    for sample in shard_samples(urls, whole):
        if not any(k in sample for k in IMAGE_KEYS):
            continue
        try:
            label = reader(sample)
        except BadLabel:
            continue
        if label >= 0:
            yield f"{Path(sample['__url__']).name}/{sample['__key__']}", sample, label


def write_part(cfg: Config, out: Path, keep: Callable[[str], bool]) -> int:
    """The labelled samples of cfg.data.shards whose key `keep` accepts, as shards in `out`; returns their count."""
    names = list(class_names(cfg, process_state(), cfg.data.shards)) or None

    def read() -> Iterator[Sample]:
        for ident, sample, label in labelled_samples(cfg):
            if keep(ident):
                ext = next(k for k in IMAGE_KEYS if k in sample)
                yield Sample(ident.replace("/", "_").replace(".", "_"), sample[ext], "jpg" if ext == "jpeg" else ext, label)

    return write_shards(Source(f"part of {cfg.data.shards}", 0, read, names), out, overwrite=True)["samples"]


def split_stage(cfg: Config, out: Path, dev_fraction: float, image_groups: str | None = None) -> dict:
    """Copy the downstream training shards (cfg.data.shards) into out/train and out/dev, stratified by class and
    chosen by a hash of the key, whole groups of the plan's image_groups on one side (mpp.evaluation.stats.dev_split).

    Refuses a dev split with fewer than DEV_MIN_PER_CLASS images of some class: it could not rank the grid.
    """
    samples = [(ident, label) for ident, _, label in labelled_samples(cfg)]
    dev = dev_split(samples, dev_fraction, key_groups(image_groups, (ident for ident, _ in samples)))
    images, dev_counts = Counter(label for _, label in samples), Counter(label for ident, label in samples if ident in dev)
    fewest = min(images, key=lambda label: (dev_counts[label], images[label])) if images else None
    if fewest is None or dev_counts[fewest] < DEV_MIN_PER_CLASS:
        have = f"class {fewest} has {images[fewest]} images, so {dev_counts[fewest]} in dev" if images else "no labelled images"
        raise CompareError(f"the dev split ({dev_fraction:g} of {cfg.data.shards}) is too small to pick recipes: it "
                           f"needs at least {DEV_MIN_PER_CLASS} images of every class ({have}); raise dev_fraction, use "
                           f"dev_folds (cross-validation over every image), or use more training images")
    counts = {name: write_part(cfg, out / name, lambda ident, name=name: (ident in dev) == (name == "dev")) for name in ("train", "dev")}
    return {"train": str(out / "train"), "dev": str(out / "dev"), "train_images": counts["train"], "dev_images": counts["dev"],
            "dev_images_per_class": {str(k): dev_counts[k] for k in sorted(images)}}


def check_budgets(cc: CompareConfig, cfg: Config, per_class: Counter) -> None:
    """Refuse label budgets the labelled images of cfg.data.shards cannot serve, before anything is written."""
    if not per_class:
        raise CompareError(f"label budgets need labelled images, and {cfg.data.shards} holds none; point finetune's "
                           f"data.shards at labelled shards")
    fewest = min(per_class, key=lambda label: (per_class[label], label))
    if cc.labels_per_class and cc.labels_per_class[-1] > per_class[fewest]:
        raise CompareError(f"labels_per_class {cc.labels_per_class[-1]} needs that many images of every class, and "
                           f"class {fewest} of {cfg.data.shards} has {per_class[fewest]}; lower the budget to at "
                           f"most {per_class[fewest]}, or give fractions (label_fractions)")


class NoiseImages:
    """Images start..stop-1 of uniform random RGB pixels, PNG-encoded (lossless, so the noise stays noise), each
    drawn from its own index: the same images on every run. Picklable, for write_shards' worker processes."""

    def __init__(self, images: int, size: int):
        self.images, self.size = images, size

    def __call__(self, start: int = 0, stop: int | None = None) -> Iterator[Sample]:
        for index in range(start, self.images if stop is None else stop):
            pixels = np.random.default_rng(index).integers(0, 256, size=(self.size, self.size, 3), dtype=np.uint8)
            encoded = io.BytesIO()
            Image.fromarray(pixels).save(encoded, format="PNG")
            yield Sample(f"noise{index:07d}", encoded.getvalue(), "png")


def scored_on_the_plans_images(cfg: Config) -> dict[str, str | None]:
    """The evaluators' data keys that keep a noise control's frozen-feature scores and attention views, while it
    pretrains, on the images `cfg` (the plan's pretraining) names, as every other arm's: noise has no classes to
    score and nothing to look at."""
    return {f"{key}.{name}": spec for key in EVALUATION_SECTIONS if hasattr(section := getattr(cfg, key), "shards_read")
            for name, spec in section.shards_read(cfg.data).items()}


def noise_source(images: int, size: int) -> Source:
    """The negative control's pretraining data: `images` pure-noise images of size x size pixels, unlabelled."""
    return Source(f"pure noise ({images} images, {size} px)", images, NoiseImages(images, size), indexed=True)


def budget_stage(cfg: Config, out: Path, cc: CompareConfig) -> dict:
    """The plan's label budgets drawn from the labelled images of cfg.data.shards, each written as out/<name>:
    within each class the images are ordered by a hash of their key (as the dev split orders them) and a budget
    takes the first n of them (n = labels_per_class, or round(fraction x the class's images), at least 1), so every
    smaller draw lies inside every larger one and every arm and seed sees the same images. Refuses a budget larger
    than a class holds, before writing anything."""
    by_class: dict[int, list[str]] = {}
    for ident, _, label in labelled_samples(cfg):
        by_class.setdefault(label, []).append(ident)
    check_budgets(cc, cfg, Counter({label: len(idents) for label, idents in by_class.items()}))
    ranked = {label: sorted(idents, key=lambda i: (zlib.crc32(i.rsplit("/", 1)[-1].encode()), i)) for label, idents in by_class.items()}
    draws = {}
    for name, take in budget_takes(cc, {label: len(idents) for label, idents in ranked.items()}).items():
        chosen = {ident for label, idents in ranked.items() for ident in idents[:take[label]]}
        images = write_part(cfg, out / name, lambda ident, chosen=chosen: ident in chosen)
        draws[name] = {"shards": str(out / name), "images": images, "per_class": {str(k): v for k, v in sorted(take.items())}}
    return draws


def fold_stage(cfg: Config, out: Path, k: int, image_groups: str | None = None) -> dict:
    """k stratified folds of cfg.data.shards, whole groups of the plan's image_groups in one fold
    (mpp.evaluation.stats.stratified_folds), each written as out/fold<i>/{train,dev}."""
    samples = [(ident, label) for ident, _, label in labelled_samples(cfg)]
    groups = key_groups(image_groups, (ident for ident, _ in samples))
    fold_of = dict(zip((ident for ident, _ in samples), stratified_folds(samples, k, groups)))
    folds = []
    for i in range(k):
        parts = {name: write_part(cfg, out / f"fold{i}" / name, lambda ident, name=name: (fold_of[ident] == i) == (name == "dev"))
                 for name in ("train", "dev")}
        folds.append({"train": str(out / f"fold{i}" / "train"), "dev": str(out / f"fold{i}" / "dev"),
                      "train_images": parts["train"], "dev_images": parts["dev"]})
    return {"folds": folds, "images": len(samples)}


# ---------------------------------------------------------------- one arm


class ArmRun:
    """Everything one arm runs: its pretraining, the recipe pick, the length search, the seeds, the frozen features
    and, for an ablated arm, every recipe and the earlier checkpoints. `run()` -> its entry of results.json, with
    the per-image test hits of its kept recipe at every seed under "correct" (collect pairs them between arms)."""

    def __init__(self, cc: CompareConfig, arm: Arm, base: Config, grid: dict[str, dict], selection: Selection, pre: Path):
        self.cc, self.arm, self.base, self.grid, self.selection = cc, arm, base, grid, selection
        self.out = Path(cc.output_dir)
        self.pre = pre / arm.name  # the arm's pretraining: one for every label budget
        self.seeds = cc.seeds or [base.train.seed]
        self.recipes: dict[str, dict] = dict(grid)  # every recipe run, longer ones included
        self.ckpt: str | None = None
        self.fine_tuned: dict[str, tuple[Path, dict]] = {}
        self.given = {"weights_sha256": sha256(resolve_checkpoint(arm.weights))} if arm.weights else {}  # hashed once

    def run(self) -> dict:
        pretrained = self.pretrain()
        self.ckpt = str(self.pre) if pretrained else self.arm.weights  # given weights, else None: a fresh backbone
        grid_pick = self.choose({name: recipe for name, recipe in self.grid.items()})
        kept, lengths = self.search_length(grid_pick)
        ablated = self.arm.name in self.cc.ablate
        names = [kept.pick] + ([n for n in self.grid if n != kept.pick] if ablated else [])
        tests = {name: self.tested(name) for name in names}
        test = over_seeds(tests[kept.pick], self.seeds)
        # The search ended without a fall the dev split resolves: kept at the longest length tried, or with the
        # longest near-best (an image or two below the pick), the arm's dev curve may not have peaked, so it may be
        # short; with max_length set, only the cap ends a search that way, and that is said.
        longest_run = length_run(grid_pick.pick, max(map(float, lengths), default=1.0))
        longest = bool(lengths) and kept.pick == longest_run
        level = bool(lengths) and not longest and longest_run in kept.tied
        entry = {"objective": self.arm.summary, "pretrain_run": self.ckpt, "weights": self.arm.weights, "control": self.arm.control, "recipe": kept.pick,
                 "at_longest_length": longest, "longest_near_best": level,
                 "length_cap_reached": (longest or level) and self.cc.max_length is not None,
                 "extended": [m for m in lengths if float(m) > self.cc.lengths[-1]], "grid_pick": grid_pick.pick,
                 "settings": self.recipes[kept.pick], "lr": stage_config(self.cc, "finetune", self.recipes[kept.pick]).train.lr,
                 "grid": grid_pick.top1, "pick": pick_record(grid_pick), "lengths": lengths,
                 "length": kept.pick.rsplit("-x", 1)[1] if kept.pick != grid_pick.pick else "1",
                 "length_pick": pick_record(kept), "pretrain": pretrained, "test": test,
                 "run": tests[kept.pick][self.seeds[0]]["run"], "finetune": tests[kept.pick][self.seeds[0]]["finetune"],
                 "correct": {str(seed): tests[kept.pick][seed]["correct"] for seed in self.seeds},
                 "history": {str(seed): tests[kept.pick][seed]["history"] for seed in self.seeds},
                 "frozen": self.frozen(self.arm.name, self.ckpt)}
        if self.selection.splits:
            entry["dev_top1"] = kept.top1[kept.pick]
        if ablated:
            entry["ablation"] = {name: over_seeds(result, self.seeds) for name, result in tests.items()}
        if self.cc.sensitivity:
            lengths = [name for name in kept.tied if name != kept.pick]  # the split cannot tell them from the kept one
            recipes = [name for name in grid_pick.tied if name != grid_pick.pick]  # ... nor these from the grid's pick
            near_best = list(dict.fromkeys(lengths + recipes))
            entry["near_best"] = {name: {"test": over_seeds(result, self.seeds),
                                         "correct": {str(seed): result[seed]["correct"] for seed in self.seeds}}
                                  for name in near_best for result in [tests.get(name) or self.tested(name)]}
        if pretrained:
            entry["pretrain_curves"] = scalar_history(self.pre, PRETRAIN_CURVES)
            if ablated and self.cc.checkpoints:
                entry["checkpoints"] = self.earlier_checkpoints(kept.pick)
        return entry

    def pretrain(self) -> dict | None:
        if self.arm.objective is None:
            return None
        data = {}
        if self.arm.control == "noise":
            size = stage_config(self.cc, "pretrain").model.image_size
            where = self.pre.parent.parent / "noise"  # beside pre/, shared by the label budgets
            noise = stage(where, f"{self.cc.noise_images} pure-noise images", {"images": self.cc.noise_images, "size": size},
                          lambda: {"shards": str(where), "images": write_shards(noise_source(self.cc.noise_images, size), where,
                                                                                 overwrite=True)["samples"]})
            data = {"data.shards": noise["shards"], "data.val_shards": noise["shards"], **scored_on_the_plans_images(
                pretrain_config(self.cc, self.arm))}
        cfg = pretrain_config(self.cc, self.arm, output_dir=self.pre, **data)
        return stage(self.pre, f"{self.arm.name} pretraining", settings(cfg), lambda: pretrain_stage(cfg))

    def start(self, ckpt: str | None) -> dict:
        """What a stage starts from, in its settings: given weights also by their content (a file replaced at the same
        path is another start, so its stages run again)."""
        return {"ckpt": ckpt, **(self.given if ckpt is not None and ckpt == self.arm.weights else {})}

    def fine_tune(self, run_name: str, recipe: dict, seed: int, train: str, val: str, ckpt: str | None) -> tuple[Path, dict]:
        """The fine-tuning stage ft/<arm>/<run_name>, once per invocation (a candidate's run is also a tested one)."""
        if run_name not in self.fine_tuned:
            directory = self.out / "ft" / self.arm.name / run_name
            cfg = stage_config(self.cc, "finetune", output_dir=directory,
                               **{**recipe, "train.seed": seed, "data.shards": train, "data.val_shards": val})
            self.fine_tuned[run_name] = directory, stage(directory, f"{self.arm.name} fine-tuning {run_name}",
                                                         {**settings(cfg), **self.start(ckpt)}, lambda: finetune_stage(cfg, ckpt))
        return self.fine_tuned[run_name]

    def choose(self, candidates: dict[str, dict]) -> Choice:
        """Score each candidate recipe on the dev split (each fold) and pick one (mpp.evaluation.stats.pick_recipe: the best dev
        top-1; exactly equal scores to the more training steps, then the earlier candidate); one candidate or no
        split: that one, unscored."""
        scored = []
        for name, recipe in candidates.items():
            correct = {}
            for i, (train, dev) in enumerate(self.selection.splits):
                run_name = name if len(self.selection.splits) == 1 else f"{name}-f{i}"
                correct.update(self.fine_tune(run_name, recipe, self.base.train.seed, train, dev, self.ckpt)[1]["correct"])
            steps = stage_config(self.cc, "finetune", recipe).train.steps
            scored.append((name, correct, steps))
        if not self.selection.splits:
            name = next(iter(candidates))
            return Choice(name, {}, (name,), False, {})
        keys = sorted(scored[0][1])
        pick = pick_recipe([Candidate(name, [correct[k] for k in keys], steps) for name, correct, steps in scored])
        return Choice(pick.pick, pick.top1, pick.tied, pick.tie, pick.p_value)

    def search_length(self, grid_pick: Choice) -> tuple[Choice, dict[str, float]]:
        """The grid's pick fine-tuned at the plan's `lengths` multiples, then at twice the longest tried up to
        max_length, going on until a length falls below the best so far by more than the dev split resolves
        (McNemar's exact test, p < 0.05: one image down is noise, not a reason to stop). The extension obeys the same
        rule as the plan's lengths: an arm whose longest length is a few dev images below its best is not stopped
        while an arm whose curve happens to rise goes on (on 90 dev images, scratch's x2 one image down had stopped it
        at x1 while MPP went on to x8). The kept length is picked among those tried like a recipe (the best dev top-1)."""
        if not searches_length(self.cc) or not self.selection.splits:
            return grid_pick, {}
        name = grid_pick.pick
        steps = stage_config(self.cc, "finetune", self.grid[name]).train.steps
        tried: dict[str, dict] = {name: self.grid[name]}
        choice = self.choose(tried)
        planned, multiple = list(self.cc.lengths[1:]), 1.0
        while planned or next_length(self.cc, multiple) is not None:
            multiple = planned.pop(0) if planned else next_length(self.cc, multiple)
            best_so_far = max(choice.top1.values())
            longer = length_run(name, multiple)
            tried[longer] = self.recipes[longer] = {**self.grid[name], "train.steps": round(steps * multiple)}
            choice = self.choose(tried)
            if choice.top1[longer] < best_so_far and choice.p_value[longer] < SIGNIFICANCE:
                break
        return choice, {(key.rsplit("-x", 1)[1] if "-x" in key else "1"): top1 for key, top1 in choice.top1.items()}

    def tested(self, name: str, ckpt: str | None = None, suffix: str = "") -> dict[int, dict]:
        """Recipe `name` fine-tuned (from `ckpt`, default the arm's pretraining) on the final training shards at every
        seed, each scored on the evaluation shards: {seed: test stage result}. Under one dev split the grid's seed
        reuses the candidate run itself."""
        ckpt = ckpt if ckpt is not None else self.ckpt
        results = {}
        for seed in self.seeds:
            reuse = self.selection.folds == 0 and seed == self.base.train.seed
            run_name = f"{name}{suffix}" if reuse else f"{name}{suffix}-s{seed}"
            directory, trained = self.fine_tune(run_name, self.recipes[name], seed, self.selection.final, self.selection.final_val, ckpt)
            if self.selection.final_val == self.base.data.val_shards:  # its last evaluation was on the evaluation shards
                scored = {key: trained[key] for key in ("top1", "top5", "correct") if key in trained}
            else:
                cfg = stage_config(self.cc, "finetune", output_dir=self.out / "test" / self.arm.name / run_name,
                                   **{**self.recipes[name], "train.seed": seed})
                scored = stage(self.out / "test" / self.arm.name / run_name, f"{self.arm.name}: {run_name} on {self.base.data.val_shards}",
                               {**settings(cfg), "run": directory}, lambda cfg=cfg, directory=directory: test_stage(cfg, directory))
            log_scores(directory / TENSORBOARD / "finetune", {f"test/{k}": scored[k] for k in ("top1", "top5") if k in scored}, trained["steps"])
            results[seed] = {**scored, "history": trained["history"], "run": str(directory),
                             "finetune": {k: trained[k] for k in ("steps", "images_seen", "wall_time_s", "top1")}}
        return results

    def frozen(self, name: str, ckpt: str | None) -> dict:
        cfg = stage_config(self.cc, "finetune", output_dir=self.out / "frozen" / name)
        return stage(self.out / "frozen" / name, f"{name} frozen features (kNN, few-shot)", {**settings(cfg), **self.start(ckpt)},
                     lambda: frozen_stage(cfg, ckpt))

    def earlier_checkpoints(self, pick: str) -> dict:
        """The pick fine-tuned from earlier checkpoints of the same pretraining, at every seed, with their frozen
        features: the report's pretraining-length ablation."""
        pre = self.pre
        points = {}
        for step in self.cc.checkpoints:
            earlier = RunDir(pre).checkpoint(step)
            if not earlier.is_dir():
                kept = ", ".join(str(checkpoint_step(c)) for c in complete_checkpoints(pre)) or "none"
                raise CompareError(f"{pre} keeps no checkpoint at step {step} (kept: {kept}); raise "
                                   f"pretrain.train.keep_checkpoints, make the step a multiple of checkpoint_every, "
                                   f"and pretrain again in a new output_dir")
            tests = self.tested(pick, str(earlier), suffix=f"-p{step}")
            points[str(step)] = {"test": over_seeds(tests, self.seeds), "frozen": self.frozen(f"{self.arm.name}-p{step}", str(earlier))}
        return points


def length_run(name: str, multiple: float) -> str:
    """The run name of recipe `name` fine-tuned at `multiple` times its length: the recipe's own at 1."""
    return name if multiple == 1 else f"{name}-x{multiple:g}"


@dataclass(frozen=True)
class Choice:
    """A pick among candidates scored on the dev split(s): see mpp.evaluation.stats.Pick."""

    pick: str
    top1: dict[str, float | None]  # every candidate's dev top-1
    tied: tuple[str, ...]  # the best and those the split cannot tell from it
    tie: bool
    p_value: dict[str, float]


def pick_record(choice: Choice) -> dict:
    return {"pick": choice.pick, "tied": list(choice.tied), "tie": choice.tie, "p_value": choice.p_value}


def over_seeds(tests: dict[int, dict], seeds: list[int]) -> dict:
    """Test top-1 (and top-5) of one recipe at every seed -> mean, std and each seed's."""
    top1 = [tests[seed]["top1"] for seed in seeds]
    return {"top1": statistics.fmean(top1), "top1_std": statistics.stdev(top1) if len(top1) > 1 else None,
            "top1_seeds": {str(seed): t for seed, t in zip(seeds, top1)},
            **({"top5": statistics.fmean(tests[s]["top5"] for s in seeds)} if "top5" in tests[seeds[0]] else {})}


# ---------------------------------------------------------------- collect


def collect(cc: CompareConfig, base: Config, grid: dict[str, dict], selection: Selection, arms: dict[str, dict],
            design: dict, labels: dict[str, int]) -> dict:
    """results.json, report.md and comparison.png/svg from what every arm ran; returns results.json's content."""
    out = Path(cc.output_dir)
    classes = num_classes(base, resolve_shards(base.data.shards, base, process_state()))
    report = {"arms": {name: {**{k: v for k, v in e.items() if k not in ("correct", "history")},
                              "balanced_accuracy": balanced_over_seeds(e["correct"], labels)} for name, e in arms.items()},
              "config": cc.model_dump(mode="json"), "select_on_dev": bool(selection.splits), "dev_folds": selection.folds,
              "selection": selection.info, "seeds": cc.seeds or [base.train.seed], "recipes": grid, "gaps": gaps(arms, cc),
              "design": design, "test_set": evaluation_baselines(labels.values(), classes)}
    if selection.splits:
        dev_images = selection.info.get("images") or selection.info["dev_images"]
        report["dev_resolution"] = asdict(dev_resolution(dev_images))
    for name, e in report["arms"].items():  # each arm's test scores in HParams and Scalars: run summary/<arm>
        scores = {"test/top1": e["test"]["top1"], **({"test/top5": e["test"]["top5"]} if "top5" in e["test"] else {}),
                  "test/balanced_acc": e["balanced_accuracy"]["mean"]}
        log_session(out / "summary" / name, Path(e["run"]) / TENSORBOARD / "finetune", ("train.seed",), scores, e["finetune"]["steps"])
    ylabel = "dev top-1" if selection.folds == 0 and selection.splits else "evaluation top-1"
    publish(report, out / "results.json", out / "report.md", lambda: report_markdown(report, cc, base),
            lambda: comparison_figure({name: e["history"] for name, e in arms.items()},
                                      {name: e.get("pretrain_curves", {}) for name, e in arms.items()},
                                      report["gaps"], out / "comparison.png", ylabel=ylabel),
            f"report in {out / 'report.md'}, plots in {out / 'comparison.png'} and .svg, all runs in TensorBoard: "
            f"tensorboard --logdir {out}")
    return report



def collect_budgets(cc: CompareConfig, draws: dict, reports: dict[str, dict]) -> dict:
    """The label-efficiency results over the budgets (results.json, report.md, label_efficiency.png/svg at the top of
    output_dir), each budget's own report under budget-<name>/; returns results.json's content."""
    out = Path(cc.output_dir)
    first = next(iter(reports.values()))
    result = {"config": cc.model_dump(mode="json"), "kind": "labels per class" if cc.labels_per_class else "fraction of each class",
              "design": first["design"], "test_set": first["test_set"], "seeds": first["seeds"],
              "budgets": {name: {**draws[name], "report": str(out / f"budget-{name}" / "report.md"), **budget_summary(report)}
                          for name, report in reports.items()}}
    publish(result, out / "results.json", out / "report.md", lambda: budget_markdown(result, cc),
            lambda: label_efficiency_figure(result, out / "label_efficiency.png"),
            f"label-efficiency report in {out / 'report.md'}, its curve in {out / 'label_efficiency.png'} and .svg; "
            f"each budget's own report in {out}/budget-<budget>/report.md")
    return result
