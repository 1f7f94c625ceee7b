"""A comparison plan (`compare --config`): which arms, how each is pretrained, the fine-tuning grid, seeds, lengths.

An arm is a starting point for fine-tuning: `scratch` (a fresh backbone), a registered objective by name (`mpp`,
`supervised`: pretrained with the plan's `pretrain` section), or a named variant of one, `{name: mpp-pixel,
objective: mpp, pretrain: {mpp.target: pixels}}`, whose keys go on top of the `pretrain` section: so the paper's
pretext ablations (targets, corruption rates) are arms of one plan. An arm can also start from weights trained
elsewhere, `{name: vit-public, weights: DIR}` (a Hugging Face ViT directory or a timm-layout model.safetensors): no
pretraining stage, the given weights fine-tuned as the others are. Every arm is tuned, length-searched and seeded
the same way. The plan is validated when it is loaded, every stage's run config included.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf
from pydantic import Field, ValidationError, field_serializer, field_validator, model_validator

from mpp.config import Config, ConfigError, Section, dotted, read_layers, validate_config
from mpp.errors import UserError
from mpp.model.checkpoint import load_backbone
from mpp.model.registry import OBJECTIVES
from mpp.training.runtime import Device, precision_label, resolve_precision

SCRATCH = "scratch"
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # an arm's or recipe's name is a directory name


class CompareError(UserError):
    """A comparison directory that holds stages finished with other settings, or a plan its data cannot serve."""


class Arm(Section):
    """One starting point: fresh (objective None, the arm named scratch), pretrained with an objective, or given
