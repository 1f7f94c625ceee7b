import math

import numpy as np
import pytest
import torch

from mpp.evaluation.baselines import likely_causes
from mpp.errors import UserError
from mpp.evaluation.stats import (Candidate, FoldError, assumed_design_effect, design_effect, dev_resolution, disagreement,
                                 gap_resolution, images_to_resolve, mcnemar, mcnemar_p, paired_bootstrap_gap, pick_recipe,
                                 dev_split, seeds_needed, stratified_folds)


def shifted(images: int, right: int, shift: int, seeds: int = 1, noise: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Arm A right on `right` of `images`; arm B the same runs with `shift` of A's right images wrong. With `noise`,
    each seed's run differs from the others on that many random images (in both arms alike)."""
    rng = np.random.default_rng(seed)
    a = np.zeros((seeds, images), dtype=bool)
    a[:, :right] = True
    for row in a:
        flip = rng.choice(np.arange(shift, images), size=noise, replace=False)  # never the shifted images
        row[flip] = ~row[flip]
    b = a.copy()
    b[:, :shift] = False
    return a, b


def test_identical_predictions_give_a_zero_width_interval_at_zero():
    a = np.random.default_rng(0).random((3, 500)) < 0.7
    same_seeds = np.repeat(a[:1], 3, axis=0)  # seeds that agree: only the images vary
    for correct in (a[:1], same_seeds):
        gap = paired_bootstrap_gap(correct, correct.copy(), resamples=2000)
        assert (gap.gap, gap.low, gap.high) == (0.0, 0.0, 0.0)
        assert not gap.excludes_zero


def test_a_five_point_shift_on_1000_images_is_detected_and_covered():
    a, b = shifted(1000, 700, 50)
    gap = paired_bootstrap_gap(a, b)
    assert gap.gap == pytest.approx(0.05)
    assert gap.excludes_zero and gap.low < 0.05 < gap.high
    assert gap.resamples == 10_000 and gap.confidence == 0.95
    # B - A is the mirror image
    mirrored = paired_bootstrap_gap(b, a)
    assert mirrored.gap == pytest.approx(-0.05) and mirrored.high < 0


def test_the_interval_is_paired_so_it_is_far_narrower_than_for_independent_test_sets():
    a, b = shifted(1000, 700, 50)
    gap = paired_bootstrap_gap(a, b)
    # The same gap between two independent samples of 1000 images: a 95% half-width of 1.96 x sqrt(sum p(1-p)/n).
    unpaired_half_width = 1.96 * math.sqrt((0.7 * 0.3 + 0.65 * 0.35) / 1000)
    assert (gap.high - gap.low) / 2 < 0.5 * unpaired_half_width
    # Paired: only the 50 discordant images vary the gap, so its standard error is about sqrt(50 (1 - 50/1000)) / 1000.
    assert (gap.high - gap.low) / 2 == pytest.approx(1.96 * math.sqrt(50 * 0.95) / 1000, rel=0.15)


def test_seeds_are_resampled_so_their_spread_widens_the_interval_and_arms_may_have_different_seed_counts():
    a, b = shifted(1000, 700, 50, seeds=3, noise=60)
    noisy = paired_bootstrap_gap(a, b)
    quiet = paired_bootstrap_gap(*shifted(1000, 700, 50, seeds=3))
    assert noisy.gap == pytest.approx(0.05) and noisy.low < 0.05 < noisy.high
    assert noisy.high - noisy.low > quiet.high - quiet.low
    uneven = paired_bootstrap_gap(a, b[:2])
    assert uneven.gap == pytest.approx(a.mean() - b[:2].mean())
    assert uneven.low < uneven.gap < uneven.high


def copies(correct: np.ndarray, times: int = 4) -> np.ndarray:
    """Every image (column) repeated `times` times in a row: renditions of one thing answered exactly alike."""
    return np.repeat(correct, times, axis=-1)


def test_a_cluster_bootstrap_counts_an_images_four_copies_as_the_one_sample_they_are():
    a, b = shifted(1000, 700, 50)
    emoji = [f"code-{i}" for i in range(1000) for _ in range(4)]  # each image's group: the thing it shows
    width = lambda interval: interval.high - interval.low  # noqa: E731
    original = paired_bootstrap_gap(a, b)
    grouped = paired_bootstrap_gap(copies(a), copies(b), groups=emoji)
    independent = paired_bootstrap_gap(copies(a), copies(b))
    assert grouped.gap == independent.gap == pytest.approx(original.gap)
    # Grouped copies resample as the originals did (bootstrap noise: 10,000 replicates put the 2.5% and 97.5%
    # quantiles within a few percent); counted as independent, 4,000 images halve the width, which is false.
    assert width(grouped) == pytest.approx(width(original), rel=0.1)
    assert width(independent) == pytest.approx(width(original) / 2, rel=0.15)
    assert width(grouped) > 1.6 * width(independent)
    # Groups of one image are the plain bootstrap (other draws, the same distribution).
    assert width(paired_bootstrap_gap(a, b, groups=range(1000))) == pytest.approx(width(original), rel=0.1)
    with pytest.raises(ValueError, match="groups names 1000 images' groups, but the arms were scored on 4000 images"):
        paired_bootstrap_gap(copies(a), copies(b), groups=range(1000))


def test_the_design_effect_is_the_group_size_for_copies_about_one_for_unrelated_images_and_widens_the_resolution():
    a, b = shifted(1000, 700, 50, seeds=2, noise=30)
    groups = np.repeat(np.arange(1000), 4)
    assert design_effect(copies(a), copies(b), groups) == pytest.approx(4.0)
    assert assumed_design_effect(groups) == 4.0 and assumed_design_effect(["x", "x", "x", "y"]) == (9 + 1) / 4
    # Four unrelated images per group: no within-group correlation, so about 1 (and never below 1, which would claim
    # more than independent images give).
    rng = np.random.default_rng(3)
    unrelated = design_effect(rng.random((2, 4000)) < 0.7, rng.random((2, 4000)) < 0.6, groups)
    assert 1.0 <= unrelated < 1.2
    assert design_effect(a, a.copy(), range(1000)) == 1.0  # arms that never differ
    # 4,000 images in groups of 4 answered alike resolve what 1,000 independent images do.
    assert gap_resolution(4000, 3, 0.2, 0.005, design_effect=4).resolvable == pytest.approx(
        gap_resolution(1000, 3, 0.2, 0.005).resolvable)
    assert images_to_resolve(0.02, 3, 0.2, 0.005, design_effect=4) == pytest.approx(4 * 5832, abs=4)


def test_the_clustered_mcnemar_test_is_the_asymptotic_one_for_single_images_and_copies_do_not_sharpen_it():
    a, b = np.zeros(100, dtype=bool), np.zeros(100, dtype=bool)
    a[:10], b[10:12] = True, True
    singles = mcnemar(a, b, groups=range(100))
    # X^2 = (10 - 2)^2 / (10 + 2) = 5.33 on one degree of freedom: p = 0.0209 (the exact test's is 0.0386).
    assert (singles.a_only, singles.b_only) == (10, 2)
    assert singles.p_value == pytest.approx(math.erfc(math.sqrt(64 / 12 / 2))) == pytest.approx(0.0209, abs=1e-4)
    grouped = mcnemar(copies(a), copies(b), groups=np.repeat(np.arange(100), 4))
    assert (grouped.a_only, grouped.b_only, grouped.p_value) == (40, 8, pytest.approx(singles.p_value))
    assert mcnemar(copies(a), copies(b)).p_value < 1e-4  # 40 vs 8 as independent images: far surer than the data
    assert mcnemar(a, a.copy(), groups=range(100)).p_value == 1.0


def test_bootstrap_is_deterministic_per_seed_and_takes_torch_tensors():
    a, b = shifted(300, 200, 10, seeds=2, noise=20)
    first = paired_bootstrap_gap(a, b, resamples=500, seed=3)
    assert paired_bootstrap_gap(torch.from_numpy(a), torch.from_numpy(b), resamples=500, seed=3) == first
    assert paired_bootstrap_gap(a, b, resamples=500, seed=4) != first


def test_bootstrap_refuses_different_test_sets_and_non_boolean_scores():
    with pytest.raises(ValueError, match="different test sets"):
        paired_bootstrap_gap(np.ones((2, 100), bool), np.ones((2, 99), bool))
    with pytest.raises(ValueError, match="True/False"):
        paired_bootstrap_gap(np.full((1, 10), 0.7), np.ones((1, 10)))


def test_mcnemar_matches_hand_computed_exact_values():
    # b=10, c=2: p = 2 (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 2 x 79 / 4096
    assert mcnemar_p(10, 2) == 158 / 4096
    assert mcnemar_p(2, 10) == 158 / 4096
    assert mcnemar_p(5, 0) == 2 / 32
    assert mcnemar_p(7, 7) == 1.0 and mcnemar_p(0, 0) == 1.0
    # many discordant images: close to the continuity-corrected chi-square, (|b - c| - 1)^2 / (b + c) = 1.661 -> p 0.197
    assert mcnemar_p(3000, 2900) == pytest.approx(0.1974, abs=0.002)
    a = np.array([1] * 10 + [0] * 2 + [1] * 50 + [0] * 30, dtype=bool)
    b = np.array([0] * 10 + [1] * 2 + [1] * 50 + [0] * 30, dtype=bool)
    result = mcnemar(a, torch.from_numpy(b))
    assert (result.a_only, result.b_only, result.p_value) == (10, 2, 158 / 4096)


def test_dev_resolution_of_64_images_at_half_accuracy():
    res = dev_resolution(64, 0.5)
    assert res.one_image == 1 / 64 and res.standard_error == 0.0625  # +-6.25 points
    assert dev_resolution(10_000, 0.9).standard_error == pytest.approx(0.003)
    with pytest.raises(ValueError):
        dev_resolution(0)


def test_a_designs_resolution_matches_the_known_power_figures():
    # sqrt(d / n) per image pair (shared/REFERENCE.md): 1,131 test images at 20% disagreement give +-2.6 points at 95%.
    plain = gap_resolution(1131, seeds=1, disagreement=0.2)
    assert plain.standard_error == pytest.approx(math.sqrt(0.2 / 1131))
    assert plain.half_width == pytest.approx(0.0261, abs=1e-4)
    assert plain.resolvable == pytest.approx((1.959964 + 0.841621) * math.sqrt(0.2 / 1131))  # 80% power: 3.7 points
    # ... and resolving +2 points with 80% power needs roughly 4,000 test images: 2.8016^2 x 0.2 / 0.02^2 = 3,924.4.
    assert images_to_resolve(0.02, seeds=3, disagreement=0.2) == 3925
    # Seeds add 2 x seed_std^2 / seeds: at a 0.5-point seed spread and 3 seeds, 0.2 / ((0.02 / 2.8016)^2 - 2 x 0.005^2 / 3).
    assert images_to_resolve(0.02, seeds=3, disagreement=0.2, seed_std=0.005) == 5832
    assert gap_resolution(5832, 3, 0.2, 0.005).resolvable == pytest.approx(0.02, rel=1e-3)
    # A seed spread of 1 point leaves no room for a 1-point gap at one seed, whatever the test set; 16 seeds do.
    assert images_to_resolve(0.01, seeds=1, disagreement=0.2, seed_std=0.01) is None
    assert seeds_needed(0.01, seed_std=0.01) == 16 and images_to_resolve(0.01, 16, 0.2, 0.01) is not None
    assert images_to_resolve(0.01, 15, 0.2, 0.01) is None


def test_the_planned_half_width_is_the_paired_bootstraps_on_a_constructed_case():
    # 2,000 images on which the arms disagree on 400 (20%), 200 each way: gap 0, bootstrap half-width 1.96 sqrt(0.2 / 2000).
    a = np.zeros(2000, dtype=bool)
    b = np.zeros(2000, dtype=bool)
    a[:1000] = b[:1000] = True
    a[1000:1200] = True
    b[1200:1400] = True
    assert disagreement(a, b) == pytest.approx(0.2)
    interval = paired_bootstrap_gap(a, b)
    planned = gap_resolution(2000, 1, disagreement(a, b))
    assert (interval.high - interval.low) / 2 == pytest.approx(planned.half_width, rel=0.08)


def test_disagreement_averages_every_pair_of_seeds():
    a = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=bool)
    b = np.array([[1, 1, 1, 0]], dtype=bool)
    # seed 0 of A differs from B on 1 image of 4, seed 1 on 2: (1 + 2) / (2 x 4).
    assert disagreement(a, b) == pytest.approx(3 / 8)
    assert disagreement(a[:1], a[:1]) == 0.0
    with pytest.raises(ValueError, match="different test sets"):
        disagreement(a, b[:, :3])


