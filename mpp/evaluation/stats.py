"""Statistics for comparing fine-tuned classifiers: pure functions on per-image "correct" arrays, no I/O.

- `paired_bootstrap_gap`: a 95% interval for the top-1 gap between two arms scored on the same test images, over
  test images (or whole groups of them: a cluster bootstrap) and fine-tuning seeds.
- `mcnemar`: the exact McNemar test for two runs scored on the same images (a clustered one for grouped images).
- `assumed_design_effect`, `design_effect`: how much grouped test images (renditions of one thing) widen a gap's
  variance over independent ones, assumed before the runs and observed after.
- `dev_resolution`: what a dev split of n images can resolve.
- `gap_resolution`, `images_to_resolve`, `disagreement`: the smallest gap a design (test images, seeds) resolves,
  planned from an assumed disagreement between the arms or read from the one observed.
- `pick_recipe`: the dev pick that treats differences the dev split cannot resolve as ties.
- `stratified_folds`, `dev_split`: a stratified, key-hashed k-fold assignment and dev split, grouped where the images
  are (renditions of one thing kept on one side).
- `balanced_accuracy`: the mean per-class recall, top-1's counterpart on a test set whose classes are imbalanced.

docs/statistics.md gives the method, its assumptions and a worked example.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import torch

from mpp.errors import UserError

# Per-image correctness as the callers hold it: a numpy array, a (CPU or GPU) tensor, or nested lists of bools.
Correct = np.ndarray | torch.Tensor | Sequence
# Replicates drawn at once: their draw and image-count matrices (replicates x images) stay near 2**23 entries (64 MiB each).
CHUNK_ENTRIES = 2**23


def correct_matrix(correct: Correct, name: str) -> np.ndarray:
    """A (seeds, images) or (images,) boolean array (numpy, torch or nested lists) -> a (seeds, images) float64 array."""
    if isinstance(correct, torch.Tensor):
        correct = correct.detach().cpu().numpy()
    matrix = np.asarray(correct)
    if matrix.ndim == 1:
        matrix = matrix[None, :]
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (seeds, images) array of per-image correctness, got shape {matrix.shape}")
    if not np.isin(matrix, (0, 1)).all():
        raise ValueError(f"{name} must hold only True/False (or 1/0) per image")
    return matrix.astype(np.float64)


@dataclass(frozen=True)
class GapInterval:
    """Mean top-1 of arm A minus arm B (fractions of 1) with its percentile bootstrap interval (plain fields, so
    dataclasses.asdict gives results.json its entry)."""

    gap: float
    low: float
    high: float
    excludes_zero: bool  # low > 0 or high < 0: the gap is resolved at this confidence
    confidence: float
    resamples: int


def group_index(groups: Sequence[Hashable] | None, images: int) -> np.ndarray | None:
    """Each image's group as an index in [0, groups); None stays None (every image its own group)."""
    if groups is None:
        return None
    if len(groups) != images:
        raise ValueError(f"groups names {len(groups)} images' groups, but the arms were scored on {images} images")
    first: dict[Hashable, int] = {}
    return np.array([first.setdefault(g, len(first)) for g in groups], dtype=np.int64)


