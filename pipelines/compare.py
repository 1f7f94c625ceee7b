"""Comparison stage: MPP pretraining vs supervised pretraining vs training from scratch, each at its best recipe.

Stages, each in its own directory under output_dir (so `tensorboard --logdir output_dir` shows every run, under
short names): [split: a dev split held out of the downstream training shards, first, so a split too small to
rank the grid is refused before any pretraining] -> pre/mpp, pre/supervised ->
ft/<arm>/<recipe> for every arm and fine-tuning recipe of the grid -> ft/<arm>/<recipe>-x<multiple> for the pick
fine-tuned longer (`lengths`) until dev top-1 falls below its best -> ft/<arm>/<pick>-s<seed> for the other seeds
of each arm's dev-picked recipe (of every recipe, for the arms in `ablate`) -> [test/<arm>/<run>: each of those runs
on the evaluation shards] -> frozen/<arm> (kNN and few-shot of the frozen backbone) -> [for the arms in `ablate`,
the pick from earlier pretraining checkpoints: ft/<arm>/<pick>-p<step>[-s<seed>], test/..., frozen/<arm>-p<step>]
-> report.md, results.json, comparison.png. A finished stage leaves stage.json and is skipped when the command is
repeated; an interrupted training stage resumes from its newest checkpoint.

The stages run one after another in this process, each started by stage.start_run with its own Accelerator
(trackers, project directory, accumulation). Accelerate keeps one state per process, which the first Accelerator
sets and nothing public resets, so every stage of a plan must agree on train.mixed_precision: a plan that does not
is refused when it is loaded. Each training stage compiles its own model from a clean dynamo state.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import statistics
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import Field, ValidationError
from safetensors.torch import load_file
from webdataset.tariterators import tarfile_samples

from mpp.checkpoint import load_backbone
from mpp.model import build_backbone
from mpp.config import Config, ConfigError, Pooling, Section, validate_config
from mpp.data import IMAGE_KEYS
from mpp.errors import UserError
from mpp.rundir import RESULTS, WEIGHTS, checkpoint_dir, checkpoint_step, complete_checkpoints
from mpp.shards import Sample, write_shards
from mpp.runtime import Device, precision_label, process_state, resolve_precision
from pipelines import finetune, pretrain
from pipelines.loaders import num_classes, resolve_shards
from pipelines.run_policy import RunInUse
from pipelines.start import start_run
from pipelines.evaluators import Stage, TopK
from pipelines.fewshot import FewShot
from pipelines.knn import Knn
from pipelines.report import PRETRAIN_CURVES, line_chart, report_markdown, scalar_history, val_shards_name

ARMS = ("mpp", "supervised", "scratch")
STAGE_DONE = "stage.json"
OBJECTIVE = {"mpp": "masked patch prediction", "supervised": "supervised (upstream labels)", "scratch": "none (random init)"}
# Fewer dev images of a class than this and the learning-rate pick is noise: one image moves that class's accuracy by
# over 10 points, and with 10 classes (100 images) top-1's binomial standard error is still up to 5 points.
DEV_MIN_PER_CLASS = 10
WAIT_POLL_S = 5.0  # how often a stage running in another compare process is checked for its end


class CompareConfig(Section):
    output_dir: str = Field("runs/compare", description="Where every stage's run directory, report.md, results.json and comparison.png go.")
    arms: list[Literal["mpp", "supervised", "scratch"]] = Field(list(ARMS), min_length=1, description="Which starting points to fine-tune: MPP-pretrained, supervised-pretrained, fresh.")
    common: dict[str, Any] = Field({}, description="Run-config keys shared by every stage (model.*, fewshot.*, data.num_workers, ...).")
    pretrain: dict[str, Any] = Field({}, description="Run-config keys of both pretraining runs: data.shards (upstream; labelled for supervised), train.*, mpp.*.")
    finetune: dict[str, Any] = Field({}, description="Run-config keys of every fine-tuning run: data.shards (downstream training), data.val_shards (evaluation), train.*, finetune.eval_every.")
    lrs: list[float] = Field([], description="Fine-tuning learning rates tried per arm, the best picked on the dev split; empty: finetune's train.lr alone, no dev split.")
    grid: list[dict[str, Any]] = Field([], description="Fine-tuning recipes tried per arm instead of lrs, each a set of finetune run-config keys (e.g. {train.optimizer: sgd, train.lr: 0.03, train.layer_decay: 0.75}) and optionally a short name; the best per arm is picked on the dev split.")
    seeds: list[int] = Field([], description="Fine-tuning seeds (train.seed) each arm's picked recipe is run with; the report gives top-1 mean +- std over them and whether each gap exceeds that spread. Empty: finetune's train.seed alone.")
    dev_fraction: float = Field(0.1, gt=0, lt=1, description="Fraction of the downstream training images held out as the dev split that picks each arm's learning rate.")
    lengths: list[float] = Field([1.0], min_length=1, description="Multiples of the fine-tuning length (train.steps) tried in order with each arm's dev-picked recipe, stopping at the first whose dev top-1 falls below the best so far (a tie goes on), so every arm fine-tunes until its dev accuracy stops rising; the shortest with the best dev top-1 is kept; [1]: the plan's length only.")
    checkpoints: list[int] = Field([], description="Earlier pretraining steps whose checkpoints each ablated arm's pick is also fine-tuned from, at every seed, with the frozen features scored there too: the report's pretraining-length ablation (pretrain.train.keep_checkpoints must keep them).")
    ablate: list[Literal["mpp", "supervised", "scratch"]] = Field([], description="Arms whose every grid recipe, not only the dev pick, is fine-tuned at every seed and scored on the evaluation shards: the report's lever ablation (test top-1 mean +- std per recipe); arms not in `arms` are not run, so arms=[scratch] runs a plan with ablate=[mpp] unchanged.")


def load_compare_config(path: str | Path, overrides: list[str] = ()) -> CompareConfig:
    """The comparison YAML <- `key=value` overrides (e.g. pretrain.train.steps=2000); every stage's config is validated now."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"comparison config {path} does not exist; pass one of configs/compare/*.yaml to --config")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override '{bad[0]}' is not of the form key=value (e.g. pretrain.train.steps=1000)")
    try:
        raw = OmegaConf.to_container(OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))), resolve=True)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path} with the overrides given ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from None
    try:
        cc = CompareConfig.model_validate(raw or {})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"comparison config key '{key}': {first['msg']}; see configs/compare/tiny.yaml") from None
    if cc.lengths[0] != 1 or any(b <= a for a, b in zip(cc.lengths, cc.lengths[1:])):
        raise ConfigError(f"lengths must start at 1 (the plan's train.steps) and increase, got {cc.lengths}; e.g. [1, 2, 4]")
    steps = stage_config(cc, "pretrain", objective="mpp").train.steps
    if any(not 0 < step < steps for step in cc.checkpoints):
        raise ConfigError(f"checkpoints {cc.checkpoints} must be pretraining steps between 0 and pretrain.train.steps ({steps}), exclusive")
    if cc.grid and cc.lrs:
        raise ConfigError("a comparison plan sets both lrs and grid; put the learning rates into the grid's recipes and drop lrs")
    stages = {f"{arm} pretraining": stage_config(cc, "pretrain", objective=arm) for arm in ("mpp", "supervised")}
    stages["fine-tuning and few-shot evaluation"] = stage_config(cc, "finetune")
    stages.update({f"fine-tuning recipe {name}": stage_config(cc, "finetune", **recipe) for name, recipe in recipes(cc).items()})
    check_one_process(stages)
    return cc