def dev(right: list[int], images: int = 64) -> np.ndarray:
    correct = np.zeros(images, dtype=bool)
    correct[right] = True
    return correct


def test_the_pick_is_the_best_dev_score_even_when_the_split_cannot_resolve_it_from_a_cheaper_one():
    picked = pick_recipe([Candidate("short", dev(list(range(32))), cost=1000),
                          Candidate("long", dev(list(range(33))), cost=2000)])  # 33/64: one image more
    assert picked.pick == picked.best == "long" and picked.top1 == {"short": 32 / 64, "long": 33 / 64}
    assert picked.tied == ("short", "long") and picked.tie  # near-best: reported, not picked
    assert picked.p_value == {"short": 1.0, "long": 1.0}  # one discordant image


def test_a_large_dev_difference_is_not_a_tie_and_exactly_equal_scores_go_to_the_costlier_then_the_earliest():
    picked = pick_recipe([Candidate("weak", dev(list(range(30))), cost=1000),
                          Candidate("strong", dev(list(range(50))), cost=2000)])
    assert (picked.best, picked.pick, picked.tied, picked.tie) == ("strong", "strong", ("strong",), False)
    assert picked.p_value["weak"] == mcnemar_p(20, 0)
    equal = pick_recipe([Candidate("first", dev(list(range(32))), cost=1000),
                         Candidate("second", dev(list(range(1, 33))), cost=1000),
                         Candidate("longer", dev(list(range(2, 34))), cost=2000)])
    assert (equal.pick, equal.tied) == ("longer", ("first", "second", "longer"))  # equal scores: the longer training
    same_cost = pick_recipe([Candidate("a", dev([0]), cost=5), Candidate("b", dev([1]), cost=5)])
    assert same_cost.pick == "a"  # equal scores and costs: the earliest in the grid