def paired_bootstrap_gap(correct_a: Correct, correct_b: Correct, *, resamples: int = 10_000, confidence: float = 0.95,
                         seed: int = 0, groups: Sequence[Hashable] | None = None) -> GapInterval:
    """The gap in top-1 between arms A and B, scored on the same test images, with a percentile bootstrap interval.

    `correct_a`, `correct_b`: (seeds, images) booleans, row s saying which test images seed s's run classified
    correctly; the arms may have different seed counts but must share the images, in the same order. The gap is the
    mean over seeds of A's top-1 minus B's. Each replicate draws the test images with replacement, the same draw for
    both arms (the pairing: an image hard for one arm tends to be hard for the other, and that shared difficulty
    cancels in the gap), and draws each arm's seeds with replacement, separately per arm (seed s of A and seed s of B
    are independent trainings, not a pair), then takes the gap of the resampled means. The interval is the
    (1-confidence)/2 and (1+confidence)/2 quantiles of the replicates' gaps. Deterministic for a given `seed`.

    `groups` (one name per image, e.g. the emoji each drawing shows) makes it a cluster bootstrap: a replicate draws
    whole groups with replacement, as many as there are, and each arm's top-1 is over the images of the drawn groups.
    Renditions of one thing tend to be right or wrong together, so they count as the one sample they nearly are.
    """
    a, b = correct_matrix(correct_a, "correct_a"), correct_matrix(correct_b, "correct_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the arms were scored on different test sets ({a.shape[1]} and {b.shape[1]} images); a paired "
                         f"comparison needs the same images, in the same order")
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError(f"resamples must be >= 1 and confidence in (0, 1), got {resamples} and {confidence}")
    rng = np.random.default_rng(seed)
    images = a.shape[1]
    index = group_index(groups, images)
    units = images if index is None else int(index.max()) + 1  # what a replicate draws: images, or groups
    both = np.concatenate([a, b]).T  # (images, seeds of A + seeds of B)
    gaps = np.empty(resamples)
    chunk = max(1, CHUNK_ENTRIES // images)
    for start in range(0, resamples, chunk):
        n = min(chunk, resamples - start)
        # How often each image (or group) is drawn in each replicate; then every seed's top-1 on that draw is one
        # matrix product, over the images drawn (a fixed count only when every unit is one image).
        drawn = rng.integers(0, units, size=(n, units)) + units * np.arange(n)[:, None]
        counts = np.bincount(drawn.ravel(), minlength=n * units).reshape(n, units).astype(np.float64)
        if index is not None:
            counts = counts[:, index]  # each image is drawn as often as its group
        top1 = counts @ both / counts.sum(axis=1, keepdims=True)  # (n, seeds of A + seeds of B)
        top1_a, top1_b = top1[:, : a.shape[0]], top1[:, a.shape[0] :]
        seeds_a = rng.integers(0, a.shape[0], size=(n, a.shape[0]))
        seeds_b = rng.integers(0, b.shape[0], size=(n, b.shape[0]))
        gaps[start : start + n] = (np.take_along_axis(top1_a, seeds_a, axis=1).mean(axis=1)
                                   - np.take_along_axis(top1_b, seeds_b, axis=1).mean(axis=1))
    low, high = np.quantile(gaps, [(1 - confidence) / 2, (1 + confidence) / 2])
    return GapInterval(gap=float(a.mean() - b.mean()), low=float(low), high=float(high),
                       excludes_zero=bool(low > 0 or high < 0), confidence=confidence, resamples=resamples)


@dataclass(frozen=True)
class McNemar:
    """Discordant images of runs A and B and the exact two-sided p-value of "both are equally accurate"."""

    a_only: int  # images A classified correctly and B did not
    b_only: int  # images B classified correctly and A did not
    p_value: float


def discordant(correct_a: Correct, correct_b: Correct) -> tuple[int, int]:
    """(images only A got right, images only B got right) for two runs scored on the same images."""
    a, b = correct_matrix(correct_a, "correct_a"), correct_matrix(correct_b, "correct_b")
    if a.shape[0] != 1 or b.shape != a.shape:
        raise ValueError(f"two runs on the same images are compared, one (images,) vector each; got shapes {a.shape} and {b.shape}")
    return int((a > b).sum()), int((b > a).sum())


def mcnemar(correct_a: Correct, correct_b: Correct, groups: Sequence[Hashable] | None = None) -> McNemar:
    """McNemar's exact test for two runs scored on the same images (one (images,) boolean vector each).

    Only the discordant images carry information on which run is more accurate. Under "equally accurate", each of
    the n = a_only + b_only discordant images is A's with probability 1/2, so p = P(Binomial(n, 1/2) is at least as
    far from n/2 as observed), both tails: 2 x P(X <= min(a_only, b_only)), capped at 1. Computed in exact integers.
    With `groups` (one name per image), the images of a group are not independent coin flips, so the test is the
    clustered McNemar test of Durkalski et al. (2003) instead: with D_g = a_only - b_only within group g,
    X^2 = (sum D_g)^2 / sum D_g^2 against chi-square with one degree of freedom (an approximation; with groups of one
    image it is the plain asymptotic McNemar test).
    """
    a_only, b_only = discordant(correct_a, correct_b)
    if groups is None:
        return McNemar(a_only, b_only, mcnemar_p(a_only, b_only))
    a, b = correct_matrix(correct_a, "correct_a")[0], correct_matrix(correct_b, "correct_b")[0]
    index = group_index(groups, len(a))
    per_group = np.bincount(index, weights=a - b)
    spread = float((per_group**2).sum())
    statistic = float(per_group.sum()) ** 2 / spread if spread else 0.0
    return McNemar(a_only, b_only, math.erfc(math.sqrt(statistic / 2)))


def mcnemar_p(a_only: int, b_only: int) -> float:
    """The exact two-sided McNemar p-value for the discordant counts (see `mcnemar`)."""
    n, fewer = a_only + b_only, min(a_only, b_only)
    tail, term = 0, 1  # term = comb(n, k), updated in exact integers
    for k in range(fewer + 1):
        tail += term
        term = term * (n - k) // (k + 1)
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True)
class Resolution:
    """What a split of `images` images can resolve at top-1 `accuracy` (fractions of 1)."""

    images: int
    accuracy: float
    one_image: float  # how much one image moves top-1: 1 / images
    standard_error: float  # the binomial standard error of top-1: sqrt(accuracy (1 - accuracy) / images)