weights (objective None, `weights` a path)."""

    name: str = Field(description="The arm's name in the report and its directories (pre/<name>, ft/<name>/...).")
    objective: str | None = Field(None, description="The pretraining objective (a registered one); null: no pretraining (scratch).")
    pretrain: dict[str, Any] = Field({}, description="Run-config keys on top of the plan's pretrain section, for this arm only (mpp.target: pixels).")
    control: Literal["noise"] | None = Field(None, description="A negative control: noise pretrains this arm (with its objective) on images of uniform random pixels that compare makes (noise_images of them), in place of the plan's pretraining data, so the report shows whether the comparison can say no: such an arm must not come out ahead of scratch.")
    model: dict[str, Any] = Field({}, description="model.* keys of this arm's every run, its pretraining and all its fine-tuning (a scratch arm's too), on top of common's: the network an arm pretrains is the one it fine-tunes ({stem: resnet}, {pos_embed: sincos_2d}).")
    weights: str | None = Field(None, description="Weights this arm fine-tunes from instead of pretraining (no objective): a Hugging Face ViT directory (config.json and model.safetensors, as save_pretrained or a Hub download writes it), a timm ViT's model.safetensors, or a run of this project; its model keys must give the weights' patch size (and, for timm, heads); image_size may differ (position embeddings are interpolated).")

    @property
    def summary(self) -> str:
        network = ", ".join(f"model.{k}={v}" for k, v in dotted(self.model).items())
        if self.weights is not None:
            return f"none here: given weights {self.weights}" + (f" ({network})" if network else "")
        if self.objective is None:
            return "none (random init)" + (f" ({network})" if network else "")
        variant = ", ".join([f"{k}={v}" for k, v in dotted(self.pretrain).items()] + ([network] if network else [])
                            + (["on pure-noise images: a negative control"] if self.control == "noise" else []))
        return OBJECTIVES[self.objective].summary + (f" ({variant})" if variant else "")


class CompareConfig(Section):
    output_dir: str = Field("runs/compare", description="Where every stage's run directory, report.md, results.json and comparison.png/svg go.")
    arms: list[str | Arm] = Field(["mpp", "supervised", SCRATCH], min_length=1, description="The starting points to fine-tune: scratch, a registered objective by name (mpp, supervised), a variant {name, objective, pretrain: {keys}, model: {keys}} (model: the network of all its runs, pretraining and fine-tuning), or given weights {name, weights: PATH, model: {keys}} (public weights: no pretraining stage).")
    note: str | None = Field(None, description="A line printed at the top of the report (a smoke-test plan says its numbers mean nothing).")
    common: dict[str, Any] = Field({}, description="Run-config keys shared by every stage (model.*, fewshot.*, data.num_workers, ...).")
    pretrain: dict[str, Any] = Field({}, description="Run-config keys of every pretraining run: data.shards (upstream; labelled for supervised), train.*, mpp.*.")
    finetune: dict[str, Any] = Field({}, description="Run-config keys of every fine-tuning run: data.shards (downstream training), data.val_shards (evaluation), train.*, finetune.eval_every.")
    lrs: list[float] = Field([], description="Fine-tuning learning rates tried per arm, the best picked on the dev split; empty: finetune's train.lr alone, no dev split.")
    grid: list[dict[str, Any]] = Field([], description="Fine-tuning recipes tried per arm instead of lrs, each a set of finetune run-config keys (e.g. {train.optimizer: sgd, train.lr: 0.03, train.layer_decay: 0.75}) and optionally a short name; the best dev top-1 per arm is picked (exactly equal scores to the longer, then the earlier recipe).")
    seeds: list[int] = Field([], description="Fine-tuning seeds (train.seed) each arm's picked recipe is run with; the report gives top-1 mean +- std over them and each gap's paired 95% interval over test images and seeds. Empty: finetune's train.seed alone.")
    dev_fraction: float = Field(0.1, gt=0, lt=1, description="Fraction of the downstream training images held out as the dev split that picks each arm's recipe (with dev_folds 0).")
    dev_folds: int | Literal["auto"] = Field("auto", description="With k >= 2, pick recipes and lengths by k-fold cross-validation over all downstream training images instead of one dev split (k fine-tunings per candidate), then fine-tune the pick on all of them; 0: one split of dev_fraction; auto: 5-fold when the downstream training set holds under 500 labelled images, else one split.")
    lengths: list[float] = Field([1.0], min_length=1, description="Multiples of the fine-tuning length (train.steps) tried in order with each arm's pick, going on until a length's dev top-1 falls below the best so far by more than the dev split resolves (McNemar's exact p < 0.05); the kept length is picked like a recipe (the best dev top-1; exactly equal scores to the longer); [1]: the plan's length only.")
    max_length: float | None = Field(None, gt=1, description="The cap of the length search's extension: past the plan's lengths each arm is fine-tuned at twice the longest multiple tried, and so on while the doubled multiple is at most this one, until a length falls below the arm's best dev top-1 by more than the dev split resolves (the rule of `lengths`); the report says where the cap stopped an arm still at its longest. null: the plan's lengths only (an arm that keeps the longest is said to be maybe short).")
    pretrain_lengths: list[float] = Field([], description="Multiples of each pretrained arm's pretraining length (its train.steps), e.g. [1, 3, 10]: each is its own pretraining, to its own schedule, and the whole fine-tuning side (picks, lengths, seeds, tests; budgets if set) runs from it, under pretrain-x<m>/ (1 is the plan's own run, in output_dir itself; scratch runs once); pretrain_length.md and its figure give each gap vs scratch per length. Empty: the plan's length alone.")
    sensitivity: bool = Field(True, description="Also fine-tune and test each arm's near-best candidates (those the dev split cannot tell from its pick) at every seed, and report whether each gap's verdict would change had each arm taken one of them.")
    checkpoints: list[int] = Field([], description="Earlier pretraining steps whose checkpoints each ablated arm's pick is also fine-tuned from, at every seed, with the frozen features scored there too: the report's pretraining-length ablation (pretrain.train.keep_checkpoints must keep them).")
    ablate: list[str] = Field([], description="Arms whose every grid recipe, not only the dev pick, is fine-tuned at every seed and scored on the evaluation shards: the report's lever ablation; names of arms not in `arms` are ignored.")
    noise_images: int = Field(2000, gt=0, description="How many pure-noise images (uniform random RGB pixels at model.image_size) a negative-control arm (control: noise) pretrains on.")
    labels_per_class: list[int] = Field([], description="Label budgets: for each, a stratified draw of that many labelled images of every class from finetune's data.shards, nested (the smaller among the larger) and the same for every arm and seed, and the whole fine-tuning side (picks, lengths, seeds, tests) run on it, each under budget-<n>/; pretraining runs once per arm. The report is then a label-efficiency curve. Empty: all the labelled images.")
    label_fractions: list[float] = Field([], description="Label budgets as fractions of every class's labelled images instead of labels_per_class (e.g. [0.01, 0.1, 1.0]), drawn and run the same way.")
    target_gap: float | None = Field(None, gt=0, lt=1, description="The smallest top-1 gap (a fraction: 0.02 is 2 points) the comparison should resolve; where its design resolves only wider gaps, compare says so in one line at its start, in --dry-run and in the report, with the test images and seeds it would need. null: no target.")
    assumed_disagreement: float = Field(0.2, gt=0, le=1, description="The fraction of test images two arms' runs are assumed to classify differently (typically 0.1-0.25), from which compare states before training the smallest gap its design resolves; the report restates it from the disagreement observed.")
    image_groups: str | None = Field(None, description="A regular expression searched in each image's key (<shard file>/<sample key>) whose first capture group names what the image shows, for data holding several renditions of one thing (e.g. '_([0-9a-f-]+)$' for the emoji of configs/compare/emoji_semi.yaml): the paired intervals resample whole test groups, the resolution counts them as correlated, and the dev split and folds keep each group on one side (docs/statistics.md). null: every image independent.")
    assumed_seed_std: float = Field(0.005, ge=0, lt=1, description="The assumed spread (standard deviation, a fraction) of an arm's test top-1 between fine-tuning seeds, for the same statement; the report uses the spread observed where there are several seeds.")

    @field_validator("arms")
    @classmethod
    def _arms(cls, arms: list[str | Arm]) -> list[Arm]:
        resolved = [Arm(name=a, objective=None if a == SCRATCH else a) if isinstance(a, str) else a for a in arms]
        names = [arm.name for arm in resolved]
        for arm in resolved:
            if not PLAIN_NAME.fullmatch(arm.name) or names.count(arm.name) > 1:
                raise ValueError(f"arm name '{arm.name}' is taken or not a plain name; give each arm a distinct name of letters, digits, '-', '_' or '.'")
            if arm.control and arm.objective is None:
                raise ValueError(f"arm '{arm.name}' is a {arm.control} control without an objective; give it one "
                                 f"(objective: mpp) to pretrain on the noise")
            if arm.objective is not None and arm.name == SCRATCH:
                raise ValueError(f"arm name '{SCRATCH}' is the fresh backbone's, and this arm pretrains with "
                                 f"{arm.objective}; give it another name")
            if arm.weights is not None and (arm.objective is not None or arm.pretrain or arm.name == SCRATCH):
                raise ValueError(f"arm '{arm.name}' starts from given weights ({arm.weights}), so it pretrains nothing "
                                 f"and is not the fresh backbone; drop its objective and pretrain keys, and name it "
                                 f"other than {SCRATCH}")
            if arm.objective is None and arm.weights is None and arm.name != SCRATCH:
                raise ValueError(f"arm '{arm.name}' names no objective and no weights; a fresh backbone is the arm "
                                 f"'{SCRATCH}', given weights are {{name: {arm.name}, weights: PATH}}")
            if arm.objective is not None and arm.objective not in OBJECTIVES:
                raise ValueError(f"arm '{arm.name}' names objective '{arm.objective}'; choose one of {', '.join(OBJECTIVES)} (or the arm {SCRATCH})")
        return resolved

    @field_validator("image_groups")
    @classmethod
    def _image_groups(cls, pattern: str | None) -> str | None:
        try:
            groups = None if pattern is None else re.compile(pattern).groups
        except re.error as e:
            raise ValueError(f"image_groups {pattern!r} is not a regular expression ({e})") from None
        if groups == 0:
            raise ValueError(f"image_groups {pattern!r} has no capture group; put the part of the key that names what "
                             f"the image shows in parentheses")
        return pattern

    @field_serializer("arms")
    def _arms_as_written(self, arms: list[Arm]) -> list[str | dict]:
        """An arm that is just an objective's name (or scratch) is written back as that name."""
        return [arm.name if not arm.pretrain and not arm.model and not arm.control and not arm.weights and arm.objective in (arm.name, None)
                else arm.model_dump() for arm in arms]

    @model_validator(mode="after")
    def _check(self) -> CompareConfig:
        if self.lengths[0] != 1 or any(b <= a for a, b in zip(self.lengths, self.lengths[1:])):
            raise ValueError(f"lengths must start at 1 (the plan's train.steps) and increase, got {self.lengths}; e.g. [1, 2, 4]")
        if self.max_length is not None and self.max_length < self.lengths[-1]:
            raise ValueError(f"max_length {self.max_length:g} is below the longest of lengths {self.lengths}; the cap of "
                             f"the length search's extension must be at least {self.lengths[-1]:g}")
        if self.pretrain_lengths and (self.pretrain_lengths[0] != 1 or any(b <= a for a, b in zip(self.pretrain_lengths, self.pretrain_lengths[1:]))):
            raise ValueError(f"pretrain_lengths must start at 1 (the plan's pretraining) and increase, got "
                             f"{self.pretrain_lengths}; e.g. [1, 3, 10]")
        if self.pretrain_lengths and (SCRATCH not in [arm.name for arm in self.arms] or len(self.arms) < 2):
            raise ValueError("pretrain_lengths gives each pretrained arm's gap over scratch per pretraining length; "
                             "the plan needs the arm scratch and at least one arm that pretrains")
        if self.grid and self.lrs:
            raise ValueError("a comparison plan sets both lrs and grid; put the learning rates into the grid's recipes and drop lrs")
        if self.labels_per_class and self.label_fractions:
            raise ValueError("a comparison plan sets both labels_per_class and label_fractions; keep one kind of budget")
        budgets = self.labels_per_class or self.label_fractions
        if any(b <= a for a, b in zip(budgets, budgets[1:])) or any(b <= 0 for b in budgets) or any(f > 1 for f in self.label_fractions):
            raise ValueError(f"label budgets must be positive and increase (fractions at most 1), got {budgets}; e.g. "
                             f"labels_per_class: [10, 25, 100]")
        if isinstance(self.dev_folds, int) and (self.dev_folds == 1 or self.dev_folds < 0):
            raise ValueError(f"dev_folds {self.dev_folds} is no cross-validation; use dev_folds 0 (one dev split), at least 2, or auto")
        repeats = {"seeds": "the same fine-tuning counted twice, which shrinks the spread the report gives (0.00 for [0, 0])",
                   "lrs": "the same recipe tried twice", "checkpoints": "the same fine-tunings run twice"}
        for key, meaning in repeats.items():
            values = getattr(self, key)
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"{key} {values} repeats {', '.join(f'{v:g}' for v in repeated)}: {meaning}; give "
                                 f"distinct {key}")
        return self