def test_a_pick_follows_the_scores_for_an_arm_that_improves_with_length_and_one_that_does_not():
    """The case that biased the old rule: on 64 dev images, scratch rises with length (25, 28, 29 right) while the
    pretrained arm is flat (34 at every length). Each keeps its best-scoring length; the old rule (the cheapest of
    the near-best) kept scratch at its shortest, 4 images below its best."""
    lengths = {"x1": 300, "x2": 600, "x4": 1200}
    rising = pick_recipe([Candidate(name, dev(list(range(right))), cost) for (name, cost), right in zip(lengths.items(), (25, 28, 29))])
    flat = pick_recipe([Candidate(name, dev(list(range(34))), cost) for name, cost in lengths.items()])
    assert rising.pick == "x4" and rising.tie and rising.tied == ("x1", "x2", "x4")  # the split cannot tell them apart
    assert flat.pick == "x4" and flat.tied == ("x1", "x2", "x4")  # equal scores: the longer training, as for any arm


def test_pick_recipe_refuses_candidates_on_different_dev_images():
    with pytest.raises(ValueError, match="same dev images"):
        pick_recipe([Candidate("a", dev([0], 64), 1), Candidate("b", dev([0], 63), 1)])


def test_stratified_folds_balance_each_class_and_the_folds_and_follow_the_keys():
    samples = [(f"shard-{i % 3}/key-{i:04d}", label) for label, count in ((0, 10), (1, 11), (2, 7)) for i in range(count * 100, count * 100 + count)]
    folds = stratified_folds(samples, 5)
    assert set(folds) == set(range(5))
    for label in (0, 1, 2):
        per_fold = np.bincount([f for f, (_, l) in zip(folds, samples) if l == label], minlength=5)
        assert per_fold.max() - per_fold.min() <= 1
    sizes = np.bincount(folds, minlength=5)
    assert sizes.max() - sizes.min() <= 1 and sizes.sum() == 28
    by_key = dict(zip((key for key, _ in samples), folds))
    shuffled = [samples[i] for i in np.random.default_rng(0).permutation(len(samples))]
    assert dict(zip((key for key, _ in shuffled), stratified_folds(shuffled, 5))) == by_key