def dev_resolution(images: int, accuracy: float = 0.5) -> Resolution:
    """The resolution of a dev split of `images` images at top-1 `accuracy` (0.5, the default, is the widest)."""
    if images < 1 or not 0 <= accuracy <= 1:
        raise ValueError(f"a split needs at least one image and an accuracy in [0, 1], got {images} and {accuracy}")
    return Resolution(images, accuracy, 1 / images, math.sqrt(accuracy * (1 - accuracy) / images))


@dataclass(frozen=True)
class GapResolution:
    """What a comparison of two arms on `test_images` shared test images, fine-tuned at `seeds` seeds each, can resolve
    (fractions of 1), given the fraction of test images one run of each arm classify differently (`disagreement`)
    and the spread of an arm's top-1 between fine-tuning seeds (`seed_std`)."""

    test_images: int
    seeds: int
    disagreement: float
    seed_std: float
    standard_error: float  # of the gap: sqrt(design_effect x disagreement / test_images + 2 seed_std^2 / seeds)
    half_width: float  # z(confidence) x standard_error: an observed gap larger than this has an interval that excludes 0
    resolvable: float  # (z(confidence) + z(power)) x standard_error: a true gap this large is resolved with that power
    confidence: float
    power: float
    design_effect: float = 1.0  # how much grouped test images widen the images' variance (1: independent images)


def gap_scale(confidence: float, power: float) -> float:
    """z of the two-sided `confidence` plus z of `power`: 1.96 + 0.84 = 2.80 for 95% and 80%."""
    if not 0 < confidence < 1 or not 0 < power < 1:
        raise ValueError(f"confidence and power must be in (0, 1), got {confidence} and {power}")
    return NormalDist().inv_cdf((1 + confidence) / 2) + NormalDist().inv_cdf(power)


def gap_resolution(test_images: int, seeds: int, disagreement: float, seed_std: float = 0.0, *,
                   confidence: float = 0.95, power: float = 0.8, design_effect: float = 1.0) -> GapResolution:
    """The smallest top-1 gap a paired comparison resolves (docs/statistics.md, "What a design resolves").

    The gap's variance has two parts. The test images: each image's difference between the arms is -1, 0 or +1, so
    its variance is at most the fraction of images the arms disagree on, and the mean over n images has variance
    disagreement / n (an upper bound: averaging seeds only smooths it). The seeds: each arm's mean top-1 over `seeds`
    fine-tunings varies by seed_std^2 / seeds, twice over for two arms. A gap of `half_width` is where its interval
    starts to exclude 0; a true gap of `resolvable` is resolved with probability `power`. Grouped test images
    multiply the images' part by their `design_effect` (`assumed_design_effect`, `design_effect`).
    """
    if test_images < 1 or seeds < 1:
        raise ValueError(f"a comparison needs at least one test image and one seed, got {test_images} and {seeds}")
    if not 0 <= disagreement <= 1 or seed_std < 0 or design_effect < 1:
        raise ValueError(f"disagreement must be in [0, 1], seed_std >= 0 and design_effect >= 1, got {disagreement}, "
                         f"{seed_std} and {design_effect}")
    error = math.sqrt(design_effect * disagreement / test_images + 2 * seed_std**2 / seeds)
    return GapResolution(test_images, seeds, disagreement, seed_std, error,
                         NormalDist().inv_cdf((1 + confidence) / 2) * error, gap_scale(confidence, power) * error,
                         confidence, power, design_effect)