def budget_names(cc: CompareConfig) -> list[str]:
    """Each label budget's name, as its directory budget-<name> and the report call it: '10' labels per class, or
    '0.1' of each class."""
    return [f"{b:d}" for b in cc.labels_per_class] or [f"{f:g}" for f in cc.label_fractions]


def budget_takes(cc: CompareConfig, per_class: dict[int, int]) -> dict[str, dict[int, int]]:
    """{budget name: {class id: images drawn}} from each class's labelled images: labels_per_class of every class,
    or round(fraction x its images), at least 1."""
    budgets = cc.labels_per_class or cc.label_fractions
    return {name: {label: budget if cc.labels_per_class else max(1, math.floor(budget * n + 0.5)) for label, n in per_class.items()}
            for name, budget in zip(budget_names(cc), budgets)}


def searches_length(cc: CompareConfig) -> bool:
    """Whether each arm's fine-tuning length is searched on the dev split: several lengths, or an extension cap."""
    return len(cc.lengths) > 1 or cc.max_length is not None


def next_length(cc: CompareConfig, longest: float) -> float | None:
    """The multiple the length search tries after `longest`, past the plan's lengths: twice it, if max_length allows."""
    return 2 * longest if cc.max_length is not None and 2 * longest <= cc.max_length else None


def training_bound(cc: CompareConfig, folds: dict[str, int]) -> dict[str, int]:
    """The most a plan can train, for sizing it before it runs: its pretraining steps, and its fine-tuning runs and
    steps were every arm's length search to go on to max_length and every candidate to be near-best (each then tested
    at every seed for the sensitivity lines; without them, the pick alone). `folds`: each budget's fold count, 0 for
    one dev split (whose candidate run at the plan's seed is also that seed's tested run); one entry without budgets."""
    grid = [stage_config(cc, "finetune", recipe).train.steps for recipe in recipes(cc).values()]
    multiples = [*cc.lengths]
    while searches_length(cc) and (longer := next_length(cc, multiples[-1])) is not None:
        multiples.append(longer)
    candidates = grid + [round(max(grid) * m) for m in multiples[1:]]  # the length search runs the grid's pick only
    selects = len(grid) > 1 or searches_length(cc)
    base_seed = stage_config(cc, "finetune").train.seed
    seeds = len(cc.seeds or [base_seed])
    pretrained = [arm for arm in cc.arms if arm.objective is not None and arm.weights is None]
    runs = steps = 0
    for arm in cc.arms:
        sides = len(cc.pretrain_lengths or [1]) if arm in pretrained else 1  # scratch and given weights run once
        tested = candidates if cc.sensitivity or arm.name in cc.ablate else [max(candidates)]
        for fold_count in folds.values():
            scored = candidates if selects else []
            reused = selects and not fold_count and base_seed in (cc.seeds or [base_seed])  # a candidate run is a tested one
            runs += sides * (len(scored) * max(fold_count, 1) + len(tested) * (seeds - reused))
            steps += sides * (sum(scored) * max(fold_count, 1) + sum(tested) * (seeds - reused))
            if arm.name in cc.ablate:  # the pick from each earlier pretraining checkpoint, at every seed
                runs += sides * len(cc.checkpoints) * seeds
                steps += sides * len(cc.checkpoints) * seeds * max(candidates)
    pretraining = sum(round(pretrain_config(cc, arm).train.steps * m) for arm in pretrained for m in cc.pretrain_lengths or [1])
    return {"pretrain_steps": pretraining, "finetune_runs": runs, "finetune_steps": steps}


