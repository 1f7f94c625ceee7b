"""What a score is worth: the baseline that knows nothing beside each headline metric, and the one line a run that
ends at or below it prints, with the causes it can check.

Baselines, by kind: `prior` (a pretext metric's own, e.g. always the batch's most frequent colour, which the targets
log as `<tag>_prior`), `majority` (always the training labels' most frequent class, scored on the evaluation
images) and `chance` (a uniform guess, 1 / classes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

PRIOR = "_prior"  # the suffix of a metric's prior, logged beside it by the part that computes it
NAMES = {"prior": "prior", "majority": "majority class", "chance": "chance"}
MIN_PASSES = 10  # fewer passes over the training images than this is named as a cause
RESOLUTION_RATIO = 2  # images whose median short side is this many times the training size are named as a cause
# A test set whose largest class holds more than this many times its smallest's images is imbalanced: top-1 then
# rewards the large classes, and balanced accuracy (mean per-class recall) is shown beside it.
IMBALANCE_RATIO = 1.2


def class_baselines(train_counts: Iterable[int] | None, eval_labels: Iterable[int], classes: int) -> dict[str, float]:
    """{'majority': the share of the evaluation images in the training labels' most frequent class (of the
    training labels themselves when the evaluation labels are unknown), 'chance': 1 / classes}; without training
    counts, chance only."""
    baselines = {"chance": 1 / classes}
    counts = list(train_counts or [])
    if any(counts):
        majority = max(range(len(counts)), key=counts.__getitem__)
        seen = Counter(int(label) for label in eval_labels)
        total = sum(seen.values())
        baselines = {"majority": seen[majority] / total if total else counts[majority] / sum(counts), **baselines}
    return baselines


def evaluation_baselines(labels: Iterable[int], classes: int) -> dict:
    """What a classifier that knows nothing scores on a test set of these labels: {'majority': the share of its most
    frequent class (the best constant guess, chosen knowing the test set), 'chance': 1 / classes}, with the per-class
    counts and whether they are imbalanced (IMBALANCE_RATIO)."""
    seen = Counter(int(label) for label in labels)
    counts = [seen.get(label, 0) for label in range(max(classes, max(seen, default=-1) + 1))]
    present = [n for n in counts if n]
    return {"baselines": class_baselines(counts, seen.elements(), classes), "images": sum(counts),
            "per_class": {str(label): n for label, n in enumerate(counts) if n},
            "imbalanced": bool(present) and max(present) > IMBALANCE_RATIO * min(present)}


def lower_is_better(tag: str) -> bool:
    return "loss" in tag


def with_priors(final: dict[str, float], baselines: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """`baselines` plus, for every metric of `final` logged with a `<tag>_prior`, that prior."""
    priors = {tag.removesuffix(PRIOR): {"prior": value} for tag, value in final.items()
              if tag.endswith(PRIOR) and tag.removesuffix(PRIOR) in final}
    return {**priors, **baselines}


def not_above(tag: str, value: float, baseline: dict[str, float]) -> bool:
    """Whether `value` of `tag` is no better than the best of its baselines."""
    if lower_is_better(tag):
        return value >= min(baseline.values())
    return value <= max(baseline.values())


def beside(value: str, baseline: dict[str, float], show) -> str:
    """'28.9% (majority class 35.0%, chance 33.3%)': a shown value with its baselines, shown alike."""
    return f"{value} ({', '.join(f'{NAMES.get(kind, kind)} {show(b)}' for kind, b in baseline.items())})"


def below_baseline(scores: dict[str, str], causes: list[str]) -> str:
    """The one line of a run whose `scores` ({tag: 'value (baselines)'}) ended at or below their baselines."""
    listed = "; ".join(f"{tag} {shown}" for tag, shown in scores.items())
    found = f" Likely causes: {'; '.join(causes)}." if causes else ""
    return f"warning: this run ended at or below its baseline ({listed}): the model does no better than a guess.{found}"


def likely_causes(*, steps: int, global_batch: int, samples: int | None, image_size: int,
                  short_side: dict[str, int] | None, lr: float, warmup: int, class_counts: list[int] | None,
                  ema_decay: float | None = None) -> list[str]:
    """The causes of a run that learnt nothing that can be checked from its settings and data, each with its fix:
    too few passes over the data, images far larger than the training resolution, a weight average slower than the
    run, the learning rate, the labels."""
    causes = []
    if ema_decay is not None and steps * (1 - ema_decay) < 1:
        causes.append(f"the weight average: train.ema_decay={ema_decay:g} averages over about {1 / (1 - ema_decay):,.0f} "
                      f"steps, more than the run's {steps}, so the evaluated and saved weights are mostly the initial "
                      f"ones (lower it, or set it to null)")
    if samples:
        passes = steps * global_batch / samples
        if passes < MIN_PASSES:
            causes.append(f"too few steps for the data: {steps} steps of {global_batch} images are {passes:.1f} passes "
                          f"over the {samples} training images (raise train.steps, or set train.epochs)")
    if short_side and short_side["median"] >= RESOLUTION_RATIO * image_size:
        causes.append(f"the model sees {image_size} px crops of images whose short sides are {short_side['min']}-"
                      f"{short_side['max']} px (median {short_side['median']}): raise model.image_size")
    causes.append(f"the learning rate: train.lr={lr:g} with {warmup} warmup steps (try it 3-10x lower and higher)")
    if class_counts:
        empty = [label for label, count in enumerate(class_counts) if not count]
        detail = f"; class(es) {empty} have none" if empty else ""
        causes.append(f"the labels: {len(class_counts)} classes with {min(class_counts)}-{max(class_counts)} training "
                      f"images each{detail} (check that each folder holds its class)")
    return causes