def images_to_resolve(gap: float, seeds: int, disagreement: float, seed_std: float = 0.0, *,
                       confidence: float = 0.95, power: float = 0.8, design_effect: float = 1.0) -> int | None:
    """The fewest test images with which `gap_resolution` resolves `gap` (grouped as the design's, at its
    `design_effect`); None when the seeds' spread alone is wider than `gap` allows, so that no number of test images
    is enough (more seeds are)."""
    if gap <= 0:
        raise ValueError(f"the gap to resolve must be positive, got {gap}")
    room = (gap / gap_scale(confidence, power)) ** 2 - 2 * seed_std**2 / seeds  # the variance left for the images
    if room <= 0:
        return None
    return max(1, math.ceil(design_effect * disagreement / room))


def seeds_needed(gap: float, seed_std: float, *, confidence: float = 0.95, power: float = 0.8) -> int:
    """The fewest seeds per arm whose spread alone leaves room to resolve `gap` (with test images enough)."""
    return math.floor(2 * seed_std**2 / (gap / gap_scale(confidence, power)) ** 2) + 1


def disagreement(correct_a: Correct, correct_b: Correct) -> float:
    """The fraction of test images on which a run of arm A and a run of arm B differ (one right, the other wrong),
    averaged over every pair of A's and B's seeds."""
    a, b = correct_matrix(correct_a, "correct_a"), correct_matrix(correct_b, "correct_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the arms were scored on different test sets ({a.shape[1]} and {b.shape[1]} images)")
    # Per image, the pairs that differ: A right and B wrong, or A wrong and B right.
    right_a, right_b = a.sum(axis=0), b.sum(axis=0)
    differ = right_a * (b.shape[0] - right_b) + (a.shape[0] - right_a) * right_b
    return float(differ.sum() / (a.shape[0] * b.shape[0] * a.shape[1]))


def assumed_design_effect(groups: Sequence[Hashable]) -> float:
    """The design effect of test images in `groups` (one name per image) were every group's images answered alike
    (right or wrong together, the worst case): sum of squared group sizes / images, so the images count as
    images / design effect independent ones; with equal groups of m images that is m, and the groups count as the
    samples."""
    sizes = np.bincount(group_index(groups, len(groups))).astype(np.float64)
    return float((sizes**2).sum() / sizes.sum())