def test_stratified_folds_refuse_a_class_smaller_than_k_in_one_line():
    samples = [(f"k{i}", 0) for i in range(8)] + [(f"j{i}", 4) for i in range(3)]
    with pytest.raises(FoldError) as refused:
        stratified_folds(samples, 5)
    message = str(refused.value)
    assert isinstance(refused.value, UserError) and "\n" not in message
    assert "class 4 has 3" in message and "lower dev_folds to 3" in message
    assert stratified_folds(samples, 3)  # 3 of class 4: enough for 3 folds


def test_a_weight_average_slower_than_the_run_is_named_among_the_likely_causes():
    # Red team round 4, row 70: train.ema_decay=0.999999 over 20 steps ended below the prior without naming the EMA.
    common = dict(steps=20, global_batch=16, samples=None, image_size=16, short_side=None, lr=1e-3, warmup=2, class_counts=None)
    causes = likely_causes(**common, ema_decay=0.999999)
    assert causes[0] == ("the weight average: train.ema_decay=0.999999 averages over about 1,000,000 steps, more than the "
                         "run's 20, so the evaluated and saved weights are mostly the initial ones (lower it, or set it to null)")
    assert not any("weight average" in cause for cause in likely_causes(**common, ema_decay=0.9))


def grouped_pool(groups_per_class: dict[int, int], shuffle_seed: int = 0) -> tuple[list[tuple[str, int]], list[str]]:
    """Renditions of one thing: group g of class c holds 1-5 images (keys '<vendor>-<g>'), in a shuffled order."""
    rows = [(f"v{v}-c{c}g{g}", c, f"c{c}g{g}") for c, n in groups_per_class.items() for g in range(n)
            for v in range(1 + (g * 7 + c) % 5)]
    np.random.default_rng(shuffle_seed).shuffle(rows)
    return [(key, label) for key, label, _ in rows], [group for _, _, group in rows]