def finished_training(output_dir: str | Path) -> dict:
    """What earlier invocations of a plan finished in output_dir, which a rerun reuses: the fine-tuning runs (ft/<arm>/
    <run>/stage.json), their steps and training seconds, and the pretraining steps (pre/<arm>/stage.json), at every budget and
    pretraining length. A record that cannot be read is left out: the plan's own run names it."""
    done = {"directory": str(output_dir), "finetune_runs": 0, "finetune_steps": 0, "finetune_s": 0.0, "pretrain_steps": 0}
    for marker in Path(output_dir).rglob(STAGE_DONE):
        parts = marker.relative_to(output_dir).parts
        kind = "ft" if parts[-4:-3] == ("ft",) else "pre" if parts[-3:-2] == ("pre",) else None
        try:
            record = json.loads(marker.read_text()) if kind else {}
        except (OSError, ValueError):
            continue
        if kind == "ft" and "steps" in record:
            done["finetune_runs"] += 1
            done["finetune_steps"] += record["steps"]
            done["finetune_s"] += record.get("wall_time_s", 0.0)  # over every start: a stage's own timer, the last only
        elif kind == "pre" and "steps" in record:
            done["pretrain_steps"] += record["steps"]
    return done


def pretrain_length_dir(cc: CompareConfig, multiple: float) -> Path:
    """Where everything run from one pretraining length lies: output_dir itself for 1 (the plan without the axis)."""
    return Path(cc.output_dir) if multiple == 1 else Path(cc.output_dir) / f"pretrain-x{multiple:g}"