def design_effect(correct_a: Correct, correct_b: Correct, groups: Sequence[Hashable]) -> float:
    """The design effect the runs showed: the variance of the mean per-image difference between the arms (each
    arm's mean over its seeds) summed within groups, over its variance were the images independent; at least 1
    (grouped images less alike than independent ones would narrow the interval, which is not claimed). 1 where the
    arms never differ."""
    a, b = correct_matrix(correct_a, "correct_a"), correct_matrix(correct_b, "correct_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"the arms were scored on different test sets ({a.shape[1]} and {b.shape[1]} images)")
    difference = a.mean(axis=0) - b.mean(axis=0)
    centred = difference - difference.mean()
    independent = float((centred**2).sum())
    grouped = float((np.bincount(group_index(groups, a.shape[1]), weights=centred) ** 2).sum())
    return max(1.0, grouped / independent) if independent > 0 else 1.0


@dataclass(frozen=True)
class Candidate:
    """A recipe scored on the dev split: its per-image correctness (the dev images, in one order for every
    candidate) and its cost (training steps, say)."""

    name: str
    correct: Correct  # (images,) booleans
    cost: float


@dataclass(frozen=True)
class Pick:
    """The recipe picked on the dev split, and how sure the split is of it."""

    pick: str  # the highest dev top-1; among exactly equal scores the costlier, then the earliest in the grid
    best: str  # the same as `pick`: kept as its own field for results.json readers
    tied: tuple[str, ...]  # `pick` and the candidates the split cannot tell from it (near-best), in grid order
    tie: bool  # more than one in `tied`: the split cannot single out the pick, so the report tests the others too
    p_value: dict[str, float]  # every candidate's exact McNemar p-value against `pick` (1.0 for `pick`)
    top1: dict[str, float]  # every candidate's dev top-1
    significance: float


def pick_recipe(candidates: Sequence[Candidate], significance: float = 0.05) -> Pick:
    """The recipe to keep from `candidates` (in grid order), scored on one dev split (or pooled over k folds).

    The rule: the pick is the candidate with the highest dev top-1, whatever its cost. Only candidates with exactly
    the same top-1 are a tie for the pick, and that tie goes to the costlier (more training steps), then the earliest
    in the grid: where the dev data gives no reason to stop, an arm gets its longer training, which cannot favour
    the arm that converges fastest (the pretrained one), and the grid's order is the same for every arm.
    Near-best candidates are reported, not picked: a candidate is `tied` with the pick when McNemar's exact test on
    their discordant dev images (`mcnemar`) gives p >= `significance`, i.e. the split cannot tell them apart; compare
    tests those too and says whether each verdict depends on the pick (the report's sensitivity lines).
    A rule that kept the cheapest of the near-best would stop every arm at its shortest tied length, which flatters
    the arm that is ahead early.
    """
    if not candidates:
        raise ValueError("pick_recipe needs at least one candidate")
    names = [c.name for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"candidate names must be distinct, got {names}")
    correct = {c.name: correct_matrix(c.correct, c.name) for c in candidates}
    if len({v.shape for v in correct.values()}) != 1 or next(iter(correct.values())).shape[0] != 1:
        raise ValueError(f"every candidate must be one (images,) vector on the same dev images, got shapes "
                         f"{[v.shape for v in correct.values()]}")
    top1 = {name: float(v.mean()) for name, v in correct.items()}
    order = {c.name: (-top1[c.name], -c.cost, i) for i, c in enumerate(candidates)}
    pick = min(names, key=lambda name: order[name])
    p_value = {name: mcnemar_p(*discordant(correct[pick], correct[name])) for name in names}
    tied = tuple(name for name in names if p_value[name] >= significance)
    return Pick(pick=pick, best=pick, tied=tied, tie=len(tied) > 1, p_value=p_value, top1=top1, significance=significance)


class FoldError(UserError):
    """A labelled set too small for the k-fold split asked for."""


def stratified_folds(samples: Iterable[tuple[str, int]], k: int, groups: Sequence[Hashable] | None = None) -> list[int]:
    """A fold index in [0, k) for each (key, label) sample, in the samples' order.

    Stratified: within each class the samples are ordered by a hash of their key (zlib.crc32, then the key) and dealt
    to the folds in turn, continuing from where the previous class (in label order) stopped; so every fold holds each
    class's images to within one, and the folds' sizes differ by at most one. The same keys give the same folds on
    every run and machine, whatever order the samples come in. Refuses a class with fewer than k images: a fold
    without that class could not score it. With `groups` (each sample's group, e.g. renditions of one thing), whole
    groups are dealt instead (`grouped_folds`).
    """
    samples = list(samples)
    if k < 2:
        raise ValueError(f"k-fold needs k >= 2, got {k}")
    keys = [key for key, _ in samples]
    if len(set(keys)) != len(keys):
        raise ValueError("stratified_folds needs distinct keys (the hash that deals the folds is of the key)")
    if groups is not None:
        return grouped_folds([label for _, label in samples], groups, k)
    by_class: dict[int, list[int]] = {}
    for index, (_, label) in enumerate(samples):
        by_class.setdefault(int(label), []).append(index)
    check_fold_classes({label: len(indices) for label, indices in by_class.items()}, k, "images")
    folds = [0] * len(samples)
    dealt = 0
    for label in sorted(by_class):
        ranked = sorted(by_class[label], key=lambda i: (zlib.crc32(samples[i][0].encode()), samples[i][0]))
        for rank, index in enumerate(ranked):
            folds[index] = (dealt + rank) % k
        dealt += len(ranked)
    return folds


def check_fold_classes(counts: dict[int, int], k: int, units: str) -> None:
    """Refuse k folds of classes holding `counts` units (images, or groups of them) where a class has fewer than k."""
    if not counts:
        raise FoldError(f"dev_folds {k} needs labelled images, and there are none; point data.shards at labelled shards")
    fewest = min(counts, key=lambda label: (counts[label], label))
    if counts[fewest] < k:
        raise FoldError(f"dev_folds {k} needs at least {k} {units} of every class, and class {fewest} has "
                        f"{counts[fewest]}; lower dev_folds to {max(2, counts[fewest])} or add images of class {fewest}")


def groups_by_class(labels: Sequence[int], groups: Sequence[Hashable]) -> dict[int, dict[Hashable, list[int]]]:
    """{class: {group: its images' indices}}, each group under its majority class (the lowest such label on a tie:
    a group whose images span classes is kept whole, so it counts wholly as that class in stratification)."""
    if len(groups) != len(labels):
        raise ValueError(f"one group per image is needed, got {len(groups)} for {len(labels)} images")
    members: dict[Hashable, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    by_class: dict[int, dict[Hashable, list[int]]] = {}
    for group, indices in members.items():
        votes = np.bincount([int(labels[i]) for i in indices])
        by_class.setdefault(int(votes.argmax()), {})[group] = indices
    return by_class


def group_rank(group: Hashable) -> tuple[int, str]:
    """A group's place in the hash order that deals groups (the same on every run and machine)."""
    return zlib.crc32(str(group).encode()), str(group)


def grouped_folds(labels: Sequence[int], groups: Sequence[Hashable], k: int) -> list[int]:
    """A fold index in [0, k) for each image, every image of a group in one fold. Stratified by each group's majority
    class (`groups_by_class`): class by class (in label order), its groups, largest first and then in hash order, go
    each to the fold holding the fewest of that class's images (then the fewest images in all, then the lowest
    index), so every fold holds every class and the folds' sizes differ by about a group. Refuses a class with
    fewer than k groups."""
    by_class = groups_by_class(labels, groups)
    check_fold_classes({label: len(members) for label, members in by_class.items()}, k, "groups (image_groups)")
    folds, fold_images = [0] * len(labels), [0] * k
    for label in sorted(by_class):
        class_images = [0] * k
        for group, indices in sorted(by_class[label].items(), key=lambda item: (-len(item[1]), group_rank(item[0]))):
            fold = min(range(k), key=lambda f: (class_images[f], fold_images[f], f))
            for index in indices:
                folds[index] = fold
            class_images[fold] += len(indices)
            fold_images[fold] += len(indices)
    return folds


def dev_split(samples: Iterable[tuple[str, int]], dev_fraction: float, groups: Sequence[Hashable] | None = None) -> set[str]:
    """The keys of a stratified dev split of (key, label) samples: each class gives round(dev_fraction x its images)
    (half up), its images ordered by a hash of the key's last part (after "/": the sample key, whatever the shard).
    With `groups` (each sample's group), whole groups go to dev, each under its majority class (`groups_by_class`):
    in hash order of the group, a group is taken where it brings the class's dev images nearer round(dev_fraction x
    the class's images), so each class's dev share is met to within about a group."""
    samples = list(samples)
    if groups is None:
        by_class: dict[int, list[str]] = {}
        for key, label in samples:
            by_class.setdefault(int(label), []).append(key)
        return {key for keys in by_class.values()
                for key in sorted(keys, key=lambda k: (zlib.crc32(k.rsplit("/", 1)[-1].encode()), k))[:math.floor(dev_fraction * len(keys) + 0.5)]}
    dev: set[str] = set()
    for members in groups_by_class([label for _, label in samples], groups).values():
        target, taken = math.floor(dev_fraction * sum(map(len, members.values())) + 0.5), 0
        for group in sorted(members, key=group_rank):
            if abs(taken + len(members[group]) - target) < abs(taken - target):
                dev.update(samples[i][0] for i in members[group])
                taken += len(members[group])
    return dev


def balanced_accuracy(correct: dict[str, int | bool], labels: dict[str, int]) -> float:
    """The mean over the test set's classes of each class's recall (the share of its images classified correctly),
    from per-image correctness and labels keyed alike; a constant guess scores 1 / (classes present) on it, whatever
    the imbalance."""
    if set(correct) != set(labels) or not labels:
        raise ValueError(f"balanced accuracy needs correctness and a label for the same images, got {len(correct)} and "
                         f"{len(labels)} (of which {len(set(correct) & set(labels))} shared)")
    right: dict[int, list[int]] = {}
    for key, label in labels.items():
        right.setdefault(int(label), []).append(int(correct[key]))
    return float(np.mean([np.mean(hits) for hits in right.values()]))