def check_one_process(stages: dict[str, Config]) -> None:
    """Refuse a plan whose stages need different mixed precision (see the module's docstring)."""
    device = Device.this_process()
    (first, cfg), *others = stages.items()
    precision = resolve_precision(cfg.train.mixed_precision, device)
    for name, other in others:
        other_precision = resolve_precision(other.train.mixed_precision, device)
        if other_precision != precision:
            raise ConfigError(f"the comparison's {first} runs with train.mixed_precision {precision_label(precision)}, its "
                              f"{name} with {precision_label(other_precision)}; compare runs every stage in one process, "
                              f"which keeps the first stage's precision: set it once, in the plan's common section")


def dotted(keys: dict, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 0.1}} or {'train.lr': 0.1} -> {'train.lr': 0.1}."""
    flat = {}
    for key, value in keys.items():
        if isinstance(value, dict):
            flat.update(dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


SHORT = {"train.optimizer": "", "train.lr": "", "finetune.pool": "", "train.layer_decay": "ld", "model.drop_path": "dp",
         "train.label_smoothing": "ls", "train.weight_decay": "wd", "train.steps": "st"}


def recipes(cc: CompareConfig) -> dict[str, dict[str, Any]]:
    """The fine-tuning grid as {short name: dotted keys}: a recipe's own `name`, else its values (sgd-0.03,
    adamw-0.001-ld0.75), else r<index> when that is long; short so TensorBoard's run list shows them whole
    (report.md's legend gives every recipe's keys)."""
    grid = [dotted(r) for r in cc.grid] or [{"train.lr": lr} for lr in cc.lrs] or [{}]
    named: dict[str, dict[str, Any]] = {}
    for i, recipe in enumerate(grid):
        given = recipe.pop("name", None)
        parts = [f"{SHORT.get(k, k.split('.')[-1][:4])}{v:g}" if isinstance(v, float) else f"{SHORT.get(k, k.split('.')[-1][:4])}{v}"
                 for k, v in recipe.items()]
        name = str(given) if given is not None else "-".join(parts) or "base"
        if given is not None and (name in named or not name.replace("-", "").replace("_", "").replace(".", "").isalnum()):
            raise ConfigError(f"grid recipe name '{name}' is taken or not a plain name; give each recipe a distinct name of letters, digits, '-', '_' or '.'")
        if given is None and (len(name) > 24 or name in named or "/" in name):
            name = f"r{i}"
        named[name] = recipe
    return named


def stage_config(cc: CompareConfig, section: str, **keys) -> Config:
    """common <- the section <- `keys` (dotted), validated as a run config."""
    dotted = OmegaConf.from_dotlist([f"{k}={v}" for k, v in keys.items()])
    merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(cc.common), OmegaConf.create(getattr(cc, section)), dotted))
    try:
        return validate_config(merged)
    except ConfigError as err:
        raise ConfigError(f"in the comparison's '{section}' runs (common + {section}): {err}") from None


class CompareError(UserError):
    """A comparison directory that holds stages finished with other settings."""


def wait_while_running_elsewhere(directory: Path, name: str) -> None:
    """Return once no other process runs the training stage in `directory` (holds its output_dir lock, see
    run_policy.OutputDirLock), so that several compare processes of one plan (one per core, say) share its stages: a
    stage another one is running is waited for and then reused, not run twice."""
    lock = directory / ".lock"
    if not lock.is_file():
        return
    with lock.open("a+") as file:
        for waits in itertools.count():
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waits:
                    print(f"[compare] {name}: running in another process, waiting for it", flush=True)
                time.sleep(WAIT_POLL_S)
            else:
                fcntl.flock(file, fcntl.LOCK_UN)
                if waits:  # the run has ended; its process writes stage.json right after
                    time.sleep(WAIT_POLL_S)
                return


def stage(directory: Path, name: str, inputs: dict, work: Callable[[], dict]) -> dict:
    """Run `work` unless a previous invocation finished it with the same `inputs` (settings, as JSON);
    record those and what `work` returns in directory/stage.json."""
    marker = directory / STAGE_DONE
    inputs = json.loads(json.dumps(inputs, default=str))
    while True:
        if process_state().is_main_process:
            wait_while_running_elsewhere(directory, name)
        process_state().wait_for_everyone()
        if marker.is_file():
            done = json.loads(marker.read_text())
            if done.get("inputs") != inputs:
                changed = sorted(k for k in {*inputs, *(done.get("inputs") or {})} if inputs.get(k) != (done.get("inputs") or {}).get(k))
                raise CompareError(f"{directory} holds a {name} finished with other settings ({', '.join(changed)}); "
                                   f"set output_dir to a new directory, or delete {directory} to redo that stage")
            print(f"[compare] {name}: finished before, skipped ({marker})", flush=True)
            return done
        print(f"[compare] {name}: running in {directory}", flush=True)
        started = time.perf_counter()
        try:
            info = {**work(), "inputs": inputs}
            break
        except RunInUse:  # another process started it a moment before this one: wait for it as above
            continue
    info["stage_wall_time_s"] = time.perf_counter() - started
    state = process_state()
    if state.is_main_process:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps(info, indent=2) + "\n")
    state.wait_for_everyone()
    return info


def run(cc: CompareConfig) -> dict:
    out = Path(cc.output_dir)
    report: dict[str, Any] = {"arms": {}, "config": cc.model_dump()}

    # The split first: a dev split too small to rank the grid is refused before hours of pretraining.
    base = stage_config(cc, "finetune")
    grid = recipes(cc)
    select_on_dev = len(grid) > 1
    seeds = cc.seeds or [base.train.seed]
    train_shards, val_shards = base.data.shards, base.data.val_shards
    if select_on_dev:
        split = stage(out / "split", f"dev split ({cc.dev_fraction:.0%} of {base.data.shards})",
                      {"shards": base.data.shards, "dev_fraction": cc.dev_fraction},
                      lambda: split_stage(base, out / "split", cc.dev_fraction))
        train_shards, val_shards = split["train"], split["dev"]

    pretrained: dict[str, dict] = {}
    for arm in ("mpp", "supervised"):
        if arm in cc.arms:
            cfg = stage_config(cc, "pretrain", objective=arm, output_dir=out / "pre" / arm)
            pretrained[arm] = stage(out / "pre" / arm, f"{arm} pretraining", settings(cfg),
                                  lambda cfg=cfg: pretrain_stage(cfg))

    def fine_tune(arm: str, ckpt: str | None, run_name: str, recipe: dict, seed: int) -> tuple[Path, dict]:
        directory = out / "ft" / arm / run_name
        cfg = stage_config(cc, "finetune", output_dir=directory, **{**recipe, "train.seed": seed,
                                                                   "data.shards": train_shards, "data.val_shards": val_shards})
        return directory, stage(directory, f"{arm} fine-tuning {run_name}", {**settings(cfg), "ckpt": ckpt},
                                lambda: finetune_stage(cfg, ckpt))

    for arm in cc.arms:
        ckpt = str(out / "pre" / arm) if arm in pretrained else None
        runs = {name: fine_tune(arm, ckpt, name, recipe, base.train.seed) for name, recipe in grid.items()}
        best = max(grid, key=lambda name: runs[name][1]["top1"])
        recipes_run, lengths = dict(grid), {}
        pick, kept = best, 1.0
        if select_on_dev:  # longer, until dev top-1 falls below its best so far
            steps = stage_config(cc, "finetune", **grid[best]).train.steps
            lengths = {1.0: runs[best][1]["top1"]}
            for multiple in cc.lengths[1:]:
                name = f"{best}-x{multiple:g}"
                recipes_run[name] = {**grid[best], "train.steps": round(steps * multiple)}
                runs[name] = fine_tune(arm, ckpt, name, recipes_run[name], base.train.seed)
                lengths[multiple] = top1 = runs[name][1]["top1"]
                if top1 < runs[pick][1]["top1"]:
                    break
                if top1 > runs[pick][1]["top1"]:  # a dev tie is no sign of a flat curve: go on, but keep the shorter
                    pick, kept = name, multiple

        def tested(name: str, start: str | None = ckpt) -> dict[int, dict]:
            """Recipe `name` fine-tuned from `start` at every seed (the grid's seed reuses its run), scored on the evaluation shards."""
            seeded = {seed: runs[name] if seed == base.train.seed else fine_tune(arm, start, f"{name}-s{seed}", recipes_run[name], seed)
                      for seed in seeds}
            if not select_on_dev:
                return {seed: result for seed, (_, result) in seeded.items()}
            test_cfgs = {seed: stage_config(cc, "finetune", output_dir=out / "test" / arm / directory.name,
                                            **{**recipes_run[name], "train.seed": seed}) for seed, (directory, _) in seeded.items()}
            return {seed: stage(out / "test" / arm / directory.name, f"{arm}: {directory.name} on {val_shards_name(base)}",
                                {**settings(test_cfgs[seed]), "run": directory},
                                lambda cfg=test_cfgs[seed], directory=directory: test_stage(cfg, directory))
                    for seed, (directory, _) in seeded.items()}

        # The pick first, so the headline is on disk before an ablation's extra runs.
        scores = {name: tested(name) for name in ([pick] + [n for n in grid if n != pick] if arm in cc.ablate else [pick])}
        entry = {"objective": OBJECTIVE[arm], "recipe": pick, "grid_pick": best, "settings": recipes_run[pick],
                 "lr": stage_config(cc, "finetune", **recipes_run[pick]).train.lr,
                 "grid": {name: runs[name][1]["top1"] for name in grid}, "lengths": {f"{m:g}": top1 for m, top1 in lengths.items()}, "length": f"{kept:g}",
                 "run": str(runs[pick][0]), "finetune": runs[pick][1], "pretrain": pretrained.get(arm),
                 "test": over_seeds(scores[pick], seeds)}
        if arm in cc.ablate:
            entry["ablation"] = {name: over_seeds(result, seeds) for name, result in scores.items()}
        if select_on_dev:
            entry["dev_top1"] = runs[pick][1]["top1"]
        if arm in pretrained:
            entry["pretrain_curves"] = scalar_history(out / "pre" / arm, PRETRAIN_CURVES)

        def frozen(name: str, ckpt: str | None) -> dict:
            cfg = stage_config(cc, "finetune", output_dir=out / "frozen" / name)
            return stage(out / "frozen" / name, f"{name} frozen features (kNN, few-shot)", {**settings(cfg), "ckpt": ckpt},
                         lambda: frozen_stage(cfg, ckpt))

        entry["frozen"] = frozen(arm, ckpt)
        if arm in cc.ablate and arm in pretrained:
            entry["checkpoints"] = {}
            for step in cc.checkpoints:  # the pick from earlier in the same pretraining
                earlier = checkpoint_dir(out / "pre" / arm, step)
                if not earlier.is_dir():
                    kept = ", ".join(str(checkpoint_step(c)) for c in complete_checkpoints(out / "pre" / arm)) or "none"
                    raise CompareError(f"{out / 'pre' / arm} keeps no checkpoint at step {step} (kept: {kept}); raise "
                                       f"pretrain.train.keep_checkpoints, make the step a multiple of checkpoint_every, "
                                       f"and pretrain again in a new output_dir")
                runs[f"{pick}-p{step}"] = fine_tune(arm, str(earlier), f"{pick}-p{step}", recipes_run[pick], base.train.seed)
                recipes_run[f"{pick}-p{step}"] = recipes_run[pick]
                entry["checkpoints"][str(step)] = {"test": over_seeds(tested(f"{pick}-p{step}", str(earlier)), seeds),
                                                   "frozen": frozen(f"{arm}-p{step}", str(earlier))}
        report["arms"][arm] = entry

    report["select_on_dev"] = select_on_dev
    report["seeds"] = seeds
    report["recipes"] = grid
    report["gaps"] = gaps(report["arms"])
    if process_state().is_main_process:
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (out / "report.md").write_text(report_markdown(report, cc, base))
        curves = {arm: e["finetune"]["history"] for arm, e in report["arms"].items()}
        ylabel = "dev top-1" if select_on_dev else "validation top-1"
        line_chart(curves, out / "comparison.png", f"fine-tuning {ylabel} vs step", "fine-tuning step", ylabel)
        print(f"[compare] report in {out / 'report.md'}, plot in {out / 'comparison.png'}, "
              f"all runs in TensorBoard: tensorboard --logdir {out}")
    return report


def over_seeds(tests: dict[int, dict], seeds: list[int]) -> dict:
    """Test top-1 (and top-5) of one recipe at every seed -> mean, std and each seed's."""
    top1 = [tests[seed]["top1"] for seed in seeds]
    return {"top1": statistics.fmean(top1), "top1_std": statistics.stdev(top1) if len(top1) > 1 else None,
            "top1_seeds": {str(seed): t for seed, t in zip(seeds, top1)},
            **({"top5": statistics.fmean(tests[s]["top5"] for s in seeds)} if "top5" in tests[seeds[0]] else {})}


def gaps(arms: dict[str, dict]) -> list[dict]:
    """Every pair of arms: the difference of mean test top-1 and whether it exceeds the seeds' spread (the sum of
    the two standard deviations); with one seed there is no spread to judge by (exceeds_spread None)."""
    names = list(arms)
    result = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ta, tb = arms[a]["test"], arms[b]["test"]
            spread = None if ta["top1_std"] is None or tb["top1_std"] is None else ta["top1_std"] + tb["top1_std"]
            gap = ta["top1"] - tb["top1"]
            result.append({"arms": [a, b], "gap": gap, "spread": spread,
                           "exceeds_spread": None if spread is None else abs(gap) > spread})
    return result


def settings(cfg: Config) -> dict:
    """What a stage's result depends on: its run config, less the directory it writes to, how often it logs and the
    CPU threads it computes with (so arms run side by side on a small machine, one thread each, are the stages a
    later plain run of the plan finds finished)."""
    values = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in ("output_dir", "log")}
    values["train"] = {k: v for k, v in values["train"].items() if k != "cpu_threads"}
    return values