def pretrain_length_plan(cc: CompareConfig, multiple: float) -> CompareConfig:
    """The plan as it runs at one pretraining length: without the axis, in pretrain_length_dir, and every pretrained
    arm's train.steps times `multiple` (its own steps: an arm may set them in its pretrain keys). At 1 it is the plan
    without the axis, run for run, so adding the axis to a plan that already ran keeps what it ran."""
    if multiple == 1:
        return cc.model_copy(update={"pretrain_lengths": []})
    arms = [arm if arm.objective is None else
            arm.model_copy(update={"pretrain": {**dotted(arm.pretrain), "train.steps": round(
                multiple * pretrain_config(arm_plan(cc, arm), arm).train.steps)}})
            for arm in cc.arms]
    return cc.model_copy(update={"pretrain_lengths": [], "arms": arms, "output_dir": str(pretrain_length_dir(cc, multiple))})


def load_compare_config(path: str | Path, overrides: list[str] = ()) -> CompareConfig:
    """The comparison YAML <- `key=value` overrides (e.g. pretrain.train.steps=2000); every stage's config is validated now."""
    raw = read_layers(path, overrides, "comparison config", "(arms:, common:, pretrain:, ...) as in configs/compare/tiny.yaml")
    try:
        cc = CompareConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"comparison config key '{key}': {message}; see configs/compare/tiny.yaml" if key else message) from None
    recipes(cc)  # names and keys of the grid
    stages = {f"{arm.name} pretraining": pretrain_config(arm_plan(cc, arm), arm) for arm in cc.arms if arm.objective}
    stages.update({f"{arm.name} fine-tuning": stage_config(arm_plan(cc, arm), "finetune") for arm in cc.arms if arm.model})
    stages["fine-tuning and few-shot evaluation"] = stage_config(cc, "finetune")
    stages.update({f"fine-tuning recipe {name}": stage_config(cc, "finetune", **recipe) for name, recipe in recipes(cc).items()})
    for plan in [pretrain_length_plan(cc, multiple) for multiple in cc.pretrain_lengths or [1]]:
        for arm in plan.arms:
            steps = pretrain_config(arm_plan(plan, arm), arm).train.steps if arm.objective else None
            if steps and any(not 0 < step < steps for step in plan.checkpoints):
                raise ConfigError(f"checkpoints {plan.checkpoints} must be pretraining steps between 0 and pretrain.train.steps ({steps}), exclusive")
            if steps and arm.name in plan.ablate:
                check_checkpoints_kept(plan.checkpoints, pretrain_config(plan, arm).train, arm.name)
    if any(c.train.epochs is not None for c in stages.values()):
        raise ConfigError("a comparison plan gives its runs' lengths in train.steps (its lengths multiply them and its "
                          "checkpoints name pretraining steps); set train.steps in the plan instead of train.epochs")
    check_one_process(stages)
    for arm in cc.arms:
        if arm.weights is not None:
            check_weights(arm, stage_config(arm_plan(cc, arm), "finetune"))
    return cc