def test_grouped_folds_keep_every_group_in_one_fold_stratified_and_deterministic():
    samples, groups = grouped_pool({0: 40, 1: 25, 2: 12})
    folds = stratified_folds(samples, 4, groups)
    fold_of_group: dict[str, set[int]] = {}
    for group, fold in zip(groups, folds):
        fold_of_group.setdefault(group, set()).add(fold)
    assert all(len(f) == 1 for f in fold_of_group.values())  # no group across folds
    for label in (0, 1, 2):  # every fold holds about a quarter of each class (within one group of at most 5)
        per_fold = [sum(1 for (_, c), f in zip(samples, folds) if c == label and f == i) for i in range(4)]
        assert max(per_fold) - min(per_fold) <= 5 and min(per_fold) > 0
    again, again_groups = grouped_pool({0: 40, 1: 25, 2: 12}, shuffle_seed=1)  # the same images in another order
    assert dict(zip((k for k, _ in again), stratified_folds(again, 4, again_groups))) == dict(zip((k for k, _ in samples), folds))
    few, few_groups = grouped_pool({0: 10, 1: 10, 2: 4})
    with pytest.raises(FoldError, match=r"dev_folds 5 needs at least 5 groups \(image_groups\) of every class, and class 2 has 4"):
        stratified_folds(few, 5, few_groups)


def test_a_group_spanning_classes_goes_whole_with_its_majority_class():
    samples = [("a1", 0), ("a2", 0), ("a3", 1)] + [(f"x{i}", i % 2) for i in range(20)]
    groups = ["a", "a", "a"] + [f"x{i}" for i in range(20)]
    folds = stratified_folds(samples, 2, groups)
    assert len(set(folds[:3])) == 1
    assert len(dev_split(samples, 0.5, groups) & {"a1", "a2", "a3"}) in (0, 3)


def test_grouped_dev_split_keeps_groups_whole_near_each_class_share_and_deterministic():
    samples, groups = grouped_pool({0: 40, 1: 25, 2: 12})
    dev = dev_split(samples, 0.3, groups)
    sides: dict[str, set[bool]] = {}
    for (key, _), group in zip(samples, groups):
        sides.setdefault(group, set()).add(key in dev)
    assert all(len(s) == 1 for s in sides.values())  # no group on both sides
    for label in (0, 1, 2):  # each class's dev share within half the largest group (5 images) of round(0.3 x n)
        images = sum(1 for _, c in samples if c == label)
        assert abs(sum(1 for k, c in samples if c == label and k in dev) - round(0.3 * images)) <= 2.5
    again, again_groups = grouped_pool({0: 40, 1: 25, 2: 12}, shuffle_seed=1)
    assert dev_split(again, 0.3, again_groups) == dev


def test_ungrouped_dev_split_is_the_split_compare_always_made():
    # The keys main's split_stage put in dev for this pool (dev_fraction 0.3), before the split moved here.
    samples = [(f"shard-{i % 3:06d}.tar/k{i:03d}", (i * 7) % 3) for i in range(30)]
    assert sorted(key.split("/")[1] for key in dev_split(samples, 0.3)) == [
        "k000", "k004", "k008", "k010", "k014", "k018", "k020", "k024", "k028"]