# ---------------------------------------------------------------- the stages


def pretrain_stage(cfg: Config) -> dict:
    started = time.perf_counter()
    results = pretrain.run(cfg, resume=True)
    return {"objective": cfg.objective, "steps": cfg.train.steps, "images_seen": results["images_seen"],
            "wall_time_s": time.perf_counter() - started, "final": results["final"]}


def finetune_stage(cfg: Config, ckpt: str | None) -> dict:
    finetune.run(cfg, ckpt=ckpt, resume=True)
    process_state().wait_for_everyone()  # the main process writes results.json
    return json.loads((Path(cfg.output_dir) / RESULTS).read_text())


def split_stage(cfg: Config, out: Path, dev_fraction: float) -> dict:
    """Copy the downstream training shards (cfg.data.shards) into out/train and out/dev, stratified: each class gives
    round(dev_fraction x its images) to dev, chosen by a hash of the key (the same split on every run and machine).

    Refuses a dev split with fewer than DEV_MIN_PER_CLASS images of some class: it could not rank the grid.
    """
    urls = resolve_shards(cfg.data.shards, cfg, process_state())  # 'synthetic' is generated here if needed

    def labelled_samples() -> Iterator[tuple[str, dict]]:
        for sample in tarfile_samples({"url": url} for url in urls):
            if "cls" in sample and any(k in sample for k in IMAGE_KEYS):
                yield f"{sample['__url__']}/{sample['__key__']}", sample

    by_class: dict[int, list[str]] = {}
    for ident, sample in labelled_samples():
        by_class.setdefault(int(sample["cls"]), []).append(ident)
    dev_counts = {label: math.floor(dev_fraction * len(idents) + 0.5) for label, idents in by_class.items()}
    if not by_class or min(dev_counts.values()) < DEV_MIN_PER_CLASS:
        fewest = min(by_class, key=lambda label: len(by_class[label])) if by_class else None
        have = f"class {fewest} has {len(by_class[fewest])} images, so {dev_counts[fewest]} in dev" if by_class else "no labelled images"
        raise CompareError(f"the dev split ({dev_fraction:g} of {cfg.data.shards}) is too small to pick learning rates: "
                           f"it needs at least {DEV_MIN_PER_CLASS} images of every class ({have}); raise dev_fraction "
                           f"or use more training images")
    dev = {ident for label, idents in by_class.items()
           for ident in sorted(idents, key=lambda i: (zlib.crc32(i.rsplit("/", 1)[-1].encode()), i))[:dev_counts[label]]}

    def part(in_dev: bool) -> Iterator[Sample]:
        for ident, sample in labelled_samples():
            if (ident in dev) == in_dev:
                ext = next(k for k in IMAGE_KEYS if k in sample)
                key = sample["__key__"].replace(".", "_")
                yield Sample(key, sample[ext], "jpg" if ext == "jpeg" else ext, int(sample["cls"]))

    summaries = {name: write_shards(part(name == "dev"), out / name, overwrite=True) for name in ("train", "dev")}
    return {"train": str(out / "train"), "dev": str(out / "dev"), "train_images": summaries["train"]["samples"],
            "dev_images": summaries["dev"]["samples"], "dev_images_per_class": {str(k): v for k, v in sorted(dev_counts.items())}}