def check_weights(arm: Arm, finetune: Config) -> None:
    """Refuse, before any stage, given weights that are missing or do not load as the arm's fine-tuning asks (its
    patch size, stem, heads), each in one line naming the arm."""
    if not Path(arm.weights).exists():
        raise ConfigError(f"arm '{arm.name}' starts from weights at {arm.weights}, which does not exist; download them "
                          f"first (a Hugging Face ViT directory with config.json and model.safetensors, or a timm "
                          f"model.safetensors) and set the arm's weights to that path")
    try:
        load_backbone(arm.weights, finetune.model)
    except UserError as err:
        raise ConfigError(f"arm '{arm.name}' cannot fine-tune its weights: {err}") from None


def check_checkpoints_kept(checkpoints: list[int], train, arm: str) -> None:
    """Refuse, before any stage, checkpoint steps the arm's pretraining will not keep: it saves every
    checkpoint_every steps and at its last, and keeps the newest keep_checkpoints (an uninterrupted run's)."""
    saved = sorted({*range(train.checkpoint_every, train.steps + 1, train.checkpoint_every), train.steps})
    kept = saved[-train.keep_checkpoints:]
    missing = [step for step in checkpoints if step not in kept]
    if missing:
        raise ConfigError(f"checkpoints names pretraining step(s) {', '.join(map(str, missing))}, which the {arm} "
                          f"pretraining will not keep (it keeps step(s) {', '.join(map(str, kept))}: every "
                          f"pretrain.train.checkpoint_every={train.checkpoint_every} steps, the newest "
                          f"pretrain.train.keep_checkpoints={train.keep_checkpoints}); make each a multiple of "
                          f"checkpoint_every and raise keep_checkpoints to keep it")


def check_one_process(stages: dict[str, Config]) -> None:
    """Refuse a plan whose stages need different mixed precision: they all run in one process, whose Accelerate state
    keeps the first stage's (see compare's docstring)."""
    device = Device.this_process()
    (first, cfg), *others = stages.items()
    precision = resolve_precision(cfg.train.mixed_precision, device)
    for name, other in others:
        other_precision = resolve_precision(other.train.mixed_precision, device)
        if other_precision != precision:
            raise ConfigError(f"the comparison's {first} runs with train.mixed_precision {precision_label(precision)}, its "
                              f"{name} with {precision_label(other_precision)}; compare runs every stage in one process, "
                              f"which keeps the first stage's precision: set it once, in the plan's common section")


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
        if given is not None and (name in named or not PLAIN_NAME.fullmatch(name)):
            raise ConfigError(f"grid recipe name '{name}' is taken or not a plain name; give each recipe a distinct name of letters, digits, '-', '_' or '.'")
        if given is None and (len(name) > 24 or name in named or not PLAIN_NAME.fullmatch(name)):
            name = f"r{i}"
        named[name] = recipe
    return named