def test_stage(cfg: Config, run_dir: Path) -> dict:
    """The fine-tuned classifier in run_dir scored on the evaluation shards, with the fine-tuning stage's own metric."""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    urls = resolve_shards(cfg.data.shards, cfg, accelerator)
    classes = num_classes(cfg, urls)
    classifier = finetune.build_classifier(cfg, str(run_dir), classes)
    weights = load_file(str(run_dir / WEIGHTS))
    classifier.head.load_state_dict({"weight": weights["head.weight"], "bias": weights["head.bias"]})
    scores = TopK(cfg, accelerator, Stage("finetune", classes)).scores(classifier.to(accelerator.device))
    return {"run": str(run_dir), "top1": scores["eval/top1"], **({"top5": scores["eval/top5"]} if "eval/top5" in scores else {})}


def frozen_stage(cfg: Config, ckpt: str | None) -> dict:
    """kNN top-1 and few-shot accuracy of the frozen backbone (`None`: a fresh one), read from both poolings: MPP never
    trains the [class] token that supervised pretraining trains, so one pooling for every arm would handicap one.
    Neighbours and examples come from knn.shards / fewshot.shards (default: the downstream training shards), the
    images classified from their val_shards (default: the evaluation shards). -> {pooling: {knn, fewshot: {shots: acc}}}"""
    accelerator, cfg, _ = start_run(cfg, per_process_seed=False)
    backbone = (load_backbone(ckpt, cfg.model) if ckpt else build_backbone(cfg.model)).to(accelerator.device)
    result = {}
    for pool in get_args(Pooling):
        pooled = cfg.model_copy(update={"knn": cfg.knn.model_copy(update={"features": pool}),
                                        "fewshot": cfg.fewshot.model_copy(update={"features": pool})})
        result[pool] = {"knn": Knn(pooled, accelerator).scores(backbone)["knn/top1"],
                        "fewshot": {str(n): statistics.fmean(a) for n, a in FewShot(pooled, accelerator).accuracies(backbone).items()}}
    return result