# compare's directories (pipelines/stages/compare.py) as a trial name says them: fine-tuning goes without saying
WITHIN = {"ft": "", "pre": "pretraining", "summary": "mean over seeds"}
STAGE_DONE = "stage.json"  # in a stage's directory once it finished: its inputs and what it returned


def trial_name(run_dir: Path, root: Path) -> str:
    """A run of the comparison in `root` as HParams' table names it: its own directory first, then what it belongs
    to, innermost first, the comparison last (mim-x2-s1 (scratch, tiny), mim-s1 (scratch, budget-10, tiny), mpp
    (pretraining, tiny)), so the part that tells runs apart shows in the table's narrow first column, and runs of two
    comparisons under one logdir are not merged into one row; '' for a run outside the comparison."""
    run_dir, root = Path(run_dir).resolve(), Path(root).resolve()
    if not run_dir.is_relative_to(root) or run_dir == root:
        return ""
    *within, name = run_dir.relative_to(root).parts
    context = [WITHIN.get(part, part) for part in reversed(within) if WITHIN.get(part, part)]
    return f"{name} ({', '.join([*context, root.name])})"


def stage_config(cc: CompareConfig, section: str, extra: dict[str, Any] | None = None, **keys) -> Config:
    """common <- the section <- `extra` (nested or dotted) <- `keys` (dotted), validated as a run config."""
    layers = [OmegaConf.create(cc.common), OmegaConf.create(getattr(cc, section)), nested(dotted(extra or {})), nested(keys)]
    try:
        return validate_config(OmegaConf.to_container(OmegaConf.merge(*layers)))
    except ConfigError as err:
        raise ConfigError(f"in the comparison's '{section}' runs (common + {section}): {err}") from None


def nested(keys: dict[str, Any]) -> DictConfig:
    """Dotted keys as a config layer, each value as it is (a path as its text): written back as `key=value` text and
    parsed again, a null became the string 'None', which no setting takes."""
    layer = OmegaConf.create()
    for key, value in keys.items():
        OmegaConf.update(layer, key, str(value) if isinstance(value, Path) else value)
    return layer


def arm_plan(cc: CompareConfig, arm: Arm) -> CompareConfig:
    """The plan as `arm` runs it: its model keys (Arm.model) put on top of common's, so every stage of the arm
    builds (or loads) the same network."""
    if not arm.model:
        return cc
    common = OmegaConf.merge(OmegaConf.create(cc.common), OmegaConf.create({"model": arm.model}))
    return cc.model_copy(update={"common": OmegaConf.to_container(common)})


def pretrain_config(cc: CompareConfig, arm: Arm, **keys) -> Config:
    """The pretraining run config of `arm`: common <- pretrain <- the arm's own keys <- its objective <- `keys`."""
    return stage_config(cc, "pretrain", arm.pretrain, objective=arm.objective, **keys)


def settings(cfg: Config) -> dict:
    """What a stage's result depends on: its run config, less the directory it writes to, how often it logs, the
    CPU threads it computes with (so arms run side by side on a small machine, one thread each, are the stages a
    later plain run of the plan finds finished) and how long a stop signal waits for data."""
    values = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in ("output_dir", "log")}
    values["train"] = {k: v for k, v in values["train"].items() if k not in ("cpu_threads", "stop_data_wait_s")}
    return result_settings(values)


def result_settings(values: dict) -> dict:
    """Stage settings less how often a fine-tuning evaluates, where it keeps no best weights: evaluating changes
    the curve a run records, not the weights it learns nor its last score (tests/test_compare.py), so a plan
    whose eval_every was changed (to spend less time testing) reuses its finished runs."""
    tuning = values.get("finetune")
    if not isinstance(tuning, dict) or tuning.get("keep_best"):
        return values
    return {**values, "finetune": {k: v for k, v in tuning.items() if k != "eval_every"}}
